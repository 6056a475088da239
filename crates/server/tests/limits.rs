//! Hostile callers against the whole server in-process (fake VMM + fake agent, as `core.rs`):
//! values that must not panic a handler, bodies refused before they are read, the same answer
//! for missing and foreign sandboxes, watchers that go with their sandbox, private files.
//! The server is `common::Server` (shared with `core.rs`).

mod common;
#[path = "limits/connections.rs"]
mod connections;

use airlock_server::core::principal::signature;
use airlock_server::listen::Limits;
use airlock_server::store::{KeyFormat, SqliteStore, TenantStore};
use axum::body::Body;
use axum::http::Method;
use common::*;
use serde_json::json;
use std::net::SocketAddr;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::time::{Duration, Instant};

/// What only these tests ask of the shared server.
impl Server {
    /// The whole answer to a request about sandbox `id`: status, content type and body, with
    /// `id` (the caller's own input, echoed) blanked out.
    async fn answer(
        &self,
        method: Method,
        path: &str,
        headers: &[(&str, &str)],
        body: Body,
        id: &str,
    ) -> (u16, String, String) {
        let res = self.send(method, path, headers, body).await;
        let content_type = res
            .headers
            .get("content-type")
            .map(|v| v.to_str().unwrap().to_string())
            .unwrap_or_default();
        let bytes = tokio::time::timeout(Duration::from_secs(10), axum::body::to_bytes(res.body, 1 << 20))
            .await
            .expect("a body within 10 s")
            .unwrap();
        let text = String::from_utf8_lossy(&bytes).replace(id, "<id>");
        (res.status, content_type, text)
    }

    /// A running E2B sandbox of the tenant whose key is `key`.
    async fn foreign_e2b_sandbox(&self, key: &str) -> String {
        let headers = [("x-api-key", key), ("content-type", "application/json")];
        let body = Body::from(json!({ "templateID": "base" }).to_string());
        let (status, sb) = self.json(Method::POST, "/sandboxes", &headers, body).await;
        assert_eq!(status, 201, "{sb}");
        sb["sandboxID"].as_str().unwrap().to_string()
    }

    async fn delete_as(&self, key: &str, id: &str) {
        let auth = format!("Bearer {key}");
        let (status, body) = self
            .json(
                Method::DELETE,
                &format!("/v1/sandboxes/{id}"),
                &[("authorization", &auth)],
                Body::empty(),
            )
            .await;
        assert_eq!(status, 202, "{body}");
    }
}

fn envd_headers<'a>(id: &'a str, token: &'a str, content_type: &'a str) -> Vec<(&'a str, &'a str)> {
    vec![
        ("x-access-token", token),
        ("e2b-sandbox-id", id),
        ("content-type", content_type),
        ("connect-protocol-version", "1"),
    ]
}

fn vm_rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_stream_headers_get_a_normal_answer() {
    let server = Server::start_fresh(Limits::default()).await;
    let E2bSandbox { id, token, .. } = server.e2b_sandbox().await;
    let mut headers = envd_headers(&id, &token, "application/connect+json");
    headers.push(("connect-timeout-ms", "18446744073709551615"));
    headers.push(("keepalive-ping-interval", "18446744073709551615"));
    let req = json!({ "process": { "cmd": "echo", "args": ["hi"] } });
    let Resp { status, body, .. } = server
        .send(
            Method::POST,
            "/process.Process/Start",
            &headers,
            Body::from(envelope(&req)),
        )
        .await;
    assert_eq!(status, 200);
    let bytes = tokio::time::timeout(Duration::from_secs(10), axum::body::to_bytes(body, 1 << 20))
        .await
        .expect("the stream ends")
        .expect("the stream is whole (no dropped connection)");
    let text = String::from_utf8_lossy(&bytes);
    assert!(text.contains("\"start\"") && text.contains("\"end\""), "{text}");
    assert!(!text.contains("\"error\""), "{text}");
    server.delete(&id).await;
}

/// Send a request head, then up to `body` zero bytes (stopping at the first failed write), and
/// read the status line if one arrives. Returns the status and the body bytes written.
async fn raw_post(addr: SocketAddr, head: &str, body: usize) -> (Option<u16>, usize) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    stream.write_all(head.as_bytes()).await.unwrap();
    let chunk = [0u8; 64 << 10];
    let mut written = 0;
    while written < body {
        let n = chunk.len().min(body - written);
        // A server that answered without reading stops taking bytes: the write blocks, then fails.
        match tokio::time::timeout(Duration::from_secs(2), stream.write_all(&chunk[..n])).await {
            Ok(Ok(())) => written += n,
            _ => break,
        }
    }
    let mut buf = vec![0u8; 4096];
    let status = match tokio::time::timeout(Duration::from_secs(5), stream.read(&mut buf)).await {
        Ok(Ok(n)) if n > 0 => std::str::from_utf8(&buf[..n])
            .ok()
            .and_then(|t| t.split_whitespace().nth(1))
            .and_then(|code| code.parse().ok()),
        _ => None,
    };
    (status, written)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_are_refused_before_they_are_read() {
    let server = Server::start_fresh(Limits::default()).await;
    let E2bSandbox { id, token, .. } = server.e2b_sandbox().await;

    // Anonymous, 256 MiB. With `Expect: 100-continue` the server must answer without ever
    // asking for the body; without it, the client writes until the server, having answered,
    // closes the connection: far less than 256 MiB is ever accepted.
    const TOTAL: usize = 256 << 20;
    for who in [id.as_str(), "nosuchsandbox0"] {
        let head = |expect: bool| {
            format!(
                "POST /process.Process/Start HTTP/1.1\r\nhost: {}\r\ne2b-sandbox-id: {who}\r\n\
                 content-type: application/connect+json\r\ncontent-length: {TOTAL}\r\n{}\r\n",
                server.addr,
                if expect { "expect: 100-continue\r\n" } else { "" }
            )
        };
        let (status, written) = raw_post(server.addr, &head(true), 0).await;
        assert!(matches!(status, Some(401 | 502)), "{who}: {status:?}");
        assert_eq!(written, 0);
        let rss_before = vm_rss_kib();
        let started = Instant::now();
        let (status, written) = raw_post(server.addr, &head(false), TOTAL).await;
        let elapsed = started.elapsed();
        let grown_mib = vm_rss_kib().saturating_sub(rss_before) / 1024;
        println!(
            "anonymous 256 MiB POST for {who}: {status:?} after {} KiB written, in {elapsed:?}, VmRSS grew {grown_mib} MiB",
            written >> 10
        );
        // The answer may be lost to the connection reset; what matters is that it came early.
        assert!(matches!(status, None | Some(401 | 502)), "{who}: {status:?}");
        assert!(written < TOTAL / 4, "{who}: the server took {written} bytes");
        assert!(elapsed < Duration::from_secs(5), "{elapsed:?}");
        assert!(grown_mib < 32, "VmRSS grew {grown_mib} MiB");
    }

    // Authenticated, but larger than an RPC reads (just over 1 MiB, so the whole body fits in
    // the socket buffers and the answer is never lost to a reset): 413.
    let big = json!({ "path": "x".repeat((1 << 20) + (64 << 10)) }).to_string();
    let headers = envd_headers(&id, &token, "application/json");
    let (status, err) = server
        .json(
            Method::POST,
            "/filesystem.Filesystem/Stat",
            &headers,
            Body::from(big.clone()),
        )
        .await;
    assert_eq!(status, 413, "{err}");
    assert_eq!(err["code"], "resource_exhausted", "{err}");
    let (status, err) = server
        .json(Method::POST, "/process.Process/List", &headers, Body::from(big.clone()))
        .await;
    assert_eq!(status, 413, "{err}");
    // The same on the native door and the E2B control plane.
    let auth = format!("Bearer {}", server.key);
    let v1 = [("authorization", auth.as_str()), ("content-type", "application/json")];
    let (status, err) = server
        .json(Method::POST, "/v1/sandboxes", &v1, Body::from(big.clone()))
        .await;
    assert_eq!(
        (status, err["code"].as_str()),
        (413, Some("payload_too_large")),
        "{err}"
    );
    let e2b = [("x-api-key", server.key.as_str()), ("content-type", "application/json")];
    let (status, _) = server.json(Method::POST, "/sandboxes", &e2b, Body::from(big)).await;
    assert_eq!(status, 413);

    // Uploads still take more than that, streamed.
    let data = vec![b'a'; 3 << 20];
    let (status, info) = server
        .json(
            Method::POST,
            "/files?path=/tmp/big.bin",
            &envd_headers(&id, &token, "application/octet-stream"),
            Body::from(data.clone()),
        )
        .await;
    assert_eq!(status, 200, "{info}");
    let (status, info) = server
        .json(
            Method::PUT,
            &format!("/v1/sandboxes/{id}/files?path=/tmp/big2.bin"),
            &[
                ("authorization", auth.as_str()),
                ("content-type", "application/octet-stream"),
            ],
            Body::from(data),
        )
        .await;
    assert_eq!(status, 200, "{info}");
    assert_eq!(info["size"], 3 << 20, "{info}");
    server.delete(&id).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_and_foreign_sandboxes_answer_alike() {
    let server = Server::start_fresh(Limits::default()).await;
    let E2bSandbox { id, token, traffic } = server.e2b_sandbox().await;
    let native = server.running_sandbox().await;
    let other_key = server
        .core()
        .store()
        .create_key("other", KeyFormat::Airlock)
        .await
        .unwrap();
    let other_bearer = format!("Bearer {other_key}");
    let own_bearer = format!("Bearer {}", server.key);
    let missing = "nosuchsandbox0";
    // Another tenant's sandbox, opened to E2B (it has a token: just not one this caller holds).
    let foreign = server.foreign_e2b_sandbox(&other_key).await;

    // envd: every route, by header and by host.
    let routes = [
        ("/process.Process/List", "application/json", "{}".to_string()),
        (
            "/filesystem.Filesystem/Stat",
            "application/json",
            r#"{"path":"/tmp"}"#.into(),
        ),
        ("/files?path=/tmp/a", "application/octet-stream", "data".into()),
        ("/health", "", String::new()),
    ];
    for (path, ct, body) in &routes {
        let method = if *path == "/health" { Method::GET } else { Method::POST };
        let mut answers = Vec::new();
        for (target, creds) in [
            (missing, vec![]),
            (missing, vec![("x-access-token", token.as_str())]),
            (id.as_str(), vec![("x-access-token", "wrong")]),
            (native.as_str(), vec![]),
            (native.as_str(), vec![("authorization", own_bearer.as_str())]),
            (native.as_str(), vec![("x-access-token", token.as_str())]),
            // The traffic token opens ports, never envd: as a missing sandbox, by either header.
            (id.as_str(), vec![("e2b-traffic-access-token", traffic.as_str())]),
            (id.as_str(), vec![("x-access-token", traffic.as_str())]),
        ]
        .into_iter()
        .chain([
            // No token at all, on a sandbox that has one: `/health` too (it would otherwise tell
            // which ids exist).
            (id.as_str(), vec![]),
            // Another tenant's sandbox, with this tenant's token and key.
            (foreign.as_str(), vec![("x-access-token", token.as_str())]),
            (foreign.as_str(), vec![("authorization", own_bearer.as_str())]),
        ]) {
            for by_host in [false, true] {
                let host = format!("49983-{target}.localhost");
                let mut headers = creds.clone();
                if by_host {
                    headers.push(("host", host.as_str()));
                } else {
                    headers.push(("e2b-sandbox-id", target));
                }
                if !ct.is_empty() {
                    headers.push(("content-type", ct));
                }
                let answer = server
                    .answer(method.clone(), path, &headers, Body::from(body.clone()), target)
                    .await;
                answers.push((target, answer));
            }
        }
        let first = answers[0].1.clone();
        assert_eq!(first.0, 502, "{path}: {first:?}");
        for (target, a) in &answers {
            assert_eq!(a, &first, "{path} for {target}");
        }
        println!("envd {path}: every caller without proof gets {first:?}");
    }
    // A correct token still works.
    let (status, _) = server
        .json(
            Method::GET,
            "/health",
            &[("e2b-sandbox-id", id.as_str()), ("x-access-token", token.as_str())],
            Body::empty(),
        )
        .await;
    assert_eq!(status, 204);
    let (status, list) = server
        .json(
            Method::POST,
            "/process.Process/List",
            &envd_headers(&id, &token, "application/json"),
            Body::from("{}"),
        )
        .await;
    assert_eq!(status, 200, "{list}");

    // Ports, by host and by E2B's headers: unknown, a wrong token, another tenant's key, another
    // tenant's sandbox. A request with no credential at all is told it needs one (401), the
    // same whether the sandbox exists.
    for target in [missing, id.as_str()] {
        let host = format!("8000-{target}.localhost");
        let (status, body) = server
            .json(Method::GET, "/index.html", &[("host", host.as_str())], Body::empty())
            .await;
        assert_eq!(status, 401, "{body}");
        assert!(
            body["message"].as_str().unwrap().contains("E2B-Traffic-Access-Token"),
            "{body}"
        );
    }
    let mut answers = Vec::new();
    for (target, creds) in [
        (missing, vec![("e2b-traffic-access-token", "wrong")]),
        (missing, vec![("authorization", own_bearer.as_str())]),
        (id.as_str(), vec![("e2b-traffic-access-token", "wrong")]),
        (id.as_str(), vec![("authorization", other_bearer.as_str())]),
        (native.as_str(), vec![("authorization", other_bearer.as_str())]),
        (native.as_str(), vec![("e2b-traffic-access-token", traffic.as_str())]),
        (foreign.as_str(), vec![("authorization", own_bearer.as_str())]),
        (foreign.as_str(), vec![("e2b-traffic-access-token", traffic.as_str())]),
    ] {
        for by_host in [false, true] {
            let host = format!("8000-{target}.localhost");
            let mut headers = creds.clone();
            if by_host {
                headers.push(("host", host.as_str()));
            } else {
                headers.extend([("e2b-sandbox-id", target), ("e2b-sandbox-port", "8000")]);
            }
            let answer = server
                .answer(Method::GET, "/index.html", &headers, Body::empty(), target)
                .await;
            answers.push((target, answer));
        }
    }
    let first = answers[0].1.clone();
    assert_eq!(first.0, 502, "{first:?}");
    for (target, a) in &answers {
        assert_eq!(a, &first, "port 8000 of {target}");
    }
    println!("ports: every caller without proof gets {first:?}");
    // The traffic token (and envd's, which the code interpreter's SDK sends) gets past the check
    // (to the fake agent's tunnel, whatever it answers).
    let host = format!("8000-{id}.localhost");
    for creds in [
        ("e2b-traffic-access-token", traffic.as_str()),
        ("x-access-token", token.as_str()),
    ] {
        let answer = server
            .answer(
                Method::GET,
                "/index.html",
                &[("host", host.as_str()), creds],
                Body::empty(),
                &id,
            )
            .await;
        assert_ne!(answer, first, "a correct token is not refused: {creds:?}");
    }

    // Signed `/files` URLs: a bad signature, a signature for another operation or path, one
    // made with another sandbox's token, and a sandbox never opened to tokens all answer as an
    // unknown sandbox does.
    // As a URL carries it (base64 has `+` and `/`).
    let enc = |sig: String| sig.replace('+', "%2B").replace('/', "%2F");
    let sign = |path: &str, op: &str, token: &str| enc(signature(path, op, "user", token, None));
    let foreign_token = server.core().access_token(&foreign);
    let native_token = server.core().access_token(&native);
    // Write first: the read below then finds the file.
    for (method, op) in [(Method::POST, "write"), (Method::GET, "read")] {
        let other_op = if op == "read" { "write" } else { "read" };
        let mut answers = Vec::new();
        for (target, sig) in [
            (missing, sign("/tmp/a", op, &token)),
            (missing, "v1_bad".to_string()),
            (id.as_str(), "v1_bad".to_string()),
            (id.as_str(), String::new()),
            (id.as_str(), sign("/tmp/a", other_op, &token)),
            (id.as_str(), sign("/tmp/b", op, &token)),
            (id.as_str(), sign("/tmp/a", op, &foreign_token)),
            // Signed with the traffic token, which proves nothing about files.
            (id.as_str(), sign("/tmp/a", op, &traffic)),
            (foreign.as_str(), sign("/tmp/a", op, &token)),
            (native.as_str(), sign("/tmp/a", op, &native_token)),
        ] {
            let url = format!("/files?path=/tmp/a&username=user&signature={sig}");
            for by_host in [false, true] {
                let host = format!("49983-{target}.localhost");
                let mut headers = vec![("content-type", "application/octet-stream")];
                if by_host {
                    headers.push(("host", host.as_str()));
                } else {
                    headers.push(("e2b-sandbox-id", target));
                }
                let answer = server
                    .answer(method.clone(), &url, &headers, Body::from("data"), target)
                    .await;
                answers.push((target, sig.clone(), answer));
            }
        }
        let first = answers[0].2.clone();
        assert_eq!(first.0, 502, "signed {op}: {first:?}");
        for (target, sig, a) in &answers {
            assert_eq!(a, &first, "signed {op} of {target} with {sig:?}");
        }
        println!("signed {op} URLs: every bad or foreign signature gets {first:?}");
        // The right signature works; an expired right one says so (only the token makes one).
        let url = format!(
            "/files?path=/tmp/a&username=user&signature={}",
            sign("/tmp/a", op, &token)
        );
        let headers = [
            ("e2b-sandbox-id", id.as_str()),
            ("content-type", "application/octet-stream"),
        ];
        let (status, body) = server.json(method.clone(), &url, &headers, Body::from("data")).await;
        assert_eq!(status, 200, "signed {op}: {body}");
        let past = 1_000_000_000;
        let sig = enc(signature("/tmp/a", op, "user", &token, Some(past)));
        let url = format!("/files?path=/tmp/a&username=user&signature={sig}&signature_expiration={past}");
        let (status, body) = server.json(method.clone(), &url, &headers, Body::from("data")).await;
        assert_eq!(status, 401, "expired signed {op}: {body}");
    }

    server.delete(&id).await;
    server.delete(&native).await;
    server.delete_as(&other_key, &foreign).await;
}

#[tokio::test]
async fn the_store_is_private() {
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("airlock.db");
    let store = SqliteStore::open(&db).await.unwrap();
    assert!(store
        .bootstrap(&airlock_server::store::new_key(KeyFormat::Airlock))
        .await
        .unwrap());
    for f in ["airlock.db", "airlock.db-wal", "airlock.db-shm"] {
        let p = dir.path().join(f);
        assert!(p.exists(), "{f}");
        assert_eq!(mode(&p), 0o600, "{f}");
    }
    drop(store);
    // A store from before is tightened.
    let old = dir.path().join("old.db");
    std::fs::write(&old, b"").unwrap();
    std::fs::set_permissions(&old, std::fs::Permissions::from_mode(0o644)).unwrap();
    let _store = SqliteStore::open(&old).await.unwrap();
    assert_eq!(mode(&old), 0o600);
}

/// The E2B control plane with another tenant's key: every route on that tenant's sandbox answers
/// exactly as for a missing one, listings and the tenant's usage leave it out, and it is left
/// untouched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e2b_control_routes_answer_another_tenants_sandbox_as_missing() {
    let server = Server::start_fresh(Limits::default()).await;
    let other_key = server.core().store().create_key("other", KeyFormat::E2b).await.unwrap();
    let foreign = server.foreign_e2b_sandbox(&other_key).await;
    let missing = "nosuchsandbox0";
    let routes: [(Method, &str, &str); 8] = [
        (Method::GET, "/sandboxes/{id}", ""),
        (Method::GET, "/sandboxes/{id}/metrics", ""),
        (Method::POST, "/sandboxes/{id}/timeout", r#"{"timeout": 60}"#),
        (Method::POST, "/sandboxes/{id}/connect", r#"{"timeout": 60}"#),
        (Method::POST, "/v2/sandboxes/{id}/connect", r#"{"timeout": 60}"#),
        (Method::POST, "/sandboxes/{id}/pause", ""),
        (Method::POST, "/sandboxes/{id}/snapshots", "{}"),
        (Method::DELETE, "/sandboxes/{id}", ""),
    ];
    let headers = [("x-api-key", server.key.as_str()), ("content-type", "application/json")];
    for (method, path, body) in routes {
        let mut answers = Vec::new();
        for target in [missing, foreign.as_str()] {
            let p = path.replace("{id}", target);
            answers.push(
                server
                    .answer(method.clone(), &p, &headers, Body::from(body.to_string()), target)
                    .await,
            );
        }
        assert_eq!(answers[0], answers[1], "{method} {path}");
        assert!(answers[0].0 >= 400, "{method} {path}: {:?}", answers[0]);
    }
    // Not in this tenant's listings, nor in its usage.
    let (status, list) = server.json(Method::GET, "/v2/sandboxes", &headers, Body::empty()).await;
    assert_eq!(status, 200, "{list}");
    assert!(!list.to_string().contains(&foreign), "{list}");
    let (_, native) = server.v1(Method::GET, "/sandboxes", None).await;
    assert!(!native.to_string().contains(&foreign));
    let (_, me) = server.v1(Method::GET, "/tenant", None).await;
    assert_eq!(me["usage"]["sandboxes"], 0, "{me}");
    // Untouched: its owner still finds it running.
    let auth = [("x-api-key", other_key.as_str())];
    let (status, sb) = server
        .json(Method::GET, &format!("/sandboxes/{foreign}"), &auth, Body::empty())
        .await;
    assert_eq!((status, sb["state"].as_str()), (200, Some("running")), "{sb}");
    server.delete_as(&other_key, &foreign).await;
}

/// A sandbox port never sees airlock's credentials (whichever opened it, and whichever were
/// co-sent), while the app's own `Authorization` passes; a cookie the sandbox sets for the
/// parent domain comes back host-only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_platform_credential_reaches_a_sandbox_port() {
    let server = Server::start_fresh(Limits::default()).await;
    let E2bSandbox { id, token, traffic } = server.e2b_sandbox().await;
    let host = format!("8000-{id}.localhost");
    let own_bearer = format!("Bearer {}", server.key);
    for (opener, app_auth) in [
        (
            ("e2b-traffic-access-token", traffic.as_str()),
            Some("Bearer the-app-s-own"),
        ),
        (("x-access-token", token.as_str()), Some("Basic dXNlcjpwYXNz")),
        (("authorization", own_bearer.as_str()), None),
    ] {
        let mut headers = vec![
            ("host", host.as_str()),
            opener,
            ("x-api-key", server.key.as_str()),
            ("x-access-token", token.as_str()),
            ("e2b-traffic-access-token", traffic.as_str()),
        ];
        if let Some(a) = app_auth {
            headers.push(("authorization", a));
        }
        headers.dedup();
        let resp = server.send(Method::GET, "/echo", &headers, Body::empty()).await;
        let cookies: Vec<String> = resp
            .headers
            .get_all("set-cookie")
            .iter()
            .map(|v| v.to_str().unwrap().to_string())
            .collect();
        let (status, body) = resp.json().await;
        assert_eq!(status, 200, "{body}");
        let seen = &body["headers"];
        for h in ["x-api-key", "x-access-token", "e2b-traffic-access-token"] {
            assert!(seen.get(h).is_none(), "{h} reached the sandbox: {seen}");
        }
        assert_eq!(seen.get("authorization").and_then(|v| v.as_str()), app_auth, "{seen}");
        assert!(
            !seen.to_string().contains(server.key.as_str()),
            "the tenant's key reached the sandbox: {seen}"
        );
        assert_eq!(cookies, ["tossed=1; Path=/"], "{cookies:?}");
    }
    server.delete(&id).await;
}

/// A tenant sees the server's version, accelerator, runtimes and egress configuration; the
/// node's counts and warm pools are the platform account's (`/v1/admin/system`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_wide_figures_are_the_platform_account_s() {
    let server = Server::start_fresh(Limits::default()).await;
    let (status, sys) = server.v1(Method::GET, "/system", None).await;
    assert_eq!(status, 200, "{sys}");
    assert!(sys["accel"].is_string() && sys["egress"].is_object(), "{sys}");
    assert!(sys.get("capacity").is_none() && sys.get("pools").is_none(), "{sys}");
    let (status, _) = server.v1(Method::GET, "/admin/system", None).await;
    assert_eq!(status, 403, "a tenant's key is no admin token");
}
