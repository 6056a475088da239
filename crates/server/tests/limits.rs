//! Hostile callers against the whole server in-process (fake VMM + fake agent, as `core.rs`):
//! values that must not panic a handler, bodies refused before they are read, the same answer
//! for missing and foreign sandboxes, watchers that go with their sandbox, private files.

use airlock_runtime::{fake, Runtime};
use airlock_server::core::{Config, Core};
use airlock_server::e2b::Watchers;
use airlock_server::listen::Limits;
use airlock_server::nodes::{LocalNode, Nodes};
use airlock_server::store::{KeyFormat, SqliteStore, TenantStore};
use airlock_server::AppState;
use axum::body::Body;
use axum::http::{Method, Request};
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The server on its own tokio runtime, talked to over HTTP from the test's.
struct Server {
    addr: SocketAddr,
    key: String,
    core: Core,
    watchers: Arc<Watchers>,
    tokio: Option<tokio::runtime::Runtime>,
    _runtime: Runtime,
    _dir: tempfile::TempDir,
}

impl Server {
    async fn start() -> Server {
        Server::start_with(Limits::default()).await
    }

    async fn start_with(limits: Limits) -> Server {
        let dir = tempfile::tempdir().unwrap();
        fake::install_template(dir.path(), "seed").unwrap();
        let tokio_rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let d = dir.path().to_path_buf();
        let watchers: Arc<Watchers> = Default::default();
        let w = watchers.clone();
        let (addr, key, core, runtime) = tokio_rt
            .spawn(async move {
                let runtime = Runtime::open(fake::options(&d)).await.unwrap();
                let store = SqliteStore::open(&d.join("airlock.db")).await.unwrap();
                let key = airlock_server::bootstrap_admin_key(&store, &d, &"127.0.0.1:0".parse().unwrap())
                    .await
                    .unwrap()
                    .unwrap();
                let nodes: Arc<dyn Nodes> = Arc::new(LocalNode::new(runtime.clone()));
                let core = Core::new(
                    Arc::new(store),
                    nodes,
                    Config {
                        max_sandboxes_per_tenant: 8,
                        // Only the tenant quota here, whatever host runs the test.
                        vcpu_overcommit: 64.0,
                        memory_reserve_mib: 0,
                        disk_reserve_mib: 0,
                        ..Config::default()
                    },
                    vec![7; 32],
                );
                core.engine.recover().await.unwrap();
                core.engine.spawn_reaper();
                let app = airlock_server::router(AppState {
                    core: core.clone(),
                    watchers: w,
                    e2b_domain: None,
                });
                let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
                let addr = listener.local_addr().unwrap();
                tokio::spawn(airlock_server::listen::serve(listener, app, None, limits));
                (addr, key, core, runtime)
            })
            .await
            .unwrap();
        Server {
            addr,
            key,
            core,
            watchers,
            tokio: Some(tokio_rt),
            _runtime: runtime,
            _dir: dir,
        }
    }

    async fn send(&self, method: Method, path: &str, headers: &[(&str, &str)], body: Body) -> (u16, Body) {
        let mut req = Request::builder().method(method).uri(path);
        if !headers.iter().any(|(k, _)| k.eq_ignore_ascii_case("host")) {
            req = req.header("host", self.addr.to_string());
        }
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let stream = tokio::net::TcpStream::connect(self.addr).await.unwrap();
        let (mut sender, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .unwrap();
        tokio::spawn(conn);
        let res = sender.send_request(req.body(body).unwrap()).await.unwrap();
        (res.status().as_u16(), Body::new(res.into_body()))
    }

    async fn json(&self, method: Method, path: &str, headers: &[(&str, &str)], body: Body) -> (u16, Value) {
        let (status, body) = self.send(method, path, headers, body).await;
        let bytes = tokio::time::timeout(Duration::from_secs(10), axum::body::to_bytes(body, 16 << 20))
            .await
            .expect("a body within 10 s")
            .unwrap();
        let v =
            serde_json::from_slice(&bytes).unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into()));
        (status, v)
    }

    /// A running sandbox made through E2B, and its access token.
    async fn e2b_sandbox(&self) -> (String, String) {
        let headers = [("x-api-key", self.key.as_str()), ("content-type", "application/json")];
        let body = Body::from(json!({ "templateID": "base" }).to_string());
        let (status, sb) = self.json(Method::POST, "/sandboxes", &headers, body).await;
        assert_eq!(status, 201, "{sb}");
        (
            sb["sandboxID"].as_str().unwrap().to_string(),
            sb["envdAccessToken"].as_str().unwrap().to_string(),
        )
    }

    async fn v1(&self, method: Method, path: &str, body: Option<Value>) -> (u16, Value) {
        let auth = format!("Bearer {}", self.key);
        let mut headers = vec![("authorization", auth.as_str())];
        let body = match body {
            Some(b) => {
                headers.push(("content-type", "application/json"));
                Body::from(b.to_string())
            }
            None => Body::empty(),
        };
        self.json(method, &format!("/v1{path}"), &headers, body).await
    }

    /// A running sandbox made through `/v1` (no access token issued).
    async fn native_sandbox(&self) -> String {
        let (status, body) = self
            .v1(Method::POST, "/sandboxes", Some(json!({ "template": "seed" })))
            .await;
        assert_eq!(status, 202, "{body}");
        let id = body["sandbox_id"].as_str().unwrap().to_string();
        self.await_state(&id, "running").await;
        id
    }

    async fn await_state(&self, id: &str, want: &str) {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let (_, sb) = self.v1(Method::GET, &format!("/sandboxes/{id}"), None).await;
            if sb["state"] == want {
                return;
            }
            assert!(Instant::now() < deadline, "sandbox {id} is {sb}, not {want}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    async fn delete(&self, id: &str) {
        let (status, body) = self.v1(Method::DELETE, &format!("/sandboxes/{id}"), None).await;
        assert_eq!(status, 202, "{body}");
        self.await_state(id, "deleted").await;
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(rt) = self.tokio.take() {
            rt.shutdown_background();
        }
    }
}

/// A Connect envelope: flags u8, length u32 BE, JSON.
fn envelope(v: &Value) -> Vec<u8> {
    let payload = serde_json::to_vec(v).unwrap();
    let mut b = vec![0u8];
    b.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    b.extend_from_slice(&payload);
    b
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
    let server = Server::start().await;
    let (id, token) = server.e2b_sandbox().await;
    let mut headers = envd_headers(&id, &token, "application/connect+json");
    headers.push(("connect-timeout-ms", "18446744073709551615"));
    headers.push(("keepalive-ping-interval", "18446744073709551615"));
    let req = json!({ "process": { "cmd": "echo", "args": ["hi"] } });
    let (status, body) = server
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
    let server = Server::start().await;
    let (id, token) = server.e2b_sandbox().await;

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

/// The answer with the requested id blanked out (it is the caller's own input).
fn shape(status: u16, mut body: Value, id: &str) -> (u16, String) {
    let text = body.to_string().replace(id, "<id>");
    body = serde_json::from_str(&text).unwrap();
    (status, body.to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_and_foreign_sandboxes_answer_alike() {
    let server = Server::start().await;
    let (id, token) = server.e2b_sandbox().await;
    let native = server.native_sandbox().await;
    let other_key = server.core.store.create_key("other", KeyFormat::Airlock).await.unwrap();
    let other_bearer = format!("Bearer {other_key}");
    let own_bearer = format!("Bearer {}", server.key);
    let missing = "nosuchsandbox0";

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
        ]
        .into_iter()
        .chain(
            // No token at all: only routes that need one (health and signed URLs need none).
            (*path != "/health").then(|| (id.as_str(), vec![])),
        ) {
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
                let (status, resp) = server
                    .json(method.clone(), path, &headers, Body::from(body.clone()))
                    .await;
                answers.push((target, shape(status, resp, target)));
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

    // Ports: unknown, no credentials, a wrong token, another tenant's key.
    let mut answers = Vec::new();
    for (target, creds) in [
        (missing, vec![]),
        (missing, vec![("authorization", own_bearer.as_str())]),
        (id.as_str(), vec![]),
        (id.as_str(), vec![("e2b-traffic-access-token", "wrong")]),
        (id.as_str(), vec![("authorization", other_bearer.as_str())]),
        (native.as_str(), vec![("authorization", other_bearer.as_str())]),
        (native.as_str(), vec![("e2b-traffic-access-token", token.as_str())]),
    ] {
        let host = format!("8000-{target}.localhost");
        let mut headers = creds.clone();
        headers.push(("host", host.as_str()));
        let (status, resp) = server.json(Method::GET, "/index.html", &headers, Body::empty()).await;
        answers.push((target, shape(status, resp, target)));
    }
    let first = answers[0].1.clone();
    assert_eq!(first.0, 502, "{first:?}");
    for (target, a) in &answers {
        assert_eq!(a, &first, "port 8000 of {target}");
    }
    println!("ports: every caller without proof gets {first:?}");
    // The right token gets past the check (to the fake agent's tunnel, whatever it answers).
    let host = format!("8000-{id}.localhost");
    let (status, resp) = server
        .json(
            Method::GET,
            "/index.html",
            &[("host", host.as_str()), ("e2b-traffic-access-token", token.as_str())],
            Body::empty(),
        )
        .await;
    assert_ne!(shape(status, resp, &id), first, "a correct token is not refused");

    server.delete(&id).await;
    server.delete(&native).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandboxs_watchers_go_with_it() {
    let server = Server::start().await;
    let (id, _token) = server.e2b_sandbox().await;
    let (keep, _) = server.e2b_sandbox().await;
    let (core, watchers) = (server.core.clone(), server.watchers.clone());
    let (i, k) = (id.clone(), keep.clone());
    server
        .tokio
        .as_ref()
        .unwrap()
        .spawn(async move {
            for _ in 0..3 {
                watchers.create(&core, &i, futures_util::stream::pending()).unwrap();
            }
            watchers.create(&core, &k, futures_util::stream::pending()).unwrap();
        })
        .await
        .unwrap();
    assert_eq!((server.watchers.count(&id), server.watchers.count(&keep)), (3, 1));
    server.delete(&id).await;
    let deadline = Instant::now() + Duration::from_secs(5);
    while server.watchers.count(&id) > 0 {
        assert!(
            Instant::now() < deadline,
            "the deleted sandbox's watchers are still there"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(server.watchers.count(&keep), 1, "another sandbox's watchers stay");
    server.delete(&keep).await;
    let deadline = Instant::now() + Duration::from_secs(5);
    while server.watchers.count(&keep) > 0 {
        assert!(Instant::now() < deadline);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
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

/// Raise the soft fd limit to at least `want` (up to the hard limit).
fn raise_fd_limit(want: u64) -> u64 {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) };
    if (lim.rlim_cur as u64) < want {
        lim.rlim_cur = (want as libc::rlim_t).min(lim.rlim_max);
        unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) };
    }
    lim.rlim_cur as u64
}

/// Open `n` connections that each send a partial request head and then nothing.
async fn slow_heads(addr: SocketAddr, n: usize) -> Vec<tokio::net::TcpStream> {
    use tokio::io::AsyncWriteExt;
    let mut slow = Vec::with_capacity(n);
    for _ in 0..n {
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n").await.unwrap();
        slow.push(s);
    }
    slow
}

/// When each connection was closed by the server (None: still open after `wait`).
async fn closed_at(slow: Vec<tokio::net::TcpStream>, wait: Duration) -> Vec<Option<Instant>> {
    use tokio::io::AsyncReadExt;
    futures_util::future::join_all(slow.into_iter().map(|mut s| async move {
        let mut buf = [0u8; 256];
        loop {
            match tokio::time::timeout(wait, s.read(&mut buf)).await {
                Ok(Ok(0)) | Ok(Err(_)) => return Some(Instant::now()),
                Ok(Ok(_)) => continue,
                Err(_) => return None,
            }
        }
    }))
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_request_heads_are_cut_off_while_others_are_served() {
    const SLOW: usize = 1000;
    let fds = raise_fd_limit(4 * SLOW as u64);
    assert!(fds >= 3 * SLOW as u64, "RLIMIT_NOFILE is {fds}");
    let header_read = Duration::from_secs(2);
    let server = Server::start_with(Limits {
        header_read,
        ..Limits::default()
    })
    .await;
    let started = Instant::now();
    let slow = slow_heads(server.addr, SLOW).await;
    let opened = started.elapsed();
    // Normal requests while all of them hang.
    let mut latencies = Vec::new();
    while started.elapsed() < header_read / 2 || latencies.len() < 3 {
        let t = Instant::now();
        let (status, doc) = server.json(Method::GET, "/openapi-m1.json", &[], Body::empty()).await;
        latencies.push(t.elapsed());
        assert_eq!(status, 200, "{doc}");
        assert!(doc["paths"].is_object());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let closed = closed_at(slow, header_read * 3).await;
    let open = closed.iter().filter(|c| c.is_none()).count();
    let last = closed.iter().flatten().max().unwrap().duration_since(started);
    let first = closed.iter().flatten().min().unwrap().duration_since(started);
    let worst = latencies.iter().max().unwrap();
    println!(
        "{SLOW} slow heads opened in {opened:?}; {} normal requests during the attack, worst {worst:?} \
         (all: {latencies:?}); slow ones closed from {first:?} to {last:?} after the attack began \
         (header timeout {header_read:?}), {open} left open",
        latencies.len()
    );
    assert_eq!(open, 0, "every slow connection is closed");
    assert!(
        first >= header_read - Duration::from_millis(100),
        "{first:?}: closed too early"
    );
    assert!(last < opened + header_read + Duration::from_secs(2), "{last:?}");
    assert!(*worst < Duration::from_secs(1), "{worst:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_the_connection_cap_new_connections_wait_their_turn() {
    let header_read = Duration::from_secs(1);
    let server = Server::start_with(Limits {
        header_read,
        max_connections: 4,
        ..Limits::default()
    })
    .await;
    let slow = slow_heads(server.addr, 4).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    // The fifth connection waits in the backlog until the slow ones are cut off.
    let t = Instant::now();
    let (status, _) = server.json(Method::GET, "/openapi-m1.json", &[], Body::empty()).await;
    let waited = t.elapsed();
    println!("with 4 of 4 connections held by slow heads, a request took {waited:?}");
    assert_eq!(status, 200);
    assert!(waited >= header_read - Duration::from_millis(300), "{waited:?}");
    assert!(waited < header_read + Duration::from_secs(2), "{waited:?}");
    assert!(closed_at(slow, Duration::from_secs(1))
        .await
        .iter()
        .all(Option::is_some));
}
