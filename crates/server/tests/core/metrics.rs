//! `GET /metrics` (issue 28): who may scrape (a scrape token, the admin's token; never a
//! tenant's key or nobody), and that what it counts is what happened: creates by start source,
//! operations, HTTP requests by route template, sandboxes by state, agent calls, node budgets.

use super::*;

const PASSWORD: &str = "metrics-console-password";

async fn admin_token(server: &Server) -> String {
    server.admin_token(PASSWORD).await
}

async fn scrape(server: &Server, bearer: Option<&str>) -> (u16, String, String) {
    let auth = bearer.map(|b| format!("Bearer {b}"));
    let headers: Vec<(&str, &str)> = auth.iter().map(|a| ("authorization", a.as_str())).collect();
    let resp = server.send(Method::GET, "/metrics", &headers, Body::empty()).await;
    let content_type = resp
        .headers
        .get("content-type")
        .map(|v| v.to_str().unwrap().to_string())
        .unwrap_or_default();
    let (status, body) = resp.json().await;
    let text = match body {
        Value::String(s) => s,
        v => v.to_string(),
    };
    (status, content_type, text)
}

/// The value of the sample `series` (name and labels exactly as exposed).
fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_what_happened_for_whoever_may_scrape() {
    let tmp = fresh();
    let server = Server::start(tmp.path(), 20, None).await;
    airlock_server::telemetry::observe_agent_calls(server.core().telemetry());
    let admin = admin_token(&server).await;

    // Nobody, and a tenant's key, are refused; the admin's token may scrape.
    let (status, _, body) = scrape(&server, None).await;
    assert_eq!(status, 401, "{body}");
    assert!(
        body.contains("scrape-token create"),
        "the refusal names the fix: {body}"
    );
    let (status, _, body) = scrape(&server, Some(&server.key)).await;
    assert_eq!(status, 403, "{body}");
    let (status, content_type, _) = scrape(&server, Some(&admin)).await;
    assert_eq!(status, 200);
    assert!(content_type.starts_with("text/plain; version=0.0.4"), "{content_type}");

    // A scrape token, minted by the admin and shown once.
    let (status, minted) = server
        .json(
            Method::POST,
            "/v1/admin/scrape-tokens",
            &[
                ("authorization", &format!("Bearer {admin}")),
                ("content-type", "application/json"),
            ],
            Body::from(json!({"name": "prometheus"}).to_string()),
        )
        .await;
    assert_eq!(status, 201, "{minted}");
    let token = minted["token"].as_str().unwrap().to_string();
    let id = minted["id"].as_str().unwrap().to_string();

    let first = server.running_sandbox().await;
    let second = server.running_sandbox().await;
    let (status, body) = server
        .v1(Method::POST, &format!("/sandboxes/{first}/pause"), None)
        .await;
    assert_eq!(status, 202, "{body}");
    server.wait_op(body["operation"]["id"].as_str().unwrap()).await;
    let (status, body) = server.v1(Method::GET, "/sandboxes/sb_missing", None).await;
    assert_eq!(status, 404, "{body}");

    let (status, _, text) = scrape(&server, Some(&token)).await;
    assert_eq!(status, 200, "{text}");
    assert_eq!(
        sample(&text, "airlock_sandbox_creates_total{result=\"ok\"}"),
        Some(2.0),
        "{text}"
    );
    let started: f64 = text
        .lines()
        .filter(|l| l.starts_with("airlock_sandbox_create_duration_seconds_count{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert_eq!(started, 2.0, "one observation per create, by its start source: {text}");
    assert_eq!(
        sample(
            &text,
            "airlock_operation_duration_seconds_count{kind=\"create\",result=\"succeeded\"}"
        ),
        Some(2.0),
        "{text}"
    );
    assert_eq!(
        sample(
            &text,
            "airlock_operation_duration_seconds_count{kind=\"pause\",result=\"succeeded\"}"
        ),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        sample(
            &text,
            "airlock_sandboxes{state=\"running\",template=\"seed\",tenant=\"default\"}"
        ),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        sample(
            &text,
            "airlock_sandboxes{state=\"paused\",template=\"seed\",tenant=\"default\"}"
        ),
        Some(1.0),
        "{text}"
    );
    // Requests by route template (never by id) and status.
    assert_eq!(
        sample(
            &text,
            "airlock_http_request_duration_seconds_count{method=\"POST\",route=\"/v1/sandboxes\",status=\"202\"}"
        ),
        Some(2.0),
        "{text}"
    );
    assert_eq!(
        sample(
            &text,
            "airlock_http_request_duration_seconds_count{method=\"GET\",route=\"/v1/sandboxes/{id}\",status=\"404\"}"
        ),
        Some(1.0),
        "{text}"
    );
    assert!(!text.contains(&second), "no sandbox id in a label");
    assert!(
        text.lines()
            .any(|l| l.starts_with("airlock_agent_call_duration_seconds_count{") && l.contains("outcome=\"ok\"")),
        "agent calls are counted: {text}"
    );
    let budget = sample(&text, "airlock_node_budget{node=\"local\",resource=\"vcpu\"}").unwrap();
    let used = sample(&text, "airlock_node_budget_used{node=\"local\",resource=\"vcpu\"}").unwrap();
    assert!(budget > 0.0 && used >= 2.0, "{text}");
    assert!(sample(&text, "airlock_server_start_time_seconds").unwrap() > 1.7e9);

    // Listed (never the token), revoked, refused.
    let admin_auth = format!("Bearer {admin}");
    let (status, list) = server
        .json(
            Method::GET,
            "/v1/admin/scrape-tokens",
            &[("authorization", &admin_auth)],
            Body::empty(),
        )
        .await;
    assert_eq!(status, 200, "{list}");
    assert_eq!(list["tokens"][0]["id"], id.as_str());
    assert!(!list.to_string().contains(&token));
    let path = format!("/v1/admin/scrape-tokens/{id}");
    let (status, _) = server
        .json(Method::DELETE, &path, &[("authorization", &admin_auth)], Body::empty())
        .await;
    assert_eq!(status, 204);
    let (status, _, _) = scrape(&server, Some(&token)).await;
    assert_eq!(status, 401);
    let (status, body) = server
        .json(Method::DELETE, &path, &[("authorization", &admin_auth)], Body::empty())
        .await;
    assert_eq!(
        (status, body["code"].as_str()),
        (404, Some("scrape_token_not_found")),
        "{body}"
    );
    server.stop().await;
}

/// The series of `family` in a scrape: its sample lines (buckets, sum and count of each label
/// set).
fn series(text: &str, family: &str) -> usize {
    text.lines().filter(|l| l.starts_with(family)).count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn made_up_methods_and_paths_add_no_series() {
    let tmp = fresh();
    let server = Server::start(tmp.path(), 20, None).await;
    let admin = admin_token(&server).await;
    const HTTP: &str = "airlock_http_request_duration_seconds";
    // One request of each standard method first, so the series they make are there before.
    for method in ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "MADEUP"] {
        let method = Method::from_bytes(method.as_bytes()).unwrap();
        server.send(method, "/nowhere", &[], Body::empty()).await;
    }
    let (_, _, text) = scrape(&server, Some(&admin)).await;
    let before = series(&text, HTTP);
    // Any client, no credential: a method and a path of its choosing each time.
    let word = |n: usize| -> String { (0..n).map(|_| fastrand::alphabetic().to_ascii_uppercase()).collect() };
    for i in 0..1000 {
        let method = Method::from_bytes(word(3 + i % 10).as_bytes()).unwrap();
        let path = match i % 3 {
            0 => format!("/{}", word(12).to_lowercase()),
            1 => format!("/v1/{}/{}", word(8).to_lowercase(), i),
            _ => format!("/console/{}", word(8).to_lowercase()),
        };
        let resp = server.send(method, &path, &[], Body::empty()).await;
        assert!(resp.status < 500, "{path}: {}", resp.status);
    }
    let (_, _, text) = scrape(&server, Some(&admin)).await;
    let after = series(&text, HTTP);
    eprintln!("{HTTP} lines: {before} before, {after} after 1000 made-up requests");
    let methods: std::collections::BTreeSet<&str> = text
        .lines()
        .filter(|l| l.starts_with(HTTP))
        .filter_map(|l| l.split("method=\"").nth(1)?.split('"').next())
        .collect();
    assert!(
        methods
            .iter()
            .all(|m| ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "other"].contains(m)),
        "{methods:?}"
    );
    // The scrapes' own series may appear; nothing a client chose does.
    let per_set = 17 + 3;
    assert!(after <= before + 2 * per_set, "{before} -> {after}:\n{text}");
    server.stop().await;
}
