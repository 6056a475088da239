//! Runs (issue 25): every VM a node starts is a new run of its sandbox's id, listed in the
//! node's report and kept in the sandbox's record. A delete naming a run ends only that run: one
//! sent from an old report cannot end a VM started since, and a leftover VM of a sandbox that
//! runs elsewhere is removed where it is, after the grace, without touching the sandbox. And
//! fencing: a change from a replica whose lease of the operation was taken over is refused.

use super::cluster::{node_of, replica_config};
use super::common::cluster::{node_link, ClusterNode};
use super::common::*;
use airlock_runtime::fake;
use airlock_server::core::{Config, NodeError};
use airlock_server::nodes::{Nodes, RemoteNode, VmRequest, VmState};
use axum::body::Body;
use axum::http::Method;
use std::time::{Duration, Instant};

pub(crate) fn vm_request(id: &str) -> VmRequest {
    VmRequest {
        id: id.into(),
        template: "seed".into(),
        resources: Default::default(),
        image_id: None,
        env: Default::default(),
        egress: Default::default(),
        node: String::new(),
        moved_from: None,
        keep_image: false,
        volumes: Vec::new(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delete_naming_an_earlier_run_leaves_the_newer_one() {
    let dir = fresh();
    let node = ClusterNode::start(dir.path(), ROOMY, 0).await;
    let remote = RemoteNode::connect(node.addr, node_link()).await.unwrap();
    let id = "runs00000001";

    let first = remote.create(&vm_request(id)).await.unwrap();
    assert_eq!(first.run.len(), 16, "a run is 8 random bytes in hex: {:?}", first.run);
    assert_eq!(remote.vm_state_now(id).await, Some(VmState::Running));
    assert_eq!(
        remote.vm_run(id).as_deref(),
        Some(first.run.as_str()),
        "the report lists the run"
    );
    remote.delete(id, Some(&first.run)).await.unwrap();
    assert_eq!(remote.vm_state_now(id).await, Some(VmState::Gone));

    // The same id started again is another run; a delete meant for the first (say, a reaper's
    // from a report read before) is refused and the VM runs on.
    let second = remote.create(&vm_request(id)).await.unwrap();
    assert_ne!(second.run, first.run);
    let stale = remote.delete(id, Some(&first.run)).await;
    assert!(matches!(stale, Err(NodeError::StaleRun(ref s)) if s == id), "{stale:?}");
    assert!(matches!(
        remote.delete(id, Some("../../x")).await,
        Err(NodeError::StaleRun(_))
    ));
    assert_eq!(remote.vm_state_now(id).await, Some(VmState::Running));
    assert_eq!(fake::live_vms(dir.path()).len(), 1);
    // Paused and resumed, it is still the same run (the fake VMM cannot suspend; the runtime
    // keeps the record, run and all, through a suspend).
    remote.pause(id).await.unwrap();
    remote.resume(id).await.unwrap();
    assert_eq!(remote.vm_state_now(id).await, Some(VmState::Running));
    assert_eq!(remote.vm_run(id).as_deref(), Some(second.run.as_str()));
    // A delete that names no run ends whatever run is there.
    remote.delete(id, None).await.unwrap();
    assert!(fake::live_vms(dir.path()).is_empty());
}

/// A VM of a sandbox's id on a node the sandbox's record does not name (a node that kept one
/// through a move, a create retried elsewhere): the replicas remove it once it has been so for
/// the node grace, naming its run, and the sandbox runs on where its record says.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vm_on_a_node_its_sandbox_is_not_on_goes_after_the_grace() {
    let (store_dir, dirs) = (fresh(), [fresh(), fresh()]);
    let nodes = [
        ClusterNode::start(dirs[0].path(), ROOMY, 0).await,
        ClusterNode::start(dirs[1].path(), ROOMY, 0).await,
    ];
    let addrs: Vec<_> = nodes.iter().map(|n| n.addr).collect();
    let config = Config {
        node_grace: Duration::from_secs(4),
        ..replica_config()
    };
    let a = Server::start_replica(store_dir.path(), &addrs, None, config.clone()).await;
    // A sandbox on the second node (the leftover goes on the first, which a lookup by the
    // nodes' reports alone would ask first).
    let mut made = Vec::new();
    let id = loop {
        let id = a.running_sandbox().await;
        if node_of(&a, &id).await == addrs[1].to_string() {
            break id;
        }
        made.push(id);
    };
    for other in made {
        a.delete(&other).await;
    }
    let (here, there) = (&nodes[1], &nodes[0]);
    let path = format!("/v1/sandboxes/{id}/files?path=/home/user/where.txt");
    let auth = format!("Bearer {}", a.key);
    let put = a
        .send(
            Method::PUT,
            &path,
            &[("authorization", &auth)],
            Body::from("the recorded run"),
        )
        .await;
    assert!(put.status < 300, "put: {}", put.status);
    // The record names the run its node reports.
    let home_node = RemoteNode::connect(here.addr, node_link()).await.unwrap();
    let row = a.core().store().sandbox_by_id(&id).await.unwrap().unwrap();
    assert!(!row.run.is_empty());
    assert_eq!(home_node.vm_run(&id), Some(row.run.clone()));

    // A VM of the same id on the other node, as a move's old node might have kept.
    let other = RemoteNode::connect(there.addr, node_link()).await.unwrap();
    let leftover = other.create(&vm_request(&id)).await.unwrap();
    assert_ne!(leftover.run, row.run);
    let planted = Instant::now();
    // A replica that never placed it routes by the record's node and run, not to the leftover.
    let b = Server::start_replica(store_dir.path(), &addrs, Some(&a.key), config).await;
    let got = b
        .send(Method::GET, &path, &[("authorization", &auth)], Body::empty())
        .await;
    assert_eq!(got.status, 200);
    assert_eq!(
        &axum::body::to_bytes(got.body, 1 << 20).await.unwrap()[..],
        b"the recorded run"
    );
    while !fake::live_vms(&there.dir).is_empty() {
        assert!(
            planted.elapsed() < Duration::from_secs(30),
            "the leftover VM still runs"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let took = planted.elapsed();
    println!("leftover removed after {took:?} (grace 4 s)");
    assert!(took >= Duration::from_secs(4), "removed within the grace ({took:?})");
    // The sandbox itself is untouched.
    assert_eq!(fake::live_vms(&here.dir).len(), 1);
    assert_eq!(a.sandbox_state(&id).await, "running");
    a.assert_answers(&id).await;
    a.delete(&id).await;
    a.stop().await;
    b.stop().await;
}

/// Fencing: a node refuses a change made for an operation under a lease epoch lower than one
/// it has seen for that operation (its replica stalled past the lease and another took the
/// operation over); other operations and calls made for none pass.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_change_under_a_lease_since_taken_over_is_refused() {
    use airlock_server::nodes::wire::{Carried, OPERATION};
    let dir = fresh();
    let node = ClusterNode::start(dir.path(), ROOMY, 0).await;
    let remote = RemoteNode::connect(node.addr, node_link()).await.unwrap();
    let id = "fence0000001";
    remote.create(&vm_request(id)).await.unwrap();
    let under = |op: &str, epoch| Carried { id: op.into(), epoch };
    // The operation's new holder (epoch 2) pauses it; the stalled one (epoch 1) wakes and
    // would delete it.
    OPERATION.scope(under("op_taken", 2), remote.pause(id)).await.unwrap();
    let late = OPERATION.scope(under("op_taken", 1), remote.delete(id, None)).await;
    assert!(
        matches!(late, Err(NodeError::Fenced(ref op)) if op == "op_taken"),
        "{late:?}"
    );
    assert_eq!(remote.vm_state_now(id).await, Some(VmState::Paused));
    assert_eq!(fake::live_vms(dir.path()).len(), 1);
    // The holder goes on; another operation's epochs are its own; reads are never fenced.
    OPERATION.scope(under("op_taken", 2), remote.resume(id)).await.unwrap();
    OPERATION.scope(under("op_other", 1), remote.pause(id)).await.unwrap();
    OPERATION
        .scope(under("op_taken", 1), remote.vm_state_now(id))
        .await
        .expect("a read under an old epoch is answered");
    remote.delete(id, None).await.unwrap();
    assert!(fake::live_vms(dir.path()).is_empty());
}
