//! A sandbox's ports and envd by host name (as wildcard DNS delivers them): who gets in, and that
//! no credential that opened the way reaches the sandbox.

use super::*;

pub(crate) fn ports_and_envd_are_reachable_by_host_name() {
    let s = server();
    let id = shared();
    let script = "mkdir -p /tmp/www && echo served-from-sandbox > /tmp/www/hello.txt && exec python3 -m http.server 8000 --bind 127.0.0.1 --directory /tmp/www";
    s.session(id, json!({ "argv": ["sh", "-c", script] }));
    let host = format!("8000-{id}.sandbox.test");
    let bearer = format!("Bearer {}", s.key);
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (status, body) = get_with_host(s, &host, "/hello.txt", &[("Authorization", &bearer)]);
        if status == 200 {
            assert!(body.contains("served-from-sandbox"), "{body}");
            break;
        }
        assert!(Instant::now() < deadline, "port 8000 never answered: {status} {body}");
        std::thread::sleep(Duration::from_millis(300));
    }
    let (status, body) = get_with_host(s, &host, "/hello.txt", &[]);
    // Never public: a caller without credentials is told it needs one (whatever exists).
    assert_eq!(status, 401, "sandbox ports are never public: {body}");
    assert!(body.contains("E2B-Traffic-Access-Token"), "{body}");
    // A wrong one learns nothing: the missing-sandbox answer.
    let (status, body) = get_with_host(s, &host, "/hello.txt", &[("E2B-Traffic-Access-Token", "0000")]);
    assert_eq!(status, 502, "{body}");
    assert!(body.contains("is not running"), "{body}");
    let (status, body) = get_with_host(
        s,
        &format!("8001-{id}.sandbox.test"),
        "/",
        &[("Authorization", &bearer)],
    );
    assert_eq!(status, 502, "{body}");
    assert!(body.contains("nothing listens on port 8001"), "{body}");

    // envd by host name (E2B_DOMAIN setups): closed until the E2B API hands out a token (and
    // answered as for a missing sandbox).
    let envd_host = format!("49983-{id}.sandbox.test");
    assert_eq!(get_with_host(s, &envd_host, "/health", &[]).0, 502);
    let (status, sb) = s.call_with(
        "POST",
        &format!("/sandboxes/{id}/connect"),
        Some(json!({ "timeout": 1800 })),
        None,
        &[("X-API-KEY", &s.key)],
    );
    assert_eq!(status, 200, "{sb}");
    let token = sb["envdAccessToken"].as_str().unwrap().to_string();
    assert_eq!(
        get_with_host(s, &envd_host, "/health", &[("X-Access-Token", &token)]).0,
        204
    );
    assert_eq!(
        get_with_host(s, &envd_host, "/health", &[("X-Access-Token", "wrong")]).0,
        502
    );
}

/// A header-echo server inside a sandbox: the credential that opened the sandbox never reaches
/// it (the owner's API key, the access token), while the app's own headers do.
pub(crate) fn credentials_never_reach_a_sandbox_port() {
    let s = server();
    // Its own sandbox: the E2B access token it has issued would open the shared sandbox's envd,
    // which `ports_and_envd_are_reachable_by_host_name` expects closed.
    let own = s.create(json!({ "template": "seed", "timeout": "10m" }));
    let id = own.as_str();
    // (Lines joined explicitly: a `\` line continuation would eat Python's indentation.)
    let echo = [
        "import http.server",
        "class H(http.server.BaseHTTPRequestHandler):",
        "    def do_GET(self):",
        "        b = ''.join(k.lower() + ': ' + v + '\\n' for k, v in self.headers.items()).encode()",
        "        self.send_response(200)",
        "        self.send_header('content-length', str(len(b)))",
        "        self.end_headers()",
        "        self.wfile.write(b)",
        "    def log_message(self, *a):",
        "        pass",
        "http.server.HTTPServer(('127.0.0.1', 8002), H).serve_forever()",
    ]
    .join("\n");
    s.session(id, json!({ "argv": ["python3", "-c", echo] }));
    let host = format!("8002-{id}.sandbox.test");
    let bearer = format!("Bearer {}", s.key);
    // Opened by the owner's key: the key stays out, the app's own header goes in.
    let deadline = Instant::now() + Duration::from_secs(60);
    let seen = loop {
        let (status, body) = get_with_host(s, &host, "/", &[("Authorization", &bearer), ("X-App", "keep-me")]);
        if status == 200 {
            break body;
        }
        assert!(Instant::now() < deadline, "port 8002 never answered: {status} {body}");
        std::thread::sleep(Duration::from_millis(300));
    };
    assert!(seen.contains("x-app: keep-me"), "{seen}");
    assert!(
        !seen.contains(&s.key) && !seen.contains("authorization"),
        "the API key reached the sandbox: {seen}"
    );
    // Opened by E2B's traffic token: no airlock token gets in (the envd token co-sent neither),
    // while the app's own Authorization passes.
    let (status, sb) = s.call_with(
        "POST",
        &format!("/sandboxes/{id}/connect"),
        Some(json!({ "timeout": 1800 })),
        None,
        &[("X-API-KEY", &s.key)],
    );
    assert_eq!(status, 200, "{sb}");
    let token = sb["envdAccessToken"].as_str().unwrap().to_string();
    let traffic = sb["trafficAccessToken"].as_str().unwrap().to_string();
    assert_ne!(token, traffic);
    let (status, seen) = get_with_host(
        s,
        &host,
        "/",
        &[
            ("E2B-Traffic-Access-Token", &traffic),
            ("X-Access-Token", &token),
            ("Authorization", "Bearer app-secret"),
        ],
    );
    assert_eq!(status, 200, "{seen}");
    assert!(
        !seen.contains(&token) && !seen.contains(&traffic),
        "a sandbox token reached the sandbox: {seen}"
    );
    assert!(seen.contains("authorization: Bearer app-secret"), "{seen}");
    let (status, seen) = get_with_host(s, &host, "/", &[("X-Access-Token", &token)]);
    assert_eq!(status, 200, "{seen}");
    assert!(!seen.contains(&token), "the access token reached the sandbox: {seen}");
    s.delete(id);
}
