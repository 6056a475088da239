//! Plain HTTP on port 80, request by request: every request head of a connection is judged, and
//! what can't be framed safely is refused.

use super::*;

impl World {
    /// From inside the sandbox: one connection; each part is written and answered (read until
    /// 300 ms pass without a byte) before the next, and after the last, everything until close.
    fn conversation(&self, to: (Ipv4Addr, u16), parts: &[&str]) -> String {
        let parts: Vec<Vec<u8>> = parts.iter().map(|p| p.as_bytes().to_vec()).collect();
        self.net
            .sandbox
            .spawn(move || {
                let Ok(mut s) = TcpStream::connect_timeout(&SocketAddr::new(to.0.into(), to.1), Duration::from_secs(5))
                else {
                    return String::new();
                };
                let mut out = Vec::new();
                let mut buf = [0u8; 4096];
                for (i, part) in parts.iter().enumerate() {
                    let _ = s.write_all(part);
                    if i + 1 == parts.len() {
                        s.set_read_timeout(Some(Duration::from_secs(8))).unwrap();
                        let _ = s.read_to_end(&mut out);
                        break;
                    }
                    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
                    while let Ok(n) = s.read(&mut buf) {
                        if n == 0 {
                            break;
                        }
                        out.extend_from_slice(&buf[..n]);
                        s.set_read_timeout(Some(Duration::from_millis(300))).unwrap();
                    }
                }
                String::from_utf8_lossy(&out).to_string()
            })
            .join()
            .unwrap()
    }
}

/// A keep-alive GET for `host`.
fn get(host: &str) -> String {
    format!("GET / HTTP/1.1\r\nHost: {host}\r\nConnection: keep-alive\r\n\r\n")
}

/// The status lines of the responses in `r`, in order (a body never starts with "HTTP/1.1 ").
fn statuses(r: &str) -> Vec<&str> {
    r.match_indices("HTTP/1.1 ").map(|(i, _)| &r[i + 9..i + 12]).collect()
}

fn denials(w: &World) -> Vec<(String, String)> {
    w.sandbox
        .snapshot()
        .recent_denials
        .into_iter()
        .map(|d| (d.destination, d.rule))
        .collect()
}

#[test]
fn every_request_on_a_plain_http_connection_is_judged() {
    let w = world(WEB, NO_TENANT, &[], SandboxLimits::default());
    let other = "airlock egress denied: other.test:80 (default deny)";
    // Keep-alive, one request after the other: the second names a host the policy denies.
    let r = w.conversation((ALLOWED, 80), &[&get("allowed.test"), &get("other.test")]);
    assert_eq!(statuses(&r), ["200", "403"], "{r}");
    assert!(
        r.contains(&format!("served-by {ALLOWED}:80")) && r.contains(other),
        "{r}"
    );
    // Pipelined in one write, to the allowed name dialed at another address.
    let r = w.tcp((OTHER, 80), (get("allowed.test") + &get("other.test")).as_bytes());
    assert_eq!(statuses(&r), ["200", "403"], "{r}");
    assert!(r.contains(other), "{r}");
    // Another allowed name on a connection dialed for the first: not where it would be dialed.
    let profiles = r#"{"web": {"domains": ["allowed.test", "other.test"], "default": true}}"#;
    let w2 = world(profiles, NO_TENANT, &[], SandboxLimits::default());
    let r = w2.tcp((ALLOWED, 80), (get("allowed.test") + &get("other.test")).as_bytes());
    assert_eq!(statuses(&r), ["200", "403"], "{r}");
    assert!(
        r.contains("other.test:80 (request names another host than its connection)"),
        "{r}"
    );
    assert_eq!(w2.web.hosts(), ["allowed.test"]);
    drop(w2);
    // The same host again and again is one keep-alive connection, as before.
    let r = w.tcp(
        (ALLOWED, 80),
        (get("allowed.test") + &get("ALLOWED.test.:80") + "GET / HTTP/1.1\r\nHost: allowed.test\r\n\r\n").as_bytes(),
    );
    assert_eq!(statuses(&r), ["200", "200", "200"], "{r}");
    assert_eq!(
        w.web.hosts(),
        [
            "allowed.test",
            "allowed.test",
            "allowed.test",
            "ALLOWED.test.:80",
            "allowed.test"
        ]
    );
    assert!(w.no_hit_on(OTHER), "{:?}", w.hits());
    // Each refused request is a denial in the sandbox's report.
    assert_eq!(
        denials(&w),
        [
            ("other.test:80".to_string(), "default deny".to_string()),
            ("other.test:80".to_string(), "default deny".to_string())
        ]
    );
    assert_eq!(w.sandbox.snapshot().counters.tcp_denied, 2);
}

#[test]
fn request_bodies_are_framed_and_what_cannot_be_framed_is_refused() {
    let w = world(WEB, NO_TENANT, &[], SandboxLimits::default());
    let inner = "GET / HTTP/1.1\r\nHost: other.test\r\n\r\n";
    // A body that looks like a request is a body, by Content-Length or chunked...
    let post = format!(
        "POST /p HTTP/1.1\r\nHost: allowed.test\r\nConnection: keep-alive\r\nContent-Length: {}\r\n\r\n{inner}",
        inner.len()
    );
    let chunked = format!(
        "POST /c HTTP/1.1\r\nHost: allowed.test\r\nConnection: keep-alive\r\nTransfer-Encoding: chunked\r\n\r\n\
         {:x}\r\n{}\r\n{:X};ext=1\r\n{}\r\n0\r\nX-Trailer: 1\r\n\r\n",
        10,
        &inner[..10],
        inner.len() - 10,
        &inner[10..]
    );
    let r = w.tcp(
        (ALLOWED, 80),
        (post + &chunked + "GET / HTTP/1.1\r\nHost: allowed.test\r\n\r\n").as_bytes(),
    );
    assert_eq!(statuses(&r), ["200", "200", "200"], "{r}");
    let bodies: Vec<Vec<u8>> = w.web.requests.lock().unwrap().iter().map(|r| r.body.clone()).collect();
    assert_eq!(bodies, [inner.as_bytes(), inner.as_bytes(), b""]);
    // ... and what follows a body is the next request, judged.
    let r = w.tcp(
        (ALLOWED, 80),
        format!("POST / HTTP/1.1\r\nHost: allowed.test\r\nConnection: keep-alive\r\nContent-Length: 0\r\n\r\n{inner}")
            .as_bytes(),
    );
    assert_eq!(statuses(&r), ["200", "403"], "{r}");
    assert!(r.contains("other.test:80 (default deny)"), "{r}");
    assert_eq!(w.web.hosts().len(), 4);
    // Shapes two parsers could frame differently are refused before anything reaches the upstream.
    let head = "POST / HTTP/1.1\r\nHost: allowed.test\r\n";
    for (bad, why) in [
        (
            format!("{head}Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"),
            "both Content-Length and Transfer-Encoding",
        ),
        (
            format!("{head}Transfer-Encoding: gzip, chunked\r\n\r\n"),
            "a Transfer-Encoding other than chunked",
        ),
        (
            format!("{head}Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n"),
            "two Transfer-Encoding headers",
        ),
        (
            format!("{head}Content-Length: 5\r\nContent-Length: 6\r\n\r\nhello!"),
            "two different Content-Length values",
        ),
        (
            format!("{head}Content-Length: +5\r\n\r\nhello"),
            "a malformed Content-Length",
        ),
        (
            format!("{head}Transfer-Encoding: chunked\r\n\r\n5 \r\nhello\r\n0\r\n\r\n"),
            "a malformed chunk",
        ),
        (
            "CONNECT allowed.test:80 HTTP/1.1\r\nHost: allowed.test:80\r\n\r\n".to_string(),
            "CONNECT is not proxied",
        ),
        (
            format!(
                "{}GET / HTTP/1.1\r\nHost: allowed.test\r\nX-Big: {}\r\n\r\n",
                get("allowed.test"),
                "a".repeat(20_000)
            ),
            "request head too large",
        ),
    ] {
        let r = w.tcp((ALLOWED, 80), bad.as_bytes());
        assert!(r.contains("HTTP/1.1 403 Forbidden") && r.contains(why), "{why}: {r}");
    }
    // Only the chunked request's head (its chunk refused mid-way: never a whole request) and
    // the big head's first request reached it.
    assert_eq!(w.web.hosts().len(), 5, "{:?}", w.web.hosts());
    assert_eq!(w.sandbox.snapshot().counters.tcp_denied, 9);
}

#[test]
fn a_websocket_upgrade_becomes_opaque_and_other_upgrades_are_refused() {
    let w = world(WEB, NO_TENANT, &[], SandboxLimits::default());
    let inner = "GET / HTTP/1.1\r\nHost: other.test\r\n\r\n";
    // WebSocket: after the 101 the bytes are the site's own protocol (echoed here), unjudged.
    let ws = "GET /ws HTTP/1.1\r\nHost: allowed.test\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n";
    let r = w.conversation((ALLOWED, 80), &[ws, inner]);
    assert!(r.starts_with("HTTP/1.1 101") && r.ends_with(inner), "{r}");
    // Any other protocol (h2c names hosts in its own frames): the 101 is not passed on.
    let h2c = "GET / HTTP/1.1\r\nHost: allowed.test\r\nConnection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n\
               HTTP2-Settings: AAMAAABkAAQCAAAAAAIAAAAA\r\n\r\n";
    let r = w.conversation((ALLOWED, 80), &[h2c, inner]);
    assert_eq!(statuses(&r), ["403"], "{r}");
    assert!(
        r.contains("allowed.test:80 (upgrade to a protocol other than websocket)"),
        "{r}"
    );
    // An upgrade is only the connection's first request (its answer is then the first one back).
    let r = w.tcp((ALLOWED, 80), (get("allowed.test") + ws).as_bytes());
    assert_eq!(statuses(&r), ["200", "403"], "{r}");
    assert!(r.contains("upgrade after the connection's first request"), "{r}");
    assert_eq!(w.web.hosts(), ["allowed.test"; 3]);
    assert_eq!(w.sandbox.snapshot().counters.tcp_denied, 2);
}
