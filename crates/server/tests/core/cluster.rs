//! Many nodes behind many replicas (issue 25): two API replicas over one store, three nodes
//! each behind its face, every replica holding a `Cluster` of the three. Placement spreads and
//! refuses with every node's reason; a sandbox on any node answers through either replica; a
//! node that dies is skipped by new creates.

use super::common::cluster::{node_link, ClusterNode};
use super::common::*;
use airlock_runtime::fake;
use airlock_server::core::Config;
use airlock_server::nodes::{Capacity, Nodes};
use axum::body::Body;
use axum::http::Method;
use serde_json::Value;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// A node whose budgets fit exactly four default sandboxes (512 MiB each, no memory reserve).
pub(crate) const FITS_FOUR: Capacity = Capacity {
    memory_mib: 4 * 512,
    ..ROOMY
};

pub(crate) fn replica_config() -> Config {
    Config {
        memory_reserve_mib: 0,
        disk_reserve_mib: 0,
        tenant_share: 1.0,
        max_sandboxes_per_tenant: 100,
        max_creates_per_minute: 1000,
        ..Config::default()
    }
}

/// Addresses as a DNS answer lists them.
fn listed(addrs: &[std::net::SocketAddr]) -> Vec<airlock_server::nodes::discovery::Listed> {
    addrs
        .iter()
        .copied()
        .map(airlock_server::nodes::discovery::Listed::serving)
        .collect()
}

pub(crate) async fn node_of(server: &Server, id: &str) -> String {
    let row = server.core().store().sandbox_by_id(id).await.unwrap().unwrap();
    row.node
}

/// A create no node takes: 503 `no_node_fits`; its message.
async fn refused_create(via: &Server) -> String {
    let (status, body) = via
        .v1(
            Method::POST,
            "/sandboxes",
            Some(serde_json::json!({ "template": "seed" })),
        )
        .await;
    assert_eq!(status, 503, "{body}");
    assert_eq!(body["code"], "no_node_fits", "{body}");
    body["message"].as_str().unwrap().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn creates_spread_over_nodes_refuse_with_every_reason_and_route_through_any_replica() {
    let (store_dir, dirs) = (fresh(), [fresh(), fresh(), fresh()]);
    let mut nodes = Vec::new();
    for d in &dirs {
        nodes.push(ClusterNode::start(d.path(), FITS_FOUR, 0).await);
    }
    let addrs: Vec<_> = nodes.iter().map(|n| n.addr).collect();
    let a = Server::start_replica(store_dir.path(), &addrs, None, replica_config()).await;
    let b = Server::start_replica(store_dir.path(), &addrs, Some(&a.key), replica_config()).await;

    // 12 creates through alternating replicas: 4 on each node, each VM where its record says.
    let mut ids = Vec::new();
    for i in 0..12 {
        let via = if i % 2 == 0 { &a } else { &b };
        ids.push(via.running_sandbox().await);
    }
    let mut per_node: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for id in &ids {
        per_node.entry(node_of(&a, id).await).or_default().push(id.clone());
    }
    let counts: Vec<usize> = per_node.values().map(Vec::len).collect();
    assert_eq!(counts, vec![4, 4, 4], "{per_node:?}");
    for n in &nodes {
        assert_eq!(fake::live_vms(&n.dir).len(), 4, "node {}", n.addr);
        assert!(per_node.contains_key(&n.addr.to_string()));
    }

    // The 13th: 503, naming every node and why.
    let message = refused_create(&b).await;
    for n in &nodes {
        assert!(
            message.contains(&format!("node {}: this node's memory budget", n.addr)),
            "{message}"
        );
    }

    // A sandbox of the third node answers through either replica, a session and a file each.
    let third = &per_node[&nodes[2].addr.to_string()][0];
    for via in [&a, &b] {
        via.assert_answers(third).await;
        let path = format!("/sandboxes/{third}/files?path=/home/user/f.txt");
        let (status, _) = via.v1(Method::PUT, &path, Some(Value::String("x".into()))).await;
        assert!(status < 300, "{status}");
        let (status, got) = via.v1(Method::GET, &path, None).await;
        assert_eq!((status, got), (200, Value::String("x".into())));
    }

    // A node dies: placement skips it within seconds; deleting one elsewhere makes room there.
    let dead = nodes.pop().unwrap();
    let dead_name = dead.addr.to_string();
    dead.kill();
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let members = a.core().nodes().members();
        let m = members.iter().find(|m| m.name == dead_name).unwrap();
        if m.refuses.is_some() {
            break;
        }
        assert!(Instant::now() < deadline, "the dead node is still taken for live");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Readiness (no credentials): the store answers; two of three nodes take sandboxes.
    let (status, ready) = a.json(Method::GET, "/readyz", &[], Body::empty()).await;
    assert_eq!(
        (status, ready),
        (200, serde_json::json!({ "nodes_ready": 2, "nodes": 3 }))
    );
    let freed = per_node[&nodes[0].addr.to_string()][0].clone();
    a.delete(&freed).await;
    let again = a.running_sandbox().await;
    assert_eq!(node_of(&a, &again).await, nodes[0].addr.to_string());
    let message = refused_create(&a).await;
    assert!(
        message.contains(&format!("node {dead_name}: node {dead_name} did not answer")),
        "{message}"
    );

    // Clean up: the live nodes' sandboxes through the replicas, the dead node's VMs by hand.
    for id in ids.iter().filter(|id| **id != freed).chain([&again]) {
        if node_of(&a, id).await != dead_name {
            b.delete(id).await;
        }
    }
    for pid in fake::live_vms(dirs[2].path()) {
        fake::kill_vm(pid);
    }
    a.stop().await;
    b.stop().await;
    drop(nodes);
    for d in &dirs {
        assert_no_vms(d.path());
    }
}

/// Discovery (`serve --nodes-dns`): nodes join under the names they report; one no longer
/// listed takes no new sandbox; a node back at a new address under its name replaces its old
/// entry and its sandboxes answer through it again (the node re-adopted its VMs).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn discovered_nodes_join_by_name_and_a_node_back_at_a_new_address_keeps_its_sandboxes() {
    use airlock_server::nodes::discovery::Discovery;
    use airlock_server::nodes::Nodes as _;
    let (store_dir, dir_a, dir_b) = (fresh(), fresh(), fresh());
    let a = ClusterNode::start_named(dir_a.path(), FITS_FOUR, 0, "node-a").await;
    let b = ClusterNode::start_named(dir_b.path(), FITS_FOUR, 0, "node-b").await;
    let replica = Server::start_replica(store_dir.path(), &[], None, replica_config()).await;
    let cluster = replica.cluster.clone().unwrap();
    let mut discovery = Discovery::default();
    discovery.round(&cluster, listed(&[a.addr, b.addr]), &node_link()).await;
    let names = |s: &Server| -> Vec<(String, bool)> {
        let mut m: Vec<_> = s
            .core()
            .nodes()
            .members()
            .into_iter()
            .map(|m| (m.name, m.refuses.is_none()))
            .collect();
        m.sort();
        m
    };
    assert_eq!(names(&replica), vec![("node-a".into(), true), ("node-b".into(), true)]);

    // node-b leaves the listing: no new sandbox goes there.
    discovery.round(&cluster, listed(&[a.addr]), &node_link()).await;
    assert_eq!(names(&replica), vec![("node-a".into(), true), ("node-b".into(), false)]);
    let mut ids = Vec::new();
    for _ in 0..3 {
        let id = replica.running_sandbox().await;
        assert_eq!(node_of(&replica, &id).await, "node-a");
        ids.push(id);
    }

    // A warm pool the cluster keeps: every member keeps it, and so does one that joins later.
    let resources = airlock_runtime::Resources::default();
    replica.core().nodes().set_pool("seed", &resources, 1).await.unwrap();

    // node-a dies and comes back on another port with its data dir: it re-adopts its VMs and
    // discovery points its name at the new address.
    let old_addr = a.addr;
    a.kill();
    let a = ClusterNode::start_named(dir_a.path(), FITS_FOUR, 0, "node-a").await;
    assert_ne!(a.addr, old_addr);
    discovery.round(&cluster, listed(&[a.addr, b.addr]), &node_link()).await;
    for id in &ids {
        replica.assert_answers(id).await;
    }
    let deadline = Instant::now() + Duration::from_secs(15);
    while cluster
        .pools()
        .iter()
        .filter(|p| p.template == "seed" && p.size == 1)
        .count()
        < 2
    {
        assert!(
            Instant::now() < deadline,
            "the rejoined node keeps no pool: {:?}",
            cluster.pools()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    replica.core().nodes().set_pool("seed", &resources, 0).await.unwrap();
    for id in &ids {
        replica.delete(id).await;
    }
    replica.stop().await;
    drop((a, b));
    assert_no_vms(dir_a.path());
    assert_no_vms(dir_b.path());
}

/// A node admits creates by its own budgets, whatever a replica's view of it: one that refuses
/// (`capacity`) sends the create to the next node, and a create every node refuses fails naming
/// each node's reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_refuses_past_its_own_budget_and_the_create_goes_to_the_next_node() {
    use airlock_server::nodes::NodeRules;
    let (store_dir, dirs) = (fresh(), [fresh(), fresh()]);
    // The replica's budgets (no reserve) fit four on each; the nodes' own keep a reserve:
    // node "a" takes one sandbox, node "b" three.
    let rules = |reserve_mib| {
        Some(NodeRules {
            max_starts: 4,
            vcpu_overcommit: 8.0,
            memory_reserve_mib: reserve_mib,
            expiry_grace: Duration::from_secs(3),
            deadlines: None,
        })
    };
    let a = ClusterNode::start_ruled(dirs[0].path(), FITS_FOUR, 0, "a", rules(3 * 512)).await;
    let b = ClusterNode::start_ruled(dirs[1].path(), FITS_FOUR, 0, "b", rules(512)).await;
    let replica = Server::start_replica(store_dir.path(), &[a.addr, b.addr], None, replica_config()).await;

    // Four creates: placement offers "a" more than once (by load), "a" refuses all but the
    // first, and every create runs, recorded where its VM is.
    let mut ids = Vec::new();
    for _ in 0..4 {
        ids.push(replica.running_sandbox().await);
    }
    assert_eq!(fake::live_vms(&a.dir).len(), 1);
    assert_eq!(fake::live_vms(&b.dir).len(), 3);
    let mut on_a = 0;
    for id in &ids {
        if node_of(&replica, id).await == a.addr.to_string() {
            on_a += 1;
        }
    }
    assert_eq!(on_a, 1);

    // The replica still sees room on both (its budgets fit four each); both nodes refuse.
    let (id, op) = replica.create_native().await;
    let op = replica.wait_op(&op).await;
    assert_eq!(op["state"], "failed", "{op}");
    assert_eq!(op["error"]["code"], "no_node_fits", "{op}");
    let message = op["error"]["message"].as_str().unwrap();
    for n in [&a, &b] {
        assert!(
            message.contains(&format!("node {}: this node's memory budget", n.addr)),
            "{message}"
        );
    }
    assert_eq!(replica.sandbox_state(&id).await, "failed");

    for id in &ids {
        replica.delete(id).await;
    }
    replica.stop().await;
    drop((a, b));
    for d in &dirs {
        assert_no_vms(d.path());
    }
}

/// A burst past what a node starts at once queues: the node refuses the extra creates `busy`,
/// and the replica asks it again (no other node is left) until each runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_past_a_nodes_starts_at_once_waits_for_it() {
    let (store_dir, dir) = (fresh(), fresh());
    let rules = airlock_server::nodes::NodeRules {
        max_starts: 1,
        ..expiring_rules(dir.path())
    };
    let node = ClusterNode::start_ruled_slow(dir.path(), FITS_FOUR, rules, Duration::from_millis(700)).await;
    let replica = Server::start_replica(store_dir.path(), &[node.addr], None, replica_config()).await;
    let mut ops = Vec::new();
    for _ in 0..3 {
        ops.push(replica.create_native().await);
    }
    for (id, op) in &ops {
        let op = replica.wait_op(op).await;
        assert_eq!(op["state"], "succeeded", "{id}: {op}");
    }
    assert_eq!(fake::live_vms(&node.dir).len(), 3);
    for (id, _) in &ops {
        replica.delete(id).await;
    }
    replica.stop().await;
}

/// A node's rules that end timed-out VMs 3 s late, their deadlines kept under `dir`.
fn expiring_rules(dir: &std::path::Path) -> airlock_server::nodes::NodeRules {
    airlock_server::nodes::NodeRules {
        max_starts: 4,
        vcpu_overcommit: 8.0,
        memory_reserve_mib: 0,
        expiry_grace: Duration::from_secs(3),
        deadlines: Some(dir.join("deadlines")),
    }
}

/// A node that ends timed-out VMs itself (on `dir`), a replica over it (its store in
/// `store_dir`), and a running sandbox with a 5 s timeout on them.
async fn node_enforcing_a_five_second_sandbox(
    store_dir: &std::path::Path,
    dir: &std::path::Path,
) -> (ClusterNode, Server, String) {
    let node = ClusterNode::start_ruled(dir, FITS_FOUR, 0, "n", Some(expiring_rules(dir))).await;
    let replica = Server::start_replica(store_dir, &[node.addr], None, replica_config()).await;
    let id = five_second_sandbox(&replica).await;
    (node, replica, id)
}

/// A running sandbox made through `via` with a 5 s timeout.
async fn five_second_sandbox(via: &Server) -> String {
    let (status, body) = via
        .v1(
            Method::POST,
            "/sandboxes",
            Some(serde_json::json!({ "template": "seed", "timeout": "5s" })),
        )
        .await;
    assert_eq!(status, 202, "{body}");
    let op = via.wait_op(body["operation"]["id"].as_str().unwrap()).await;
    assert_eq!(op["state"], "succeeded", "{op}");
    body["sandbox_id"].as_str().unwrap().to_string()
}

/// A node ends a sandbox whose timeout passed by itself while no replica is up to do it (issue
/// 25, check 7), also after a restart of its own, and a replica started later records it
/// deleted, not failed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_ends_an_expired_sandbox_while_no_replica_runs() {
    let (store_dir, dir) = (fresh(), fresh());
    let (node, replica, id) = node_enforcing_a_five_second_sandbox(store_dir.path(), dir.path()).await;
    let running = Instant::now();
    let key = replica.key.clone();
    replica.stop().await;
    // The node restarts meanwhile: it keeps the deadline it was told and its VM.
    let port = node.addr.port();
    node.kill();
    let node = ClusterNode::start_ruled(dir.path(), FITS_FOUR, port, "n", Some(expiring_rules(dir.path()))).await;

    // No replica: the node ends it 5 s + its 3 s grace after it started running.
    while !fake::live_vms(&node.dir).is_empty() {
        assert!(
            running.elapsed() < Duration::from_secs(10),
            "the node still runs an expired sandbox"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(running.elapsed() >= Duration::from_secs(5), "ended before its timeout");

    let back = Server::start_replica(store_dir.path(), &[node.addr], Some(&key), replica_config()).await;
    assert_eq!(back.sandbox_state(&id).await, "deleted");
    back.stop().await;
    drop(node);
    assert_no_vms(dir.path());
}

/// Replicas share operations through their leases (issue 25, check 3): a replica that starts
/// while another's create runs leaves it alone, and the create of a replica that died mid-call
/// is taken over once its lease lapses, ending by what the node did, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_leaves_anothers_operations_alone_and_takes_them_over_when_it_dies() {
    let (store_dir, node_dir) = (fresh(), fresh());
    let node = ClusterNode::start_slow(node_dir.path(), ROOMY, Duration::from_secs(3)).await;
    let a = Server::start_replica(store_dir.path(), &[node.addr], None, replica_config()).await;

    // B's recovery runs while A's create is under way on the node: it is A's to finish.
    let (first, op) = a.create_native().await;
    let b = Server::start_replica(store_dir.path(), &[node.addr], Some(&a.key), replica_config()).await;
    let done = b.wait_op(&op).await;
    assert_eq!(done["state"], "succeeded", "{done}");
    assert_eq!(b.sandbox_state(&first).await, "running");

    // A dies while the node boots its second create; the node finishes it all the same, and
    // B takes the operation over once A's lease lapses.
    let (second, op) = a.create_native().await;
    // Well inside the node's 3 s boot: A's call has reached it.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let died = Instant::now();
    a.stop().await;
    let done = loop {
        let now = b.operation(&op).await;
        if now["state"] == "succeeded" || now["state"] == "failed" {
            break now;
        }
        assert!(
            died.elapsed() < Duration::from_secs(15),
            "still open 15 s after its replica died: {now}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let took = died.elapsed();
    assert_eq!(done["state"], "succeeded", "{done}");
    assert_eq!(b.sandbox_state(&second).await, "running");
    assert_eq!(node_of(&b, &second).await, node.addr.to_string());
    eprintln!("a dead replica's create ended {took:?} after it died");

    for id in [&first, &second] {
        b.delete(id).await;
    }
    b.stop().await;
}

/// A deadline its node missed (unreachable when the timeout moved) reaches it once it is back:
/// the replica tells it again, so the node does not end the sandbox by the old one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deadline_the_node_missed_reaches_it_once_it_is_back() {
    let (store_dir, dir) = (fresh(), fresh());
    let (node, replica, id) = node_enforcing_a_five_second_sandbox(store_dir.path(), dir.path()).await;
    let running = Instant::now();

    // The node is down while the timeout moves to a minute; it comes back with the old one.
    let port = node.addr.port();
    node.kill();
    let (status, body) = replica
        .e2b(
            Method::POST,
            &format!("/sandboxes/{id}/timeout"),
            serde_json::json!({ "timeout": 60 }),
        )
        .await;
    assert!(status < 300, "{status} {body}");
    let node = ClusterNode::start_ruled(dir.path(), FITS_FOUR, port, "n", Some(expiring_rules(dir.path()))).await;

    // Past the old deadline and its grace: the VM runs on.
    tokio::time::sleep(Duration::from_secs(10).saturating_sub(running.elapsed())).await;
    assert_eq!(
        fake::live_vms(&node.dir).len(),
        1,
        "the node ended it by the deadline it missed"
    );
    assert_eq!(replica.sandbox_state(&id).await, "running");
    replica.delete(&id).await;
    replica.stop().await;
    drop(node);
    assert_no_vms(dir.path());
}

/// A node that stops drains (issue 25, check 5; its end to end with real VMs, suspended and
/// resumed, is in `tests/api/servers.rs`): it reports `draining` and refuses every start, so
/// new sandboxes go to the other node; a resume there is refused; its drain ends once its
/// budget is spent (the fake VMM cannot suspend, so nothing takes its VMs off it here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draining_node_takes_nothing_new() {
    let (store_dir, dirs) = (fresh(), [fresh(), fresh()]);
    let a = ClusterNode::start(dirs[0].path(), ROOMY, 0).await;
    let b = ClusterNode::start(dirs[1].path(), ROOMY, 0).await;
    let replica = Server::start_replica(store_dir.path(), &[a.addr, b.addr], None, replica_config()).await;
    let mut ids = Vec::new();
    let on_a = loop {
        assert!(ids.len() < 12, "placement never chose node a");
        let id = replica.running_sandbox().await;
        ids.push(id.clone());
        if node_of(&replica, &id).await == a.addr.to_string() {
            break id;
        }
    };
    let took = a.drain(Duration::from_secs(1)).await;
    assert!(took < Duration::from_secs(5), "{took:?}");
    let cluster = replica.cluster.clone().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !cluster.members().iter().any(|m| m.draining) {
        assert!(Instant::now() < deadline, "no replica saw node a draining");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let a_seen = cluster
        .members()
        .into_iter()
        .find(|m| m.name == a.addr.to_string())
        .unwrap();
    assert!(
        a_seen.refuses.as_deref().unwrap_or("").contains("draining"),
        "{a_seen:?}"
    );
    for _ in 0..3 {
        let id = replica.running_sandbox().await;
        assert_eq!(node_of(&replica, &id).await, b.addr.to_string());
        ids.push(id);
    }
    // A start asked of it all the same is refused by its own admission.
    let (status, body) = replica
        .v1(Method::POST, &format!("/sandboxes/{on_a}/pause"), None)
        .await;
    assert_eq!(status, 202, "{body}");
    let op = replica.wait_op(body["operation"]["id"].as_str().unwrap()).await;
    assert_eq!(op["state"], "succeeded", "{op}");
    let (status, body) = replica
        .v1(Method::POST, &format!("/sandboxes/{on_a}/resume"), None)
        .await;
    let refusal = match status {
        202 => replica.wait_op(body["operation"]["id"].as_str().unwrap()).await,
        _ => body,
    };
    assert!(refusal.to_string().contains("draining"), "{status} {refusal}");
    assert_eq!(replica.sandbox_state(&on_a).await, "paused");

    for id in &ids {
        replica.delete(id).await;
    }
    replica.stop().await;
    drop((a, b));
    for d in &dirs {
        assert_no_vms(d.path());
    }
}

/// A node that stops answering (issue 25, check 4): back within the grace, it keeps its
/// sandboxes; silent to every replica for longer, its running sandboxes are `lost` (the other
/// node's run on), a lost one is deleted without its node, and once the node is back its VM
/// of it is removed, never run again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_silent_past_the_grace_loses_its_sandboxes_and_their_vms_go_when_it_is_back() {
    let (store_dir, dirs) = (fresh(), [fresh(), fresh()]);
    let config = || Config {
        node_grace: Duration::from_secs(6),
        ..replica_config()
    };
    let mut nodes = vec![
        ClusterNode::start(dirs[0].path(), FITS_FOUR, 0).await,
        ClusterNode::start(dirs[1].path(), FITS_FOUR, 0).await,
    ];
    let addrs: Vec<_> = nodes.iter().map(|n| n.addr).collect();
    let a = Server::start_replica(store_dir.path(), &addrs, None, config()).await;
    let b = Server::start_replica(store_dir.path(), &addrs, Some(&a.key), config()).await;
    // One sandbox on each node.
    let mut on: BTreeMap<String, String> = BTreeMap::new();
    while on.len() < 2 {
        let id = a.running_sandbox().await;
        on.entry(node_of(&a, &id).await).or_insert(id);
    }
    let (silent, other) = (addrs[0].to_string(), addrs[1].to_string());

    // Down for a moment (a restart): nothing is lost, its VM is re-adopted.
    let port = addrs[0].port();
    nodes.remove(0).kill();
    tokio::time::sleep(Duration::from_secs(2)).await;
    nodes.insert(0, ClusterNode::start(dirs[0].path(), FITS_FOUR, port).await);
    tokio::time::sleep(Duration::from_secs(8)).await;
    assert_eq!(a.sandbox_state(&on[&silent]).await, "running");
    b.assert_answers(&on[&silent]).await;

    // Down past the grace: lost, through either replica; the other node's sandbox runs on.
    nodes.remove(0).kill();
    let down = Instant::now();
    while a.sandbox_state(&on[&silent]).await != "lost" {
        assert!(down.elapsed() < Duration::from_secs(20), "not lost after 20 s");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(down.elapsed() >= Duration::from_secs(6), "lost within the grace");
    println!("lost after {:?} (grace 6 s)", down.elapsed());
    assert_eq!(b.sandbox_state(&on[&silent]).await, "lost");
    assert_eq!(b.sandbox_state(&on[&other]).await, "running");
    b.assert_answers(&on[&other]).await;

    // Deleted while its node is down: recorded at once (there is no node to ask).
    let (status, body) = b.v1(Method::DELETE, &format!("/sandboxes/{}", on[&silent]), None).await;
    assert_eq!(status, 202, "{body}");
    let op = b.wait_op(body["operation"]["id"].as_str().unwrap()).await;
    assert_eq!(op["state"], "succeeded", "{op}");
    assert_eq!(a.sandbox_state(&on[&silent]).await, "deleted");

    // Back: its VM of that sandbox goes, never to run again.
    let back = ClusterNode::start(dirs[0].path(), FITS_FOUR, port).await;
    let returned = Instant::now();
    while !fake::live_vms(&back.dir).is_empty() {
        assert!(
            returned.elapsed() < Duration::from_secs(15),
            "the lost sandbox's VM still runs"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(a.sandbox_state(&on[&silent]).await, "deleted");
    a.stop().await;
    b.stop().await;
}

/// A node on `node_dir`, a replica over it (its store in `store_dir`), and the record of a
/// running sandbox made through it.
async fn a_replica_and_a_running_sandbox(
    store_dir: &std::path::Path,
    node_dir: &std::path::Path,
) -> (ClusterNode, Server, airlock_server::records::SandboxRecord) {
    let node = ClusterNode::start(node_dir, ROOMY, 0).await;
    let a = Server::start_replica(store_dir, &[node.addr], None, replica_config()).await;
    let id = a.running_sandbox().await;
    let row = a.core().store().sandbox_by_id(&id).await.unwrap().unwrap();
    (node, a, row)
}

/// A fork's image, saved, of sandbox `parent`, as `Core::fork_sandbox` records it.
async fn record_fork_image(
    store: &dyn airlock_server::store::Store,
    parent: &airlock_server::records::SandboxRecord,
    id: &str,
    created_at_ms: i64,
) -> airlock_server::records::SnapshotRecord {
    use airlock_server::records::{SnapshotKind, SnapshotRecord};
    let image = SnapshotRecord {
        id: id.into(),
        tenant_id: parent.tenant_id.clone(),
        name: None,
        kind: SnapshotKind::Fork,
        sandbox_id: parent.id.clone(),
        template: parent.template.clone(),
        resources: parent.resources,
        bytes: 0,
        digest: None,
        created_at_ms,
        shared: None,
    };
    store
        .admit_snapshot(
            &image,
            0,
            &airlock_server::model::Quota::default(),
            &airlock_server::store::NodeBudget::UNLIMITED,
        )
        .await
        .unwrap();
    assert!(store.snapshot_saved(&image).await.unwrap());
    image
}

/// A fork's image stays until its children have started from it, also when another replica
/// starts meanwhile: that replica's sweep of the images a restart cut short passes over one an
/// unfinished create starts from (a fork is no operation of its own; its children's creates
/// are). The fake VMM restores no image, so the fork is recorded as one leaves the store
/// between its save and its child's start; the real fork is tests/api's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_starting_mid_fork_leaves_the_forks_image_alone() {
    use airlock_server::model::{Operation, OperationKind, OperationState, SandboxState};
    use airlock_server::records::{now_ms, rfc3339, SandboxRecord};
    let (store_dir, node_dir) = (fresh(), fresh());
    let (node, a, row) = a_replica_and_a_running_sandbox(store_dir.path(), node_dir.path()).await;
    let store = a.core().store();
    let image = record_fork_image(store.as_ref(), &row, "snap_0123456789abcdef0123", now_ms()).await;
    // Its child's create: recorded (leased by A, which runs it), not yet finished.
    let child = SandboxRecord {
        id: "0123456789abcdef0123".into(),
        state: SandboxState::Creating,
        image_id: Some(image.id.clone()),
        ..row.clone()
    };
    let op = Operation {
        id: "op_0123456789abcdef0123".into(),
        kind: OperationKind::Create,
        state: OperationState::Pending,
        sandbox_id: child.id.clone(),
        error: None,
        created_at: rfc3339(now_ms()),
        finished_at: None,
    };
    store.insert_create(&child, &op, None, 100).await.unwrap();
    tokio::time::sleep(Duration::from_millis(5)).await;

    // B starts, recovers and sweeps within A's lease of the create.
    let b = Server::start_replica(store_dir.path(), &[node.addr], Some(&a.key), replica_config()).await;
    assert!(
        store.get_snapshot(&image.tenant_id, &image.id).await.unwrap().is_some(),
        "B removed the image A's child starts from"
    );
    a.stop().await;
    b.stop().await;
}

/// A fork whose replica died before removing its image leaves it to the reaper's holder: once
/// it is older than any fork takes (10 min) and no create starts from it, it goes without a
/// restart; a younger one stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_forks_image_goes_without_a_restart() {
    use airlock_server::records::now_ms;
    let (store_dir, node_dir) = (fresh(), fresh());
    let (_node, a, row) = a_replica_and_a_running_sandbox(store_dir.path(), node_dir.path()).await;
    let (parent, store) = (row.id.clone(), a.core().store());
    // Recorded after A started (its start's sweep is over), as a fork of a replica since dead.
    let old = record_fork_image(
        store.as_ref(),
        &row,
        "snap_00000000000000000old",
        now_ms() - 11 * 60_000,
    )
    .await;
    let young = record_fork_image(store.as_ref(), &row, "snap_0000000000000000young", now_ms() - 60_000).await;
    let deadline = Instant::now() + Duration::from_secs(15);
    while store.get_snapshot(&old.tenant_id, &old.id).await.unwrap().is_some() {
        assert!(Instant::now() < deadline, "the dead fork's image is still recorded");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(store.get_snapshot(&young.tenant_id, &young.id).await.unwrap().is_some());
    a.delete(&parent).await;
    a.stop().await;
}
