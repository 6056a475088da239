//! What counts against a tenant's disk quota and the node's disk budget besides sandbox disks
//! (snapshots, forks' images, saved memory), tenants whose names come back, and the default
//! quotas (issue 23: findings 6, 7 and 17).

use super::*;
use airlock_server::core::accounts::Admin;

const MIB: u64 = 1 << 20;
/// What a fake save holds once saved, MiB.
const SAVED_MIB: u64 = FAKE_IMAGE_BYTES / MIB;

async fn snapshot(server: &Server, key: &str, id: &str, name: &str) -> (u16, Value) {
    server
        .v1_as(
            key,
            Method::POST,
            &format!("/sandboxes/{id}/snapshots"),
            Some(json!({ "name": name })),
        )
        .await
}

/// Wait for the operation an answer names to succeed, as `key`'s tenant.
async fn wait_op_as(server: &Server, key: &str, answer: &Value) {
    let op = answer["operation"]["id"].as_str().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (_, o) = server.v1_as(key, Method::GET, &format!("/operations/{op}"), None).await;
        if o["state"] == "succeeded" {
            return;
        }
        assert!(Instant::now() < deadline, "{o}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn usage(server: &Server, key: &str) -> Value {
    let (status, info) = server.v1_as(key, Method::GET, "/tenant", None).await;
    assert_eq!(status, 200, "{info}");
    info["usage"].clone()
}

/// Snapshots hold disk: each is charged its sandbox's disk plus memory (the most a save writes)
/// while it is saved, then its size; past the tenant's disk quota the next is refused like a
/// create, `GET /v1/tenant` shows them, and deleting one frees its place.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshots_count_against_the_disk_quota_and_deleting_frees_it() {
    let tmp = fresh();
    let server = Server::start(tmp.path(), 20, None).await;
    let key = server.key.clone();
    let id = server.running_sandbox().await;
    // The sandbox holds 2048; each save asks for 2048 + 512 and then holds its 98.
    let limit = 2048 + 2560 + SAVED_MIB;
    set_quota(&server, json!({ "disk_mib": limit })).await;

    let (status, first) = snapshot(&server, &key, &id, "one").await;
    assert_eq!(status, 201, "{first}");
    let (status, second) = snapshot(&server, &key, &id, "two").await;
    assert_eq!(status, 201, "{second}");
    assert_eq!(second["bytes"], FAKE_IMAGE_BYTES, "{second}");
    let u = usage(&server, &key).await;
    assert_eq!(u["snapshots"], 2, "{u}");
    assert_eq!(u["snapshot_disk_mib"], 2 * SAVED_MIB, "{u}");
    assert_eq!(u["disk_mib"], 2048 + 2 * SAVED_MIB, "{u}");

    let (status, third) = snapshot(&server, &key, &id, "three").await;
    assert_eq!(
        (status, third["code"].as_str()),
        (429, Some("quota_exceeded")),
        "{third}"
    );
    let m = third["message"].as_str().unwrap();
    assert!(
        m.contains(&format!("disk_mib quota is {limit}"))
            && m.contains(&format!("hold {}", 2048 + 2 * SAVED_MIB))
            && m.contains("asks for 2560"),
        "{m}"
    );
    // Nothing of the refused one is left: no record, no image.
    let (_, list) = server.v1(Method::GET, "/snapshots", None).await;
    assert_eq!(list["snapshots"].as_array().unwrap().len(), 2, "{list}");
    assert_eq!(server.core().nodes().image_ids().len(), 2);
    // A fork's image is a snapshot too: refused alike.
    let (status, fork) = server
        .v1(
            Method::POST,
            &format!("/sandboxes/{id}/fork"),
            Some(json!({ "count": 1 })),
        )
        .await;
    assert_eq!((status, fork["code"].as_str()), (429, Some("quota_exceeded")), "{fork}");

    // Deleting one gives its place back.
    let (status, _) = server
        .v1(
            Method::DELETE,
            &format!("/snapshots/{}", first["id"].as_str().unwrap()),
            None,
        )
        .await;
    assert_eq!(status, 204);
    let u = usage(&server, &key).await;
    assert_eq!(
        (u["snapshots"].as_u64(), u["disk_mib"].as_u64()),
        (Some(1), Some(2048 + SAVED_MIB)),
        "{u}"
    );
    let (status, third) = snapshot(&server, &key, &id, "three").await;
    assert_eq!(status, 201, "{third}");
    server.delete(&id).await;
    server.stop().await;
    assert_no_vms(tmp.path());
}

/// The node's disk budget counts every tenant's snapshots too: a save that does not fit is
/// `node_budget_exceeded`, like a create.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshots_count_against_the_node_disk_budget() {
    let tmp = fresh();
    let config = Config {
        disk_reserve_mib: 0,
        tenant_share: 1.0,
        ..Config::default()
    };
    // Room for the sandbox (2048) and one save under way (2560), not for a second next to the
    // first once saved (98).
    let server = Server::start_sized(tmp.path(), 20, node(64, 1 << 20, 2048 + 2560 + 50), config).await;
    let key = server.key.clone();
    let id = server.running_sandbox().await;
    let (status, body) = snapshot(&server, &key, &id, "one").await;
    assert_eq!(status, 201, "{body}");
    // Saved, it holds its 98: a second save (2560) no longer fits next to it.
    let (status, body) = snapshot(&server, &key, &id, "two").await;
    assert_eq!(
        (status, body["code"].as_str()),
        (503, Some("node_budget_exceeded")),
        "{body}"
    );
    assert!(body["message"].as_str().unwrap().contains("disk budget"), "{body}");
    // Nor does a create that would fit next to the sandbox alone.
    let (status, body) = create_sized(&server, 1, 512, 2600).await;
    assert_eq!(
        (status, body["code"].as_str()),
        (503, Some("node_budget_exceeded")),
        "{body}"
    );
    server.delete(&id).await;
    server.stop().await;
    assert_no_vms(tmp.path());
}

/// A suspend writes the sandbox's memory to disk: it is charged to the disk quota before it
/// starts (refused past it), and a sandbox whose timeout suspends it holds that place from its
/// create.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn saved_memory_counts_against_the_disk_quota() {
    let tmp = fresh();
    let server = Server::start(tmp.path(), 20, None).await;
    let key = server.key.clone();
    let id = server.running_sandbox().await;
    set_quota(&server, json!({ "disk_mib": 2048 + 511 })).await;
    let (status, body) = server.v1(Method::POST, &format!("/sandboxes/{id}/suspend"), None).await;
    assert_eq!((status, body["code"].as_str()), (429, Some("quota_exceeded")), "{body}");
    assert!(body["message"].as_str().unwrap().contains("asks for 512"), "{body}");
    assert_eq!(server.sandbox_state(&id).await, "running");
    server.delete(&id).await;

    let (status, body) = server
        .v1(
            Method::POST,
            "/sandboxes",
            Some(json!({ "template": "seed", "on_timeout": "suspend" })),
        )
        .await;
    assert_eq!((status, body["code"].as_str()), (429, Some("quota_exceeded")), "{body}");
    set_quota(&server, json!({ "disk_mib": 2048 + 512 })).await;
    let (status, body) = server
        .v1(
            Method::POST,
            "/sandboxes",
            Some(json!({ "template": "seed", "on_timeout": "suspend" })),
        )
        .await;
    assert_eq!(status, 202, "{body}");
    assert_eq!(usage(&server, &key).await["disk_mib"], 2048 + 512);
    let op = server.wait_op(body["operation"]["id"].as_str().unwrap()).await;
    assert_eq!(op["state"], "succeeded", "{op}");
    server.delete(body["sandbox_id"].as_str().unwrap()).await;
    server.stop().await;
    assert_no_vms(tmp.path());
}

/// A tenant's id is not its name, and deleting it deletes its snapshots (records and images,
/// which hold its sandboxes' memory): a new tenant of the same name inherits nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_tenant_of_a_deleted_ones_name_inherits_nothing() {
    let tmp = fresh();
    let server = Server::start(tmp.path(), 20, None).await;
    let core = server.core().clone();
    let admin = Admin {
        account: "root@local".into(),
    };
    let made = core.create_tenant(&admin, "x").await.unwrap();
    assert_eq!(made.name, "x");
    let old = core.store().tenant_by_name("x").await.unwrap().unwrap();
    assert_ne!(old.id, "x", "a new tenant's id is not its name");
    assert!(old.id.starts_with("tn_"), "{}", old.id);
    let key = core.mint_key(&admin, "x", "k", false).await.unwrap().key;

    let (status, body) = server
        .v1_as(&key, Method::POST, "/sandboxes", Some(json!({ "template": "seed" })))
        .await;
    assert_eq!(status, 202, "{body}");
    let id = body["sandbox_id"].as_str().unwrap().to_string();
    wait_op_as(&server, &key, &body).await;
    let (status, snap) = snapshot(&server, &key, &id, "secrets").await;
    assert_eq!(status, 201, "{snap}");
    let image = snap["id"].as_str().unwrap().to_string();
    let image_dir = tmp.path().join("images").join(&image);
    assert!(image_dir.is_dir());

    // E2B state of its sandbox (the alias the SDK used).
    core.store().set_e2b_alias(&id, "base").await.unwrap();

    core.delete_tenant(&admin, "x").await.unwrap();
    assert!(!image_dir.exists(), "the deleted tenant's image is still on disk");
    assert_eq!(core.store().e2b_alias(&id).await.unwrap(), None, "its E2B state stays");
    assert!(core.store().tenant_snapshots(&old.id).await.unwrap().is_empty());
    let deadline = Instant::now() + Duration::from_secs(10);
    while core.store().sandbox_by_id(&id).await.unwrap().unwrap().state != SandboxState::Deleted {
        assert!(Instant::now() < deadline, "the tenant's sandbox was not deleted");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    core.create_tenant(&admin, "x").await.unwrap();
    let new = core.store().tenant_by_name("x").await.unwrap().unwrap();
    assert_ne!(new.id, old.id);
    let key = core.mint_key(&admin, "x", "k", false).await.unwrap().key;
    let (status, list) = server.v1_as(&key, Method::GET, "/snapshots", None).await;
    assert_eq!(
        (status, list["snapshots"].as_array().map(Vec::len)),
        (200, Some(0)),
        "{list}"
    );
    for by in [image.as_str(), "secrets"] {
        let (status, _) = server.v1_as(&key, Method::GET, &format!("/snapshots/{by}"), None).await;
        assert_eq!(status, 404, "{by}");
        let (status, body) = server
            .v1_as(&key, Method::POST, "/sandboxes", Some(json!({ "template": by })))
            .await;
        assert_eq!(status, 404, "{by}: {body}");
    }
    let (status, list) = server.v1_as(&key, Method::GET, "/sandboxes?state=deleted", None).await;
    assert_eq!(
        (status, list["sandboxes"].as_array().map(Vec::len)),
        (200, Some(0)),
        "{list}"
    );
    let u = usage(&server, &key).await;
    assert_eq!(
        (u["snapshots"].as_u64(), u["disk_mib"].as_u64()),
        (Some(0), Some(0)),
        "{u}"
    );
    server.stop().await;
    assert_no_vms(tmp.path());
}

/// Without a quota of its own, a tenant gets half of each of the node's budgets: past its share
/// of vCPUs or memory it is refused `quota_exceeded`, while the node still has room for others.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_gets_half_the_node_by_default() {
    let tmp = fresh();
    let config = Config {
        memory_reserve_mib: 1024,
        vcpu_overcommit: 8.0,
        ..Config::default()
    };
    // 8 vCPUs, 4096 MiB of memory: 4 and 2048 for each tenant.
    let server = Server::start_sized(tmp.path(), 20, node(1, 4096 + 1024, 1 << 30), config).await;
    let (_, info) = server.v1(Method::GET, "/tenant", None).await;
    assert_eq!(
        (info["quota"]["vcpu"].as_u64(), info["quota"]["memory_mib"].as_u64()),
        (Some(4), Some(2048)),
        "{info}"
    );
    assert_eq!(info["quota"]["creates_per_minute"], 60, "{info}");

    // Memory: two of 1024 MiB, not a third.
    for _ in 0..2 {
        let (status, body) = create_sized(&server, 1, 1024, 2048).await;
        assert_eq!(status, 202, "{body}");
        server.wait_op(body["operation"]["id"].as_str().unwrap()).await;
    }
    let (status, body) = create_sized(&server, 1, 1024, 2048).await;
    assert_eq!((status, body["code"].as_str()), (429, Some("quota_exceeded")), "{body}");
    assert!(
        body["message"].as_str().unwrap().contains("memory_mib quota is 2048"),
        "{body}"
    );
    let (status, body) = server
        .e2b(Method::POST, "/sandboxes", json!({ "templateID": "base" }))
        .await;
    assert_eq!(status, 429, "{body}");
    delete_all(&server).await;

    // vCPUs: four of 1, not a fifth.
    for _ in 0..4 {
        let (status, body) = create_sized(&server, 1, 256, 2048).await;
        assert_eq!(status, 202, "{body}");
        server.wait_op(body["operation"]["id"].as_str().unwrap()).await;
    }
    let (status, body) = create_sized(&server, 1, 256, 2048).await;
    assert_eq!((status, body["code"].as_str()), (429, Some("quota_exceeded")), "{body}");
    assert!(body["message"].as_str().unwrap().contains("vcpu quota is 4"), "{body}");

    // The other half is there for another tenant.
    let other = server
        .core()
        .store()
        .create_key("other", KeyFormat::Airlock)
        .await
        .unwrap();
    let (status, body) = server
        .v1_as(&other, Method::POST, "/sandboxes", Some(json!({ "template": "seed" })))
        .await;
    assert_eq!(status, 202, "{body}");
    wait_op_as(&server, &other, &body).await;
    let (status, body) = server
        .v1_as(
            &other,
            Method::DELETE,
            &format!("/sandboxes/{}", body["sandbox_id"].as_str().unwrap()),
            None,
        )
        .await;
    assert_eq!(status, 202, "{body}");
    wait_op_as(&server, &other, &body).await;
    delete_all(&server).await;
    server.stop().await;
    assert_no_vms(tmp.path());
}
