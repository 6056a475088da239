//! The whole server in-process over the fake VMM: both doors, the engine's crash recovery, VMs
//! that die on their own, admission. No VM boots; every test takes a second or two.
//!
//! The harness (`Server`, one per server life, restartable) is `common/`, shared with `limits.rs`.

mod common;
// Disk held by snapshots and saved memory, tenants' ids, default quotas (issue 23).
#[path = "core/quotas.rs"]
mod quotas;

use airlock_runtime::fake;
use airlock_runtime::vmm::pid_alive;
use airlock_server::core::Config;
use airlock_server::model::{Operation, OperationKind, OperationState, Resources, SandboxState};
use airlock_server::nodes::Capacity;
use airlock_server::records::{now_ms, rfc3339, SandboxRecord};
use airlock_server::store::KeyFormat;
use axum::body::Body;
use axum::http::Method;
use common::*;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A sandbox record as `Core::create_sandbox` makes it.
fn sandbox_row(id: &str, tenant_id: &str) -> SandboxRecord {
    let r = airlock_runtime::Resources::default();
    SandboxRecord {
        id: id.into(),
        tenant_id: tenant_id.into(),
        state: SandboxState::Creating,
        template: "seed".into(),
        template_digest: String::new(),
        runtime: fake::NAME.into(),
        accel: "tcg".into(),
        resources: Resources {
            vcpu: r.vcpu,
            memory_mib: r.memory_mib,
            disk_mib: r.disk_mib,
        },
        env: BTreeMap::new(),
        metadata: BTreeMap::new(),
        created_at_ms: now_ms(),
        expires_at_ms: now_ms() + 300_000,
        egress: Default::default(),
        start: None,
        lifecycle: Default::default(),
        timeout_ms: 300_000,
        image_id: None,
    }
}

fn operation(kind: OperationKind, sandbox_id: &str) -> Operation {
    Operation {
        id: format!("op_{}_{sandbox_id}", kind.as_str()),
        kind,
        state: OperationState::Pending,
        sandbox_id: sandbox_id.into(),
        error: None,
        created_at: rfc3339(now_ms()),
        finished_at: None,
    }
}

/// What a server that crashed in the middle of `kind` leaves in the store: the operation,
/// recorded and marked running, never finished.
async fn unfinished(server: &Server, kind: OperationKind, sandbox_id: &str) -> String {
    let store = &server.core().store;
    let op = operation(kind, sandbox_id);
    store.insert_operation(&server.tenant_id().await, &op).await.unwrap();
    store
        .set_operation_state(&op.id, OperationState::Running)
        .await
        .unwrap();
    op.id
}

/// A sandbox and its create operation recorded, the operation running, as a crash mid-create
/// leaves them.
async fn crashed_create(server: &Server, id: &str) -> String {
    let store = &server.core().store;
    let row = sandbox_row(id, &server.tenant_id().await);
    let op = operation(OperationKind::Create, id);
    store.insert_create(&row, &op, None, server.max).await.unwrap();
    store
        .set_operation_state(&op.id, OperationState::Running)
        .await
        .unwrap();
    op.id
}

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
        .store
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
        .store
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
    assert!(server.core().engine.recovering(&dead) && server.core().engine.recovering(&alive.id));
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
        assert!(server.core().engine.recovering(&dead));
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

// ---------------------------------------------------------------------------------------------
// 5. Node budgets

/// A node of `cpus`, `memory_mib` and free disk, nothing held yet.
fn node(cpus: u32, memory_mib: u64, disk_free_mib: u64) -> Capacity {
    Capacity {
        cpus,
        memory_mib,
        sandboxes_running: 0,
        disk_free_mib,
        disk_held_mib: 0,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_budget_admits_two_refuses_the_third_and_frees_on_delete() {
    let tmp = fresh();
    // 2048 MiB less a 1024 MiB reserve: room for two 512 MiB sandboxes (the tenant may have
    // the whole node).
    let config = Config {
        memory_reserve_mib: 1024,
        tenant_share: 1.0,
        ..Config::default()
    };
    let server = Server::start_sized(tmp.path(), 20, node(64, 2048, 1 << 30), config).await;
    let a = server.running_sandbox().await;
    let b = server.e2b_sandbox().await;

    let (status, body) = server
        .v1(Method::POST, "/sandboxes", Some(json!({ "template": "seed" })))
        .await;
    assert_eq!(status, 503, "{body}");
    assert_eq!(body["code"], "node_budget_exceeded", "{body}");
    let m = body["message"].as_str().unwrap();
    for part in [
        "memory budget",
        "asks for 512 MiB",
        "0 MiB of 1024 MiB are left",
        "--memory-reserve-mib",
    ] {
        assert!(m.contains(part), "{part:?} not in {m:?}");
    }
    let (status, body) = server
        .e2b(Method::POST, "/sandboxes", json!({ "templateID": "base" }))
        .await;
    assert_eq!((status, &body["code"]), (503, &json!(503)), "{body}");
    assert!(body["message"].as_str().unwrap().contains("memory budget"), "{body}");
    // Nothing was recorded for the refused creates.
    let (_, list) = server.v1(Method::GET, "/sandboxes", None).await;
    assert_eq!(list["sandboxes"].as_array().unwrap().len(), 2, "{list}");

    // More than the whole budget never fits: a bad request, not a wait.
    let (status, body) = server
        .v1(
            Method::POST,
            "/sandboxes",
            Some(json!({ "template": "seed", "resources": { "memory_mib": 1536 } })),
        )
        .await;
    assert_eq!(
        (status, body["code"].as_str()),
        (422, Some("invalid_resources")),
        "{body}"
    );

    // A deleted sandbox gives its memory back.
    server.delete(&a).await;
    let c = server.running_sandbox().await;
    let (status, body) = server
        .v1(
            Method::POST,
            "/sandboxes",
            Some(json!({ "template": "seed", "resources": { "memory_mib": 128 } })),
        )
        .await;
    assert_eq!(status, 503, "full again: {body}");
    server.delete(&b.id).await;
    server.delete(&c).await;
    server.stop().await;
    assert_no_vms(tmp.path());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_creates_never_overshoot_the_vcpu_budget() {
    let tmp = fresh();
    // 3 CPUs, no overcommit: three 1-vCPU sandboxes, whoever asks.
    let config = Config {
        vcpu_overcommit: 1.0,
        tenant_share: 1.0,
        ..Config::default()
    };
    let server = Arc::new(Server::start_sized(tmp.path(), 20, node(3, 1 << 20, 1 << 30), config).await);
    let tasks: Vec<_> = (0..10)
        .map(|i| {
            let server = server.clone();
            tokio::spawn(async move {
                if i % 2 == 0 {
                    let (s, b) = server
                        .v1(Method::POST, "/sandboxes", Some(json!({ "template": "seed" })))
                        .await;
                    (s, b["sandbox_id"].as_str().map(String::from), b)
                } else {
                    let (s, b) = server
                        .e2b(Method::POST, "/sandboxes", json!({ "templateID": "base" }))
                        .await;
                    (s, b["sandboxID"].as_str().map(String::from), b)
                }
            })
        })
        .collect();
    let mut admitted = Vec::new();
    for t in tasks {
        match t.await.unwrap() {
            (202 | 201, Some(id), _) => admitted.push(id),
            (503, _, b) => {
                let m = b["message"].as_str().unwrap();
                assert!(m.contains("vcpu budget") && m.contains("of 3 vCPUs"), "{b}");
            }
            (s, _, b) => panic!("unexpected {s} {b}"),
        }
    }
    assert_eq!(admitted.len(), 3, "admitted {admitted:?}");
    for id in &admitted {
        server.await_state(id, "running", Duration::from_secs(10)).await;
        server.delete(id).await;
    }
    let server = Arc::into_inner(server).unwrap();
    server.stop().await;
    assert_no_vms(tmp.path());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disk_budget_counts_disks_at_full_size_and_keeps_the_reserve() {
    let tmp = fresh();
    let config = Config {
        disk_reserve_mib: 2048,
        tenant_share: 1.0,
        ..Config::default()
    };
    // 5000 MiB free less the reserve: one 2048 MiB disk fits, a second does not.
    let server = Server::start_sized(tmp.path(), 20, node(64, 1 << 20, 5000), config.clone()).await;
    let a = server.running_sandbox().await;
    let (status, body) = server
        .v1(Method::POST, "/sandboxes", Some(json!({ "template": "seed" })))
        .await;
    assert_eq!(
        (status, body["code"].as_str()),
        (503, Some("node_budget_exceeded")),
        "{body}"
    );
    let m = body["message"].as_str().unwrap();
    assert!(
        m.contains("disk budget") && m.contains("asks for 2048 MiB") && m.contains("904 MiB of 2952 MiB"),
        "{m}"
    );
    server.delete(&a).await;
    server.stop().await;
    assert_no_vms(tmp.path());

    // Free space below the reserve: nothing is admitted.
    let tmp = fresh();
    let server = Server::start_sized(tmp.path(), 20, node(64, 1 << 20, 1000), config).await;
    let (status, body) = server
        .v1(Method::POST, "/sandboxes", Some(json!({ "template": "seed" })))
        .await;
    assert_eq!(
        (status, body["code"].as_str()),
        (503, Some("node_budget_exceeded")),
        "{body}"
    );
    assert!(body["message"].as_str().unwrap().contains("0 MiB of 0 MiB"), "{body}");
    server.stop().await;
    assert_no_vms(tmp.path());
}

// ---------------------------------------------------------------------------------------------
// Egress (issue 10): profiles, the tenant's base policy, the E2B door's network options

/// An egress configuration as `AIRLOCK_EGRESS_PROFILES` would give it.
fn egress_config(profiles: &str) -> Config {
    Config {
        egress: airlock_egress::EgressConfig::new(
            airlock_egress::PlatformDenies::new(Vec::new()),
            airlock_egress::Profiles::from_json(profiles).unwrap(),
        ),
        ..Config::default()
    }
}

const PROFILES: &str = r#"{"pypi": {"domains": ["pypi.org", "files.pythonhosted.org"], "default": true},
                           "gh": {"domains": ["github.com"]}}"#;

/// Set tenant `default`'s base policy directly on the store (as `airlock tenant policy set`).
async fn set_tenant_policy(server: &Server, json: &str) {
    let policy = airlock_egress::TenantPolicy::from_json(json).unwrap();
    let tenant = server.tenant_id().await;
    server.core().store.set_egress_policy(&tenant, &policy).await.unwrap();
}

/// `POST /v1/sandboxes` with extra headers; the sandbox is running when this returns.
async fn create_native_with(server: &Server, headers: &[(&str, &str)]) -> String {
    let auth = format!("Bearer {}", server.key);
    let mut all = vec![("authorization", auth.as_str()), ("content-type", "application/json")];
    all.extend_from_slice(headers);
    let (status, body) = server
        .send(
            Method::POST,
            "/v1/sandboxes",
            &all,
            Body::from(json!({ "template": "seed" }).to_string()),
        )
        .await
        .json()
        .await;
    assert_eq!(status, 202, "{body}");
    let id = body["sandbox_id"].as_str().unwrap().to_string();
    let op = server.wait_op(body["operation"]["id"].as_str().unwrap()).await;
    assert_eq!(op["state"], "succeeded", "{op}");
    id
}

async fn egress_report(server: &Server, id: &str) -> Value {
    let (status, body) = server.v1(Method::GET, &format!("/sandboxes/{id}/egress"), None).await;
    assert_eq!(status, 200, "{body}");
    body
}

async fn sandbox_egress(server: &Server, id: &str) -> Value {
    let (status, body) = server.v1(Method::GET, &format!("/sandboxes/{id}"), None).await;
    assert_eq!(status, 200, "{body}");
    body["egress"].clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_profiles_header_is_ignored_on_every_create_and_the_defaults_are_fixed_for_life() {
    let tmp = fresh();
    let server = Server::start_full(tmp.path(), 20, None, Duration::ZERO, ROOMY, egress_config(PROFILES)).await;
    // No caller signs in yet: the header, naming a real profile or not, changes nothing.
    let a = create_native_with(&server, &[("x-airlock-egress-profiles", "gh")]).await;
    let b = create_native_with(&server, &[("x-airlock-egress-profiles", "nope")]).await;
    assert_eq!(
        sandbox_egress(&server, &a).await,
        json!({"profiles": ["pypi"], "sealed": false})
    );
    assert_eq!(
        sandbox_egress(&server, &b).await,
        json!({"profiles": ["pypi"], "sealed": false})
    );
    // The same on the E2B door.
    let headers = [
        ("x-api-key", server.key.as_str()),
        ("content-type", "application/json"),
        ("x-airlock-egress-profiles", "gh"),
    ];
    let (status, body) = server
        .send(
            Method::POST,
            "/sandboxes",
            &headers,
            Body::from(json!({"templateID": "base"}).to_string()),
        )
        .await
        .json()
        .await;
    assert_eq!(status, 201, "{body}");
    let c = body["sandboxID"].as_str().unwrap().to_string();
    assert_eq!(sandbox_egress(&server, &c).await["profiles"], json!(["pypi"]));
    let report = egress_report(&server, &a).await;
    assert_eq!(
        report["policy"]["profiles"],
        json!({"pypi": {"domains": ["files.pythonhosted.org", "pypi.org"], "ips": [], "cidrs": []}})
    );

    // A restart with other defaults: live sandboxes keep theirs, new ones get the new ones.
    let key = server.key.clone();
    server.stop().await;
    let other = r#"{"pypi": {"domains": ["pypi.org"]}, "gh": {"domains": ["github.com"], "default": true}}"#;
    let server = Server::start_full(tmp.path(), 20, Some(&key), Duration::ZERO, ROOMY, egress_config(other)).await;
    assert_eq!(sandbox_egress(&server, &a).await["profiles"], json!(["pypi"]));
    let report = egress_report(&server, &a).await;
    assert_eq!(
        report["policy"]["profiles"],
        json!({"pypi": {"domains": ["pypi.org"], "ips": [], "cidrs": []}})
    );
    let d = create_native_with(&server, &[]).await;
    assert_eq!(sandbox_egress(&server, &d).await["profiles"], json!(["gh"]));
    for id in [&a, &b, &c, &d] {
        server.delete(id).await;
    }
    server.stop().await;
    assert_no_vms(tmp.path());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn egress_report_shows_the_effective_policy_and_is_404_for_foreign_sandboxes() {
    let tmp = fresh();
    let server = Server::start_full(tmp.path(), 20, None, Duration::ZERO, ROOMY, egress_config(PROFILES)).await;
    set_tenant_policy(
        &server,
        r#"{"allow": {"domains": ["api.example.com"], "cidrs": ["203.0.113.0/24"]}, "deny": {"domains": ["pypi.org"]}}"#,
    )
    .await;
    let id = server.running_sandbox().await;
    // Made at create, in the core's registry (what the egress plumbing will serve).
    assert!(server.core().egress.get(&id).is_some());
    let r = egress_report(&server, &id).await;
    assert_eq!(r["sandbox_id"], json!(id));
    let p = &r["policy"];
    assert_eq!(p["sealed"], json!(false));
    assert_eq!(
        p["tenant_allow"],
        json!({"domains": ["api.example.com"], "ips": [], "cidrs": ["203.0.113.0/24"]})
    );
    assert_eq!(
        p["tenant_deny"],
        json!({"domains": ["pypi.org"], "ips": [], "cidrs": []})
    );
    let platform: Vec<&str> = p["platform_deny"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert!(platform.contains(&"127.0.0.0/8 (loopback)"), "{platform:?}");
    assert!(
        platform.contains(&"169.254.0.0/16 (link-local/metadata)"),
        "{platform:?}"
    );
    assert!(p["profiles"].get("pypi").is_some(), "{p}");
    // Nothing proxied yet: zero counters, no denials.
    assert_eq!(
        r["counters"],
        json!({"tcp_allowed": 0, "tcp_denied": 0, "dns_allowed": 0, "dns_denied": 0, "by_rule": {}})
    );
    assert_eq!(r["recent_denials"], json!([]));
    // The tenant's policy changing later does not reach a live sandbox.
    set_tenant_policy(&server, r#"{"allow": {"domains": ["other.example.com"]}}"#).await;
    assert_eq!(egress_report(&server, &id).await["policy"], r["policy"]);

    // Another tenant's sandbox answers exactly like a missing one.
    let other = server
        .core()
        .store
        .create_key("other", KeyFormat::Airlock)
        .await
        .unwrap();
    let (s1, foreign) = server
        .v1_as(&other, Method::GET, &format!("/sandboxes/{id}/egress"), None)
        .await;
    let (s2, missing) = server.v1(Method::GET, "/sandboxes/nosuchsandbox/egress", None).await;
    assert_eq!((s1, s2), (404, 404), "{foreign} {missing}");
    assert_eq!(foreign["code"], missing["code"]);
    assert_eq!(
        foreign["message"].as_str().unwrap().replace(&id, "X"),
        missing["message"].as_str().unwrap().replace("nosuchsandbox", "X")
    );

    // Gone from the registry when the sandbox ends; the recorded policy still shows.
    server.delete(&id).await;
    let deadline = Instant::now() + Duration::from_secs(5);
    while server.core().egress.get(&id).is_some() {
        assert!(Instant::now() < deadline, "the sandbox's egress outlived it");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let after = egress_report(&server, &id).await;
    assert_eq!(after["policy"]["tenant_allow"], r["policy"]["tenant_allow"]);
    assert!(
        server.core().egress.get(&id).is_none(),
        "a report does not bring it back"
    );
    server.stop().await;
    assert_no_vms(tmp.path());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn system_shows_the_egress_digest_and_profiles() {
    let tmp = fresh();
    let config = egress_config(PROFILES);
    let digest = config.egress.digest();
    let server = Server::start_full(tmp.path(), 20, None, Duration::ZERO, ROOMY, config).await;
    let (status, body) = server.v1(Method::GET, "/system", None).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["egress"]["digest"], json!(digest));
    assert_eq!(digest.len(), 64);
    assert_eq!(
        body["egress"]["profiles"],
        json!([{"name": "gh", "default": false}, {"name": "pypi", "default": true}])
    );
    // A replica with the same profiles written differently shows the same digest.
    let same = egress_config(
        r#"{"gh": {"domains": ["GitHub.com."]}, "pypi": {"default": true, "domains": ["files.pythonhosted.org", "pypi.org"]}}"#,
    );
    assert_eq!(same.egress.digest(), digest);
    assert_ne!(
        egress_config(r#"{"gh": {"domains": ["github.com"]}}"#).egress.digest(),
        digest
    );
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e2b_network_options_only_narrow_the_tenant_policy() {
    let tmp = fresh();
    let server = Server::start_full(tmp.path(), 20, None, Duration::ZERO, ROOMY, egress_config(PROFILES)).await;
    set_tenant_policy(
        &server,
        r#"{"allow": {"domains": ["a.test", "b.test"], "ips": ["198.51.100.7"], "cidrs": ["203.0.113.0/24"]},
            "deny": {"domains": ["c.test"], "ips": ["203.0.113.66"]}}"#,
    )
    .await;
    let create = |body: Value| {
        let server = &server;
        async move {
            let (status, b) = server.e2b(Method::POST, "/sandboxes", body).await;
            (status, b)
        }
    };
    let id_of = |b: &Value| b["sandboxID"].as_str().unwrap().to_string();
    let mut made = Vec::new();

    // Absent or true: the tenant's default policy (base + default profiles).
    for body in [
        json!({"templateID": "base"}),
        json!({"templateID": "base", "allow_internet_access": true}),
    ] {
        let (status, b) = create(body).await;
        assert_eq!(status, 201, "{b}");
        let id = id_of(&b);
        let r = egress_report(&server, &id).await;
        assert_eq!(r["policy"]["sealed"], json!(false));
        assert_eq!(r["policy"]["tenant_allow"]["domains"], json!(["a.test", "b.test"]));
        assert_eq!(sandbox_egress(&server, &id).await["profiles"], json!(["pypi"]));
        let (_, info) = server.e2b(Method::GET, &format!("/sandboxes/{id}"), json!({})).await;
        assert_eq!(info["allowInternetAccess"], json!(true), "{info}");
        made.push(id);
    }

    // False: sealed, recorded on the sandbox.
    let (status, b) = create(json!({"templateID": "base", "allow_internet_access": false})).await;
    assert_eq!(status, 201, "{b}");
    let sealed = id_of(&b);
    assert_eq!(
        sandbox_egress(&server, &sealed).await,
        json!({"profiles": [], "sealed": true})
    );
    let r = egress_report(&server, &sealed).await;
    assert_eq!(r["policy"]["sealed"], json!(true));
    assert_eq!(
        r["policy"]["tenant_allow"],
        json!({"domains": [], "ips": [], "cidrs": []})
    );
    assert_eq!(r["policy"]["profiles"], json!({}));
    let (_, info) = server
        .e2b(Method::GET, &format!("/sandboxes/{sealed}"), json!({}))
        .await;
    assert_eq!(info["allowInternetAccess"], json!(false), "{info}");
    made.push(sealed);

    // allowOut inside the tenant's policy: exactly those entries (the common E2B form, with a
    // denyOut of everything, works: allowOut takes precedence as in E2B).
    let (status, b) = create(json!({"templateID": "base", "network": {
        "allowOut": ["a.test", "198.51.100.7", "203.0.113.0/28", "pypi.org"],
        "denyOut": ["0.0.0.0/0"], "allowPublicTraffic": false}}))
    .await;
    assert_eq!(status, 201, "{b}");
    let narrowed = id_of(&b);
    let r = egress_report(&server, &narrowed).await;
    assert_eq!(
        r["policy"]["tenant_allow"],
        json!({"domains": ["a.test", "pypi.org"], "ips": ["198.51.100.7"], "cidrs": ["203.0.113.0/28"]})
    );
    assert_eq!(
        r["policy"]["tenant_deny"]["domains"],
        json!(["c.test"]),
        "the tenant's denies stay"
    );
    assert_eq!(r["policy"]["profiles"], json!({}));
    made.push(narrowed);

    // denyOut alone adds denies to the tenant's.
    let (status, b) =
        create(json!({"templateID": "base", "network": {"denyOut": ["b.test", "198.51.100.0/24"]}})).await;
    assert_eq!(status, 201, "{b}");
    let denied = id_of(&b);
    let r = egress_report(&server, &denied).await;
    assert_eq!(r["policy"]["tenant_deny"]["domains"], json!(["b.test", "c.test"]));
    assert_eq!(r["policy"]["tenant_deny"]["cidrs"], json!(["198.51.100.0/24"]));
    assert_eq!(r["policy"]["tenant_allow"]["domains"], json!(["a.test", "b.test"]));
    made.push(denied);

    // Widening, wildcards and public traffic are 400s naming the entry; nothing is created.
    let (_, before) = server.v1(Method::GET, "/sandboxes", None).await;
    for (network, needle) in [
        (json!({"allowOut": ["other.test"]}), "other.test"),
        (json!({"allowOut": ["c.test"]}), "c.test"),
        (json!({"allowOut": ["github.com"]}), "github.com"),
        (json!({"allowOut": ["1.1.1.1"]}), "1.1.1.1"),
        (json!({"allowOut": ["203.0.112.0/23"]}), "203.0.112.0/23"),
        (json!({"allowOut": ["203.0.113.64/28"]}), "203.0.113.64/28"),
        (json!({"allowOut": ["*.a.test"]}), "*.a.test"),
        (json!({"denyOut": ["*.b.test"]}), "*.b.test"),
        (json!({"allowOut": ["10.0.0.1/8"]}), "10.0.0.1/8"),
        (json!({"allowPublicTraffic": true}), "allowPublicTraffic"),
    ] {
        let (status, b) = create(json!({"templateID": "base", "network": network})).await;
        assert_eq!(status, 400, "{network}: {b}");
        assert_eq!(b["code"], json!(400), "{b}");
        let m = b["message"].as_str().unwrap();
        assert!(m.contains(needle), "{network}: {b}");
        let field = network.as_object().unwrap().keys().next().unwrap().clone();
        assert!(m.contains(&field), "the message names the option as E2B spells it: {b}");
    }
    // A sealed create still refuses a wildcard by name.
    let (status, b) = create(json!({"templateID": "base", "allow_internet_access": false,
        "network": {"allowOut": ["*.a.test"]}}))
    .await;
    assert_eq!(status, 400, "{b}");
    let (_, after) = server.v1(Method::GET, "/sandboxes", None).await;
    assert_eq!(
        before["sandboxes"].as_array().unwrap().len(),
        after["sandboxes"].as_array().unwrap().len()
    );
    assert_eq!(
        server.core().egress.len(),
        made.len(),
        "refused creates leave no egress state"
    );

    for id in &made {
        server.delete(id).await;
    }
    server.stop().await;
    assert_no_vms(tmp.path());
}

async fn set_quota(server: &Server, quota: Value) {
    let q: airlock_server::model::Quota = serde_json::from_value(quota).unwrap();
    server.core().set_tenant_quota("default", q).await.unwrap();
}

async fn create_sized(server: &Server, vcpu: u32, memory_mib: u32, disk_mib: u32) -> (u16, Value) {
    let body =
        json!({ "template": "seed", "resources": { "vcpu": vcpu, "memory_mib": memory_mib, "disk_mib": disk_mib } });
    server.v1(Method::POST, "/sandboxes", Some(body)).await
}

async fn live_count(server: &Server) -> usize {
    let (_, list) = server.v1(Method::GET, "/sandboxes", None).await;
    list["sandboxes"].as_array().unwrap().len()
}

async fn delete_all(server: &Server) {
    let (_, list) = server.v1(Method::GET, "/sandboxes", None).await;
    for sb in list["sandboxes"].as_array().unwrap() {
        server.delete(sb["id"].as_str().unwrap()).await;
    }
}

/// Each tenant quota, exhausted, refuses the next create by name (both doors), creates nothing,
/// and `GET /v1/tenant` shows the limits in force and the usage against them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_tenant_quota_refuses_by_name_and_creates_nothing() {
    let tmp = fresh();
    let server = Server::start(tmp.path(), 20, None).await;
    let (status, info) = server.v1(Method::GET, "/tenant", None).await;
    assert_eq!(status, 200, "{info}");
    assert_eq!(info["name"], "default");
    // The server's defaults where the tenant has none of its own.
    assert_eq!(info["quota"]["sandboxes"], 20, "{info}");
    // Half the node's vCPU budget (1024 CPUs x 16), 60 creates a minute.
    assert_eq!(info["quota"]["vcpu"], 8192, "{info}");
    assert_eq!(info["quota"]["creates_per_minute"], 60, "{info}");

    for (quota, first, second, needle) in [
        (
            json!({"sandboxes": 1}),
            (1, 512, 2048),
            (1, 512, 2048),
            "has 1 live sandboxes, its quota of 1 (sandboxes)",
        ),
        (
            json!({"vcpu": 3}),
            (2, 512, 2048),
            (2, 512, 2048),
            "vcpu quota is 3: its live sandboxes hold 2 and this one asks for 2",
        ),
        (
            json!({"memory_mib": 1024}),
            (1, 768, 2048),
            (1, 512, 2048),
            "memory_mib quota is 1024: its live sandboxes hold 768 and this one asks for 512",
        ),
        (
            json!({"disk_mib": 5000}),
            (1, 512, 3000),
            (1, 512, 3000),
            "disk_mib quota is 5000: its live sandboxes and snapshots hold 3000 and this one asks for 3000",
        ),
    ] {
        set_quota(&server, quota.clone()).await;
        let (status, body) = create_sized(&server, first.0, first.1, first.2).await;
        assert_eq!(status, 202, "{quota}: {body}");
        server.wait_op(body["operation"]["id"].as_str().unwrap()).await;
        let before = live_count(&server).await;
        let (status, body) = create_sized(&server, second.0, second.1, second.2).await;
        assert_eq!(
            (status, body["code"].as_str()),
            (429, Some("quota_exceeded")),
            "{quota}: {body}"
        );
        let m = body["message"].as_str().unwrap();
        assert!(m.contains(needle) && m.contains("tenant default"), "{quota}: {m}");
        // The E2B door (whose creates take the template's 1 vCPU, 512 MiB) refuses alike.
        if quota.get("sandboxes").is_some() || quota.get("memory_mib").is_some() {
            let (status, body) = server
                .e2b(Method::POST, "/sandboxes", json!({ "templateID": "base" }))
                .await;
            assert_eq!((status, body["code"].as_u64()), (429, Some(429)), "{quota}: {body}");
            assert!(body["message"].as_str().unwrap().contains(needle), "{body}");
        }
        assert_eq!(live_count(&server).await, before, "a refused create made nothing");
        let (_, info) = server.v1(Method::GET, "/tenant", None).await;
        let key = quota.as_object().unwrap().keys().next().unwrap().clone();
        assert_eq!(info["quota"][&key], quota[&key], "{info}");
        let used = info["usage"][&key].as_u64().unwrap();
        assert!(used > 0 && used <= quota[&key].as_u64().unwrap(), "{info}");
        delete_all(&server).await;
    }

    // Zero is refused by name, with the fix.
    let err = server
        .core()
        .set_tenant_quota(
            "default",
            airlock_server::model::Quota {
                vcpu: Some(0),
                ..Default::default()
            },
        )
        .await
        .unwrap_err();
    assert!(
        err.to_string().contains("vcpu") && err.to_string().contains("at least 1"),
        "{err}"
    );
    server.stop().await;
    assert_no_vms(tmp.path());
}

/// `creates_per_minute`: past it, 429 `rate_limited` with `Retry-After` on both doors; failed
/// and deleted sandboxes still count (it limits creates, not live sandboxes).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn creates_per_minute_is_a_429_with_retry_after_on_both_doors() {
    let tmp = fresh();
    let server = Server::start(tmp.path(), 20, None).await;
    set_quota(&server, json!({"creates_per_minute": 2})).await;
    let a = server.running_sandbox().await;
    server.delete(&a).await;
    server.running_sandbox().await;
    let body = json!({ "template": "seed" }).to_string();
    let auth = format!("Bearer {}", server.key);
    let r = server
        .send(
            Method::POST,
            "/v1/sandboxes",
            &[("authorization", &auth), ("content-type", "application/json")],
            Body::from(body),
        )
        .await;
    let retry: u64 = r.headers["retry-after"].to_str().unwrap().parse().unwrap();
    assert!((1..=60).contains(&retry), "{retry}");
    let (status, b) = r.json().await;
    assert_eq!((status, b["code"].as_str()), (429, Some("rate_limited")), "{b}");
    assert!(
        b["message"]
            .as_str()
            .unwrap()
            .contains("may create 2 sandboxes a minute"),
        "{b}"
    );
    let r = server
        .send(
            Method::POST,
            "/sandboxes",
            &[("x-api-key", &server.key), ("content-type", "application/json")],
            Body::from(json!({ "templateID": "base" }).to_string()),
        )
        .await;
    assert!(r.headers.contains_key("retry-after"));
    assert_eq!(r.json().await.0, 429);
    let (_, info) = server.v1(Method::GET, "/tenant", None).await;
    assert_eq!(info["usage"]["creates_last_minute"], 2, "{info}");
    // Raised: admitted at once.
    set_quota(&server, json!({"creates_per_minute": 3})).await;
    server.running_sandbox().await;
    delete_all(&server).await;
    server.stop().await;
    assert_no_vms(tmp.path());
}

/// Concurrent creates through both doors never overshoot a tenant's vcpu quota.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_creates_never_overshoot_the_tenant_vcpu_quota() {
    let tmp = fresh();
    let server = Arc::new(Server::start(tmp.path(), 20, None).await);
    set_quota(&server, json!({"vcpu": 4})).await;
    let tasks: Vec<_> = (0..10)
        .map(|i| {
            let server = server.clone();
            tokio::spawn(async move {
                if i % 2 == 0 {
                    let (s, _) = create_sized(&server, 1, 512, 2048).await;
                    s == 202
                } else {
                    let (s, _) = server
                        .e2b(Method::POST, "/sandboxes", json!({ "templateID": "base" }))
                        .await;
                    s == 201
                }
            })
        })
        .collect();
    let mut admitted = 0;
    for t in tasks {
        admitted += t.await.unwrap() as usize;
    }
    assert_eq!(admitted, 4);
    let (_, info) = server.v1(Method::GET, "/tenant", None).await;
    assert_eq!(info["usage"]["vcpu"], 4, "{info}");
    delete_all(&server).await;
    Arc::try_unwrap(server).ok().unwrap().stop().await;
    assert_no_vms(tmp.path());
}

async fn login(server: &Server, username: &str, password: &str) -> (u16, Value) {
    login_response(server, username, password).await.json().await
}

async fn login_response(server: &Server, username: &str, password: &str) -> Resp {
    server
        .send(
            Method::POST,
            "/v1/admin/login",
            &[("content-type", "application/json")],
            Body::from(json!({"username": username, "password": password}).to_string()),
        )
        .await
}

/// `root@local`: a generated password on a first start without one (returned once, stored only
/// hashed), no default password anywhere, short-lived admin tokens that a new password ends; the
/// admin routes refuse tenant keys; deleting a tenant revokes its keys and deletes its sandboxes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn console_account_and_admin_routes() {
    let tmp = fresh();
    let server = Server::start(tmp.path(), 20, None).await;
    let generated = server
        .core()
        .ensure_console_account(None)
        .await
        .unwrap()
        .expect("a generated password");
    let core = server.core().clone();
    assert!(generated.len() >= 20);
    assert!(
        core.ensure_console_account(None).await.unwrap().is_none(),
        "only the first start makes one"
    );
    let db = std::fs::read(tmp.path().join("airlock.db")).unwrap();
    assert!(
        !db.windows(generated.len()).any(|w| w == generated.as_bytes()),
        "only its hash is stored"
    );
    for (user, pw) in [
        ("root@local", ""),
        ("root@local", "admin"),
        ("root@local", "password"),
        ("root@local", "root"),
        ("admin", "admin"),
    ] {
        let (status, body) = login(&server, user, pw).await;
        assert_eq!(
            (status, body["code"].as_str()),
            (401, Some("unauthorized")),
            "{user}/{pw}: {body}"
        );
    }
    // Five failures fill the minute's window: the next sign-in, even with the right password,
    // is refused before any password is checked, saying when to retry.
    let resp = login_response(&server, "root@local", &generated).await;
    let retry_after: u64 = resp.headers["retry-after"].to_str().unwrap().parse().unwrap();
    assert!((1..=60).contains(&retry_after), "{retry_after}");
    let (status, body) = resp.json().await;
    assert_eq!((status, body["code"].as_str()), (429, Some("rate_limited")), "{body}");
    assert!(body["message"].as_str().unwrap().contains("failed sign-ins"), "{body}");
    let rows = core.store.audit(&Default::default(), 100).await.unwrap();
    assert!(rows.iter().any(|r| r.action == "login" && r.result == "throttled"));
    drop(core);
    // The window lives in memory: a restart forgives it.
    let server = server.restart().await;
    let core = server.core().clone();
    let (status, body) = login(&server, "root", &generated).await;
    assert_eq!(
        (status, body["code"].as_str()),
        (401, Some("unauthorized")),
        "only root@local: {body}"
    );
    let (status, t) = login(&server, "root@local", &generated).await;
    assert_eq!(status, 200, "{t}");
    let token = t["token"].as_str().unwrap().to_string();
    assert!(t["expires_at"].is_string());

    // The admin token administers; a tenant key gets 403, nothing 401; the token is no tenant key.
    assert_eq!(server.v1_as(&token, Method::GET, "/admin/tenants", None).await.0, 200);
    // The node's counts and pools: the platform account's view of `/v1/system`.
    let (status, sys) = server.v1_as(&token, Method::GET, "/admin/system", None).await;
    assert_eq!(status, 200, "{sys}");
    assert!(sys["capacity"]["cpus"].is_u64() && sys["pools"].is_array(), "{sys}");
    let (status, body) = server.v1(Method::GET, "/admin/tenants", None).await;
    assert_eq!((status, body["code"].as_str()), (403, Some("forbidden")), "{body}");
    assert_eq!(
        server
            .json(Method::GET, "/v1/admin/tenants", &[], Body::empty())
            .await
            .0,
        401
    );
    assert_eq!(server.v1_as(&token, Method::GET, "/sandboxes", None).await.0, 401);

    // A second tenant with a key and a sandbox; deleting the tenant takes both.
    let (status, _) = server
        .v1_as(&token, Method::POST, "/admin/tenants", Some(json!({"name": "two"})))
        .await;
    assert_eq!(status, 201);
    let (status, bad) = server
        .v1_as(
            &token,
            Method::POST,
            "/admin/tenants",
            Some(json!({"name": "Two Words"})),
        )
        .await;
    assert_eq!((status, bad["code"].as_str()), (422, Some("invalid_argument")), "{bad}");
    let (status, k) = server
        .v1_as(
            &token,
            Method::POST,
            "/admin/tenants/two/keys",
            Some(json!({"name": "ci", "e2b": true})),
        )
        .await;
    assert_eq!(status, 201, "{k}");
    let key = k["key"].as_str().unwrap().to_string();
    assert!(
        key.starts_with("e2b_") && k["id"].as_str().unwrap().starts_with("key_"),
        "{k}"
    );
    let (status, created) = server
        .v1_as(&key, Method::POST, "/sandboxes", Some(json!({"template": "seed"})))
        .await;
    assert_eq!(status, 202, "{created}");
    let id = created["sandbox_id"].as_str().unwrap().to_string();
    let op_path = format!("/operations/{}", created["operation"]["id"].as_str().unwrap());
    let deadline = Instant::now() + Duration::from_secs(10);
    while server.v1_as(&key, Method::GET, &op_path, None).await.1["state"] != "succeeded" {
        assert!(Instant::now() < deadline, "the create did not finish");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The default tenant never sees it.
    assert_eq!(server.v1(Method::GET, &format!("/sandboxes/{id}"), None).await.0, 404);
    let (status, gone) = server.v1_as(&token, Method::DELETE, "/admin/tenants/two", None).await;
    assert_eq!((status, gone["sandboxes_deleting"].as_u64()), (202, Some(1)), "{gone}");
    assert_eq!(server.v1_as(&key, Method::GET, "/tenant", None).await.0, 401);
    let deadline = Instant::now() + Duration::from_secs(30);
    while core.store.sandbox_by_id(&id).await.unwrap().unwrap().state != SandboxState::Deleted {
        assert!(Instant::now() < deadline, "the tenant's sandbox was not deleted");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (status, _) = server.v1_as(&token, Method::GET, "/admin/tenants/two", None).await;
    assert_eq!(status, 404);
    let (status, _) = server
        .v1_as(&token, Method::DELETE, "/admin/tenants/default", None)
        .await;
    assert_eq!(status, 409);

    // The audit log has each step, with no secret in it.
    let (_, audit) = server.v1_as(&token, Method::GET, "/admin/audit?limit=1000", None).await;
    let text = audit.to_string();
    for action in [
        "login",
        "tenant.create",
        "key.create",
        "sandbox.create",
        "tenant.delete",
        "sandbox.delete",
    ] {
        assert!(text.contains(&format!("\"{action}\"")), "no {action} in {audit}");
    }
    for secret in [generated.as_str(), token.as_str(), key.as_str()] {
        assert!(!text.contains(secret));
    }
    // Who: the key by its public id, the platform account for what it did.
    let key_actor = format!("key:{}", k["id"].as_str().unwrap());
    let rows = audit["entries"].as_array().unwrap();
    assert!(
        rows.iter()
            .any(|r| r["action"] == "sandbox.create" && r["actor"] == key_actor.as_str()),
        "{audit}"
    );
    assert!(
        rows.iter()
            .any(|r| r["action"] == "sandbox.delete" && r["actor"] == "root@local"),
        "{audit}"
    );

    // A password chosen later replaces the generated one and ends its sign-ins.
    assert!(core
        .ensure_console_account(Some("chosen-password-42"))
        .await
        .unwrap()
        .is_none());
    assert_eq!(server.v1_as(&token, Method::GET, "/admin/tenants", None).await.0, 401);
    assert_eq!(login(&server, "root@local", &generated).await.0, 401);
    assert_eq!(login(&server, "root@local", "chosen-password-42").await.0, 200);
    let short = core.ensure_console_account(Some("short")).await.unwrap_err();
    assert!(short.to_string().contains("at least 12"), "{short}");
    server.stop().await;
    assert_no_vms(tmp.path());
}
