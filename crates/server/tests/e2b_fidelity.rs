//! E2B fidelity on the in-process server with the fake VMM: file metadata through `/files` and
//! the filesystem RPCs, signed URLs that name no sandbox, and metrics windows.

mod common;

use airlock_proto::Metrics;
use airlock_server::core::metrics::Sample;
use airlock_server::core::principal::signature;
use airlock_server::records::now_ms;
use axum::body::Body;
use axum::http::Method;
use common::*;
use serde_json::json;

fn envd_headers<'a>(sb: &'a E2bSandbox, content_type: &'a str) -> Vec<(&'a str, &'a str)> {
    vec![
        ("x-access-token", sb.token.as_str()),
        ("e2b-sandbox-id", sb.id.as_str()),
        ("content-type", content_type),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uploads_set_file_metadata_and_stat_reads_it_back() {
    let dir = fresh();
    let server = Server::start(dir.path(), 10, None).await;
    let sb = server.e2b_sandbox().await;

    // `X-Metadata-<key>` headers: keys lowercased, the answer carries what the file now has.
    let mut h = envd_headers(&sb, "application/octet-stream");
    h.push(("x-metadata-Owner", "team a"));
    h.push(("x-metadata-stage", "raw"));
    let (status, body) = server
        .json(Method::POST, "/files?path=/home/user/m.txt", &h, Body::from("data"))
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        body,
        json!([{ "name": "m.txt", "type": "file", "path": "/home/user/m.txt",
                 "metadata": { "owner": "team a", "stage": "raw" } }])
    );
    let (status, stat) = server
        .envd_unary(
            &sb,
            "/filesystem.Filesystem/Stat",
            json!({ "path": "/home/user/m.txt" }),
        )
        .await;
    assert_eq!(status, 200, "{stat}");
    assert_eq!(stat["entry"]["metadata"], json!({ "owner": "team a", "stage": "raw" }));
    let (_, list) = server
        .envd_unary(
            &sb,
            "/filesystem.Filesystem/ListDir",
            json!({ "path": "/home/user", "depth": 1 }),
        )
        .await;
    let entry = list["entries"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["name"] == "m.txt")
        .cloned()
        .unwrap();
    assert_eq!(entry["metadata"]["stage"], "raw");

    // An upload without metadata replaces the set (with none), and answers exactly the three keys
    // older SDKs accept, multipart too.
    let boundary = "XyZ";
    let multipart = format!(
        "--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"/home/user/m.txt\"\r\n\
         Content-Type: application/octet-stream\r\n\r\nnew\r\n--{boundary}--\r\n"
    );
    let ct = format!("multipart/form-data; boundary={boundary}");
    let (status, body) = server
        .json(
            Method::POST,
            "/files?path=/home/user/m.txt",
            &envd_headers(&sb, &ct),
            Body::from(multipart),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        body,
        json!([{ "name": "m.txt", "type": "file", "path": "/home/user/m.txt" }])
    );
    let (_, stat) = server
        .envd_unary(
            &sb,
            "/filesystem.Filesystem/Stat",
            json!({ "path": "/home/user/m.txt" }),
        )
        .await;
    assert!(stat["entry"].get("metadata").is_none(), "{stat}");

    // Bad metadata is a 400 naming it, and writes nothing.
    let too_much = "v".repeat(5000);
    for (key, value, why) in [
        ("x-metadata-k", "a\tb", "non-printable-ASCII"),
        ("x-metadata-k", too_much.as_str(), "exceeds"),
    ] {
        let mut h = envd_headers(&sb, "application/octet-stream");
        h.push((key, value));
        let (status, body) = server
            .json(Method::POST, "/files?path=/home/user/bad.txt", &h, Body::from("x"))
            .await;
        assert_eq!(status, 400, "{body}");
        assert!(body["message"].as_str().unwrap().contains(why), "{body}");
    }
    let (status, _) = server
        .envd_unary(
            &sb,
            "/filesystem.Filesystem/Stat",
            json!({ "path": "/home/user/bad.txt" }),
        )
        .await;
    assert_eq!(status, 404);
    server.delete(&sb.id).await;
}

/// A refusal that comes before the body is read (bad metadata here) still reaches a client that
/// sends its body late, chunk by chunk: the server reads the small body first instead of closing
/// the connection under it (which the client saw as a broken pipe, not the 400).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_upload_reads_its_body_before_it_answers() {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let dir = fresh();
    let server = Server::start(dir.path(), 10, None).await;
    let sb = server.e2b_sandbox().await;
    let mut conn = tokio::net::TcpStream::connect(server.addr).await.unwrap();
    let head = format!(
        "POST /files?path=/home/user/late.txt HTTP/1.1\r\nhost: {}\r\nx-access-token: {}\r\n\
         e2b-sandbox-id: {}\r\ncontent-type: application/octet-stream\r\nx-metadata-k: {}\r\n\
         transfer-encoding: chunked\r\n\r\n",
        server.addr,
        sb.token,
        sb.id,
        "v".repeat(5000)
    );
    conn.write_all(head.as_bytes()).await.unwrap();
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    // Two writes: on a connection the server closed, the first draws a reset, the second fails.
    for chunk in [&b"1\r\nx\r\n"[..], b"0\r\n\r\n"] {
        conn.write_all(chunk).await.expect("the server still reads the body");
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    let mut answer = vec![0; 4096];
    let n = conn
        .read(&mut answer)
        .await
        .expect("the refusal, not a reset connection");
    let answer = String::from_utf8_lossy(&answer[..n]);
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    assert!(answer.contains("exceeds"), "{answer}");
    server.delete(&sb.id).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_signed_url_without_a_sandbox_id_finds_its_sandbox() {
    let dir = fresh();
    let server = Server::start(dir.path(), 10, None).await;
    let sb = server.e2b_sandbox().await;
    let other = server.e2b_sandbox().await;
    let enc = |sig: String| sig.replace('+', "%2B").replace('/', "%2F");
    let sign = |op: &str, token: &str, exp: Option<i64>| enc(signature("/tmp/s.txt", op, "user", token, exp));
    let url = |sig: String| format!("/files?path=/tmp/s.txt&username=user&signature={sig}");
    let octet = [("content-type", "application/octet-stream")];

    // No header names the sandbox (a URL used under E2B_SANDBOX_URL): the signature does.
    let (status, body) = server
        .json(
            Method::POST,
            &url(sign("write", &sb.token, None)),
            &octet,
            Body::from("signed"),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body[0]["path"], "/tmp/s.txt");
    let resp = server
        .send(Method::GET, &url(sign("read", &sb.token, None)), &[], Body::empty())
        .await;
    assert_eq!(resp.status, 200);
    let got = axum::body::to_bytes(resp.body, 1 << 20).await.unwrap();
    assert_eq!(&got[..], b"signed");
    // It went to that sandbox, not the other.
    let (status, _) = server
        .envd_unary(&other, "/filesystem.Filesystem/Stat", json!({ "path": "/tmp/s.txt" }))
        .await;
    assert_eq!(status, 404);

    // A signature that no sandbox makes (forged, another operation's, a deleted sandbox's)
    // answers as a missing sandbox; an expired genuine one says so.
    let missing = server
        .json(Method::GET, &url("v1_forged".into()), &[], Body::empty())
        .await;
    assert_eq!(missing.0, 502, "{}", missing.1);
    assert!(missing.1["message"].as_str().unwrap().contains("was not found"));
    let (status, _) = server
        .json(Method::GET, &url(sign("write", &sb.token, None)), &[], Body::empty())
        .await;
    assert_eq!(status, 502);
    let past = 1_000_000_000;
    let expired = format!(
        "{}&signature_expiration={past}",
        url(sign("read", &sb.token, Some(past)))
    );
    let (status, body) = server.json(Method::GET, &expired, &[], Body::empty()).await;
    assert_eq!(status, 401, "{body}");
    let other_sig = sign("read", &other.token, None);
    server.delete(&other.id).await;
    let (status, body) = server.json(Method::GET, &url(other_sig), &[], Body::empty()).await;
    assert_eq!(
        (status, body["message"].clone()),
        (502, json!("The sandbox was not found"))
    );
    server.delete(&sb.id).await;
}

fn sample(at_ms: i64, cpu: f64) -> Sample {
    Sample {
        at_ms,
        metrics: Metrics {
            cpu_count: 2,
            cpu_used_pct: cpu,
            mem_total_bytes: 1 << 30,
            mem_used_bytes: 1 << 20,
            disk_total_bytes: 1 << 32,
            disk_used_bytes: 1 << 24,
        },
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_windows_select_from_the_sampled_history() {
    let dir = fresh();
    let server = Server::start(dir.path(), 10, None).await;
    let sb = server.e2b_sandbox().await;
    let path = format!("/sandboxes/{}/metrics", sb.id);

    // A fresh sandbox has a sample at once (taken on demand).
    let (status, now) = server.e2b(Method::GET, &path, json!(null)).await;
    assert_eq!(status, 200, "{now}");
    let newest = now.as_array().unwrap().last().cloned().unwrap();
    assert!(newest["memTotal"].as_u64().unwrap() > 0, "{newest}");
    assert!(newest["timestampUnix"].as_i64().unwrap() >= now_ms() / 1000 - 10);
    // The sampler (every 5 s) and on-demand samples make more as time goes on.
    tokio::time::sleep(std::time::Duration::from_secs(6)).await;
    let (_, later) = server.e2b(Method::GET, &path, json!(null)).await;
    assert!(later.as_array().unwrap().len() >= 2, "{now} then {later}");

    // Samples as the sampler records them (a second sandbox, sampled from its creation on):
    // the default window is the sandbox's life, a window picks what lies in it.
    let fresh = server.e2b_sandbox().await;
    let created = server
        .core()
        .store()
        .sandbox_by_id(&fresh.id)
        .await
        .unwrap()
        .unwrap()
        .created_at_ms;
    let t = created / 1000 * 1000 + 1000;
    for i in 0..6 {
        server.core().metrics.record(&fresh.id, sample(t + i * 5000, i as f64));
    }
    let path = format!("/sandboxes/{}/metrics", fresh.id);
    let (status, all) = server.e2b(Method::GET, &path, json!(null)).await;
    assert_eq!(status, 200);
    let cpus: Vec<f64> = all
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["cpuUsedPct"].as_f64().unwrap())
        .collect();
    assert_eq!(cpus, vec![0.0, 1.0, 2.0, 3.0, 4.0, 5.0]);
    let window = format!("{path}?start={}&end={}", (t + 5000) / 1000, (t + 15_000) / 1000);
    let (status, w) = server.e2b(Method::GET, &window, json!(null)).await;
    assert_eq!(status, 200, "{w}");
    let cpus: Vec<f64> = w
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["cpuUsedPct"].as_f64().unwrap())
        .collect();
    assert_eq!(cpus, vec![1.0, 2.0, 3.0]);
    assert_eq!(w[0]["timestampUnix"], (t + 5000) / 1000);
    assert_eq!(w[0]["cpuCount"], 2);
    // Before the sandbox existed: nothing.
    let (status, w) = server
        .e2b(Method::GET, &format!("{path}?start=1000&end=2000"), json!(null))
        .await;
    assert_eq!((status, w), (200, json!([])));
    // A backwards range, and junk, are 400s in the SDK's error shape.
    for q in ["?start=2000&end=1000", "?start=yesterday"] {
        let (status, body) = server.e2b(Method::GET, &format!("{path}{q}"), json!(null)).await;
        assert_eq!(status, 400, "{q}: {body}");
        assert!(body["message"].is_string() && body["code"] == 400, "{body}");
    }

    // The history goes with the sandbox.
    server.delete(&sb.id).await;
    server.delete(&fresh.id).await;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while server.core().metrics.newest(&fresh.id).is_some() {
        assert!(std::time::Instant::now() < deadline, "history outlived its sandbox");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let (status, _) = server.e2b(Method::GET, &path, json!(null)).await;
    assert_eq!(status, 404);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_snapshot_list_pages_with_x_next_token() {
    let dir = fresh();
    let server = Server::start(dir.path(), 10, None).await;
    let sb = server.e2b_sandbox().await;
    let mut made = Vec::new();
    for name in [json!({}), json!({ "name": "second" }), json!({})] {
        let (status, snap) = server
            .e2b(Method::POST, &format!("/sandboxes/{}/snapshots", sb.id), name)
            .await;
        assert_eq!(status, 201, "{snap}");
        made.push(snap["snapshotID"].as_str().unwrap().to_string());
        // Each a millisecond apart at least: the order is by creation time.
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    let key = server.key.clone();
    let list = |query: String| {
        let headers = [("x-api-key", key.clone())];
        let server = &server;
        async move {
            let h: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
            let resp = server
                .send(Method::GET, &format!("/snapshots{query}"), &h, Body::empty())
                .await;
            let next = resp
                .headers
                .get("x-next-token")
                .map(|v| v.to_str().unwrap().to_string());
            let (status, body) = resp.json().await;
            let ids: Vec<String> = body
                .as_array()
                .map(|a| {
                    a.iter()
                        .map(|s| s["snapshotID"].as_str().unwrap().to_string())
                        .collect()
                })
                .unwrap_or_default();
            (status, ids, next, body)
        }
    };

    // Everything on one page by default, newest first, and no token: there is no next page.
    let (status, all, next, body) = list(String::new()).await;
    assert_eq!(status, 200, "{body}");
    let newest_first: Vec<String> = made.iter().rev().cloned().collect();
    assert_eq!(all, newest_first);
    assert_eq!(next, None);

    // Two a page: the token in X-Next-Token resumes after the page's last.
    let (status, first, next, _) = list("?limit=2".into()).await;
    assert_eq!((status, first.as_slice()), (200, &newest_first[..2]));
    let token = next.expect("a next page");
    let (status, second, next, _) = list(format!("?limit=2&nextToken={token}")).await;
    assert_eq!((status, second.as_slice(), next), (200, &newest_first[2..], None));

    // Filters apply before paging; a name picks its one snapshot.
    let (_, named, next, _) = list("?name=second&limit=1".into()).await;
    assert_eq!((named, next), (vec![made[1].clone()], None));
    let (_, of_sandbox, _, _) = list(format!("?sandboxID={}&limit=100", sb.id)).await;
    assert_eq!(of_sandbox, newest_first);

    // A token this server never issued and limits out of range are 400s in E2B's error shape.
    for q in ["?nextToken=junk", "?limit=0", "?limit=101", "?limit=many"] {
        let (status, _, _, body) = list(q.into()).await;
        assert_eq!(status, 400, "{q}: {body}");
        assert!(body["code"] == 400 && body["message"].is_string(), "{q}: {body}");
    }
    server.delete(&sb.id).await;
}

/// A Start's `connect-timeout-ms` bounds the process's life (envd's semantics), and the core
/// enforces it: the process ends at its timeout (less a margin, so the client hears of the end
/// before its own read timeout fires) whether or not anyone reads its stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_started_process_ends_at_its_timeout_by_the_core() {
    let dir = fresh();
    let server = Server::start(dir.path(), 10, None).await;
    let sb = server.e2b_sandbox().await;
    let start = |timeout_ms: &'static str| {
        let headers = [
            ("x-access-token", sb.token.clone()),
            ("e2b-sandbox-id", sb.id.clone()),
            ("content-type", "application/connect+json".to_string()),
            ("connect-protocol-version", "1".to_string()),
            ("connect-timeout-ms", timeout_ms.to_string()),
            ("keepalive-ping-interval", "1".to_string()),
        ];
        let server = &server;
        async move {
            let h: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
            let req = json!({ "process": { "cmd": "sleep", "args": ["30"] } });
            let resp = server
                .send(Method::POST, "/process.Process/Start", &h, Body::from(envelope(&req)))
                .await;
            assert_eq!(resp.status, 200);
            ConnectStream {
                body: futures_util::StreamExt::boxed(resp.body.into_data_stream()),
                buf: Vec::new(),
            }
        }
    };
    let running = || async {
        let (status, list) = server.envd_unary(&sb, "/process.Process/List", json!({})).await;
        assert_eq!(status, 200, "{list}");
        list["processes"].as_array().unwrap().len()
    };

    // Read to its end: the start, keepalives, then the deadline once the core ended it.
    let began = std::time::Instant::now();
    let mut stream = start("1500").await;
    let (flags, first) = stream.next().await.unwrap();
    assert_eq!(flags, 0);
    assert!(first["event"]["start"]["pid"].as_u64().is_some(), "{first}");
    let (flags, end) = stream.next_event().await.unwrap();
    assert_eq!(flags, 0x02, "the stream ends with an error, not an end event: {end}");
    assert_eq!(end["error"]["code"], "deadline_exceeded", "{end}");
    assert!(
        began.elapsed() >= std::time::Duration::from_millis(1350),
        "{:?}",
        began.elapsed()
    );
    // Ended by then: the client may list processes at once.
    assert_eq!(running().await, 0);

    // Nobody reads the stream: the process still ends at its timeout.
    let stream = start("1000").await;
    drop(stream);
    assert_eq!(running().await, 1);
    tokio::time::sleep(std::time::Duration::from_millis(1600)).await;
    assert_eq!(running().await, 0, "the process outlived its timeout");
    server.delete(&sb.id).await;
}
