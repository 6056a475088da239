//! Lifecycle events and webhooks (issue 28): a create, pause, resume and kill are delivered to a
//! receiver on loopback, signed, in order, the first after two failed tries; the events API
//! pages them newest first and streams them (resuming after `Last-Event-ID`); another tenant
//! sees none of them; URLs into the platform's denied ranges are refused unless allowed.

use super::*;
use airlock_server::core::accounts::Admin;
use axum::body::Bytes;
use futures_util::StreamExt;
use std::sync::Mutex;

/// What the receiver got: (headers, body) per request.
type Got = Arc<Mutex<Vec<(axum::http::HeaderMap, Bytes)>>>;

/// A receiver on loopback that answers 500 to its first `fail_first` requests, then 204.
async fn receiver(fail_first: usize) -> (String, Got) {
    let got: Got = Default::default();
    let seen = got.clone();
    let app = axum::Router::new().route(
        "/hook",
        axum::routing::post(move |headers: axum::http::HeaderMap, body: Bytes| {
            let seen = seen.clone();
            async move {
                let mut seen = seen.lock().unwrap();
                seen.push((headers, body));
                if seen.len() <= fail_first {
                    axum::http::StatusCode::INTERNAL_SERVER_ERROR
                } else {
                    axum::http::StatusCode::NO_CONTENT
                }
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    (format!("http://{addr}/hook"), got)
}

/// A page of E2B's events API (200 asserted).
async fn e2b_events(server: &Server, path: &str) -> Value {
    let (status, body) = server.e2b(Method::GET, path, Value::Null).await;
    assert_eq!(status, 200, "{path}: {body}");
    body
}

/// The receiver's check: `t=<unix>,v1=<hex HMAC-SHA256 of "<t>.<body>">` under `secret`.
fn verify(secret: &str, header: &str, body: &[u8]) -> bool {
    use hmac::Mac;
    let Some((t, v1)) = header
        .split_once(',')
        .and_then(|(t, v)| Some((t.strip_prefix("t=")?, v.strip_prefix("v1=")?)))
    else {
        return false;
    };
    let mut mac = hmac::Hmac::<sha2::Sha256>::new_from_slice(secret.as_bytes()).unwrap();
    mac.update(format!("{t}.").as_bytes());
    mac.update(body);
    hex::encode(mac.finalize().into_bytes()) == v1
}

/// Read `n` SSE events (event, id, data) from `/v1/events/stream`.
async fn sse(server: &Server, query: &str, last_id: Option<&str>, n: usize) -> Vec<(String, String, Value)> {
    let auth = format!("Bearer {}", server.key);
    let mut headers = vec![("authorization", auth.as_str())];
    if let Some(id) = last_id {
        headers.push(("last-event-id", id));
    }
    let resp = server
        .send(
            Method::GET,
            &format!("/v1/events/stream{query}"),
            &headers,
            Body::empty(),
        )
        .await;
    assert_eq!(resp.status, 200);
    let mut body = resp.body.into_data_stream();
    let (mut buf, mut out) = (String::new(), Vec::new());
    while out.len() < n {
        let chunk = tokio::time::timeout(Duration::from_secs(10), body.next())
            .await
            .expect("an event within 10 s")
            .unwrap()
            .unwrap();
        buf.push_str(&String::from_utf8_lossy(&chunk));
        while let Some(end) = buf.find("\n\n") {
            let block: String = buf.drain(..end + 2).collect();
            let field = |name: &str| {
                block
                    .lines()
                    .find_map(|l| l.strip_prefix(&format!("{name}:")))
                    .map(|v| v.trim().to_string())
            };
            if let (Some(event), Some(id), Some(data)) = (field("event"), field("id"), field("data")) {
                out.push((event, id, serde_json::from_str(&data).unwrap()));
            }
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lifecycle_events_reach_a_webhook_signed_in_order_and_the_events_api() {
    let tmp = fresh();
    let config = Config {
        webhook_allow_private: true,
        ..Config::default()
    };
    let server = Server::start_full(tmp.path(), 20, None, Duration::ZERO, ROOMY, config).await;
    let core = server.core().clone();
    server.on_server(async move { core.spawn_webhooks() }).await;
    let (url, got) = receiver(2).await;

    let (status, hook) = server
        .v1(Method::POST, "/webhooks", Some(json!({"url": url, "name": "receiver"})))
        .await;
    assert_eq!(status, 201, "{hook}");
    let secret = hook["secret"].as_str().unwrap().to_string();
    let hook_id = hook["id"].as_str().unwrap().to_string();
    assert!(secret.starts_with("whsec_"));
    let (_, listed) = server.v1(Method::GET, "/webhooks", None).await;
    assert!(
        !listed.to_string().contains(&secret),
        "the secret is shown once: {listed}"
    );

    let id = server.running_sandbox().await;
    for change in ["pause", "resume"] {
        let (status, body) = server
            .v1(Method::POST, &format!("/sandboxes/{id}/{change}"), None)
            .await;
        assert_eq!(status, 202, "{body}");
        server.wait_op(body["operation"]["id"].as_str().unwrap()).await;
    }
    let (status, body) = server.v1(Method::DELETE, &format!("/sandboxes/{id}"), None).await;
    assert_eq!(status, 202, "{body}");
    server.wait_op(body["operation"]["id"].as_str().unwrap()).await;

    // Delivered in order, the first after two failures (1 s, then 2 s of backoff).
    let want = ["sandbox.created", "sandbox.paused", "sandbox.resumed", "sandbox.killed"];
    let deadline = Instant::now() + Duration::from_secs(30);
    let delivered = loop {
        let kinds: Vec<(String, String)> = got
            .lock()
            .unwrap()
            .iter()
            .map(|(_, b)| {
                let v: Value = serde_json::from_slice(b).unwrap();
                (
                    v["type"].as_str().unwrap().to_string(),
                    v["id"].as_str().unwrap().to_string(),
                )
            })
            .collect();
        if kinds.len() >= 6 {
            break kinds;
        }
        assert!(Instant::now() < deadline, "delivered so far: {kinds:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let kinds: Vec<&str> = delivered.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(
        kinds,
        [want[0], want[0], want[0], want[1], want[2], want[3]],
        "three tries of the first, then the rest in order"
    );
    assert_eq!(delivered[0].1, delivered[2].1, "the same event tried again");
    for (headers, body) in got.lock().unwrap().iter() {
        let signature = headers["airlock-signature"].to_str().unwrap();
        assert!(verify(&secret, signature, body), "{signature}");
        let mut forged = body.to_vec();
        forged.extend_from_slice(b" ");
        assert!(!verify(&secret, signature, &forged), "a changed body fails the check");
        assert!(!verify("whsec_wrong", signature, body));
        assert_eq!(headers["airlock-webhook-id"], hook_id.as_str());
    }
    let v: Value = serde_json::from_slice(&got.lock().unwrap()[0].1).unwrap();
    assert_eq!(v["sandbox_id"], id.as_str());
    assert_eq!(v["data"]["template"], "seed");

    // The deliveries, newest first: the first event's tries.
    let (status, d) = server
        .v1(Method::GET, &format!("/webhooks/{hook_id}/deliveries"), None)
        .await;
    assert_eq!(status, 200, "{d}");
    let first = &delivered[0].1;
    let tries: Vec<(u64, Option<u64>)> = d["deliveries"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|x| x["event_id"] == first.as_str())
        .map(|x| (x["attempt"].as_u64().unwrap(), x["status"].as_u64()))
        .collect();
    assert_eq!(tries, [(3, Some(204)), (2, Some(500)), (1, Some(500))], "{d}");
    let (_, w) = server.v1(Method::GET, &format!("/webhooks/{hook_id}"), None).await;
    assert_eq!(
        (w["last_status"].as_u64(), w["attempts"].as_u64()),
        (Some(204), Some(0)),
        "{w}"
    );

    // The events API: the same events, newest first, per tenant and per sandbox.
    let (status, page) = server.v1(Method::GET, "/events", None).await;
    assert_eq!(status, 200, "{page}");
    let listed: Vec<&str> = page["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["type"].as_str().unwrap())
        .collect();
    assert_eq!(listed, [want[3], want[2], want[1], want[0]]);
    assert_eq!(page["events"][3]["id"], first.as_str());
    let (_, one) = server
        .v1(Method::GET, &format!("/sandboxes/{id}/events?limit=2"), None)
        .await;
    assert_eq!(one["events"].as_array().unwrap().len(), 2, "{one}");
    let next = one["next_before"].as_i64().unwrap();
    let (_, rest) = server
        .v1(Method::GET, &format!("/sandboxes/{id}/events?before={next}"), None)
        .await;
    assert_eq!(rest["events"][1]["type"], want[0], "{rest}");

    // The stream from the start, and again after the second event.
    let all = sse(&server, "?after=0", None, 4).await;
    assert_eq!(all.iter().map(|e| e.0.as_str()).collect::<Vec<_>>(), want);
    let resumed = sse(&server, "", Some(&all[1].1), 2).await;
    assert_eq!(
        resumed.iter().map(|e| e.0.as_str()).collect::<Vec<_>>(),
        [want[2], want[3]],
        "after Last-Event-ID, without loss or repeats"
    );

    // E2B's door: the same events in E2B's names and shape, paged by offset.
    let seen = e2b_events(&server, &format!("/events/sandboxes/{id}")).await;
    let types: Vec<&str> = seen
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["type"].as_str().unwrap())
        .collect();
    assert_eq!(
        types,
        [
            "sandbox.lifecycle.killed",
            "sandbox.lifecycle.resumed",
            "sandbox.lifecycle.paused",
            "sandbox.lifecycle.created"
        ],
        "{seen}"
    );
    let created = &seen[3];
    assert_eq!(
        (created["version"].as_str(), created["sandboxId"].as_str()),
        (Some("v1"), Some(id.as_str()))
    );
    assert_eq!(created["sandboxTemplateId"], "seed");
    assert_eq!(created["id"], first.as_str(), "the same event as the webhook's");
    assert!(created["timestamp"].as_str().unwrap().ends_with('Z'));
    let asc = e2b_events(
        &server,
        &format!("/events/sandboxes/{id}?orderAsc=true&offset=1&limit=2"),
    )
    .await;
    let types: Vec<&str> = asc
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["type"].as_str().unwrap())
        .collect();
    assert_eq!(types, ["sandbox.lifecycle.paused", "sandbox.lifecycle.resumed"]);
    let killed = e2b_events(&server, "/events/sandboxes?types=sandbox.lifecycle.killed").await;
    assert_eq!(killed.as_array().unwrap().len(), 1, "{killed}");
    let (status, _) = server
        .e2b(Method::GET, "/events/sandboxes?limit=500", Value::Null)
        .await;
    assert_eq!(status, 400);

    // Another tenant sees none of it.
    let admin = Admin {
        account: "root@local".into(),
    };
    server.core().create_tenant(&admin, "other").await.unwrap();
    let other = server.core().mint_key(&admin, "other", "k", false).await.unwrap().key;
    let (status, body) = server
        .v1_as(&other, Method::GET, &format!("/sandboxes/{id}/events"), None)
        .await;
    assert_eq!(
        (status, body["code"].as_str()),
        (404, Some("sandbox_not_found")),
        "{body}"
    );
    let (_, page) = server.v1_as(&other, Method::GET, "/events", None).await;
    assert_eq!(page["events"], json!([]));
    let as_other = [("x-api-key", other.as_str())];
    let (status, body) = server
        .json(
            Method::GET,
            &format!("/events/sandboxes/{id}"),
            &as_other,
            Body::empty(),
        )
        .await;
    assert_eq!(status, 404, "{body}");
    let (_, body) = server
        .json(Method::GET, "/events/sandboxes", &as_other, Body::empty())
        .await;
    assert_eq!(body, json!([]));
    let (status, _) = server
        .v1_as(&other, Method::GET, &format!("/webhooks/{hook_id}"), None)
        .await;
    assert_eq!(status, 404);
    let (status, _) = server.v1(Method::DELETE, &format!("/webhooks/{hook_id}"), None).await;
    assert_eq!(status, 204);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn webhook_urls_are_checked() {
    let tmp = fresh();
    // This host's own addresses as `serve` finds them; a public one stands for them here.
    let config = Config {
        webhook_host_addrs: vec!["8.8.4.4".parse().unwrap()],
        ..Config::default()
    };
    let server = Server::start_full(tmp.path(), 20, None, Duration::ZERO, ROOMY, config).await;
    for (url, events, says) in [
        ("http://127.0.0.1:9/hook", json!([]), "denied ranges"),
        ("http://169.254.169.254/latest", json!([]), "denied ranges"),
        ("http://8.8.4.4:8443/hook", json!([]), "this host's own address"),
        ("http://192.0.2.10/hook", json!([]), "192.0.2.0/24 (documentation)"),
        ("http://198.51.100.1/hook", json!([]), "documentation"),
        ("http://203.0.113.9/hook", json!([]), "documentation"),
        ("http://198.19.0.1/hook", json!([]), "198.18.0.0/15 (benchmarking)"),
        ("http://[2001:db8::7]:8080/hook", json!([]), "documentation"),
        ("ftp://example.test/", json!([]), "http or https"),
        ("http://user:pw@example.test/", json!([]), "credentials"),
        ("not a url", json!([]), "not a URL"),
        ("http://203.0.113.9/", json!(["sandbox.bogus"]), "unknown event type"),
    ] {
        let (status, body) = server
            .v1(Method::POST, "/webhooks", Some(json!({"url": url, "events": events})))
            .await;
        assert_eq!(status, 422, "{url}: {body}");
        assert!(body["message"].as_str().unwrap().contains(says), "{url}: {body}");
    }
    // Registered, never dialed: this server runs no delivery task.
    let (status, body) = server
        .v1(
            Method::POST,
            "/webhooks",
            Some(json!({"url": "http://8.8.8.8/", "events": ["sandbox.killed"]})),
        )
        .await;
    assert_eq!(status, 201, "a public address is fine: {body}");
    server.stop().await;
}

/// A receiver's requests, counted, answered `status` (with a `Location` for a redirect).
async fn counting_receiver(
    status: u16,
) -> (
    String,
    Arc<std::sync::atomic::AtomicUsize>,
    Arc<std::sync::atomic::AtomicUsize>,
) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let (hits, redirected) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let (h, r) = (hits.clone(), redirected.clone());
    let app = axum::Router::new()
        .route(
            "/hook",
            axum::routing::post(move || {
                h.fetch_add(1, Ordering::SeqCst);
                async move {
                    (
                        axum::http::StatusCode::from_u16(status).unwrap(),
                        [(axum::http::header::LOCATION, "/elsewhere")],
                    )
                }
            }),
        )
        .route(
            "/elsewhere",
            axum::routing::any(move || {
                r.fetch_add(1, Ordering::SeqCst);
                async { axum::http::StatusCode::NO_CONTENT }
            }),
        );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    (format!("http://{addr}/hook"), hits, redirected)
}

/// `hook`'s delivery attempts once there are at least `n` (30 s at most).
async fn deliveries(server: &Server, hook: &str, n: usize) -> Vec<Value> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (status, d) = server
            .v1(Method::GET, &format!("/webhooks/{hook}/deliveries"), None)
            .await;
        assert_eq!(status, 200, "{d}");
        let all = d["deliveries"].as_array().unwrap().clone();
        if all.len() >= n {
            return all;
        }
        assert!(Instant::now() < deadline, "deliveries so far: {d}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delivery_checks_the_addresses_it_dials_again() {
    use std::sync::atomic::Ordering;
    let tmp = fresh();
    let server = Server::start(tmp.path(), 20, None).await;
    let core = server.core().clone();
    server.on_server(async move { core.spawn_webhooks() }).await;
    let (url, hits, _) = counting_receiver(204).await;
    // As a webhook whose name resolved elsewhere at registration would be: in the store as is.
    let tenant = server.core().store().tenant_by_name("default").await.unwrap().unwrap();
    let hook = airlock_server::records::WebhookRecord {
        id: "wh_rebound".into(),
        tenant_id: tenant.id,
        name: "rebound".into(),
        url,
        kinds: vec![],
        enabled: true,
        created_at_ms: now_ms(),
        cursor_seq: 0,
        attempts: 0,
        next_at_ms: 0,
        last_status: None,
        last_error: None,
        last_attempt_at_ms: None,
    };
    server.core().store().insert_webhook(&hook).await.unwrap();
    server.running_sandbox().await;
    let tries = deliveries(&server, "wh_rebound", 1).await;
    let error = tries[0]["error"].as_str().unwrap_or_default();
    assert!(
        tries[0]["status"].is_null() && error.contains("denied ranges") && error.contains("loopback"),
        "{tries:?}"
    );
    assert_eq!(hits.load(Ordering::SeqCst), 0, "nothing was dialed");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redirect_is_no_delivery_and_is_not_followed() {
    use std::sync::atomic::Ordering;
    let tmp = fresh();
    let config = Config {
        webhook_allow_private: true,
        ..Config::default()
    };
    let server = Server::start_full(tmp.path(), 20, None, Duration::ZERO, ROOMY, config).await;
    let core = server.core().clone();
    server.on_server(async move { core.spawn_webhooks() }).await;
    let (url, hits, redirected) = counting_receiver(302).await;
    let (status, hook) = server
        .v1(Method::POST, "/webhooks", Some(json!({"url": url, "name": "moved"})))
        .await;
    assert_eq!(status, 201, "{hook}");
    let hook_id = hook["id"].as_str().unwrap().to_string();
    server.running_sandbox().await;
    // Tried again after its backoff (1 s): the first answer was no delivery.
    let tries = deliveries(&server, &hook_id, 2).await;
    assert_eq!(
        tries[0]["event_id"], tries[1]["event_id"],
        "the same event again: {tries:?}"
    );
    for t in &tries {
        assert_eq!(t["status"], 302, "{t}");
        assert!(t["error"].as_str().unwrap_or_default().contains("redirect"), "{t}");
    }
    assert!(hits.load(Ordering::SeqCst) >= 2);
    assert_eq!(redirected.load(Ordering::SeqCst), 0, "the redirect is not followed");
    let (_, w) = server.v1(Method::GET, &format!("/webhooks/{hook_id}"), None).await;
    assert!(w["attempts"].as_u64().unwrap() >= 1, "{w}");
    server.stop().await;
}
