//! Processes as sessions in a running sandbox: the whole walk from create to delete, exit codes
//! and stderr, a stream resumed by `Last-Event-ID`, stdin, signals and files.

use super::*;

pub(crate) fn walkthrough_create_session_stream_delete() {
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

pub(crate) fn failing_command_reports_its_exit_code_and_stderr() {
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

pub(crate) fn sse_resumes_with_last_event_id_without_loss_or_duplicates() {
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

pub(crate) fn stdin_signal_and_files() {
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
