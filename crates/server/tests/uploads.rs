//! Uploads on the in-process server with the fake VMM: E2B multipart parts stream to the agent
//! as they arrive (never held whole), a broken part leaves the old file, and uploads under way
//! are bounded per sandbox and server-wide. The fake agent counts the bytes it receives
//! (`fake::uploaded_bytes`) and drops what goes to `/dev/null`.

mod common;

use airlock_runtime::fake;
use airlock_server::listen::Limits;
use axum::body::{Body, Bytes};
use axum::http::Method;
use common::*;
use std::time::{Duration, Instant};

const BOUNDARY: &str = "airlock-test-boundary";

fn part_head(filename: &str) -> String {
    format!(
        "--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{filename}\"\r\n\
         Content-Type: application/octet-stream\r\n\r\n"
    )
}

fn envd_headers(sb: &E2bSandbox) -> Vec<(String, String)> {
    vec![
        ("x-access-token".into(), sb.token.clone()),
        ("e2b-sandbox-id".into(), sb.id.clone()),
        (
            "content-type".into(),
            format!("multipart/form-data; boundary={BOUNDARY}"),
        ),
    ]
}

fn refs(h: &[(String, String)]) -> Vec<(&str, &str)> {
    h.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect()
}

/// A request body fed by the test: chunks sent on the channel, ended by dropping it (or broken
/// by sending an error).
fn body_channel() -> (tokio::sync::mpsc::Sender<Result<Bytes, std::io::Error>>, Body) {
    let (tx, rx) = tokio::sync::mpsc::channel(1024);
    (tx, Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(rx)))
}

/// What the sandbox's fake agent has received in uploads so far.
fn uploaded(server: &Server, id: &str) -> u64 {
    let sandbox = server.runtime().get(id).expect("the sandbox's VM");
    fake::uploaded_bytes(&sandbox.handle).expect("a fake agent")
}

/// Poll `cond` for up to `within`.
async fn eventually(within: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if cond() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    cond()
}

async fn read_file(server: &Server, sb: &E2bSandbox, path: &str) -> (u16, Bytes) {
    let h = [
        ("x-access-token", sb.token.as_str()),
        ("e2b-sandbox-id", sb.id.as_str()),
    ];
    let resp = server
        .send(Method::GET, &format!("/files?path={path}"), &h, Body::empty())
        .await;
    (resp.status, axum::body::to_bytes(resp.body, 64 << 20).await.unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn multipart_parts_reach_the_agent_while_the_body_is_still_arriving() {
    let server = Server::start_fresh(Limits::default()).await;
    let sb = server.e2b_sandbox().await;
    let before = uploaded(&server, &sb.id);

    // Two files in one request, each named by its part (as `write_files` sends them). The first
    // part's 8 MiB are sent, and the body is held open.
    const CHUNK: usize = 64 << 10;
    let (tx, body) = body_channel();
    tx.send(Ok(part_head("/tmp/big.bin").into())).await.unwrap();
    for i in 0..128u8 {
        tx.send(Ok(vec![i; CHUNK].into())).await.unwrap();
    }
    let h = envd_headers(&sb);
    let h = refs(&h);
    let answer = server.json(Method::POST, "/files", &h, body);
    tokio::pin!(answer);
    let reached = eventually(Duration::from_secs(10), || {
        uploaded(&server, &sb.id) - before >= 4 << 20
    });
    tokio::select! {
        (status, body) = &mut answer => panic!("answered before the body ended: {status} {body}"),
        reached = reached => assert!(
            reached,
            "the agent got {} bytes of a part whose first 8 MiB the server has had for 10 s",
            uploaded(&server, &sb.id) - before
        ),
    }

    // The rest of the part, a second part, the end.
    tx.send(Ok(vec![128u8; CHUNK].into())).await.unwrap();
    tx.send(Ok(format!(
        "\r\n{}small\r\n--{BOUNDARY}--\r\n",
        part_head("/tmp/small.txt")
    )
    .into()))
        .await
        .unwrap();
    drop(tx);
    let (status, body) = tokio::time::timeout(Duration::from_secs(30), answer).await.unwrap();
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        body,
        serde_json::json!([
            { "name": "big.bin", "type": "file", "path": "/tmp/big.bin" },
            { "name": "small.txt", "type": "file", "path": "/tmp/small.txt" },
        ])
    );
    let (status, big) = read_file(&server, &sb, "/tmp/big.bin").await;
    assert_eq!(status, 200);
    let want: Vec<u8> = (0..=128u8).flat_map(|i| vec![i; CHUNK]).collect();
    assert!(big == want, "/tmp/big.bin: {} bytes, not as sent", big.len());
    assert_eq!(
        read_file(&server, &sb, "/tmp/small.txt").await,
        (200, Bytes::from("small"))
    );
    server.delete(&sb.id).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_multipart_upload_that_breaks_off_leaves_the_old_file() {
    let server = Server::start_fresh(Limits::default()).await;
    let sb = server.e2b_sandbox().await;
    let h = envd_headers(&sb);
    let h = refs(&h);
    let whole = format!("{}old\r\n--{BOUNDARY}--\r\n", part_head("/tmp/f.txt"));
    let (status, body) = server.json(Method::POST, "/files", &h, Body::from(whole)).await;
    assert_eq!(status, 200, "{body}");

    // 2 MiB of the new content, then the client's body fails.
    let before = uploaded(&server, &sb.id);
    let (tx, body) = body_channel();
    tx.send(Ok(part_head("/tmp/f.txt").into())).await.unwrap();
    for _ in 0..32 {
        tx.send(Ok(vec![b'n'; 64 << 10].into())).await.unwrap();
    }
    let answer = tokio::spawn({
        let addr = server.addr;
        let h: Vec<(String, String)> = envd_headers(&sb);
        async move {
            // The connection breaks with the body: there may be no answer at all.
            let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
            let (mut sender, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
                .await
                .unwrap();
            tokio::spawn(conn);
            let mut req = axum::http::Request::post("/files").header("host", addr.to_string());
            for (k, v) in &h {
                req = req.header(k, v);
            }
            sender
                .send_request(req.body(body).unwrap())
                .await
                .map(|r| r.status().as_u16())
        }
    });
    assert!(
        eventually(Duration::from_secs(10), || uploaded(&server, &sb.id) - before
            >= 1 << 20)
        .await,
        "the part did not reach the agent"
    );
    tx.send(Err(std::io::Error::other("the client went away")))
        .await
        .unwrap();
    drop(tx);
    let status = tokio::time::timeout(Duration::from_secs(10), answer)
        .await
        .unwrap()
        .unwrap();
    assert!(matches!(status, Err(_) | Ok(400)), "{status:?}");
    // The agent saw the upload break and kept the file as it was (given time to do otherwise).
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(read_file(&server, &sb, "/tmp/f.txt").await, (200, Bytes::from("old")));
    server.delete(&sb.id).await;
}

/// Post `body` to `path` on its own connection, as a task: the answer's status and JSON.
fn spawn_post(
    server: &Server,
    path: &str,
    headers: Vec<(String, String)>,
    body: Body,
) -> tokio::task::JoinHandle<(u16, serde_json::Value, Option<String>)> {
    let (addr, path) = (server.addr, path.to_string());
    tokio::spawn(async move {
        let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        let (mut sender, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .unwrap();
        tokio::spawn(conn);
        let mut req = axum::http::Request::post(path).header("host", addr.to_string());
        for (k, v) in &headers {
            req = req.header(k, v);
        }
        let resp = sender.send_request(req.body(body).unwrap()).await.unwrap();
        let retry_after = resp
            .headers()
            .get("retry-after")
            .map(|v| v.to_str().unwrap().to_string());
        let status = resp.status().as_u16();
        let bytes = axum::body::to_bytes(Body::new(resp.into_body()), 1 << 20)
            .await
            .unwrap();
        (status, serde_json::from_slice(&bytes).unwrap_or_default(), retry_after)
    })
}

fn octet_headers(sb: &E2bSandbox) -> Vec<(String, String)> {
    let mut h = envd_headers(sb);
    h[2].1 = "application/octet-stream".into();
    h
}

/// An upload to `sb` whose body stays open until the sender is dropped, once its first bytes
/// reached the agent (so it holds its slot).
async fn held_upload(
    server: &Server,
    sb: &E2bSandbox,
    path: &str,
) -> (
    tokio::sync::mpsc::Sender<Result<Bytes, std::io::Error>>,
    tokio::task::JoinHandle<(u16, serde_json::Value, Option<String>)>,
) {
    let before = uploaded(server, &sb.id);
    let (tx, body) = body_channel();
    tx.send(Ok(Bytes::from_static(b"held"))).await.unwrap();
    let answer = spawn_post(server, &format!("/files?path={path}"), octet_headers(sb), body);
    assert!(
        eventually(Duration::from_secs(10), || uploaded(server, &sb.id) > before).await,
        "the held upload did not start"
    );
    (tx, answer)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uploads_under_way_are_bounded_per_sandbox_and_server_wide() {
    let dir = fresh();
    let wait = Duration::from_millis(500);
    let config = airlock_server::core::Config {
        uploads: airlock_server::core::uploads::UploadLimits {
            per_sandbox: 1,
            per_tenant: 3,
            server: 2,
            wait,
        },
        ..Default::default()
    };
    let server = Server::start_full(dir.path(), 10, None, Duration::ZERO, ROOMY, config).await;
    let (a, b, c) = (
        server.e2b_sandbox().await,
        server.e2b_sandbox().await,
        server.e2b_sandbox().await,
    );
    let small = |sb: &E2bSandbox| {
        let body = format!("{}x\r\n--{BOUNDARY}--\r\n", part_head("/tmp/x"));
        spawn_post(&server, "/files", envd_headers(sb), Body::from(body))
    };

    // Sandbox a's one upload is under way: its next waits, then is refused with the SDK's 429.
    let (a1, a1_answer) = held_upload(&server, &a, "/tmp/a1").await;
    let started = Instant::now();
    let (status, err, retry_after) = small(&a).await.unwrap();
    assert_eq!(status, 429, "{err}");
    assert_eq!(err["code"], 429, "{err}");
    assert!(
        err["message"].as_str().unwrap().contains("under way to this sandbox"),
        "{err}"
    );
    assert!(retry_after.is_some());
    assert!(started.elapsed() >= wait, "refused without waiting");
    // The rule is the core's: the native door's upload is refused as well.
    let auth = format!("Bearer {}", server.key);
    let (status, err) = server
        .json(
            Method::PUT,
            &format!("/v1/sandboxes/{}/files?path=/tmp/n", a.id),
            &[
                ("authorization", auth.as_str()),
                ("content-type", "application/octet-stream"),
            ],
            Body::from("n"),
        )
        .await;
    assert_eq!((status, err["code"].as_str()), (429, Some("too_many_uploads")), "{err}");

    // Sandbox b's upload takes the server's second slot: sandbox c, with none of its own under
    // way (and its tenant below its bound), waits and is refused too.
    let (b1, b1_answer) = held_upload(&server, &b, "/tmp/b1").await;
    let (status, err, _) = small(&c).await.unwrap();
    assert_eq!(status, 429, "{err}");
    assert!(
        err["message"].as_str().unwrap().contains("under way on this server"),
        "{err}"
    );

    // An upload that finds no room waits for it: a's next proceeds once a1 ends.
    let a2 = small(&a);
    tokio::time::sleep(wait / 4).await;
    drop(a1);
    let (status, body, _) = a1_answer.await.unwrap();
    assert_eq!(status, 200, "{body}");
    let (status, body, _) = a2.await.unwrap();
    assert_eq!(status, 200, "{body}");
    drop(b1);
    assert_eq!(b1_answer.await.unwrap().0, 200);
    // All the room is back.
    let (c1, c1_answer) = held_upload(&server, &c, "/tmp/c1").await;
    assert_eq!(small(&a).await.unwrap().0, 200);
    drop(c1);
    assert_eq!(c1_answer.await.unwrap().0, 200);
    for sb in [a, b, c] {
        server.delete(&sb.id).await;
    }
}

fn vm_rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// The figure for issue 23: this process's RSS (server, fake agent and client together) while
/// four 300 MB multipart uploads run at once. The fake agent drops what goes to `/dev/null`, so
/// what grows is the server's. Run it alone, with `--ignored --nocapture`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement: 1.2 GB through the server"]
async fn rss_during_four_concurrent_300mb_multipart_uploads() {
    const SIZE: usize = 300_000_000;
    static CHUNK: [u8; 64 << 10] = [b'z'; 64 << 10];
    let server = Server::start_fresh(Limits::default()).await;
    let sb = server.e2b_sandbox().await;
    let baseline = vm_rss_kib();
    let peak = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(baseline));
    let sampler = tokio::spawn({
        let peak = peak.clone();
        async move {
            loop {
                peak.fetch_max(vm_rss_kib(), std::sync::atomic::Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    });
    let started = Instant::now();
    let uploads: Vec<_> = (0..4)
        .map(|_| {
            let chunks = (0..SIZE.div_ceil(CHUNK.len())).map(|i| {
                let n = CHUNK.len().min(SIZE - i * CHUNK.len());
                Ok::<_, std::io::Error>(Bytes::from_static(&CHUNK[..n]))
            });
            let body = std::iter::once(Ok(Bytes::from(part_head("/dev/null"))))
                .chain(chunks)
                .chain(std::iter::once(Ok(Bytes::from(format!("\r\n--{BOUNDARY}--\r\n")))));
            let body = Body::from_stream(futures_util::stream::iter(body));
            spawn_post(&server, "/files?path=/dev/null", envd_headers(&sb), body)
        })
        .collect();
    for u in uploads {
        let (status, body, _) = u.await.unwrap();
        assert_eq!(status, 200, "{body}");
    }
    let elapsed = started.elapsed();
    sampler.abort();
    let peak = peak.load(std::sync::atomic::Ordering::Relaxed);
    println!(
        "4 concurrent {SIZE}-byte multipart uploads in {elapsed:?}: VmRSS {} MiB before, peak {} MiB (+{} MiB)",
        baseline / 1024,
        peak / 1024,
        (peak - baseline) / 1024
    );
    assert_eq!(uploaded(&server, &sb.id), 4 * SIZE as u64);
    server.delete(&sb.id).await;
}

/// The 1 GiB cap holds for a streamed multipart body of no declared length, and for a gzip body
/// that decodes past it: 413, and the old file stays. Slow in a debug build (2 GiB through the
/// server), so run by hand.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "slow: 2 GiB through the server"]
async fn a_multipart_upload_past_the_cap_is_refused_and_leaves_the_old_file() {
    static CHUNK: [u8; 1 << 20] = [b'z'; 1 << 20];
    let server = Server::start_fresh(Limits::default()).await;
    let sb = server.e2b_sandbox().await;
    let h = envd_headers(&sb);
    let whole = format!("{}old\r\n--{BOUNDARY}--\r\n", part_head("/tmp/f.txt"));
    let (status, body) = server.json(Method::POST, "/files", &refs(&h), Body::from(whole)).await;
    assert_eq!(status, 200, "{body}");
    let chunks = (0..=airlock_server::MAX_UPLOAD_BODY / CHUNK.len()).map(|_| Ok(Bytes::from_static(&CHUNK)));
    let body = std::iter::once(Ok::<_, std::io::Error>(Bytes::from(part_head("/tmp/f.txt")))).chain(chunks);
    let (status, err, _) = spawn_post(
        &server,
        "/files",
        h,
        Body::from_stream(futures_util::stream::iter(body)),
    )
    .await
    .unwrap();
    assert_eq!(status, 413, "{err}");
    assert_eq!(read_file(&server, &sb, "/tmp/f.txt").await, (200, Bytes::from("old")));

    // An octet-stream upload counts its bytes as written too: a few MB of gzip that decode past
    // the cap are refused the same way.
    let zeros = airlock_server::MAX_UPLOAD_BODY + (1 << 20);
    let bomb = std::process::Command::new("sh")
        .args(["-c", &format!("head -c {zeros} /dev/zero | gzip -1")])
        .output()
        .unwrap()
        .stdout;
    assert!(bomb.len() < 16 << 20, "{} bytes of gzip", bomb.len());
    let mut h = octet_headers(&sb);
    h.push(("content-encoding".into(), "gzip".into()));
    let (status, err, _) = spawn_post(&server, "/files?path=/tmp/f.txt", h, Body::from(bomb))
        .await
        .unwrap();
    assert_eq!(status, 413, "{err}");
    assert_eq!(read_file(&server, &sb, "/tmp/f.txt").await, (200, Bytes::from("old")));
    server.delete(&sb.id).await;
}
