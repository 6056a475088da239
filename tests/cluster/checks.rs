//! The checks of issue 25 that need real processes, in the order they run on the one cluster.

use super::common::*;
use super::harness::*;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A sandbox on node `n`: creates until one lands there (placement spreads by load), the others
/// deleted.
fn create_on(c: &Cluster, n: usize, timeout: &str) -> String {
    let mut others = Vec::new();
    let found = loop {
        let id = create(&c.replicas[others.len() % 2], timeout);
        if c.holder(&id) == n {
            break id;
        }
        others.push(id);
        assert!(others.len() < NODES * FITS, "nothing lands on node {n}");
    };
    for id in others {
        c.replicas[0].delete(&id);
    }
    found
}

/// Check 1 [VM]: each node's budget fits four sandboxes; twelve creates through alternating
/// replicas land four on each node, and the thirteenth is refused 503 with every node's reason.
pub fn creates_spread_over_the_nodes_and_the_next_is_refused_with_every_reason() {
    let guard = cluster();
    let c = guard.as_ref().unwrap();
    let mut ids = Vec::new();
    let t = Instant::now();
    for i in 0..NODES * FITS {
        ids.push(create(&c.replicas[i % 2], "10m"));
    }
    let created = t.elapsed();
    let mut per_node: BTreeMap<usize, usize> = BTreeMap::new();
    for id in &ids {
        *per_node.entry(c.holder(id)).or_default() += 1;
    }
    assert_eq!(
        per_node.values().copied().collect::<Vec<_>>(),
        vec![FITS; NODES],
        "{per_node:?}"
    );
    let (status, body) = c.replicas[1].call("POST", "/v1/sandboxes", Some(json!({ "template": "seed" })));
    assert_eq!((status, body["code"].as_str()), (503, Some("no_node_fits")), "{body}");
    let message = body["message"].as_str().unwrap();
    for n in &c.nodes {
        assert!(message.contains(&n.name()), "{} not named: {message}", n.name());
    }
    println!(
        "spread: {} creates over {NODES} nodes in {created:?}; refused: {message}",
        ids.len()
    );
    for id in &ids {
        c.replicas[0].delete(id);
    }
}

/// Check 2 [VM]: a sandbox on the third node answers the same through either replica: a session
/// and its stream (resumed on the other replica with `Last-Event-ID`), files, its session limit,
/// and a port; and an E2B watcher made through one replica is polled through the other.
pub fn a_sandbox_on_the_third_node_answers_alike_through_either_replica() {
    let guard = cluster();
    let c = guard.as_ref().unwrap();
    let id = create_on(c, 2, "10m");
    let (a, b) = (&c.replicas[0], &c.replicas[1]);
    let hello = ["sh", "-c", "echo hello from $(hostname)"];
    assert_eq!(run(a, &id, &hello), format!("hello from {id}\n"));
    assert_eq!(run(b, &id, &hello), format!("hello from {id}\n"));

    // A file written through one replica reads back through the other, both ways.
    for (w, r, text) in [(a, b, "through A"), (b, a, "through B")] {
        let (status, _) = w.call(
            "PUT",
            &format!("/v1/sandboxes/{id}/files?path=/home/user/x.txt"),
            Some(json!(text)),
        );
        assert!((200..300).contains(&status));
        let (status, got) = r.call("GET", &format!("/v1/sandboxes/{id}/files?path=/home/user/x.txt"), None);
        assert_eq!((status, got), (200, json!(text)));
    }

    // The sandbox's session limit holds across replicas: six starts at once, alternating, with
    // room for three (each replica admits through the store, not on its own count).
    let quota = |limit: Value| {
        let (status, q) = a.admin_call(
            "PUT",
            "/v1/admin/tenants/default/quota",
            Some(json!({ "sessions_per_sandbox": limit })),
        );
        assert_eq!(status, 200, "{q}");
    };
    quota(json!(3));
    let answers: Vec<(u16, Value)> = std::thread::scope(|scope| {
        let starts: Vec<_> = (0..6)
            .map(|i| {
                let (via, id) = ([a, b][i % 2], &id);
                scope.spawn(move || {
                    via.call(
                        "POST",
                        &format!("/v1/sandboxes/{id}/sessions"),
                        Some(json!({ "argv": ["sleep", "2"] })),
                    )
                })
            })
            .collect();
        starts.into_iter().map(|t| t.join().unwrap()).collect()
    });
    let admitted = answers.iter().filter(|(status, _)| *status == 201).count();
    let refused = answers
        .iter()
        .filter(|(status, body)| (*status, body["code"].as_str()) == (429, Some("quota_exceeded")))
        .count();
    assert_eq!((admitted, refused), (3, 3), "{answers:?}");
    quota(Value::Null);

    // A stream read in part through A resumes through B after the last event A gave.
    let sid = a.session(
        &id,
        json!({ "argv": ["sh", "-c", "for i in 1 2 3 4 5 6; do echo line$i; sleep 0.3; done"] }),
    );
    let first = a.events(&id, &sid, None, Some(2));
    let last = first
        .last()
        .and_then(|(_, id, _)| id.clone())
        .expect("events carry ids");
    let rest = b.events(&id, &sid, Some(&last), None);
    let whole = format!("{}{}", decode(&first, "stdout"), decode(&rest, "stdout"));
    assert_eq!(
        whole, "line1\nline2\nline3\nline4\nline5\nline6\n",
        "{first:?} {rest:?}"
    );
    let replay = b.events(&id, &sid, None, None);
    assert_eq!(decode(&replay, "stdout"), whole);

    // A port served in the sandbox, through each replica by host name.
    let script = "mkdir -p /tmp/www && echo served-on-node-3 > /tmp/www/hi.txt && exec python3 -m http.server 8000 --bind 127.0.0.1 --directory /tmp/www";
    a.session(&id, json!({ "argv": ["sh", "-c", script] }));
    let host = format!("8000-{id}.sandbox.test");
    for s in [a, b] {
        let bearer = format!("Bearer {}", s.key);
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let (status, body) = get_with_host(s, &host, "/hi.txt", &[("Authorization", &bearer)]);
            if status == 200 {
                assert_eq!(body.trim(), "served-on-node-3");
                break;
            }
            assert!(
                Instant::now() < deadline,
                "port 8000 never answered via {}: {status} {body}",
                s.url
            );
            std::thread::sleep(Duration::from_millis(300));
        }
    }
    assert!(c.nodes[2].has(&id) && !c.nodes[0].has(&id) && !c.nodes[1].has(&id));
    a.delete(&id);

    // An E2B sandbox's polling watcher, made through A and polled and removed through B (the
    // node keeps its events, not the replica that made it).
    let (status, made) = e2b(a, "POST", "/sandboxes", None, Some(json!({ "templateID": "seed" })));
    assert_eq!(status, 201, "{made}");
    let sb = made["sandboxID"].as_str().unwrap().to_string();
    let token = made["envdAccessToken"].as_str().unwrap().to_string();
    let envd = |s: &Server, method: &str, body: Value| {
        let (status, answer) = e2b(
            s,
            "POST",
            &format!("/filesystem.Filesystem/{method}"),
            Some((&sb, &token)),
            Some(body),
        );
        assert_eq!(status, 200, "{method}: {answer}");
        answer
    };
    let made = envd(a, "CreateWatcher", json!({ "path": "/home/user" }));
    let watcher = made["watcherId"].as_str().expect("a watcher id").to_string();
    let (status, _) = b.call(
        "PUT",
        &format!("/v1/sandboxes/{sb}/files?path=/home/user/seen.txt"),
        Some(json!("x")),
    );
    assert!((200..300).contains(&status));
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut names = Vec::new();
    while !names.iter().any(|n| n == "seen.txt") {
        assert!(Instant::now() < deadline, "no event for seen.txt through B: {names:?}");
        let got = envd(b, "GetWatcherEvents", json!({ "watcherId": watcher }));
        for ev in got["events"].as_array().cloned().unwrap_or_default() {
            names.push(ev["name"].as_str().unwrap_or_default().to_string());
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    envd(b, "RemoveWatcher", json!({ "watcherId": watcher }));
    let (status, gone) = e2b(
        a,
        "POST",
        "/filesystem.Filesystem/GetWatcherEvents",
        Some((&sb, &token)),
        Some(json!({ "watcherId": watcher })),
    );
    assert_eq!((status, gone["code"].as_str()), (404, Some("not_found")), "{gone}");
    assert_eq!(e2b(b, "DELETE", &format!("/sandboxes/{sb}"), None, None).0, 204);
}

/// A call of the E2B door of `s`: its control plane with the API key, or (with `envd`: the
/// sandbox and its access token) envd's Connect RPC in JSON.
fn e2b(s: &Server, method: &str, path: &str, envd: Option<(&str, &str)>, body: Option<Value>) -> (u16, Value) {
    match envd {
        Some((sandbox, token)) => {
            let headers = [
                ("E2b-Sandbox-Id", sandbox),
                ("E2b-Sandbox-Port", "49983"),
                ("X-Access-Token", token),
                ("Connect-Protocol-Version", "1"),
            ];
            s.call_with(method, path, body, None, &headers)
        }
        None => s.call_with(method, path, body, None, &[("X-API-Key", &s.key)]),
    }
}

/// What a worker of the burst saw of one operation.
struct Seen {
    id: Option<String>,
    state: String,
    took: Duration,
}

/// (status, body) of a call, or the transport's error (a replica that died).
fn try_call(url: &str, key: &str, method: &str, path: &str) -> Result<(u16, Value), String> {
    let req = ureq::request(method, &format!("{url}{path}"))
        .timeout(Duration::from_secs(30))
        .set("Authorization", &format!("Bearer {key}"));
    match req.call() {
        Ok(r) => Ok((r.status(), r.into_json().unwrap_or(Value::Null))),
        Err(ureq::Error::Status(s, r)) => Ok((s, r.into_json().unwrap_or(Value::Null))),
        Err(e) => Err(e.to_string()),
    }
}

/// One worker of the burst: `count` pauses and resumes in turn over `sandboxes`, through
/// `replicas[first]` until it stops answering, then through the other.
fn burst_worker(
    replicas: Vec<(String, String)>,
    first: usize,
    sandboxes: Vec<String>,
    count: usize,
    done: Arc<AtomicUsize>,
) -> Vec<Seen> {
    let mut via = first;
    let mut seen = Vec::new();
    let mut paused = vec![false; sandboxes.len()];
    for i in 0..count {
        let k = i % sandboxes.len();
        let sb = &sandboxes[k];
        let kind = if paused[k] { "resume" } else { "pause" };
        let t = Instant::now();
        let (url, key) = &replicas[via];
        let submitted = try_call(url, key, "POST", &format!("/v1/sandboxes/{sb}/{kind}")).ok();
        if submitted.is_none() {
            // The replica died: on through the other, once the submit's fate is known.
            via = 1 - via;
        }
        let op = match submitted {
            Some((202, r)) => r["operation"]["id"].as_str().map(str::to_string),
            Some((status, r)) => panic!("{kind} {sb}: {status} {r}"),
            None => None,
        };
        let state = match &op {
            Some(op) => loop {
                let (url, key) = &replicas[via];
                match try_call(url, key, "GET", &format!("/v1/operations/{op}")) {
                    Ok((200, o)) if o["state"] == "succeeded" || o["state"] == "failed" => {
                        break o["state"].as_str().unwrap().to_string()
                    }
                    Ok(_) => {}
                    Err(_) => via = 1 - via,
                }
                assert!(t.elapsed() < Duration::from_secs(60), "{kind} {op} of {sb} never ended");
                std::thread::sleep(Duration::from_millis(50));
            },
            // Unknown whether it was recorded: what the sandbox settles at says, once an
            // operation the dead replica recorded was taken over (its lease lapsed) and ended.
            None => loop {
                std::thread::sleep(Duration::from_secs(15));
                let (url, key) = &replicas[via];
                let (_, s) = try_call(url, key, "GET", &format!("/v1/sandboxes/{sb}")).expect("the other replica");
                match s["state"].as_str() {
                    Some("paused") | Some("running") => {
                        let moved = (s["state"] == "paused") != paused[k];
                        break if moved { "succeeded" } else { "not recorded" }.to_string();
                    }
                    _ => {}
                }
            },
        };
        if state == "succeeded" {
            paused[k] = !paused[k];
        }
        seen.push(Seen {
            id: op,
            state,
            took: t.elapsed(),
        });
        done.fetch_add(1, Ordering::SeqCst);
    }
    seen
}

/// Check 3: 200 operations (pauses and resumes of four sandboxes) split over both replicas, one
/// replica killed (`kill -9`) mid-burst: every operation ends within 15 s, and each that
/// succeeded was carried out on its node exactly once (the node logs every change it is asked
/// for with the operation's id; a taken-over operation is settled by what its VM is, never
/// sent again).
pub fn two_hundred_operations_with_a_replica_killed_mid_burst_each_run_once() {
    let mut guard = cluster();
    let c = guard.as_mut().unwrap();
    let ids: Vec<String> = (0..4).map(|i| create(&c.replicas[i % 2], "30m")).collect();
    let replicas: Vec<(String, String)> = c.replicas.iter().map(|s| (s.url.clone(), s.key.clone())).collect();
    let done = Arc::new(AtomicUsize::new(0));
    let t = Instant::now();
    let workers: Vec<_> = (0..2)
        .map(|w| {
            let (replicas, done) = (replicas.clone(), done.clone());
            let mine = ids[2 * w..2 * w + 2].to_vec();
            std::thread::spawn(move || burst_worker(replicas, w, mine, 100, done))
        })
        .collect();
    while done.load(Ordering::SeqCst) < 60 {
        std::thread::sleep(Duration::from_millis(20));
    }
    c.replicas[0].kill9();
    let killed_at = done.load(Ordering::SeqCst);
    let seen: Vec<Seen> = workers.into_iter().flat_map(|w| w.join().unwrap()).collect();
    let burst = t.elapsed();
    c.restart_replica(0);
    assert_eq!(seen.len(), 200);

    let failed = seen.iter().filter(|s| s.state == "failed").count();
    let unknown = seen.iter().filter(|s| s.id.is_none()).count();
    let taken_over = seen
        .iter()
        .filter(|s| s.id.is_some() && s.took > Duration::from_secs(5))
        .count();

    // The store's record of every operation on them (also ones whose submit's answer was lost
    // with A): each ended, within 15 s of its submit.
    let ops = operations_of(&c.store, &ids);
    for s in &seen {
        if let Some(id) = &s.id {
            assert!(ops.iter().any(|o| &o.id == id), "{id} is not in the store");
        }
    }
    let mut slowest = Duration::ZERO;
    for o in &ops {
        let finished = o
            .finished_ms
            .unwrap_or_else(|| panic!("{} {} never ended", o.kind, o.id));
        assert!(
            o.state == "succeeded" || o.state == "failed",
            "{} ended {}",
            o.id,
            o.state
        );
        slowest = slowest.max(Duration::from_millis((finished - o.created_ms) as u64));
    }
    println!(
        "burst: {} operations in {burst:?}, replica A killed after {killed_at}; slowest {slowest:?}; {failed} failed, {taken_over} taken over by B, {unknown} submits whose answer was lost with A",
        ops.len()
    );
    assert!(slowest <= Duration::from_secs(15), "an operation took {slowest:?}");

    // What the nodes were asked, from their logs: each pause or resume of these sandboxes was
    // asked for one of their operations, and each operation asked its node once if it
    // succeeded, at most once if it failed.
    let asked: Vec<(String, String)> = c
        .nodes
        .iter()
        .flat_map(|n| n.changes())
        .filter(|(method, path, _)| method == "POST" && ids.iter().any(|id| path.starts_with(&format!("/vms/{id}/"))))
        .map(|(_, path, op)| (path, op))
        .collect();
    for (path, op) in &asked {
        if path.ends_with("/pause") || path.ends_with("/resume") {
            assert!(
                ops.iter().any(|o| &o.id == op),
                "{path} was asked for no operation of the burst ({op})"
            );
        }
    }
    for o in &ops {
        let path = format!("/vms/{}/{}", o.sandbox, o.kind);
        let n = asked.iter().filter(|(p, op)| *p == path && *op == o.id).count();
        match o.state.as_str() {
            "succeeded" => assert_eq!(n, 1, "{} {} was asked of its node {n} times", o.kind, o.id),
            _ => assert!(n <= 1, "failed {} {} was asked of its node {n} times", o.kind, o.id),
        }
    }
    for id in &ids {
        if sandbox(&c.replicas[1], id)["state"] == "paused" {
            c.replicas[1].change(id, "resume");
        }
        c.replicas[1].delete(id);
    }
}

/// An operation as the store records it.
struct Recorded {
    id: String,
    kind: String,
    state: String,
    sandbox: String,
    created_ms: i64,
    finished_ms: Option<i64>,
}

/// The pauses and resumes of `sandboxes` the store records (read from Postgres directly).
fn operations_of(store: &str, sandboxes: &[String]) -> Vec<Recorded> {
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        use sqlx::Connection;
        let mut db = sqlx::PgConnection::connect(store).await.unwrap();
        let rows: Vec<(String, String, String, String, i64, Option<i64>)> = sqlx::query_as(
            "SELECT id, kind, state, sandbox_id, created_at_ms, finished_at_ms FROM operations \
             WHERE sandbox_id = ANY($1) AND kind IN ('pause', 'resume')",
        )
        .bind(sandboxes)
        .fetch_all(&mut db)
        .await
        .unwrap();
        rows.into_iter()
            .map(|(id, kind, state, sandbox, created_ms, finished_ms)| Recorded {
                id,
                kind,
                state,
                sandbox,
                created_ms,
                finished_ms,
            })
            .collect()
    })
}

/// How many nodes replica `s` takes sandboxes on now (its readiness).
fn nodes_ready(s: &Server) -> u64 {
    let (_, r) = s.call("GET", "/readyz", None);
    r["nodes_ready"].as_u64().unwrap_or(0)
}

/// Until both replicas count `want` nodes ready (at most `within`): how long it took.
fn until_ready(c: &Cluster, want: u64, within: Duration) -> Duration {
    let t = Instant::now();
    while !c.replicas.iter().all(|s| nodes_ready(s) == want) {
        assert!(
            t.elapsed() < within,
            "the replicas did not count {want} nodes within {within:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    t.elapsed()
}

/// Check 4 [VM]: a node killed (`kill -9`) is marked unhealthy within 15 s, new creates avoid
/// it, and back within the grace it re-adopts its VM (the same QEMU, the file intact). A node
/// whose link is cut is marked unhealthy too; past the grace its sandbox ends `lost` through
/// both replicas; back, it removes that VM. No sandbox ever has a VM on two nodes.
pub fn a_killed_node_re_adopts_and_a_cut_off_one_loses_its_sandbox() {
    let mut guard = cluster();
    let c = guard.as_mut().unwrap();
    let x = create_on(c, 1, "30m");
    let (status, _) = c.replicas[0].call(
        "PUT",
        &format!("/v1/sandboxes/{x}/files?path=/home/user/kept.txt"),
        Some(json!("kept")),
    );
    assert!((200..300).contains(&status));
    let qemu = |n: &Node, id: &str| {
        std::fs::read_to_string(n.data.join("sandboxes").join(id).join("vmm.pid")).unwrap_or_default()
    };
    let pid = qemu(&c.nodes[1], &x);

    c.nodes[1].kill9();
    let marked = until_ready(c, 2, Duration::from_secs(15));
    // The operator's list says which, and why.
    let (status, nodes) = c.replicas[1].admin_call("GET", "/v1/admin/nodes", None);
    assert_eq!(status, 200, "{nodes}");
    let states: Vec<(&str, &str, bool)> = nodes
        .as_array()
        .unwrap()
        .iter()
        .map(|n| {
            let reason = n["reason"].as_str().is_some();
            (n["name"].as_str().unwrap(), n["state"].as_str().unwrap(), reason)
        })
        .collect();
    let names: Vec<String> = c.nodes.iter().map(|n| n.name()).collect();
    assert_eq!(
        states,
        vec![
            (names[0].as_str(), "ready", false),
            (names[1].as_str(), "unreachable", true),
            (names[2].as_str(), "ready", false)
        ],
        "{nodes}"
    );
    let others: Vec<String> = (0..2).map(|i| create(&c.replicas[i], "10m")).collect();
    for id in &others {
        assert_ne!(c.holder(id), 1, "a create went to the dead node");
    }
    c.nodes[1].start();
    until_ready(c, 3, Duration::from_secs(15));
    assert_eq!(sandbox(&c.replicas[1], &x)["state"], "running");
    assert_eq!(qemu(&c.nodes[1], &x), pid, "the node did not re-adopt its VM");
    let (status, got) = c.replicas[1].call(
        "GET",
        &format!("/v1/sandboxes/{x}/files?path=/home/user/kept.txt"),
        None,
    );
    assert_eq!((status, got), (200, json!("kept")));
    println!("node killed: marked unhealthy after {marked:?}; back within the grace, it re-adopted {x}");
    for id in others.iter().chain([&x]) {
        c.replicas[0].delete(id);
    }

    let y = create_on(c, 2, "30m");
    let cut_at = Instant::now();
    c.fabric.cut(2).unwrap();
    let marked = until_ready(c, 2, Duration::from_secs(15));
    let lost = loop {
        if c.replicas.iter().all(|s| sandbox(s, &y)["state"] == "lost") {
            break cut_at.elapsed();
        }
        assert!(
            cut_at.elapsed() < NODE_GRACE + Duration::from_secs(30),
            "{y} not lost: {}",
            sandbox(&c.replicas[0], &y)
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    assert!(c.nodes[2].has(&y), "the node removed the VM while cut off");
    assert!(
        !c.nodes[0].has(&y) && !c.nodes[1].has(&y),
        "{y} runs on another node too"
    );
    c.fabric.mend(2).unwrap();
    until_ready(c, 3, Duration::from_secs(15));
    let deadline = Instant::now() + Duration::from_secs(30);
    while c.nodes[2].has(&y) {
        assert!(
            Instant::now() < deadline,
            "node 3 kept the lost sandbox's VM: {}",
            c.nodes[2].log()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    println!("link cut: marked unhealthy after {marked:?}, {y} lost after {lost:?} (grace {NODE_GRACE:?}); its VM removed once the link was back");
}

/// Check 7: with both replicas stopped, the node ends a sandbox whose 5 s timeout passed, within
/// 10 s of its creation; the replicas, back, record it gone.
pub fn a_node_ends_an_expired_sandbox_while_no_replica_runs() {
    let mut guard = cluster();
    let c = guard.as_mut().unwrap();
    let id = create(&c.replicas[0], "5s");
    let created = Instant::now();
    let node = c.holder(&id);
    for s in &mut c.replicas {
        s.stop();
    }
    while c.nodes[node].has(&id) {
        assert!(
            created.elapsed() < Duration::from_secs(10),
            "the node kept {id} past its timeout: {}",
            c.nodes[node].log()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let gone = created.elapsed();
    for r in 0..2 {
        c.restart_replica(r);
    }
    let ended = wait_state(&c.replicas[1], &id, "deleted", Duration::from_secs(30));
    assert!(ended.is_ok(), "{:?}", ended.err());
    println!("node-side expiry: {id} (5 s timeout) gone from its node {gone:?} after its create, no replica up");
}
