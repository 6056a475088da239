//! One core through both doors: env names, processes as sessions, the per-sandbox session cap,
//! one-call exec, dropped output, one quota, and a missing sandbox on every route.

use super::*;

// ---------------------------------------------------------------------------------------------
// 4. One core through both doors

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn env_names_are_refused_alike_by_both_doors() {
    let tmp = fresh();
    let server = Server::start(tmp.path(), 4, None).await;
    let (status, native) = server
        .v1(
            Method::POST,
            "/sandboxes",
            Some(json!({ "template": "seed", "env": { "1BAD": "x" } })),
        )
        .await;
    assert_eq!(status, 422, "{native}");
    assert_eq!(native["code"], "invalid_argument", "{native}");
    let (status, e2b) = server
        .e2b(
            Method::POST,
            "/sandboxes",
            json!({ "templateID": "base", "envVars": { "1BAD": "x" } }),
        )
        .await;
    assert_eq!(status, 400, "{e2b}");
    assert_eq!(e2b["code"], 400, "{e2b}");
    let reason = native["message"].as_str().unwrap();
    assert!(reason.contains("\"1BAD\""), "{reason}");
    assert_eq!(e2b["message"].as_str().unwrap(), reason);
    // Nothing was created by either.
    let (_, list) = server.v1(Method::GET, "/sandboxes", None).await;
    assert_eq!(list["sandboxes"], json!([]), "{list}");
    server.stop().await;
    assert_no_vms(tmp.path());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn processes_are_sessions_on_both_doors() {
    let tmp = fresh();
    let server = Server::start(tmp.path(), 4, None).await;
    let sb = server.e2b_sandbox().await;
    let id = sb.id.clone();

    // Started through E2B, with a tag: a /v1 session with that tag.
    let (status, mut stream) = server
        .envd_stream(
            &sb,
            "/process.Process/Start",
            json!({ "process": { "cmd": "sleep", "args": ["infinity"] }, "tag": "e2b-sleeper" }),
        )
        .await;
    assert_eq!(status, 200);
    let (flags, start) = stream.next_event().await.expect("a start event");
    assert_eq!(flags, 0, "{start}");
    let e2b_pid = start["event"]["start"]["pid"].as_u64().expect("a pid");
    let (status, sessions) = server.v1(Method::GET, &format!("/sandboxes/{id}/sessions"), None).await;
    assert_eq!(status, 200, "{sessions}");
    let tagged: Vec<&Value> = sessions
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["tag"] == "e2b-sleeper")
        .collect();
    assert_eq!(tagged.len(), 1, "{sessions}");
    assert_eq!(tagged[0]["state"], "running", "{sessions}");
    assert_eq!(tagged[0]["argv"], json!(["sleep", "infinity"]), "{sessions}");
    let sid = tagged[0]["id"].as_str().unwrap().to_string();

    // Killed through /v1: it ends, on both doors.
    let (status, body) = server
        .v1(
            Method::POST,
            &format!("/sandboxes/{id}/sessions/{sid}/signal"),
            Some(json!({ "signal": "SIGKILL" })),
        )
        .await;
    assert_eq!(status, 204, "{body}");
    let (flags, end) = stream.next_event().await.expect("an end event");
    assert_eq!(flags, 0, "{end}");
    assert_eq!(end["event"]["end"]["status"], "signal: killed", "{end}");
    let (flags, eos) = stream.next().await.expect("the end of the stream");
    assert_eq!(flags, 0x02);
    assert_eq!(eos, json!({}));
    assert!(stream.next().await.is_none());
    let deadline = Instant::now() + Duration::from_secs(3);
    loop {
        let (status, s) = server
            .v1(Method::GET, &format!("/sandboxes/{id}/sessions/{sid}"), None)
            .await;
        assert_eq!(status, 200, "{s}");
        if s["state"] == "exited" {
            assert_eq!(s["signal"], "SIGKILL", "{s}");
            assert_eq!(s["exit_code"], Value::Null, "{s}");
            break;
        }
        assert!(Instant::now() < deadline, "session still running: {s}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // Started through /v1: listed by E2B's `List`, with its pid (and its session id as tag).
    let native = server.session(&id, &["sleep", "infinity"]).await;
    let native_sid = native["id"].as_str().unwrap().to_string();
    let (status, list) = server.envd_unary(&sb, "/process.Process/List", json!({})).await;
    assert_eq!(status, 200, "{list}");
    let procs = list["processes"].as_array().expect("processes");
    assert_eq!(procs.len(), 1, "only the running one: {list}");
    assert_eq!(procs[0]["tag"], native_sid.as_str(), "{list}");
    assert_eq!(procs[0]["config"]["cmd"], "sleep", "{list}");
    let listed_pid = procs[0]["pid"].as_u64().expect("a pid");
    // The pid is the guest's pid of that very process.
    let rt = server.runtime();
    let i = id.clone();
    let guest = server
        .on_server(async move { rt.get(&i).unwrap().agent().await.unwrap().processes().await.unwrap() })
        .await;
    let p = guest
        .iter()
        .find(|p| p.tag.as_deref() == Some(native_sid.as_str()))
        .expect("the agent runs it");
    assert_eq!(u64::from(p.pid), listed_pid);
    assert_ne!(listed_pid, e2b_pid);

    // E2B's kill of the sandbox ends it for /v1 too.
    let (status, body) = server.e2b(Method::DELETE, &format!("/sandboxes/{id}"), json!({})).await;
    assert!(status == 204 || status == 200, "{status} {body}");
    server.await_state(&id, "deleted", Duration::from_secs(5)).await;
    server.stop().await;
    assert_no_vms(tmp.path());
}

/// Start `argv` through E2B's `Process/Start`: the HTTP status and, for a refused start, its
/// Connect error (`None` when the stream started).
async fn e2b_start(server: &Server, sb: &E2bSandbox, argv: &[&str]) -> (u16, Option<Value>, Option<ConnectStream>) {
    let req = json!({ "process": { "cmd": argv[0], "args": &argv[1..] } });
    let (status, mut stream) = server.envd_stream(sb, "/process.Process/Start", req.clone()).await;
    if status != 200 {
        let headers = [
            ("x-access-token", sb.token.as_str()),
            ("e2b-sandbox-id", sb.id.as_str()),
            ("content-type", "application/connect+json"),
            ("connect-protocol-version", "1"),
        ];
        // The same request again, to read the error body whole.
        let (status, body) = server
            .send(
                Method::POST,
                "/process.Process/Start",
                &headers,
                Body::from(envelope(&req)),
            )
            .await
            .json()
            .await;
        return (status, Some(body), None);
    }
    let (flags, start) = stream.next_event().await.expect("a start event");
    assert_eq!(flags, 0, "{start}");
    assert!(start["event"]["start"]["pid"].is_u64(), "{start}");
    (status, None, Some(stream))
}

/// A sandbox runs at most `max_sessions_per_sandbox` sessions at once, counted across both
/// doors; past it both refuse with `quota_exceeded` naming the limit, concurrent starts never
/// overshoot it, and a session that ended (even unrecorded) gives its place back. The store
/// keeps only the newest `max_finished_sessions_per_sandbox` exited sessions.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_are_capped_per_sandbox_on_both_doors() {
    let tmp = fresh();
    let config = Config {
        max_sessions_per_sandbox: 3,
        max_finished_sessions_per_sandbox: 4,
        ..Config::default()
    };
    let server = Arc::new(Server::start_full(tmp.path(), 4, None, Duration::ZERO, ROOMY, config).await);
    let sb = server.e2b_sandbox().await;
    let id = sb.id.clone();

    // Exited sessions: 8 in a row, each seen exited; only the newest 4 are kept.
    let mut sids = Vec::new();
    for n in 0..8 {
        let s = server.session(&id, &["echo", &n.to_string()]).await;
        let sid = s["id"].as_str().unwrap().to_string();
        let deadline = Instant::now() + Duration::from_secs(3);
        loop {
            let (status, s) = server
                .v1(Method::GET, &format!("/sandboxes/{id}/sessions/{sid}"), None)
                .await;
            assert_eq!(status, 200, "{s}");
            if s["state"] == "exited" {
                break;
            }
            assert!(Instant::now() < deadline, "echo still running: {s}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        sids.push(sid);
    }
    let (status, list) = server.v1(Method::GET, &format!("/sandboxes/{id}/sessions"), None).await;
    assert_eq!(status, 200, "{list}");
    let kept: Vec<&str> = list
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["id"].as_str().unwrap())
        .collect();
    assert_eq!(kept, sids[4..].iter().map(String::as_str).collect::<Vec<_>>(), "{list}");
    let (status, gone) = server
        .v1(Method::GET, &format!("/sandboxes/{id}/sessions/{}", sids[0]), None)
        .await;
    assert_eq!(
        (status, gone["code"].as_str()),
        (404, Some("session_not_found")),
        "{gone}"
    );

    // Running sessions: two through /v1, one through E2B fill the sandbox.
    let a = server.session(&id, &["sleep", "infinity"]).await;
    server.session(&id, &["sleep", "infinity"]).await;
    let (status, err, _e2b_stream) = e2b_start(&server, &sb, &["sleep", "infinity"]).await;
    assert_eq!(status, 200, "{err:?}");
    // The fourth is refused by both doors, naming the limit.
    let (status, body) = server
        .v1(
            Method::POST,
            &format!("/sandboxes/{id}/sessions"),
            Some(json!({ "argv": ["true"] })),
        )
        .await;
    assert_eq!(status, 429, "{body}");
    assert_eq!(body["code"], "quota_exceeded", "{body}");
    let message = body["message"].as_str().unwrap();
    assert!(
        message.contains("quota of 3 (sessions_per_sandbox)") && message.contains(&id),
        "{body}"
    );
    let (status, err, _) = e2b_start(&server, &sb, &["true"]).await;
    let err = err.expect("a refusal");
    assert_eq!(status, 429, "{err}");
    assert_eq!(err["code"], "resource_exhausted", "{err}");
    assert_eq!(err["message"], message, "{err}");

    // One ends (killed; its exit not yet recorded by anyone): its place is free again, for
    // exactly one of several concurrent starts.
    let sid = a["id"].as_str().unwrap();
    let (status, body) = server
        .v1(
            Method::POST,
            &format!("/sandboxes/{id}/sessions/{sid}/signal"),
            Some(json!({ "signal": "SIGKILL" })),
        )
        .await;
    assert_eq!(status, 204, "{body}");
    let tasks: Vec<_> = (0..5)
        .map(|_| {
            let (server, id) = (server.clone(), id.clone());
            tokio::spawn(async move {
                server
                    .v1(
                        Method::POST,
                        &format!("/sandboxes/{id}/sessions"),
                        Some(json!({ "argv": ["sleep", "infinity"] })),
                    )
                    .await
            })
        })
        .collect();
    let mut statuses = Vec::new();
    for t in tasks {
        let (status, body) = t.await.unwrap();
        assert!(
            status == 201 || (status == 429 && body["code"] == "quota_exceeded"),
            "{status} {body}"
        );
        statuses.push(status);
    }
    statuses.sort();
    assert_eq!(statuses, vec![201, 429, 429, 429, 429]);
    let (status, list) = server.envd_unary(&sb, "/process.Process/List", json!({})).await;
    assert_eq!(status, 200, "{list}");
    assert_eq!(list["processes"].as_array().unwrap().len(), 3, "{list}");

    server.delete(&id).await;
    let server = Arc::into_inner(server).expect("no other holder");
    server.stop().await;
    assert_no_vms(tmp.path());
}

/// The SSE events of a finished session's stream, read from after `after`: (event, id, data).
async fn sse_events(server: &Server, id: &str, sid: &str, after: u64) -> Vec<(String, String, Value)> {
    let resp = server
        .send(
            Method::GET,
            &format!("/v1/sandboxes/{id}/sessions/{sid}/stream?last_event_id={after}"),
            &[("authorization", &format!("Bearer {}", server.key))],
            Body::empty(),
        )
        .await;
    assert_eq!(resp.status, 200);
    parse_sse(resp).await
}

/// A whole event stream (it must end within 10 s): (event, id, data).
async fn parse_sse(resp: common::Resp) -> Vec<(String, String, Value)> {
    let sse = tokio::time::timeout(Duration::from_secs(10), axum::body::to_bytes(resp.body, 64 << 20))
        .await
        .expect("the stream ends within 10 s")
        .unwrap();
    let mut out = Vec::new();
    for block in String::from_utf8(sse.to_vec()).unwrap().split("\n\n") {
        let (mut event, mut eid, mut data) = (String::new(), String::new(), Value::Null);
        for line in block.lines() {
            if let Some(v) = line.strip_prefix("event:") {
                event = v.trim().into();
            } else if let Some(v) = line.strip_prefix("id:") {
                eid = v.trim().into();
            } else if let Some(v) = line.strip_prefix("data:") {
                data = serde_json::from_str(v.trim()).unwrap();
            }
        }
        if !event.is_empty() {
            out.push((event, eid, data));
        }
    }
    out
}

/// A command and its output in one call: `POST .../sessions` with `Accept: text/event-stream`
/// answers with the session first, then its events as `.../stream` sends them (same ids, so a
/// client that lost the connection resumes there).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_call_exec_streams_the_session_then_its_events() {
    let tmp = fresh();
    let server = Server::start(tmp.path(), 4, None).await;
    let id = server.running_sandbox().await;
    let auth = format!("Bearer {}", server.key);
    let resp = server
        .send(
            Method::POST,
            &format!("/v1/sandboxes/{id}/sessions"),
            &[
                ("authorization", &auth),
                ("content-type", "application/json"),
                ("accept", "text/event-stream"),
            ],
            Body::from(json!({ "argv": ["echo", "alive"] }).to_string()),
        )
        .await;
    assert_eq!(resp.status, 201);
    assert_eq!(resp.headers["content-type"], "text/event-stream");
    let events = parse_sse(resp).await;
    let (first, rest) = events.split_first().expect("events");
    assert_eq!(first.0, "session", "{events:?}");
    let sid = first.2["id"].as_str().unwrap();
    assert_eq!(first.2["argv"], json!(["echo", "alive"]));
    // base64("alive\n")
    assert!(
        rest.iter().any(|(e, _, d)| e == "stdout" && d["data"] == "YWxpdmUK"),
        "{events:?}"
    );
    let last = rest.last().unwrap();
    assert_eq!(
        (last.0.as_str(), &last.2["exit_code"]),
        ("process_exited", &json!(0)),
        "{events:?}"
    );
    assert_eq!(
        sse_events(&server, &id, sid, 0).await,
        rest,
        "the session's stream has the same events"
    );
    // Without that Accept: the session as JSON, as before.
    let s = server.session(&id, &["true"]).await;
    assert_eq!(s["state"], "running", "{s}");
    server.delete(&id).await;
    server.stop().await;
    assert_no_vms(tmp.path());
}

/// The server holds no output of its own (it streams what the guest agent keeps); the agent
/// keeps a bounded tail of each process's output, and a reader that comes after older output
/// was dropped is told so, with an `output_truncated` event where it is missing, before the
/// tail that is still there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_output_is_announced_where_it_is_missing() {
    use base64::Engine as _;
    let tmp = fresh();
    let server = Server::start(tmp.path(), 4, None).await;
    let id = server.running_sandbox().await;
    let (status, s) = server
        .v1(
            Method::POST,
            &format!("/sandboxes/{id}/sessions"),
            Some(json!({ "argv": ["cat"], "stdin": true })),
        )
        .await;
    assert_eq!(status, 201, "{s}");
    let sid = s["id"].as_str().unwrap().to_string();
    // 3 x 512 KiB through `cat`: more than the (fake) agent keeps.
    let chunk = 512 << 10;
    let mut written = Vec::new();
    for n in 0..3u8 {
        let data: Vec<u8> = (0..chunk).map(|i| b'a' + n + (i % 7) as u8).collect();
        written.extend_from_slice(&data);
        let b64 = base64::engine::general_purpose::STANDARD.encode(&data);
        let (status, body) = server
            .v1(
                Method::POST,
                &format!("/sandboxes/{id}/sessions/{sid}/stdin"),
                Some(json!({ "data": b64, "eof": n == 2 })),
            )
            .await;
        assert_eq!(status, 204, "{body}");
    }
    let events = sse_events(&server, &id, &sid, 0).await;
    let (event, eid, data) = &events[0];
    assert_eq!(event, "output_truncated", "{events:?}");
    assert_eq!(data["first_seq"], 1, "{data}");
    let last = data["last_seq"].as_u64().unwrap();
    assert_eq!(eid, &last.to_string());
    assert!(data["message"].as_str().unwrap().contains("no longer kept"), "{data}");
    // Then the tail, contiguous from the event after the gap, and the exit.
    let mut tail = Vec::new();
    for (next, (event, eid, data)) in (last + 1..).zip(&events[1..events.len() - 1]) {
        assert_eq!(event, "stdout", "{event} {data}");
        assert_eq!(eid, &next.to_string());
        tail.extend(
            base64::engine::general_purpose::STANDARD
                .decode(data["data"].as_str().unwrap())
                .unwrap(),
        );
    }
    assert_eq!(events.last().unwrap().0, "process_exited");
    assert!(!tail.is_empty() && tail.len() <= airlock_runtime::fake::RETAINED_OUTPUT);
    assert!(written.ends_with(&tail), "the kept output is the newest");
    // A reader that resumes after the gap is told nothing more; one inside it is told the rest.
    let resumed = sse_events(&server, &id, &sid, last).await;
    assert_eq!(resumed[0].0, "stdout", "{resumed:?}");
    let inside = sse_events(&server, &id, &sid, last - 1).await;
    assert_eq!(inside[0].0, "output_truncated");
    assert_eq!(
        (inside[0].2["first_seq"].as_u64(), inside[0].2["last_seq"].as_u64()),
        (Some(last), Some(last))
    );

    server.delete(&id).await;
    server.stop().await;
    assert_no_vms(tmp.path());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quota_is_one_limit_for_both_doors() {
    let tmp = fresh();
    let server = Arc::new(Server::start(tmp.path(), 2, None).await);
    let tasks: Vec<_> = (0..10)
        .map(|i| {
            let server = server.clone();
            tokio::spawn(async move {
                if i % 2 == 0 {
                    let (s, b) = server
                        .v1(Method::POST, "/sandboxes", Some(json!({ "template": "seed" })))
                        .await;
                    ("native", s, b)
                } else {
                    let (s, b) = server
                        .e2b(Method::POST, "/sandboxes", json!({ "templateID": "base" }))
                        .await;
                    ("e2b", s, b)
                }
            })
        })
        .collect();
    let mut admitted = Vec::new();
    let mut refused = 0;
    for t in tasks {
        match t.await.unwrap() {
            ("native", 202, b) => admitted.push(b["sandbox_id"].as_str().unwrap().to_string()),
            ("e2b", 201, b) => admitted.push(b["sandboxID"].as_str().unwrap().to_string()),
            ("native", 429, b) => {
                assert_eq!(b["code"], "quota_exceeded", "{b}");
                refused += 1;
            }
            ("e2b", 429, b) => {
                assert_eq!(b["code"], 429, "{b}");
                assert!(
                    b["message"].as_str().unwrap().contains("its quota of 2 (sandboxes)"),
                    "{b}"
                );
                refused += 1;
            }
            (door, s, b) => panic!("{door}: unexpected {s} {b}"),
        }
    }
    assert_eq!(admitted.len(), 2, "admitted {admitted:?}");
    assert_eq!(refused, 8);

    for id in &admitted {
        server.await_state(id, "running", Duration::from_secs(10)).await;
        server.delete(id).await;
    }
    let server = Arc::into_inner(server).unwrap();
    server.stop().await;
    assert_no_vms(tmp.path());
}

/// Every `/v1/sandboxes/{id}...` route: (method, path after the id, JSON body).
const SANDBOX_ROUTES: &[(&str, &str, Option<&str>)] = &[
    ("GET", "", None),
    ("DELETE", "", None),
    ("POST", "/pause", None),
    ("POST", "/resume", None),
    ("GET", "/sessions", None),
    ("POST", "/sessions", Some(r#"{"argv":["true"]}"#)),
    ("GET", "/sessions/ses_0000000000000000", None),
    ("GET", "/sessions/ses_0000000000000000/stream", None),
    (
        "POST",
        "/sessions/ses_0000000000000000/stdin",
        Some(r#"{"data":"aGkK"}"#),
    ),
    (
        "POST",
        "/sessions/ses_0000000000000000/signal",
        Some(r#"{"signal":"SIGTERM"}"#),
    ),
    (
        "POST",
        "/sessions/ses_0000000000000000/resize",
        Some(r#"{"cols":80,"rows":24}"#),
    ),
    ("GET", "/files?path=/tmp/a.txt", None),
    ("PUT", "/files?path=/tmp/a.txt", Some("data")),
    ("DELETE", "/files?path=/tmp/a.txt", None),
    ("GET", "/files/list?path=/tmp", None),
];

async fn assert_every_route_404(server: &Server, key: &str, id: &str) {
    for (method, rest, body) in SANDBOX_ROUTES {
        let path = format!("/v1/sandboxes/{id}{rest}");
        let auth = format!("Bearer {key}");
        let mut headers = vec![("authorization", auth.as_str())];
        let body = match body {
            Some(b) => {
                let ct = if rest.starts_with("/files") {
                    "application/octet-stream"
                } else {
                    "application/json"
                };
                headers.push(("content-type", ct));
                Body::from(b.to_string())
            }
            None => Body::empty(),
        };
        let (status, resp) = server
            .send(method.parse().unwrap(), &path, &headers, body)
            .await
            .json()
            .await;
        assert_eq!(
            (status, resp["code"].as_str()),
            (404, Some("sandbox_not_found")),
            "{method} {path}: {resp}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_sandbox_is_404_on_every_route() {
    let tmp = fresh();
    let server = Server::start(tmp.path(), 4, None).await;
    assert_every_route_404(&server, &server.key.clone(), "nosuchsandbox0").await;
    // Another tenant's sandbox answers exactly like a missing one, and is left untouched.
    let id = server.running_sandbox().await;
    let other = server
        .core()
        .store
        .create_key("other", KeyFormat::Airlock)
        .await
        .unwrap();
    assert_every_route_404(&server, &other, &id).await;
    assert_eq!(server.sandbox_state(&id).await, "running");
    server.assert_answers(&id).await;
    server.delete(&id).await;
    server.stop().await;
    assert_no_vms(tmp.path());
}
