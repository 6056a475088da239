//! Restarts and VMs that die: a crash in the middle of a create, a pause or a resume, the
//! recovery that serves at once, paging past failed sandboxes, VMs killed or powered off.

use super::*;

// ---------------------------------------------------------------------------------------------
// 1. Crash in the middle of a create

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_mid_create_without_a_vm_fails_it() {
    let tmp = fresh();
    let server = Server::start(tmp.path(), 4, None).await;
    let id = "crashnovm01";
    let op = crashed_create(&server, id).await;
    assert_eq!(server.operation(&op).await["state"], "running");
    assert_eq!(server.sandbox_state(id).await, "creating");

    let server = server.restart().await;
    let op = server.operation(&op).await;
    assert_eq!(op["state"], "failed", "{op}");
    assert_eq!(op["error"]["code"], "interrupted", "{op}");
    assert!(op["finished_at"].is_string(), "{op}");
    assert_eq!(server.sandbox_state(id).await, "failed");
    // A failed sandbox holds no quota slot and has no VM.
    assert!(server.runtime().get(id).is_err());
    server.stop().await;
    assert_no_vms(tmp.path());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_mid_create_after_the_boot_succeeds_it() {
    let tmp = fresh();
    let server = Server::start(tmp.path(), 4, None).await;
    let id = "crashbooted01";
    let op = crashed_create(&server, id).await;
    // The VM booted before the crash, but the server never recorded it.
    let rt = server.runtime();
    server
        .on_server(async move {
            rt.create(airlock_runtime::CreateVm {
                id: Some(id.into()),
                template: "seed".into(),
                resources: Default::default(),
                image: None,
                env: Default::default(),
                volumes: Vec::new(),
            })
            .await
            .map(|_| ())
        })
        .await
        .unwrap();
    let pid = server.vm_pid(id);

    let server = server.restart().await;
    let op = server.operation(&op).await;
    assert_eq!(op["state"], "succeeded", "{op}");
    assert!(op.get("error").is_none(), "{op}");
    assert_eq!(server.sandbox_state(id).await, "running");
    assert_eq!(server.vm_pid(id), pid, "the VM was re-attached, not replaced");
    server.assert_answers(id).await;

    server.delete(id).await;
    assert!(!pid_alive(pid));
    server.stop().await;
    assert_no_vms(tmp.path());
}

// ---------------------------------------------------------------------------------------------
// 2. Restart during a pause or a resume

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_during_pause() {
    let tmp = fresh();
    let server = Server::start(tmp.path(), 4, None).await;
    // `done`: the VM paused before the crash; `undone`: the pause never took effect.
    let done = server.running_sandbox().await;
    let undone = server.running_sandbox().await;
    let done_op = unfinished(&server, OperationKind::Pause, &done).await;
    let undone_op = unfinished(&server, OperationKind::Pause, &undone).await;
    let rt = server.runtime();
    let d = done.clone();
    server.on_server(async move { rt.pause(&d).await }).await.unwrap();
    let pids = (server.vm_pid(&done), server.vm_pid(&undone));

    let server = server.restart().await;
    // Pause took effect: succeeded, paused, and the VM kept (not killed, not rebooted).
    let op = server.operation(&done_op).await;
    assert_eq!(op["state"], "succeeded", "{op}");
    assert_eq!(server.sandbox_state(&done).await, "paused");
    assert!(pid_alive(pids.0), "the paused VM was killed");
    assert_eq!(server.vm_pid(&done), pids.0);
    // Pause never happened: interrupted, still running, and answering.
    let op = server.operation(&undone_op).await;
    assert_eq!(op["state"], "failed", "{op}");
    assert_eq!(op["error"]["code"], "interrupted", "{op}");
    assert_eq!(server.sandbox_state(&undone).await, "running");
    assert!(pid_alive(pids.1));
    assert_eq!(server.vm_pid(&undone), pids.1);
    server.assert_answers(&undone).await;

    // The paused one resumes through the API and answers.
    let (status, body) = server
        .v1(Method::POST, &format!("/sandboxes/{done}/resume"), None)
        .await;
    assert_eq!(status, 202, "{body}");
    assert_eq!(body["operation"]["state"], "succeeded", "{body}");
    assert_eq!(server.sandbox_state(&done).await, "running");
    server.assert_answers(&done).await;

    server.delete(&done).await;
    server.delete(&undone).await;
    server.stop().await;
    assert_no_vms(tmp.path());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_during_resume() {
    let tmp = fresh();
    let server = Server::start(tmp.path(), 4, None).await;
    // Both paused through the API; then a resume starts: `done` resumed before the crash,
    // `undone` did not.
    let done = server.running_sandbox().await;
    let undone = server.running_sandbox().await;
    for id in [&done, &undone] {
        let (status, body) = server.v1(Method::POST, &format!("/sandboxes/{id}/pause"), None).await;
        assert_eq!(status, 202, "{body}");
        assert_eq!(body["operation"]["state"], "succeeded", "{body}");
        assert_eq!(server.sandbox_state(id).await, "paused");
    }
    let done_op = unfinished(&server, OperationKind::Resume, &done).await;
    let undone_op = unfinished(&server, OperationKind::Resume, &undone).await;
    let rt = server.runtime();
    let d = done.clone();
    server.on_server(async move { rt.resume(&d).await }).await.unwrap();
    let pids = (server.vm_pid(&done), server.vm_pid(&undone));

    let server = server.restart().await;
    let op = server.operation(&done_op).await;
    assert_eq!(op["state"], "succeeded", "{op}");
    assert_eq!(server.sandbox_state(&done).await, "running");
    assert_eq!(server.vm_pid(&done), pids.0);
    server.assert_answers(&done).await;

    let op = server.operation(&undone_op).await;
    assert_eq!(op["state"], "failed", "{op}");
    assert_eq!(op["error"]["code"], "interrupted", "{op}");
    assert_eq!(server.sandbox_state(&undone).await, "paused");
    assert!(pid_alive(pids.1), "the paused VM was killed");
    assert_eq!(server.vm_pid(&undone), pids.1);
    // It can still be resumed, and answers.
    let (status, body) = server
        .v1(Method::POST, &format!("/sandboxes/{undone}/resume"), None)
        .await;
    assert_eq!(status, 202, "{body}");
    assert_eq!(body["operation"]["state"], "succeeded", "{body}");
    server.assert_answers(&undone).await;

    server.delete(&done).await;
    server.delete(&undone).await;
    server.stop().await;
    assert_no_vms(tmp.path());
}

/// The other two things a restart settles: a delete under way is carried out, and a sandbox
/// whose VM died while no server ran is failed (and its slot freed) before the first request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_finishes_deletes_and_fails_vms_that_died_meanwhile() {
    let tmp = fresh();
    let server = Server::start(tmp.path(), 2, None).await;
    let deleting = server.running_sandbox().await;
    let dies = server.running_sandbox().await;
    // A delete recorded as `submit` records it, never carried out.
    let delete_op = unfinished(&server, OperationKind::Delete, &deleting).await;
    server
        .core()
        .store()
        .set_sandbox_state(&deleting, SandboxState::Deleting)
        .await
        .unwrap();
    let pids = (server.vm_pid(&deleting), server.vm_pid(&dies));
    let (dir, key) = (server.dir.clone(), server.key.clone());
    server.stop().await;
    fake::kill_vm(pids.1);
    let deadline = Instant::now() + Duration::from_secs(3);
    while pid_alive(pids.1) {
        assert!(Instant::now() < deadline, "kill -9 did not end the fake VM");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }

    let server = Server::start(&dir, 2, Some(&key)).await;
    assert_eq!(server.sandbox_state(&dies).await, "failed");
    let op = server.wait_op(&delete_op).await;
    assert_eq!(op["state"], "succeeded", "{op}");
    assert_eq!(server.sandbox_state(&deleting).await, "deleted");
    assert!(!pid_alive(pids.0));
    // Both slots are free again.
    let a = server.running_sandbox().await;
    let b = server.running_sandbox().await;
    server.delete(&a).await;
    server.delete(&b).await;
    server.stop().await;
    assert_no_vms(tmp.path());
}

/// envd's `Process/List` of sandbox `id` with `token`.
async fn envd_list(server: &Server, id: &str, token: &str) -> (u16, Value) {
    let headers = [
        ("x-access-token", token),
        ("e2b-sandbox-id", id),
        ("content-type", "application/json"),
    ];
    server
        .send(Method::POST, "/process.Process/List", &headers, Body::from("{}"))
        .await
        .json()
        .await
}

/// A restart serves at once, while sandboxes are still being recovered: a settled sandbox
/// answers straight away, a request about one not yet settled waits for it and then gets the
/// truth (here: `failed`, its VM died while no server ran, where the record still says
/// `running`), or `unavailable` past `recovery_wait`, through both doors. A caller without
/// the right to the sandbox never waits (its answer is the missing one's at once).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_serves_at_once_and_requests_wait_for_their_sandbox() {
    let tmp = fresh();
    let server = Server::start(tmp.path(), 4, None).await;
    let dead = server.running_sandbox().await;
    let alive = server.e2b_sandbox().await;
    let quick = server.running_sandbox().await;
    let other_key = server
        .core()
        .store()
        .create_key("other", KeyFormat::Airlock)
        .await
        .unwrap();
    let pids = (server.vm_pid(&dead), server.vm_pid(&alive.id));
    let (dir, key) = (server.dir.clone(), server.key.clone());
    server.stop().await;
    fake::kill_vm(pids.0);
    let deadline = Instant::now() + Duration::from_secs(3);
    while pid_alive(pids.0) {
        assert!(Instant::now() < deadline, "kill -9 did not end the fake VM");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }

    // Life 2: the node re-attaches `dead` and `alive` only when the test says so.
    let config = Config {
        recovery_wait: Duration::from_secs(10),
        ..Config::default()
    };
    let hold = Hold::of(&[&dead, &alive.id]);
    let server = Server::start_recovering(&dir, &key, config, hold.clone()).await;
    let started = Instant::now();
    assert_eq!(server.sandbox_state(&quick).await, "running");
    server.assert_answers(&quick).await;
    assert!(started.elapsed() < Duration::from_secs(3), "a settled sandbox waited");
    assert!(server.core().engine().recovering(&dead) && server.core().engine().recovering(&alive.id));
    // Another tenant learns nothing, at once.
    let asked = Instant::now();
    let (status, body) = server
        .v1_as(&other_key, Method::GET, &format!("/sandboxes/{dead}"), None)
        .await;
    assert_eq!(
        (status, body["code"].as_str()),
        (404, Some("sandbox_not_found")),
        "{body}"
    );
    assert!(asked.elapsed() < Duration::from_secs(1), "a foreign caller waited");
    let asked = Instant::now();
    let (status, body) = envd_list(&server, &alive.id, "not-the-token").await;
    assert_eq!(status, 502, "{body}");
    assert!(
        asked.elapsed() < Duration::from_secs(1),
        "a caller without the token waited"
    );

    // The owner waits for the sandbox, then gets what its VM really is.
    let asked = Instant::now();
    let release = async {
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(server.core().engine().recovering(&dead));
        hold.release(&dead);
    };
    let path = format!("/sandboxes/{dead}");
    let ((status, sb), ()) = tokio::join!(server.v1(Method::GET, &path, None), release);
    assert_eq!(status, 200, "{sb}");
    assert_eq!(sb["state"], "failed", "{sb}");
    assert!(asked.elapsed() >= Duration::from_millis(500));
    // Listing waits for the tenant's sandboxes too (and then lists the live ones right).
    let release = async {
        tokio::time::sleep(Duration::from_millis(300)).await;
        hold.release(&alive.id);
    };
    let ((status, list), ()) = tokio::join!(server.v1(Method::GET, "/sandboxes", None), release);
    assert_eq!(status, 200, "{list}");
    let mut live: Vec<&str> = list["sandboxes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["id"].as_str().unwrap())
        .collect();
    live.sort();
    let mut want = vec![quick.as_str(), alive.id.as_str()];
    want.sort();
    assert_eq!(live, want, "{list}");
    let (status, body) = envd_list(&server, &alive.id, &alive.token).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(server.vm_pid(&alive.id), pids.1, "re-attached, not replaced");
    let (dir, key) = (server.dir.clone(), server.key.clone());
    server.stop().await;

    // Life 3: a sandbox not settled within `recovery_wait` is `unavailable` on both doors,
    // then answers once it is.
    let config = Config {
        recovery_wait: Duration::from_millis(300),
        ..Config::default()
    };
    let hold = Hold::of(&[&alive.id]);
    let server = Server::start_recovering(&dir, &key, config, hold.clone()).await;
    let (status, body) = server.v1(Method::GET, &format!("/sandboxes/{}", alive.id), None).await;
    assert_eq!((status, body["code"].as_str()), (503, Some("unavailable")), "{body}");
    assert!(body["message"].as_str().unwrap().contains("restart"), "{body}");
    let (status, body) = server
        .e2b(Method::GET, &format!("/sandboxes/{}", alive.id), json!({}))
        .await;
    assert_eq!(status, 503, "{body}");
    let (status, body) = envd_list(&server, &alive.id, &alive.token).await;
    assert_eq!((status, body["code"].as_str()), (503, Some("unavailable")), "{body}");
    hold.release(&alive.id);
    let (status, body) = envd_list(&server, &alive.id, &alive.token).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(server.sandbox_state(&alive.id).await, "running");
    assert_eq!(server.vm_pid(&alive.id), pids.1);

    server.delete(&alive.id).await;
    server.delete(&quick).await;
    server.stop().await;
    assert_no_vms(tmp.path());
}

/// Listing pages through live sandboxes with failed ones between them (failed after a restart
/// found their VMs gone, and by the reaper): every live sandbox is on exactly one page, on
/// both doors and at every page size, and no failed one is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pages_skip_failed_sandboxes_without_losing_live_ones() {
    let tmp = fresh();
    let server = Server::start(tmp.path(), 10, None).await;
    let mut ids = Vec::new();
    for _ in 0..7 {
        ids.push(server.running_sandbox().await);
        // Distinct creation times: pages are ordered by them.
        tokio::time::sleep(Duration::from_millis(3)).await;
    }
    // Fail every other one: two while no server runs, two while it does.
    let failed: Vec<String> = [0, 2, 4, 6].iter().map(|i| ids[*i].clone()).collect();
    let live: Vec<String> = [1, 3, 5].iter().map(|i| ids[*i].clone()).collect();
    let pids: Vec<u32> = failed.iter().map(|id| server.vm_pid(id)).collect();
    let server = {
        let (dir, key) = (server.dir.clone(), server.key.clone());
        server.stop().await;
        for pid in &pids[..2] {
            fake::kill_vm(*pid);
            while pid_alive(*pid) {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
        Server::start(&dir, 10, Some(&key)).await
    };
    for (id, pid) in failed.iter().zip(&pids).skip(2) {
        fake::kill_vm(*pid);
        server.await_state(id, "failed", Duration::from_secs(3)).await;
    }
    for id in &failed[..2] {
        assert_eq!(server.sandbox_state(id).await, "failed");
    }

    for limit in 1..=4 {
        // /v1: `page_token`.
        let mut seen = Vec::new();
        let mut token: Option<String> = None;
        for _ in 0..10 {
            let mut path = format!("/sandboxes?limit={limit}");
            if let Some(t) = &token {
                path.push_str(&format!("&page_token={t}"));
            }
            let (status, page) = server.v1(Method::GET, &path, None).await;
            assert_eq!(status, 200, "{page}");
            seen.extend(
                page["sandboxes"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|s| s["id"].as_str().unwrap().to_string()),
            );
            token = page["next_page_token"].as_str().map(String::from);
            if token.is_none() {
                break;
            }
        }
        assert_eq!(seen, live, "/v1 pages of {limit}");
        // E2B: `nextToken`, answered in `x-next-token`.
        let mut seen = Vec::new();
        let mut token: Option<String> = None;
        for _ in 0..10 {
            let mut path = format!("/v2/sandboxes?limit={limit}");
            if let Some(t) = &token {
                path.push_str(&format!("&nextToken={t}"));
            }
            let headers = [("x-api-key", server.key.as_str())];
            let resp = server.send(Method::GET, &path, &headers, Body::empty()).await;
            token = resp
                .headers
                .get("x-next-token")
                .map(|v| v.to_str().unwrap().to_string());
            let (status, page) = resp.json().await;
            assert_eq!(status, 200, "{page}");
            seen.extend(
                page.as_array()
                    .unwrap()
                    .iter()
                    .map(|s| s["sandboxID"].as_str().unwrap().to_string()),
            );
            if token.is_none() {
                break;
            }
        }
        // E2B lists newest first.
        let newest_first: Vec<String> = live.iter().rev().cloned().collect();
        assert_eq!(seen, newest_first, "E2B pages of {limit}");
    }
    for id in &live {
        server.delete(id).await;
    }
    server.stop().await;
    assert_no_vms(tmp.path());
}

// ---------------------------------------------------------------------------------------------
// 3. VMs that die on their own

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vm_killed_or_powered_off_fails_the_sandbox_and_frees_its_slot() {
    let tmp = fresh();
    let server = Server::start(tmp.path(), 1, None).await;

    // kill -9 of the VM.
    let first = server.running_sandbox().await;
    let (status, body) = server
        .v1(Method::POST, "/sandboxes", Some(json!({ "template": "seed" })))
        .await;
    assert_eq!(status, 429, "the limit is 1: {body}");
    assert_eq!(body["code"], "quota_exceeded");
    fake::kill_vm(server.vm_pid(&first));
    let took = server.await_state(&first, "failed", Duration::from_secs(3)).await;
    eprintln!("kill -9: failed after {took:?}");

    // The slot is free again: power off from inside the next one.
    let second = server.running_sandbox().await;
    let pid = server.vm_pid(&second);
    server.session(&second, &["poweroff"]).await;
    let took = server.await_state(&second, "failed", Duration::from_secs(3)).await;
    eprintln!("poweroff: failed after {took:?}");
    assert!(!pid_alive(pid));

    // And again.
    let third = server.running_sandbox().await;
    server.assert_answers(&third).await;
    server.delete(&third).await;
    server.stop().await;
    assert_no_vms(tmp.path());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delete_racing_a_create_or_pause_leaves_no_vm() {
    let tmp = fresh();
    // Creates reach the node 300 ms late, so the delete below gets there first.
    let server = Server::start_with(tmp.path(), 20, None, Duration::from_millis(300)).await;
    for round in 0..3 {
        // A delete that overtakes the create finds no VM; the VM booted after it must still go.
        let (id, create) = server.create_native().await;
        let (status, body) = server.v1(Method::DELETE, &format!("/sandboxes/{id}"), None).await;
        assert_eq!(status, 202, "round {round}: {body}");
        let delete = body["operation"]["id"].as_str().unwrap().to_string();
        server.wait_op(&create).await;
        assert_eq!(server.wait_op(&delete).await["state"], "succeeded");
        assert_eq!(server.sandbox_state(&id).await, "deleted", "round {round}");
        assert_no_vms(tmp.path());
    }
    // A pause racing a delete never brings the sandbox back from deleting.
    for round in 0..5 {
        let id = server.running_sandbox().await;
        let (pause_path, delete_path) = (format!("/sandboxes/{id}/pause"), format!("/sandboxes/{id}"));
        let (pause, delete) = tokio::join!(
            server.v1(Method::POST, &pause_path, None),
            server.v1(Method::DELETE, &delete_path, None),
        );
        assert!([202, 409].contains(&pause.0), "round {round}: {pause:?}");
        assert_eq!(delete.0, 202, "round {round}: {delete:?}");
        let op = delete.1["operation"]["id"].as_str().unwrap().to_string();
        assert_eq!(server.wait_op(&op).await["state"], "succeeded");
        assert_eq!(server.sandbox_state(&id).await, "deleted", "round {round}");
    }
    server.stop().await;
    assert_no_vms(tmp.path());
}
