//! A sandbox's life: idempotent creates, listing, pause and resume, timeouts (suspend or
//! delete), and a VM that dies on its own.

use super::*;

pub(crate) fn idempotent_create_returns_the_same_operation() {
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

pub(crate) fn list_filters_by_state_and_metadata_with_paging() {
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

pub(crate) fn pause_freezes_in_memory_and_resume_continues() {
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
pub(crate) fn timeout_suspends_and_a_request_resumes() {
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

pub(crate) fn timeout_expiry_deletes_the_sandbox() {
    let s = server();
    let id = s.create(json!({ "template": "seed", "timeout": "2s" }));
    s.wait_expired(&id);
    assert!(!s.data.join("sandboxes").join(&id).exists());
}

/// A VM that stops on its own (killed from outside, powered off from inside) fails its sandbox.
pub(crate) fn a_vm_that_dies_is_failed_and_frees_its_slot() {
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
