//! The native API over HTTP, against a real `airlock serve` process with real VMs.

mod common;

use base64::Engine as _;
use common::*;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

static SERVER: OnceLock<Server> = OnceLock::new();

fn server() -> &'static Server {
    SERVER.get_or_init(|| {
        let data = test_data_dir();
        build_template(&data, "seed");
        Server::start(&data)
    })
}

/// One sandbox the read-only tests share.
fn shared() -> &'static str {
    static ID: OnceLock<String> = OnceLock::new();
    ID.get_or_init(|| server().create(json!({ "template": "seed", "timeout": "30m", "metadata": { "suite": "api" } })))
}

fn walkthrough_create_session_stream_delete() {
    let s = server();
    let (status, created) = s.call(
        "POST",
        "/v1/sandboxes",
        Some(json!({ "template": "seed", "timeout": "10m", "metadata": { "who": "walkthrough" } })),
    );
    assert_eq!(status, 202, "{created}");
    let id = created["sandbox_id"].as_str().unwrap().to_string();
    assert_eq!(created["operation"]["kind"], "create");
    assert!(["pending", "running"].contains(&created["operation"]["state"].as_str().unwrap()));
    let op = s.wait_op(created["operation"]["id"].as_str().unwrap());
    assert_eq!(op["state"], "succeeded");
    assert!(op["finished_at"].is_string());

    let (_, sb) = s.call("GET", &format!("/v1/sandboxes/{id}"), None);
    assert_eq!(sb["state"], "running");
    assert!(sb["template_digest"].as_str().unwrap().starts_with("sha256:"));
    assert_eq!(sb["runtime"], "qemu");
    assert_eq!(sb["metadata"]["who"], "walkthrough");
    assert!(
        ["boot", "restore"].contains(&sb["start"]["from"].as_str().unwrap()),
        "{sb}"
    );
    assert!(sb["start"]["ms"].as_u64().unwrap() > 0, "{sb}");

    let sid = s.session(&id, json!({ "argv": ["python3", "-c", "import os; print('hello from airlock'); print(os.getcwd())"], "cwd": "/tmp", "timeout": "30s" }));
    let events = s.events(&id, &sid, None, None);
    assert_eq!(decode(&events, "stdout"), "hello from airlock\n/tmp\n");
    assert!(events.iter().all(|(e, _, _)| e != "error"), "{events:?}");
    let (last, _, exit) = events.last().unwrap();
    assert_eq!(last, "process_exited");
    assert_eq!(exit["exit_code"], 0);
    let (_, sess) = s.call("GET", &format!("/v1/sandboxes/{id}/sessions/{sid}"), None);
    assert_eq!(
        (sess["state"].as_str(), sess["exit_code"].as_i64()),
        (Some("exited"), Some(0))
    );
    let (_, list) = s.call("GET", &format!("/v1/sandboxes/{id}/sessions"), None);
    assert!(list.as_array().unwrap().iter().any(|x| x["id"] == sid.as_str()));

    s.delete(&id);
    let (_, gone) = s.call("GET", &format!("/v1/sandboxes/{id}"), None);
    assert_eq!(gone["state"], "deleted");
    assert!(!s.data.join("sandboxes").join(&id).exists());
    let (status, err) = s.call("DELETE", &format!("/v1/sandboxes/{id}"), None);
    assert_eq!(
        (status, err["code"].as_str()),
        (404, Some("sandbox_not_found")),
        "{err}"
    );
}

fn failing_command_reports_its_exit_code_and_stderr() {
    let s = server();
    let id = shared();
    let sid = s.session(
        id,
        json!({ "argv": ["sh", "-c", "echo oops >&2; exit 3"], "user": "root" }),
    );
    let events = s.events(id, &sid, None, None);
    assert_eq!(decode(&events, "stderr"), "oops\n");
    assert_eq!(events.last().unwrap().2["exit_code"], 3);
    let sid = s.session(id, json!({ "argv": ["sleep", "30"], "timeout": "1s" }));
    let events = s.events(id, &sid, None, None);
    let exit = &events.last().unwrap().2;
    assert_eq!(
        (exit["signal"].as_str(), exit["timed_out"].as_bool()),
        (Some("SIGKILL"), Some(true))
    );
}

fn sse_resumes_with_last_event_id_without_loss_or_duplicates() {
    let s = server();
    let id = shared();
    let sid = s.session(
        id,
        json!({ "argv": ["sh", "-c", "for i in 1 2 3 4 5 6; do echo line$i; sleep 0.3; done"] }),
    );
    let first = s.events(id, &sid, None, Some(2));
    assert_eq!(first.len(), 2);
    let last_id = first[1].1.clone().expect("events carry ids");
    let rest = s.events(id, &sid, Some(&last_id), None);
    let mut all = first.clone();
    all.extend(rest.clone());
    assert_eq!(decode(&all, "stdout"), "line1\nline2\nline3\nline4\nline5\nline6\n");
    let ids: Vec<u64> = all
        .iter()
        .map(|(_, i, _)| i.as_ref().unwrap().parse().unwrap())
        .collect();
    assert!(ids.windows(2).all(|w| w[1] > w[0]), "ids strictly increase: {ids:?}");
    // A late attach from the start replays everything, too.
    assert_eq!(
        decode(&s.events(id, &sid, None, None), "stdout"),
        decode(&all, "stdout")
    );
}

fn stdin_signal_and_files() {
    let s = server();
    let id = shared();
    let sid = s.session(id, json!({ "argv": ["cat"], "stdin": true }));
    let b64 = base64::engine::general_purpose::STANDARD.encode(b"round trip\n");
    let (status, _) = s.call(
        "POST",
        &format!("/v1/sandboxes/{id}/sessions/{sid}/stdin"),
        Some(json!({ "data": b64, "eof": true })),
    );
    assert_eq!(status, 204);
    assert_eq!(decode(&s.events(id, &sid, None, None), "stdout"), "round trip\n");

    let sid = s.session(id, json!({ "argv": ["sleep", "300"] }));
    let (status, _) = s.call(
        "POST",
        &format!("/v1/sandboxes/{id}/sessions/{sid}/signal"),
        Some(json!({ "signal": "SIGTERM" })),
    );
    assert_eq!(status, 204);
    assert_eq!(s.events(id, &sid, None, None).last().unwrap().2["signal"], "SIGTERM");
    let (status, err) = s.call(
        "POST",
        &format!("/v1/sandboxes/{id}/sessions/{sid}/signal"),
        Some(json!({ "signal": "SIGNOPE" })),
    );
    assert_eq!((status, err["code"].as_str()), (422, Some("invalid_argument")));

    let put = ureq::put(&format!(
        "{}/v1/sandboxes/{id}/files?path=/home/user/dir/hello.bin",
        s.url
    ))
    .set("Authorization", &format!("Bearer {}", s.key))
    .send_bytes(&[0u8, 1, 2, 255, 10])
    .unwrap()
    .into_json::<Value>()
    .unwrap();
    assert_eq!((put["size"].as_u64(), put["owner"].as_str()), (Some(5), Some("user")));
    let mut back = Vec::new();
    std::io::Read::read_to_end(
        &mut ureq::get(&format!(
            "{}/v1/sandboxes/{id}/files?path=/home/user/dir/hello.bin",
            s.url
        ))
        .set("Authorization", &format!("Bearer {}", s.key))
        .call()
        .unwrap()
        .into_reader(),
        &mut back,
    )
    .unwrap();
    assert_eq!(back, vec![0u8, 1, 2, 255, 10]);
    let (_, list) = s.call(
        "GET",
        &format!("/v1/sandboxes/{id}/files/list?path=/home/user&depth=2"),
        None,
    );
    assert!(
        list["entries"]
            .as_array()
            .unwrap()
            .iter()
            .any(|e| e["path"] == "/home/user/dir/hello.bin"),
        "{list}"
    );
    let (status, _) = s.call("DELETE", &format!("/v1/sandboxes/{id}/files?path=/home/user/dir"), None);
    assert_eq!(status, 204);
    // Removing what isn't there succeeds, as envd's (and `rm -rf`) does.
    let (status, _) = s.call("DELETE", &format!("/v1/sandboxes/{id}/files?path=/home/user/dir"), None);
    assert_eq!(status, 204);
    let (status, err) = s.call(
        "GET",
        &format!("/v1/sandboxes/{id}/files?path=/home/user/dir/hello.bin"),
        None,
    );
    assert_eq!((status, err["code"].as_str()), (404, Some("file_not_found")), "{err}");
    let (status, _) = s.call("GET", &format!("/v1/sandboxes/{id}/files/list?path=/etc&depth=0"), None);
    assert_eq!(status, 422);
}

fn pause_freezes_in_memory_and_resume_continues() {
    let s = server();
    let id = s.create(json!({ "template": "seed", "timeout": "15s" }));
    let sid = s.session(&id, json!({ "argv": ["sh", "-c", "sleep 1; echo after-resume"] }));
    let (status, r) = s.call("POST", &format!("/v1/sandboxes/{id}/pause"), None);
    assert_eq!(status, 202, "{r}");
    assert_eq!(s.wait_op(r["operation"]["id"].as_str().unwrap())["state"], "succeeded");
    let (_, sb) = s.call("GET", &format!("/v1/sandboxes/{id}"), None);
    assert_eq!(sb["state"], "paused");
    let (status, err) = s.call(
        "POST",
        &format!("/v1/sandboxes/{id}/sessions"),
        Some(json!({ "argv": ["true"] })),
    );
    assert_eq!((status, err["code"].as_str()), (409, Some("invalid_state")), "{err}");
    let (status, err) = s.call("POST", &format!("/v1/sandboxes/{id}/pause"), None);
    assert_eq!(
        (status, err["code"].as_str()),
        (409, Some("invalid_state")),
        "pausing twice: {err}"
    );
    let (_, listed) = s.call("GET", "/v1/sandboxes?state=paused", None);
    assert!(listed["sandboxes"]
        .as_array()
        .unwrap()
        .iter()
        .any(|x| x["id"] == id.as_str()));
    // A paused sandbox does not spend its timeout: well past the 15 s it was created with, it
    // is still there.
    std::thread::sleep(Duration::from_secs(16));
    let (_, sb) = s.call("GET", &format!("/v1/sandboxes/{id}"), None);
    assert_eq!(sb["state"], "paused", "{sb}");
    let (status, r) = s.call("POST", &format!("/v1/sandboxes/{id}/resume"), None);
    assert_eq!(status, 202, "{r}");
    assert_eq!(s.wait_op(r["operation"]["id"].as_str().unwrap())["state"], "succeeded");
    // The command started before the pause finishes after it.
    let events = s.events(&id, &sid, None, None);
    assert_eq!(decode(&events, "stdout"), "after-resume\n");
    // Resumed, its clock runs again with what was left at the pause, and it expires.
    s.wait_expired(&id);
}

/// `on_timeout: suspend` saves the sandbox when its timeout passes instead of deleting it, and
/// with `auto_resume` the next request resumes it, with its whole timeout again.
fn timeout_suspends_and_a_request_resumes() {
    let s = server();
    let id = s.create(json!({ "template": "seed", "timeout": "4s", "on_timeout": "suspend", "auto_resume": true }));
    let (_, sb) = s.call("GET", &format!("/v1/sandboxes/{id}"), None);
    assert_eq!(
        sb["lifecycle"],
        json!({ "on_timeout": "suspend", "auto_resume": true }),
        "{sb}"
    );
    let sid = s.session(&id, json!({ "argv": ["sh", "-c", "echo kept > /tmp/kept; sleep 600"] }));
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (_, sb) = s.call("GET", &format!("/v1/sandboxes/{id}"), None);
        if sb["state"] == "suspended" {
            break;
        }
        assert!(
            sb["state"] == "running" && Instant::now() < deadline,
            "not suspended at its timeout: {sb}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    // A request resumes it: files and processes as they were.
    let probe = s.session(&id, json!({ "argv": ["cat", "/tmp/kept"] }));
    assert_eq!(decode(&s.events(&id, &probe, None, None), "stdout"), "kept\n");
    let (_, session) = s.call("GET", &format!("/v1/sandboxes/{id}/sessions/{sid}"), None);
    assert_eq!(session["state"], "running", "{session}");
    let (_, sb) = s.call("GET", &format!("/v1/sandboxes/{id}"), None);
    assert_eq!(sb["state"], "running", "{sb}");
    // Its timeout runs again from the resume, and suspends it again.
    let left = humantime::parse_rfc3339(sb["expires_at"].as_str().unwrap())
        .unwrap()
        .duration_since(std::time::SystemTime::now())
        .unwrap_or_default();
    assert!(left <= Duration::from_secs(4), "{sb}");
    let deadline = Instant::now() + Duration::from_secs(60);
    while s.call("GET", &format!("/v1/sandboxes/{id}"), None).1["state"] != "suspended" {
        assert!(Instant::now() < deadline, "not suspended again");
        std::thread::sleep(Duration::from_millis(200));
    }
    s.delete(&id);
}

/// A snapshot saves a running sandbox (it runs on) under a content digest; sandboxes made from
/// it (by digest) and a fork's children start with its files and running processes, each
/// independent; deleting the snapshot leaves them be.
fn snapshots_and_forks_start_from_a_running_sandbox() {
    let s = server();
    let id = s.create(json!({ "template": "seed", "timeout": "10m" }));
    let counting = "i=0; while true; do i=$((i+1)); echo $i > /tmp/n.new; mv /tmp/n.new /tmp/n; sleep 0.1; done";
    s.session(
        &id,
        json!({ "argv": ["sh", "-c", format!("echo parent > /home/user/p.txt; {counting}")] }),
    );
    std::thread::sleep(Duration::from_millis(700));
    let name = format!("warm-{id}");
    let (status, snap) = s.call(
        "POST",
        &format!("/v1/sandboxes/{id}/snapshots"),
        Some(json!({ "name": name })),
    );
    assert_eq!(status, 201, "{snap}");
    assert_eq!(
        (snap["sandbox_id"].as_str(), snap["template"].as_str()),
        (Some(id.as_str()), Some("seed"))
    );
    assert!(snap["bytes"].as_u64().unwrap() > 0, "{snap}");
    let snap_id = snap["id"].as_str().unwrap().to_string();
    // Content-addressed: the digest names it as its id and name do, and its image records it.
    let digest = snap["digest"].as_str().unwrap_or_default().to_string();
    assert!(
        digest.len() == 71 && digest.starts_with("sha256:") && digest[7..].bytes().all(|b| b.is_ascii_hexdigit()),
        "{snap}"
    );
    let manifest: Value =
        serde_json::from_slice(&std::fs::read(s.data.join("images").join(&snap_id).join("image.json")).unwrap())
            .unwrap();
    assert_eq!(manifest["digest"], digest.as_str());
    for reference in [&digest, &name] {
        let (status, got) = s.call("GET", &format!("/v1/snapshots/{reference}"), None);
        assert_eq!(
            (status, got["id"].as_str()),
            (200, Some(snap_id.as_str())),
            "{reference}: {got}"
        );
    }
    // The sandbox runs on (its counter counts): saved again, it is another machine.
    let (status, later) = s.call("POST", &format!("/v1/sandboxes/{id}/snapshots"), None);
    assert_eq!(status, 201, "{later}");
    assert_ne!(later["digest"], digest.as_str(), "{later}");
    let (status, _) = s.call(
        "DELETE",
        &format!("/v1/snapshots/{}", later["id"].as_str().unwrap()),
        None,
    );
    assert_eq!(status, 204);
    let (status, again) = s.call(
        "POST",
        &format!("/v1/sandboxes/{id}/snapshots"),
        Some(json!({ "name": name })),
    );
    assert_eq!((status, again["code"].as_str()), (409, Some("conflict")), "{again}");
    let (_, listed) = s.call("GET", &format!("/v1/snapshots?sandbox_id={id}"), None);
    assert_eq!(listed["snapshots"][0]["id"], snap_id.as_str(), "{listed}");
    let (status, _) = s.call("GET", "/v1/snapshots/snap_0000000000000000000", None);
    assert_eq!(status, 404);
    let (status, err) = s.call(
        "POST",
        "/v1/sandboxes",
        Some(json!({ "template": name, "resources": { "memory_mib": 1024 } })),
    );
    assert_eq!(
        (status, err["code"].as_str()),
        (422, Some("invalid_resources")),
        "{err}"
    );
    // Each of these has the parent's file, and its counter counting on.
    let still_counting = |sb: &str| {
        let sid = s.session(sb, json!({ "argv": ["sh", "-c", "cat /home/user/p.txt; a=$(cat /tmp/n); sleep 0.5; [ $(cat /tmp/n) -gt $a ] && echo counting"] }));
        decode(&s.events(sb, &sid, None, None), "stdout")
    };
    let from_snapshot = s.create(json!({ "template": digest }));
    let (_, sb) = s.call("GET", &format!("/v1/sandboxes/{from_snapshot}"), None);
    assert_eq!(
        (sb["start"]["from"].as_str(), sb["template"].as_str()),
        (Some("snapshot"), Some("seed")),
        "{sb}"
    );
    assert_eq!(still_counting(&from_snapshot), "parent\ncounting\n");
    let (status, forked) = s.call("POST", &format!("/v1/sandboxes/{id}/fork"), Some(json!({ "count": 2 })));
    assert_eq!(status, 202, "{forked}");
    assert_eq!(forked["errors"], json!([]), "{forked}");
    let children: Vec<String> = forked["sandboxes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            assert_eq!(s.wait_op(c["operation"]["id"].as_str().unwrap())["state"], "succeeded");
            c["sandbox_id"].as_str().unwrap().to_string()
        })
        .collect();
    assert_eq!(children.len(), 2);
    for (n, child) in children.iter().enumerate() {
        assert_eq!(still_counting(child), "parent\ncounting\n");
        let sid = s.session(
            child,
            json!({ "argv": ["sh", "-c", format!("echo {n} > /home/user/p.txt")] }),
        );
        s.events(child, &sid, None, None);
    }
    for (n, child) in children.iter().enumerate() {
        let (_, body) = s.call(
            "GET",
            &format!("/v1/sandboxes/{child}/files?path=/home/user/p.txt"),
            None,
        );
        assert_eq!(body, json!(n), "each child's disk is its own");
    }
    assert_eq!(
        still_counting(&id),
        "parent\ncounting\n",
        "the parent runs on undisturbed"
    );
    // A paused sandbox is not saved (resume it first); it can be saved again once it runs.
    assert_eq!(s.change(&id, "pause")["state"], "paused");
    let (status, err) = s.call("POST", &format!("/v1/sandboxes/{id}/fork"), None);
    assert_eq!((status, err["code"].as_str()), (409, Some("invalid_state")), "{err}");
    assert_eq!(s.change(&id, "resume")["state"], "running");
    // A fork's image goes once its children run; the snapshot's stays until deleted.
    let images = || -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(s.data.join("images"))
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().to_string())
            .filter(|n| {
                n == &snap_id || !n.starts_with("snap_") || {
                    // Another test's snapshot would not be this sandbox's.
                    let m: Value = serde_json::from_slice(
                        &std::fs::read(s.data.join("images").join(n).join("image.json")).unwrap_or_default(),
                    )
                    .unwrap_or(Value::Null);
                    m["source"] == id.as_str()
                }
            })
            .collect();
        v.sort();
        v
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    while images() != vec![snap_id.clone()] {
        assert!(Instant::now() < deadline, "images left: {:?}", images());
        std::thread::sleep(Duration::from_millis(200));
    }
    let (status, _) = s.call("DELETE", &format!("/v1/snapshots/{snap_id}"), None);
    assert_eq!(status, 204);
    let (status, _) = s.call("GET", &format!("/v1/snapshots/{snap_id}"), None);
    assert_eq!(status, 404);
    assert!(images().is_empty(), "{:?}", images());
    assert_eq!(still_counting(&from_snapshot), "parent\ncounting\n");
    for sb in children.iter().chain([&from_snapshot, &id]) {
        s.delete(sb);
    }
}

/// A raw HTTP/1.1 GET with our own Host header (as wildcard DNS would deliver it).
fn get_with_host(s: &Server, host: &str, path: &str, headers: &[(&str, &str)]) -> (u16, String) {
    use std::io::{Read, Write};
    let addr = s.url.trim_start_matches("http://");
    let mut conn = std::net::TcpStream::connect(addr).unwrap();
    conn.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let mut req = format!("GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n");
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    conn.write_all(req.as_bytes()).unwrap();
    let mut raw = Vec::new();
    let _ = conn.read_to_end(&mut raw);
    let text = String::from_utf8_lossy(&raw).to_string();
    let status = text.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    (status, body)
}

fn ports_and_envd_are_reachable_by_host_name() {
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
fn credentials_never_reach_a_sandbox_port() {
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

fn e2b_unsupported_create_options_are_refused_by_name() {
    let s = server();
    let key = [("X-API-KEY", s.key.as_str())];
    let cases = [
        (
            json!({ "templateID": "base", "volumeMounts": [{ "name": "v", "path": "/mnt" }] }),
            "volumeMounts",
        ),
        (json!({ "templateID": "base", "iam": { "tokens": {} } }), "iam"),
        (json!({ "templateID": "base", "mcp": { "exa": {} } }), "mcp"),
        (
            json!({ "templateID": "base", "network": { "allowPublicTraffic": true } }),
            "allowPublicTraffic",
        ),
        (
            json!({ "templateID": "base", "network": { "allowOut": ["198.51.100.7"] } }),
            "allowOut",
        ),
        (json!({ "templateID": "base", "colour": "red" }), "colour"),
        (json!({ "templateID": "team/name" }), "team/name"),
    ];
    for (body, needle) in cases {
        let (status, err) = s.call_with("POST", "/sandboxes", Some(body.clone()), None, &key);
        assert_eq!((status, err["code"].as_i64()), (400, Some(400)), "{body} -> {err}");
        assert!(err["message"].as_str().unwrap().contains(needle), "{body} -> {err}");
    }
    let (status, err) = s.call_with(
        "POST",
        "/sandboxes",
        Some(json!({ "templateID": "base" })),
        None,
        &[("X-API-KEY", "nope")],
    );
    assert_eq!((status, err["code"].as_i64()), (401, Some(401)), "{err}");
}

fn idempotent_create_returns_the_same_operation() {
    let s = server();
    let body = json!({ "template": "seed", "timeout": "5m" });
    let key = format!("idem-{}", free_port());
    let (st1, a) = s.call_with(
        "POST",
        "/v1/sandboxes",
        Some(body.clone()),
        Some(&s.key),
        &[("Idempotency-Key", &key)],
    );
    let (st2, b) = s.call_with(
        "POST",
        "/v1/sandboxes",
        Some(body),
        Some(&s.key),
        &[("Idempotency-Key", &key)],
    );
    assert_eq!((st1, st2), (202, 202));
    assert_eq!(a["operation"]["id"], b["operation"]["id"]);
    assert_eq!(a["sandbox_id"], b["sandbox_id"]);
    s.wait_op(a["operation"]["id"].as_str().unwrap());
    s.delete(a["sandbox_id"].as_str().unwrap());
}

fn timeout_expiry_deletes_the_sandbox() {
    let s = server();
    let id = s.create(json!({ "template": "seed", "timeout": "2s" }));
    s.wait_expired(&id);
    assert!(!s.data.join("sandboxes").join(&id).exists());
}

fn list_filters_by_state_and_metadata_with_paging() {
    let s = server();
    let id = shared();
    let (_, all) = s.call("GET", "/v1/sandboxes?metadata.suite=api", None);
    let ids: Vec<&str> = all["sandboxes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x["id"].as_str().unwrap())
        .collect();
    assert!(ids.contains(&id), "{all}");
    let (_, none) = s.call("GET", "/v1/sandboxes?metadata.suite=nothing-matches", None);
    assert_eq!(none["sandboxes"].as_array().unwrap().len(), 0);
    let (_, page) = s.call("GET", "/v1/sandboxes?state=deleted&limit=1", None);
    assert!(page["sandboxes"].as_array().unwrap().len() <= 1);
    if let Some(token) = page["next_page_token"].as_str() {
        let (status, next) = s.call(
            "GET",
            &format!("/v1/sandboxes?state=deleted&limit=1&page_token={token}"),
            None,
        );
        assert_eq!(status, 200);
        assert_ne!(next["sandboxes"][0]["id"], page["sandboxes"][0]["id"]);
    }
    let (status, err) = s.call("GET", "/v1/sandboxes?state=sideways", None);
    assert_eq!((status, err["code"].as_str()), (422, Some("invalid_argument")));
}

fn bad_input_gets_clear_4xx_errors() {
    let s = server();
    let cases: Vec<(Value, u16, &str, &str)> = vec![
        (json!({ "template": "nope" }), 404, "template_not_found", "nope"),
        (json!({ "template": 7 }), 422, "invalid_argument", "template"),
        (
            json!({ "template": "seed", "resources": { "vcpu": -1 } }),
            422,
            "invalid_argument",
            "vcpu",
        ),
        (
            json!({ "template": "seed", "resources": { "vcpu": 0 } }),
            422,
            "invalid_resources",
            "vcpu",
        ),
        (
            json!({ "template": "seed", "resources": { "memory_mib": 16 } }),
            422,
            "invalid_resources",
            "memory_mib",
        ),
        (
            json!({ "template": "seed", "resources": { "disk_mib": 1 } }),
            422,
            "invalid_resources",
            "disk_mib",
        ),
        (
            json!({ "template": "seed", "timeout": "soon" }),
            422,
            "invalid_argument",
            "timeout",
        ),
        (
            json!({ "template": "seed", "timeout": "48h" }),
            422,
            "invalid_argument",
            "timeout",
        ),
        (
            json!({ "template": "seed", "runtime": "fc" }),
            422,
            "invalid_argument",
            "fc",
        ),
        (
            json!({ "template": "seed", "colour": "red" }),
            422,
            "invalid_argument",
            "colour",
        ),
        (
            json!({ "template": "team/name" }),
            404,
            "template_not_found",
            "team/name",
        ),
    ];
    for (body, status, code, needle) in cases {
        let (got, err) = s.call("POST", "/v1/sandboxes", Some(body.clone()));
        assert_eq!((got, err["code"].as_str()), (status, Some(code)), "{body} -> {err}");
        assert!(err["message"].as_str().unwrap().contains(needle), "{body} -> {err}");
    }
    let (status, err) = s.raw_post("/v1/sandboxes", "{\"template\": ");
    assert_eq!((status, err["code"].as_str()), (400, Some("bad_request")));
    let (status, err) = s.raw_post("/v1/sandboxes", "[1, 2]");
    assert_eq!(status, 422, "{err}");
    let id = shared();
    let (status, err) = s.call(
        "POST",
        &format!("/v1/sandboxes/{id}/sessions"),
        Some(json!({ "argv": [] })),
    );
    assert_eq!((status, err["code"].as_str()), (422, Some("invalid_argument")));
    let (status, err) = s.call(
        "POST",
        &format!("/v1/sandboxes/{id}/sessions"),
        Some(json!({ "argv": ["/no/such/program"] })),
    );
    assert_eq!((status, err["code"].as_str()), (400, Some("invalid_argument")), "{err}");
    let (status, err) = s.call(
        "POST",
        &format!("/v1/sandboxes/{id}/sessions"),
        Some(json!({ "argv": ["true"], "user": "ghost" })),
    );
    assert_eq!(status, 400, "{err}");
}

fn unknown_ids_are_404_and_keys_are_checked() {
    let s = server();
    for (path, code) in [
        ("/v1/sandboxes/0000000000000000dead", "sandbox_not_found"),
        ("/v1/operations/op_nope", "operation_not_found"),
        ("/v1/templates/nope", "template_not_found"),
        ("/v1/nothing-here", "route_not_found"),
    ] {
        let (status, err) = s.call("GET", path, None);
        assert_eq!((status, err["code"].as_str()), (404, Some(code)), "{path}: {err}");
        assert!(err["message"].is_string());
    }
    let id = shared();
    let (status, err) = s.call("GET", &format!("/v1/sandboxes/{id}/sessions/ses_nope"), None);
    assert_eq!(
        (status, err["code"].as_str()),
        (404, Some("session_not_found")),
        "{err}"
    );
    let (status, err) = s.call_with("GET", "/v1/sandboxes", None, None, &[]);
    assert_eq!((status, err["code"].as_str()), (401, Some("unauthorized")));
    let (status, _) = s.call_with("GET", "/v1/sandboxes", None, Some("ak_wrong"), &[]);
    assert_eq!(status, 401);
    let (status, sys) = s.call("GET", "/v1/system", None);
    assert_eq!(status, 200);
    assert!(["kvm", "tcg"].contains(&sys["accel"].as_str().unwrap()));
    let (_, t) = s.call("GET", "/v1/templates/seed", None);
    assert!(t["digest"].as_str().unwrap().starts_with("sha256:"));
    let (_, doc) = s.call_with("GET", "/openapi-m1.json", None, None, &[]);
    assert!(doc["openapi"].as_str().unwrap().starts_with("3.1"));
    assert!(doc["paths"]["/v1/sandboxes/{id}/sessions/{sid}/stream"].is_object());
}

fn cli_run_exec_and_python_example() {
    let s = server();
    let env = [("AIRLOCK_URL", s.url.as_str()), ("AIRLOCK_API_KEY", s.key.as_str())];
    let out = Command::new(BIN)
        .args(["run", "--", "sh", "-c", "echo from-cli; exit 4"])
        .envs(env)
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), "from-cli\n");
    assert_eq!(out.status.code(), Some(4));
    let out = Command::new(BIN)
        .args(["exec", shared(), "--user", "root", "--", "id", "-un"])
        .envs(env)
        .output()
        .unwrap();
    assert_eq!(
        (String::from_utf8_lossy(&out.stdout).as_ref(), out.status.code()),
        ("root\n", Some(0))
    );
    let out = Command::new(BIN)
        .args(["sandbox", "get", "0000000000000000dead"])
        .envs(env)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("HTTP 404"));
    let example = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/first_sandbox.py");
    let out = Command::new("python3").arg(example).envs(env).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("hello from airlock") && stdout.trim_end().ends_with("ok"),
        "{stdout}"
    );
}

/// Through the server: once the shape's base snapshot is built (the first create of it asks for
/// one), creates report `restore`, and each restored sandbox is itself: its id as hostname, its
/// own machine id, and none of another's files.
fn creates_restore_from_a_base_snapshot_through_the_api() {
    let s = server();
    let body =
        json!({ "template": "seed", "timeout": "10m", "resources": {"vcpu": 1, "memory_mib": 384, "disk_mib": 1536} });
    let deadline = std::time::Instant::now() + Duration::from_secs(300);
    let mut restored = Vec::new();
    while restored.len() < 2 {
        assert!(std::time::Instant::now() < deadline, "no create restored within 300 s");
        let id = s.create(body.clone());
        let (_, sb) = s.call("GET", &format!("/v1/sandboxes/{id}"), None);
        if sb["start"]["from"] == "restore" {
            restored.push(id);
        } else {
            assert_eq!(sb["start"]["from"], "boot", "{sb}");
            s.delete(&id);
            std::thread::sleep(Duration::from_secs(2));
        }
    }
    let mut machine_ids = Vec::new();
    for id in &restored {
        let sid = s.session(
            id,
            json!({ "argv": ["sh", "-c", "hostname; cat /etc/machine-id; ls /tmp"] }),
        );
        let out = decode(&s.events(id, &sid, None, None), "stdout");
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines.first().copied(), Some(id.as_str()), "{out}");
        assert!(
            !lines.iter().any(|l| l.starts_with("written-by-")),
            "another clone's file: {out}"
        );
        machine_ids.push(lines[1].to_string());
        put_file(s, id, &format!("/tmp/written-by-{id}"), b"mine");
    }
    assert_ne!(machine_ids[0], machine_ids[1]);
    for id in &restored {
        s.delete(id);
    }
}

/// `serve` with TLS files it cannot use stops at once, naming the files; half a flag set is a
/// usage error naming the missing flag.
fn serve_refuses_unusable_tls_files() {
    let dir = tempfile::tempdir().unwrap();
    let (cert, key) = (dir.path().join("cert.pem"), dir.path().join("key.pem"));
    std::fs::write(
        &cert,
        "-----BEGIN CERTIFICATE-----\nnot base64 at all\n-----END CERTIFICATE-----\n",
    )
    .unwrap();
    std::fs::write(&key, "").unwrap();
    let data = test_data_dir();
    let run = |args: &[&str]| {
        let mut child = Command::new(BIN)
            .args(["--data-dir", data.to_str().unwrap(), "serve", "--listen"])
            .arg(format!("127.0.0.1:{}", free_port()))
            .args(args)
            .stderr(std::process::Stdio::piped())
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while child.try_wait().unwrap().is_none() {
            if std::time::Instant::now() > deadline {
                let _ = child.kill();
                panic!("serve kept running with {args:?}");
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        let out = child.wait_with_output().unwrap();
        (out.status.code(), String::from_utf8_lossy(&out.stderr).to_string())
    };
    let tls_listen = format!("127.0.0.1:{}", free_port());
    let (code, stderr) = run(&[
        "--tls-listen",
        &tls_listen,
        "--tls-cert",
        cert.to_str().unwrap(),
        "--tls-key",
        key.to_str().unwrap(),
    ]);
    assert_ne!(code, Some(0));
    assert!(stderr.contains(&format!("--tls-cert {}", cert.display())), "{stderr}");
    let (code, stderr) = run(&["--tls-listen", &tls_listen, "--tls-cert", cert.to_str().unwrap()]);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("--tls-key"), "{stderr}");
}

/// A first start without `AIRLOCK_CONSOLE_PASSWORD` and without a terminal (its output is a log
/// file) leaves a generated password in `<data-dir>/console-password` (0600) and names the file
/// in the log, never the password; it signs in (through the CLI), no usual default does, a
/// restart writes nothing, and the password is nowhere else in the data dir.
fn a_first_start_prints_a_generated_console_password_once() {
    use std::os::unix::fs::PermissionsExt;
    let data = own_data_dir("console");
    let mut first = Server::start_console(&data, &[], None);
    let log_of = |s: &Server| {
        std::fs::read_to_string(data.join(format!("serve-{}.log", s.url.rsplit(':').next().unwrap()))).unwrap()
    };
    let text = log_of(&first);
    let file = data.join("console-password");
    let password = std::fs::read_to_string(&file)
        .unwrap_or_else(|e| panic!("{}: {e}; the log: {text}", file.display()))
        .trim()
        .to_string();
    assert!(password.len() >= 20, "{password}");
    assert_eq!(std::fs::metadata(&file).unwrap().permissions().mode() & 0o777, 0o600);
    assert!(!text.contains(&password), "the password is in the log: {text}");
    assert!(
        text.contains(&file.display().to_string()),
        "the log names the file: {text}"
    );
    let marker = "generated password";

    let login = |s: &Server, password: &str| {
        ureq::post(&format!("{}/v1/admin/login", s.url))
            .send_json(json!({"username": "root@local", "password": password}))
            .map(|r| r.status())
            .unwrap_or_else(|e| match e {
                ureq::Error::Status(code, _) => code,
                other => panic!("{other}"),
            })
    };
    for guess in ["", "admin", "password", "airlock"] {
        assert_eq!(login(&first, guess), 401, "{guess:?} signs in");
    }
    let cli_login = |s: &Server, password: &str| {
        Command::new(BIN)
            .arg("--data-dir")
            .arg(&data)
            .arg("login")
            .env("AIRLOCK_URL", &s.url)
            .env("AIRLOCK_CONSOLE_PASSWORD", password)
            .stdin(std::process::Stdio::null())
            .output()
            .unwrap()
    };
    let out = cli_login(&first, &password);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // The token `login` stored administers.
    let out = Command::new(BIN)
        .arg("--data-dir")
        .arg(&data)
        .args(["tenant", "ls"])
        .env("AIRLOCK_URL", &first.url)
        .env_remove("AIRLOCK_ADMIN_TOKEN")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("default"));
    first.stop();

    // A second start keeps the account and hands out no password.
    let written = std::fs::metadata(&file).unwrap().modified().unwrap();
    let mut second = Server::start_console(&data, &[], None);
    let again = log_of(&second);
    assert!(!again.contains(marker) && !again.contains(&password), "{again}");
    assert_eq!(
        std::fs::metadata(&file).unwrap().modified().unwrap(),
        written,
        "written once"
    );
    assert!(cli_login(&second, &password).status.success());
    second.stop();
    // Only its hash is kept: no file the server wrote holds the password (the logs, which were
    // just checked, and the file handed over aside; the templates are the shared dir's).
    for entry in walk(&data) {
        if entry.extension().is_some_and(|e| e == "log") || entry.starts_with(data.join("blobs")) || entry == file {
            continue;
        }
        let bytes = std::fs::read(&entry).unwrap_or_default();
        assert!(
            !bytes.windows(password.len()).any(|w| w == password.as_bytes()),
            "{} holds the password",
            entry.display()
        );
    }
    let _ = std::fs::remove_dir_all(&data);
}

fn walk(dir: &std::path::Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let path = entry.path();
        if path.is_dir() {
            files.extend(walk(&path));
        } else if path.is_file() {
            files.push(path);
        }
    }
    files
}

/// An empty data dir of its own (`<shared>-<suffix>`) with the shared one's templates, as hard
/// links (templates are immutable), so a server on it starts without building `seed`.
fn own_data_dir(suffix: &str) -> PathBuf {
    let data = PathBuf::from(format!("{}-{suffix}", test_data_dir().display()));
    end_vms_left_in(&data);
    let _ = std::fs::remove_dir_all(&data);
    std::fs::create_dir_all(&data).unwrap();
    server(); // the shared data dir has the template built
    let src = test_data_dir();
    let ok = Command::new("cp")
        .arg("-al")
        .arg(src.join("blobs"))
        .arg(src.join("templates"))
        .arg(&data)
        .status()
        .unwrap();
    assert!(ok.success());
    let _ = std::fs::copy(src.join("accel.json"), data.join("accel.json"));
    data
}

/// End the VMs a failed earlier run left in `data` (VMs outlive their server by design, and the
/// dir is about to go): each by the pid it recorded, if that process still names the dir.
fn end_vms_left_in(data: &Path) {
    for dir in std::fs::read_dir(data.join("sandboxes"))
        .into_iter()
        .flatten()
        .flatten()
    {
        let Some(pid) = std::fs::read_to_string(dir.path().join("vmm.pid"))
            .ok()
            .and_then(|p| p.trim().parse::<i32>().ok())
        else {
            continue;
        };
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        if pid > 1 && String::from_utf8_lossy(&cmdline).contains(&*dir.path().to_string_lossy()) {
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
    }
}

/// Restart safety on a data dir of its own (the blobs are hard links: templates are immutable).
/// A sandbox suspended before the crash resumes after it with its files and processes.
fn server_killed_mid_create_recovers_and_reattaches() {
    let data = own_data_dir("restart");

    let mut s1 = Server::start(&data);
    let running = s1.create(json!({ "template": "seed", "timeout": "30m" }));
    let held = s1.create(json!({ "template": "seed", "timeout": "30m" }));
    let (status, r) = s1.call(
        "PUT",
        &format!("/v1/sandboxes/{held}/files?path=/home/user/kept.txt"),
        Some(json!("kept")),
    );
    assert!((200..300).contains(&status), "{r}");
    let across = s1.session(&held, json!({ "argv": ["sh", "-c", "sleep 3; echo after-resume"] }));
    let qemu_of = |id: &str| -> Option<u64> {
        let vm: Value =
            serde_json::from_slice(&std::fs::read(data.join("sandboxes").join(id).join("vm.json")).ok()?).ok()?;
        vm["pid"]
            .as_u64()
            .filter(|pid| Path::new(&format!("/proc/{pid}/cmdline")).exists())
    };
    let held_qemu = qemu_of(&held).expect("its VM runs");
    let sb = s1.change(&held, "suspend");
    assert_eq!(sb["state"], "suspended", "{sb}");
    assert!(
        !Path::new(&format!("/proc/{held_qemu}")).exists(),
        "a suspended sandbox's QEMU is gone"
    );
    let (status, err) = s1.call(
        "POST",
        &format!("/v1/sandboxes/{held}/sessions"),
        Some(json!({ "argv": ["true"] })),
    );
    assert_eq!((status, err["code"].as_str()), (409, Some("invalid_state")), "{err}");
    let (_, r) = s1.call(
        "POST",
        "/v1/sandboxes",
        Some(json!({ "template": "seed", "timeout": "30m" })),
    );
    let op_id = r["operation"]["id"].as_str().unwrap().to_string();
    std::thread::sleep(Duration::from_millis(1200));
    s1.kill9();

    let mut s2 = Server::start(&data);
    let op = s2.wait_op(&op_id);
    assert!(op["state"] == "succeeded" || op["state"] == "failed", "{op}");
    if op["state"] == "failed" {
        assert_eq!(op["error"]["code"], "interrupted");
    }
    // The list matches the VMs that really exist.
    let (_, list) = s2.call("GET", "/v1/sandboxes?state=running", None);
    let mut listed: Vec<String> = list["sandboxes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x["id"].as_str().unwrap().to_string())
        .collect();
    let mut vms: Vec<String> = std::fs::read_dir(data.join("sandboxes"))
        .unwrap()
        .flatten()
        .filter(|e| {
            let vm: Value = serde_json::from_slice(&std::fs::read(e.path().join("vm.json")).unwrap_or_default())
                .unwrap_or(Value::Null);
            vm["pid"]
                .as_u64()
                .is_some_and(|pid| Path::new(&format!("/proc/{pid}/cmdline")).exists())
        })
        .map(|e| e.file_name().to_string_lossy().to_string())
        .collect();
    listed.sort();
    vms.sort();
    assert_eq!(listed, vms);
    assert!(listed.contains(&running), "the running sandbox survived the crash");

    // The VM that ran before the crash is re-attached and usable.
    let sid = s2.session(&running, json!({ "argv": ["echo", "after restart"] }));
    assert_eq!(
        decode(&s2.events(&running, &sid, None, None), "stdout"),
        "after restart\n"
    );
    // The suspended one is still suspended, and resumes as it was: its file, and the command
    // started before the suspend finishes after the resume, on the same session.
    let (_, sb) = s2.call("GET", &format!("/v1/sandboxes/{held}"), None);
    assert_eq!(sb["state"], "suspended", "{sb}");
    let sb = s2.change(&held, "resume");
    assert_eq!(sb["state"], "running", "{sb}");
    assert_eq!(
        decode(&s2.events(&held, &across, None, None), "stdout"),
        "after-resume\n"
    );
    let (status, body) = s2.call(
        "GET",
        &format!("/v1/sandboxes/{held}/files?path=/home/user/kept.txt"),
        None,
    );
    assert_eq!((status, body), (200, json!("kept")));
    listed.push(held);
    for id in listed {
        s2.delete(&id);
    }
    s2.stop();
    let _ = std::fs::remove_dir_all(&data);
}

/// A warm pool keeps VMs ready; a create claims one (`start.from: pool`), it is fresh (nothing a
/// sandbox before it wrote), the pool refills, the admin resizes it, and a stopped server leaves
/// no pool VM behind.
fn warm_pool_claims_are_fresh_and_refilled() {
    let data = own_data_dir("pool");
    // A first start (no cached verdict) probes KVM with a VM before the egress side is up: a
    // sealed one, which waits for nothing (it once waited a minute for the core, then failed).
    std::fs::remove_file(data.join("accel.json")).unwrap();
    let mut s = Server::start_with(&data, &["--warm-pool", "seed=2"]);
    let log = std::fs::read_to_string(&s.log).unwrap();
    assert!(log.contains("probed in") && !log.contains("not ready in time"), "{log}");
    let pool = |s: &Server| {
        let (_, system) = s.admin_call("GET", "/v1/admin/system", None);
        system["pools"][0].clone()
    };
    let wait_ready = |s: &Server, n: u64| {
        let deadline = Instant::now() + Duration::from_secs(180);
        while pool(s)["ready"].as_u64() != Some(n) {
            assert!(Instant::now() < deadline, "pool not at {n}: {}", pool(s));
            std::thread::sleep(Duration::from_millis(200));
        }
    };
    wait_ready(&s, 2);
    assert_eq!(pool(&s)["template"], "seed");
    let first = s.create(json!({ "template": "seed" }));
    let (_, sb) = s.call("GET", &format!("/v1/sandboxes/{first}"), None);
    assert_eq!(sb["start"]["from"], "pool", "{sb}");
    let probe = |s: &Server, id: &str, script: &str| {
        let sid = s.session(id, json!({ "argv": ["sh", "-c", script] }));
        decode(&s.events(id, &sid, None, None), "stdout")
    };
    assert_eq!(probe(&s, &first, "hostname"), format!("{first}\n"));
    assert_eq!(probe(&s, &first, "echo used > /home/user/used.txt; echo ok"), "ok\n");
    s.delete(&first);
    // Refilled; every later claim is a VM nobody used.
    wait_ready(&s, 2);
    let (a, b) = (
        s.create(json!({ "template": "seed" })),
        s.create(json!({ "template": "seed" })),
    );
    let mut seen = vec![first.clone()];
    for id in [&a, &b] {
        let (_, sb) = s.call("GET", &format!("/v1/sandboxes/{id}"), None);
        assert_eq!(sb["start"]["from"], "pool", "{sb}");
        assert_eq!(
            probe(&s, id, "cat /home/user/used.txt 2>/dev/null || echo fresh"),
            "fresh\n"
        );
        assert!(!seen.contains(id));
        seen.push(id.to_string());
    }
    assert!(pool(&s)["hits"].as_u64().unwrap() >= 3, "{}", pool(&s));
    // The admin empties it: its VMs go.
    let login = json!({ "username": "root@local", "password": CONSOLE_PASSWORD });
    let (status, signed_in) = s.call_with("POST", "/v1/admin/login", Some(login), None, &[]);
    assert_eq!(status, 200, "{signed_in}");
    let token = signed_in["token"].as_str().unwrap().to_string();
    let (status, resized) = s.call_with(
        "PUT",
        "/v1/admin/pools",
        Some(json!({ "template": "seed", "size": 0 })),
        Some(&token),
        &[],
    );
    assert_eq!(status, 200, "{resized}");
    wait_ready(&s, 0);
    let pool_vms = || {
        std::fs::read_dir(data.join("sandboxes"))
            .unwrap()
            .flatten()
            .filter(|e| e.path().join("pool.json").exists())
            .count()
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    while pool_vms() != 0 {
        assert!(Instant::now() < deadline, "pool VMs left after the pool was emptied");
        std::thread::sleep(Duration::from_millis(200));
    }
    // Refilled again (by the CLI this time), then the server stops: its pool VMs go with it.
    let set = s.cli_ok(&["pool", "set", "seed", "1"]);
    assert_eq!(
        (set["template"].as_str(), set["size"].as_u64()),
        (Some("seed"), Some(1)),
        "{set}"
    );
    let refused = s.cli(&["pool", "set", "no-such-template", "1"]);
    assert!(!refused.status.success());
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("no-such-template"),
        "{refused:?}"
    );
    wait_ready(&s, 1);
    let listed = s.cli_ok(&["pool", "ls"]);
    assert_eq!(
        (listed[0]["template"].as_str(), listed[0]["ready"].as_u64()),
        (Some("seed"), Some(1)),
        "{listed}"
    );
    let (status, _) = s.call("GET", "/v1/admin/pools", None);
    assert_eq!(status, 403, "a tenant's key lists no pools through the admin API");
    for id in [&a, &b] {
        s.delete(id);
    }
    s.stop();
    assert_eq!(pool_vms(), 0, "a stopped server leaves no pool VM");
    let _ = std::fs::remove_dir_all(&data);
}

/// Every `/v1/sandboxes/{id}...` route answers a well-formed but unknown id the same way.
fn missing_sandbox_has_one_code_on_every_route() {
    let s = server();
    let id = "00000000000000c0ffee";
    let sid = "ses_0000000000000000";
    let b = |p: &str| format!("/v1/sandboxes/{id}{p}");
    let routes: Vec<(&str, String, Option<Value>)> = vec![
        ("GET", b(""), None),
        ("DELETE", b(""), None),
        ("POST", b("/pause"), None),
        ("POST", b("/resume"), None),
        ("GET", b("/sessions"), None),
        ("POST", b("/sessions"), Some(json!({ "argv": ["true"] }))),
        ("GET", b(&format!("/sessions/{sid}")), None),
        ("GET", b(&format!("/sessions/{sid}/stream")), None),
        (
            "POST",
            b(&format!("/sessions/{sid}/stdin")),
            Some(json!({ "data": "", "eof": true })),
        ),
        (
            "POST",
            b(&format!("/sessions/{sid}/signal")),
            Some(json!({ "signal": "SIGTERM" })),
        ),
        (
            "POST",
            b(&format!("/sessions/{sid}/resize")),
            Some(json!({ "cols": 80, "rows": 24 })),
        ),
        ("GET", b("/files?path=/tmp/x"), None),
        ("PUT", b("/files?path=/tmp/x"), Some(json!("bytes"))),
        ("DELETE", b("/files?path=/tmp/x"), None),
        ("GET", b("/files/list?path=/tmp"), None),
    ];
    let mut wrong = Vec::new();
    for (method, path, body) in routes {
        let (status, err) = s.call(method, &path, body);
        if (status, err["code"].as_str()) != (404, Some("sandbox_not_found")) || !err["message"].is_string() {
            wrong.push(format!("{method} {path} -> {status} {err}"));
        }
    }
    assert!(wrong.is_empty(), "not 404 sandbox_not_found:\n{}", wrong.join("\n"));
}

/// One check of environment variable names behind both doors: same refusal, same reason.
fn env_names_are_refused_alike_by_both_doors() {
    let s = server();
    let (status, native) = s.call(
        "POST",
        "/v1/sandboxes",
        Some(json!({ "template": "seed", "env": { "1BAD": "x" } })),
    );
    assert_eq!(
        (status, native["code"].as_str()),
        (422, Some("invalid_argument")),
        "{native}"
    );
    let message = native["message"].as_str().unwrap();
    let reason = message
        .strip_prefix("env: ")
        .unwrap_or_else(|| panic!("message is not `env: <reason>`: {message}"));
    assert!(reason.contains("1BAD"), "{message}");
    let (status, e2b) = s.call_with(
        "POST",
        "/sandboxes",
        Some(json!({ "templateID": "base", "envVars": { "1BAD": "x" } })),
        None,
        &[("X-API-KEY", &s.key)],
    );
    assert_eq!((status, e2b["code"].as_i64()), (400, Some(400)), "{e2b}");
    assert!(
        e2b["message"].as_str().unwrap().contains(reason),
        "E2B message {e2b} lacks the native reason {reason:?}"
    );
}

/// A VM that stops on its own (killed from outside, powered off from inside) fails its sandbox.
fn a_vm_that_dies_is_failed_and_frees_its_slot() {
    let s = server();
    // Killed from outside: SIGKILL to this sandbox's QEMU (a child of our server), nothing else.
    let id = s.create(json!({ "template": "seed", "timeout": "10m" }));
    let pid = qemu_pid(s, &id);
    assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0);
    let took = wait_state(s, &id, "failed", Duration::from_secs(10))
        .unwrap_or_else(|sb| panic!("not failed 10 s after kill -9 of its QEMU: {sb}"));
    println!("kill -9: failed after {took:?}");
    assert!(!listed_by_default(s, &id), "a failed sandbox is not live");
    let (status, err) = s.call(
        "POST",
        &format!("/v1/sandboxes/{id}/sessions"),
        Some(json!({ "argv": ["true"] })),
    );
    assert_eq!((status, err["code"].as_str()), (409, Some("invalid_state")), "{err}");
    s.delete(&id);

    // Powered off from inside, as root (the seed image has no `poweroff`: the kernel's sysrq).
    let id = s.create(json!({ "template": "seed", "timeout": "10m" }));
    let (status, r) = s.call(
        "POST",
        &format!("/v1/sandboxes/{id}/sessions"),
        Some(json!({ "argv": ["sh", "-c", "echo o > /proc/sysrq-trigger"], "user": "root" })),
    );
    // The VM may vanish before the agent answers; either way it must end up failed.
    println!("power-off session: {status} {r}");
    let took = wait_state(s, &id, "failed", Duration::from_secs(10))
        .unwrap_or_else(|sb| panic!("not failed 10 s after a power-off from inside ({status} {r}): {sb}"));
    println!("power-off from inside: failed after {took:?}");
    assert!(!listed_by_default(s, &id), "a failed sandbox is not live");
    s.delete(&id);
}

/// A server on a data dir of its own; dropping it deletes what it holds, stops it, removes the dir.
struct OwnServer {
    s: Server,
    data: PathBuf,
}

impl OwnServer {
    /// The templates are hard links to the shared data dir's (templates are immutable).
    fn start(suffix: &str, extra: &[&str]) -> OwnServer {
        let data = PathBuf::from(format!("{}-{suffix}", test_data_dir().display()));
        let _ = std::fs::remove_dir_all(&data);
        std::fs::create_dir_all(&data).unwrap();
        server(); // the shared data dir has the template built
        let src = test_data_dir();
        let ok = Command::new("cp")
            .arg("-al")
            .arg(src.join("blobs"))
            .arg(src.join("templates"))
            .arg(&data)
            .status()
            .unwrap();
        assert!(ok.success());
        let _ = std::fs::copy(src.join("accel.json"), data.join("accel.json"));
        OwnServer {
            s: Server::start_with(&data, extra),
            data,
        }
    }
}

impl Drop for OwnServer {
    fn drop(&mut self) {
        let s = &self.s;
        for q in ["limit=100", "state=failed&limit=100"] {
            let (_, list) = s.call("GET", &format!("/v1/sandboxes?{q}"), None);
            for sb in list["sandboxes"].as_array().into_iter().flatten() {
                let (_, r) = s.call(
                    "DELETE",
                    &format!("/v1/sandboxes/{}", sb["id"].as_str().unwrap_or("")),
                    None,
                );
                if let Some(op) = r["operation"]["id"].as_str() {
                    let deadline = Instant::now() + Duration::from_secs(60);
                    while Instant::now() < deadline {
                        let (_, o) = s.call("GET", &format!("/v1/operations/{op}"), None);
                        if o["state"] == "succeeded" || o["state"] == "failed" {
                            break;
                        }
                        std::thread::sleep(Duration::from_millis(100));
                    }
                }
            }
        }
        self.s.stop();
        let _ = std::fs::remove_dir_all(&self.data);
    }
}

/// `--max-sandboxes 2`, ten concurrent creates over both doors: exactly two are admitted; a VM
/// that dies gives its slot back.
fn quota_is_exact_under_concurrent_creates_over_both_doors() {
    let own = OwnServer::start("quota", &["--max-sandboxes", "2"]);
    let s = &own.s;
    let barrier = std::sync::Barrier::new(10);
    let started = Instant::now();
    let results: Vec<(&str, u16, Value)> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..10)
            .map(|i| {
                let barrier = &barrier;
                scope.spawn(move || {
                    barrier.wait();
                    if i % 2 == 0 {
                        let (st, r) = s.call(
                            "POST",
                            "/v1/sandboxes",
                            Some(json!({ "template": "seed", "timeout": "5m" })),
                        );
                        ("native", st, r)
                    } else {
                        let (st, r) = s.call_with(
                            "POST",
                            "/sandboxes",
                            Some(json!({ "templateID": "base", "timeout": 300 })),
                            None,
                            &[("X-API-KEY", &s.key)],
                        );
                        ("e2b", st, r)
                    }
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    println!("ten concurrent creates answered within {:?}", started.elapsed());
    let summary: Vec<String> = results.iter().map(|(d, st, r)| format!("{d} {st} {r}")).collect();
    let summary = summary.join("\n");
    for (door, st, r) in &results {
        if *door == "native" && *st == 202 {
            assert_eq!(
                s.wait_op(r["operation"]["id"].as_str().unwrap())["state"],
                "succeeded",
                "{r}"
            );
        }
    }
    let admitted = results
        .iter()
        .filter(|(door, st, _)| (*door == "native" && *st == 202) || (*door == "e2b" && *st == 201))
        .count();
    let refused = results.iter().filter(|(_, st, _)| *st == 429).count();
    let by_door: Vec<String> = results.iter().map(|(d, st, _)| format!("{d} {st}")).collect();
    println!("answers: {}", by_door.join(", "));
    assert_eq!((admitted, refused), (2, 8), "{summary}");
    for (door, _, r) in results.iter().filter(|(_, st, _)| *st == 429) {
        let code = if *door == "native" {
            json!("quota_exceeded")
        } else {
            json!(429)
        };
        assert_eq!(r["code"], code, "{door}: {r}");
    }
    let (_, list) = s.call("GET", "/v1/sandboxes?limit=100", None);
    let live: Vec<String> = list["sandboxes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x["id"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(live.len(), 2, "live after the burst: {live:?}\n{summary}");

    // At the limit; one VM dies on its own: its slot is free again, and only that one.
    let pid = qemu_pid(s, &live[0]);
    assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0);
    let took = wait_state(s, &live[0], "failed", Duration::from_secs(10))
        .unwrap_or_else(|sb| panic!("not failed 10 s after kill -9 of its QEMU: {sb}"));
    println!("quota server: failed {took:?} after kill -9");
    s.create(json!({ "template": "seed", "timeout": "5m" }));
    let (status, err) = s.call("POST", "/v1/sandboxes", Some(json!({ "template": "seed" })));
    assert_eq!((status, err["code"].as_str()), (429, Some("quota_exceeded")), "{err}");
    drop(own);
}

/// The admin commands, through the API as `root@local`: tenants, keys (named, listed, revoked
/// with immediate effect), quotas, egress policies; a tenant key can't administer; the audit log
/// has a row for each action; no secret reaches the server's log.
fn admin_cli_manages_tenants_keys_quotas_and_policies() {
    let s = server();
    let tenant = format!("acme-{}", std::process::id());
    let created = s.cli_ok(&["tenant", "create", &tenant]);
    assert_eq!(created["name"], tenant.as_str(), "{created}");
    let again = s.cli(&["tenant", "create", &tenant]);
    assert!(!again.status.success() && String::from_utf8_lossy(&again.stderr).contains("exists"));
    let listed = s.cli_ok(&["tenant", "ls"]);
    assert!(listed["tenants"]
        .as_array()
        .unwrap()
        .iter()
        .any(|t| t["name"] == tenant.as_str()));

    // A named key, shown once; it works, and `key ls` shows it without the secret.
    let key = s.cli_ok(&["key", "create", "--tenant", &tenant, "--name", "ci"]);
    let key = key.as_str().unwrap().to_string();
    assert!(key.starts_with("ak_"), "{key}");
    let (status, me) = s.call_with("GET", "/v1/tenant", None, Some(&key), &[]);
    assert_eq!((status, me["name"].as_str()), (200, Some(tenant.as_str())), "{me}");
    let keys = s.cli_ok(&["key", "ls", "--tenant", &tenant]);
    let k = &keys["keys"][0];
    assert_eq!(
        (k["name"].as_str(), k["prefix"].as_str()),
        (Some("ci"), Some(&key[..8])),
        "{keys}"
    );
    assert!(k["last_used_at"].is_string() && k["revoked_at"].is_null(), "{keys}");
    assert!(!keys.to_string().contains(&key), "a listing never shows the key");
    // A tenant key can't administer.
    let (status, body) = s.call_with("GET", "/v1/admin/tenants", None, Some(&key), &[]);
    assert_eq!((status, body["code"].as_str()), (403, Some("forbidden")), "{body}");
    let (status, _) = s.call_with(
        "POST",
        &format!("/v1/admin/tenants/{tenant}/keys"),
        Some(serde_json::json!({})),
        Some(&key),
        &[],
    );
    assert_eq!(status, 403);

    // Quotas: set, shown, a zero refused by name.
    let q = s.cli_ok(&[
        "tenant",
        "quota",
        "set",
        "--tenant",
        &tenant,
        "--sandboxes",
        "3",
        "--vcpu",
        "6",
    ]);
    assert_eq!(
        (q["sandboxes"].as_u64(), q["vcpu"].as_u64(), &q["memory_mib"]),
        (Some(3), Some(6), &Value::Null),
        "{q}"
    );
    let out = s.cli(&["tenant", "quota", "set", "--tenant", &tenant, "--vcpu", "0"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("vcpu") && err.contains("at least 1"),
        "{err}"
    );
    assert_eq!(s.cli_ok(&["tenant", "quota", "show", "--tenant", &tenant])["vcpu"], 6);
    let info = s.cli_ok(&["tenant", "get", &tenant]);
    assert_eq!(
        (info["quota"]["sandboxes"].as_u64(), info["usage"]["sandboxes"].as_u64()),
        (Some(3), Some(0)),
        "{info}"
    );

    // Egress policy: normalized, wildcards and malformed entries refused by name.
    let set = s.cli_ok(&[
        "tenant",
        "policy",
        "set",
        "--tenant",
        &tenant,
        "--allow-domain",
        "PyPI.org.",
        "--allow-domain",
        "files.pythonhosted.org",
        "--allow-cidr",
        "203.0.113.0/24",
        "--allow-cidr",
        "198.51.100.7",
        "--deny-domain",
        "evil.test",
        "--deny-cidr",
        "203.0.113.64/26",
    ]);
    let want = serde_json::json!({
        "allow": {"domains": ["files.pythonhosted.org", "pypi.org"], "ips": ["198.51.100.7"], "cidrs": ["203.0.113.0/24"]},
        "deny": {"domains": ["evil.test"], "ips": [], "cidrs": ["203.0.113.64/26"]},
    });
    assert_eq!(set, want);
    for (flag, entry) in [
        ("--allow-domain", "*.pypi.org"),
        ("--deny-domain", ".evil.test"),
        ("--allow-cidr", "203.0.113.1/24"),
        ("--allow-cidr", "pypi.org"),
    ] {
        let out = s.cli(&["tenant", "policy", "set", "--tenant", &tenant, flag, entry]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && stderr.contains(entry),
            "{flag} {entry}: {stderr}"
        );
    }
    assert_eq!(s.cli_ok(&["tenant", "policy", "show", "--tenant", &tenant]), want);
    let out = s.cli(&["tenant", "policy", "show", "--tenant", "nobody-here"]);
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("nobody-here"));

    // Revoked: the very next call is refused.
    let id = k["id"].as_str().unwrap();
    s.cli_ok(&["key", "revoke", id, "--tenant", &tenant]);
    let (status, _) = s.call_with("GET", "/v1/tenant", None, Some(&key), &[]);
    assert_eq!(status, 401);
    let keys = s.cli_ok(&["key", "ls", "--tenant", &tenant]);
    assert!(keys["keys"][0]["revoked_at"].is_string(), "{keys}");

    // Removing the tenant revokes its other keys too; `default` stays.
    let second = s.cli_ok(&["key", "create", "--tenant", &tenant]);
    let second = second.as_str().unwrap().to_string();
    s.cli_ok(&["tenant", "rm", &tenant]);
    assert_eq!(s.call_with("GET", "/v1/tenant", None, Some(&second), &[]).0, 401);
    let out = s.cli(&["tenant", "rm", "default"]);
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("bootstrap key"));

    // The audit log names each action (never a secret).
    let token = std::fs::read_to_string(s.data.join("admin-token")).unwrap();
    // Newest first, by tenant and by action (the shared data dir keeps every run's rows).
    let audit = |query: &str| {
        let (status, page) = s.call_with(
            "GET",
            &format!("/v1/admin/audit?{query}"),
            None,
            Some(token.trim()),
            &[],
        );
        assert_eq!(status, 200, "{page}");
        page
    };
    let ours = audit(&format!("tenant={tenant}&limit=1000"));
    let rows = ours["entries"].as_array().unwrap();
    for action in [
        "tenant.create",
        "key.create",
        "tenant.quota",
        "tenant.policy",
        "key.revoke",
        "tenant.delete",
    ] {
        assert!(
            rows.iter()
                .any(|r| r["action"] == action && r["tenant"] == tenant.as_str()),
            "no {action} row: {ours}"
        );
    }
    assert!(rows
        .iter()
        .any(|r| r["action"] == "tenant.quota" && r["result"] == "invalid_argument"));
    let seqs: Vec<i64> = rows.iter().map(|r| r["seq"].as_i64().unwrap()).collect();
    assert!(seqs.windows(2).all(|w| w[0] > w[1]), "newest first: {seqs:?}");
    let refused = audit("action=auth.key&limit=5");
    assert!(refused["entries"][0]["result"] == "unauthorized", "{refused}");
    let logins = audit("action=login&limit=1");
    assert_eq!(logins["entries"][0]["actor"], "root@local", "{logins}");
    let text = format!("{ours}{refused}{logins}");
    for secret in [key.as_str(), second.as_str(), CONSOLE_PASSWORD, token.trim()] {
        assert!(!text.contains(secret), "a secret in the audit log");
    }
    // Nor in any log the server wrote.
    for entry in std::fs::read_dir(&s.data).unwrap().flatten() {
        let name = entry.file_name().to_string_lossy().to_string();
        if name.ends_with(".log") {
            let log = std::fs::read_to_string(entry.path()).unwrap_or_default();
            for secret in [key.as_str(), second.as_str(), CONSOLE_PASSWORD, token.trim()] {
                assert!(!log.contains(secret), "a secret in {name}");
            }
        }
    }
}

fn main() {
    unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
    let args = libtest_mimic::Arguments::from_args();
    let t = trial;
    let tests = vec![
        t(
            "walkthrough_create_session_stream_delete",
            walkthrough_create_session_stream_delete,
        ),
        t(
            "failing_command_reports_its_exit_code_and_stderr",
            failing_command_reports_its_exit_code_and_stderr,
        ),
        t(
            "sse_resumes_with_last_event_id_without_loss_or_duplicates",
            sse_resumes_with_last_event_id_without_loss_or_duplicates,
        ),
        t("stdin_signal_and_files", stdin_signal_and_files),
        t(
            "idempotent_create_returns_the_same_operation",
            idempotent_create_returns_the_same_operation,
        ),
        t(
            "pause_freezes_in_memory_and_resume_continues",
            pause_freezes_in_memory_and_resume_continues,
        ),
        t(
            "timeout_suspends_and_a_request_resumes",
            timeout_suspends_and_a_request_resumes,
        ),
        t(
            "warm_pool_claims_are_fresh_and_refilled",
            warm_pool_claims_are_fresh_and_refilled,
        ),
        t(
            "snapshots_and_forks_start_from_a_running_sandbox",
            snapshots_and_forks_start_from_a_running_sandbox,
        ),
        t(
            "ports_and_envd_are_reachable_by_host_name",
            ports_and_envd_are_reachable_by_host_name,
        ),
        t(
            "credentials_never_reach_a_sandbox_port",
            credentials_never_reach_a_sandbox_port,
        ),
        t(
            "e2b_unsupported_create_options_are_refused_by_name",
            e2b_unsupported_create_options_are_refused_by_name,
        ),
        t("timeout_expiry_deletes_the_sandbox", timeout_expiry_deletes_the_sandbox),
        t(
            "list_filters_by_state_and_metadata_with_paging",
            list_filters_by_state_and_metadata_with_paging,
        ),
        t("bad_input_gets_clear_4xx_errors", bad_input_gets_clear_4xx_errors),
        t(
            "unknown_ids_are_404_and_keys_are_checked",
            unknown_ids_are_404_and_keys_are_checked,
        ),
        t("cli_run_exec_and_python_example", cli_run_exec_and_python_example),
        t("serve_refuses_unusable_tls_files", serve_refuses_unusable_tls_files),
        t(
            "creates_restore_from_a_base_snapshot_through_the_api",
            creates_restore_from_a_base_snapshot_through_the_api,
        ),
        t(
            "server_killed_mid_create_recovers_and_reattaches",
            server_killed_mid_create_recovers_and_reattaches,
        ),
        t(
            "missing_sandbox_has_one_code_on_every_route",
            missing_sandbox_has_one_code_on_every_route,
        ),
        t(
            "env_names_are_refused_alike_by_both_doors",
            env_names_are_refused_alike_by_both_doors,
        ),
        t(
            "a_vm_that_dies_is_failed_and_frees_its_slot",
            a_vm_that_dies_is_failed_and_frees_its_slot,
        ),
        t(
            "quota_is_exact_under_concurrent_creates_over_both_doors",
            quota_is_exact_under_concurrent_creates_over_both_doors,
        ),
        t(
            "a_first_start_prints_a_generated_console_password_once",
            a_first_start_prints_a_generated_console_password_once,
        ),
        t(
            "admin_cli_manages_tenants_keys_quotas_and_policies",
            admin_cli_manages_tenants_keys_quotas_and_policies,
        ),
    ];
    let conclusion = libtest_mimic::run(&args, tests);
    cleanup();
    reap_orphans();
    conclusion.exit();
}

/// Delete every sandbox the shared server knows, then stop it: VMs outlive servers by design.
fn cleanup() {
    let Some(s) = SERVER.get() else { return };
    let (_, list) = s.call("GET", "/v1/sandboxes?limit=100", None);
    for sb in list["sandboxes"].as_array().into_iter().flatten() {
        s.delete(sb["id"].as_str().unwrap());
    }
    unsafe { libc::kill(s.child.id() as i32, libc::SIGTERM) };
    std::thread::sleep(Duration::from_millis(300));
    reap_orphans();
}
