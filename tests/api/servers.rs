//! Servers on data dirs of their own: a crash mid-create and the restart, a warm pool, the
//! admission quota under concurrent creates.

use super::*;
use std::process::Stdio;

/// Restart safety on a data dir of its own (the blobs are hard links: templates are immutable).
/// A sandbox suspended before the crash resumes after it with its files and processes.
pub(crate) fn server_killed_mid_create_recovers_and_reattaches() {
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
pub(crate) fn warm_pool_claims_are_fresh_and_refilled() {
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

/// A server on a data dir of its own; dropping it deletes what it holds, stops it, removes the dir.
struct OwnServer {
    s: Server,
    data: PathBuf,
}

impl OwnServer {
    /// On a data dir of its own (`own_data_dir`: templates hard-linked from the shared one).
    fn start(suffix: &str, extra: &[&str]) -> OwnServer {
        let data = own_data_dir(suffix);
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
pub(crate) fn quota_is_exact_under_concurrent_creates_over_both_doors() {
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

/// `airlock node` in a process of its own and `airlock serve --node` over it (what a replica on
/// another host does, here over loopback): a sandbox is created, runs a command, takes and gives
/// a file, and its egress is decided on the node (the node's counters reach the report); the
/// two talk mutual TLS with certificates of one CA (openssl's); a server whose secret differs
/// is refused; a node stopped drains (its sandbox suspended by the
/// replica, exit 0) and the sandbox resumes whole once it is back; the node's VMs go with their
/// sandboxes.
pub(crate) fn a_replica_drives_a_node_in_its_own_process() {
    let node_data = own_data_dir("node");
    let api_data = own_data_dir("replica");
    // The replica has no runtime: it must not need the templates.
    let _ = std::fs::remove_dir_all(api_data.join("templates"));
    let secret = node_data.join("cluster.secret");
    std::fs::write(&secret, "a cluster secret of at least thirty-two bytes\n").unwrap();
    let port = free_port();
    let node_addr = format!("127.0.0.1:{port}");
    let pki = cluster_pki(&node_data);
    let pem = |name: &str| pki.join(name).to_str().unwrap().to_string();
    let node_tls = [
        "--tls-cert".to_string(),
        pem("node.crt"),
        "--tls-key".into(),
        pem("node.key"),
        "--tls-ca".into(),
        pem("ca.crt"),
    ];
    let node_tls: Vec<&str> = node_tls.iter().map(String::as_str).collect();
    let replica_tls = [
        "--node-tls-cert".to_string(),
        pem("replica.crt"),
        "--node-tls-key".into(),
        pem("replica.key"),
        "--node-tls-ca".into(),
        pem("ca.crt"),
    ];
    let replica_tls: Vec<&str> = replica_tls.iter().map(String::as_str).collect();
    let start = || start_node(&node_data, &node_addr, &secret, &node_tls);
    let mut node = start();
    // A short secret is refused by name before anything starts.
    let short = node_data.join("short.secret");
    std::fs::write(&short, "short").unwrap();
    let out = Command::new(BIN)
        .arg("--data-dir")
        .arg(&api_data)
        .args(["serve", "--node", &node_addr, "--node-secret-file"])
        .arg(&short)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("at least 32"), "{err}");
    // Another cluster's secret: the node refuses it, and the server says so and stops.
    let other = node_data.join("other.secret");
    std::fs::write(&other, "another cluster's secret, also long enough").unwrap();
    let out = Command::new(BIN)
        .arg("--data-dir")
        .arg(&api_data)
        .args([
            "serve",
            "--listen",
            &format!("127.0.0.1:{}", free_port()),
            "--node",
            &node_addr,
        ])
        .arg("--node-secret-file")
        .arg(&other)
        .args(&replica_tls)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("signature is not of the cluster secret"),
        "{err}"
    );

    let mut args = vec!["--node", &node_addr, "--node-secret-file", secret.to_str().unwrap()];
    args.extend(&replica_tls);
    let s = Server::start_with(&api_data, &args);
    let id = s.create(json!({ "template": "seed", "timeout": "10m" }));
    assert!(
        node_data.join("sandboxes").join(&id).exists(),
        "the VM runs on the node"
    );
    assert!(!api_data.join("sandboxes").join(&id).exists());
    let sid = s.session(
        &id,
        json!({ "argv": ["sh", "-c", "echo hello from $(hostname); getent hosts blocked.test || echo refused"] }),
    );
    assert_eq!(
        decode(&s.events(&id, &sid, None, None), "stdout"),
        format!("hello from {id}\nrefused\n")
    );
    let (status, _) = s.call(
        "PUT",
        &format!("/v1/sandboxes/{id}/files?path=/home/user/x.txt"),
        Some(json!("across")),
    );
    assert!((200..300).contains(&status));
    let (status, body) = s.call("GET", &format!("/v1/sandboxes/{id}/files?path=/home/user/x.txt"), None);
    assert_eq!((status, body), (200, json!("across")));
    // Decided on the node: the spec beside its VMs, the denial counted there.
    assert!(node_data.join("egress").join(format!("{id}.json")).exists());
    let (_, r) = s.call("GET", &format!("/v1/sandboxes/{id}/egress"), None);
    assert!(r["counters"]["dns_denied"].as_u64().unwrap_or(0) >= 1, "{r}");
    assert!(r["recent_denials"].to_string().contains("blocked.test"), "{r}");

    // The node is stopped (SIGTERM): it drains. The replica suspends its sandbox (a process
    // running, the file written) and the node exits 0; back, the sandbox resumes whole.
    s.session(&id, json!({ "argv": ["sleep", "3600"] }));
    let stopping = Instant::now();
    node.drain(&node_data, Duration::from_secs(120));
    println!("node: drained and exited 0 in {:?}", stopping.elapsed());
    wait_state(&s, &id, "suspended", Duration::from_secs(10)).unwrap_or_else(|sb| panic!("not suspended: {sb}"));
    let mut node = start();
    let (status, body) = s.call("POST", &format!("/v1/sandboxes/{id}/resume"), None);
    assert_eq!(status, 202, "{body}");
    let op = s.wait_op(body["operation"]["id"].as_str().unwrap());
    assert_eq!(op["state"], "succeeded", "{op}");
    let (status, body) = s.call("GET", &format!("/v1/sandboxes/{id}/files?path=/home/user/x.txt"), None);
    assert_eq!((status, body), (200, json!("across")));
    let sid = s.session(&id, json!({ "argv": ["pgrep", "-x", "sleep"] }));
    assert!(
        !decode(&s.events(&id, &sid, None, None), "stdout").trim().is_empty(),
        "the process running before the drain is gone"
    );
    s.delete(&id);
    let deadline = Instant::now() + Duration::from_secs(30);
    while node_data.join("sandboxes").join(&id).exists() {
        assert!(Instant::now() < deadline, "the node kept the deleted sandbox's VM");
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(!node_data.join("egress").join(format!("{id}.json")).exists());
    drop(s);
    node.stop();
    let _ = std::fs::remove_dir_all(&node_data);
    let _ = std::fs::remove_dir_all(&api_data);
}

/// A cluster CA in `dir/pki` and, of it, a node's certificate (`airlock-node`, serverAuth) and a
/// replica's (clientAuth), made by openssl as the chart's README says.
fn cluster_pki(dir: &Path) -> std::path::PathBuf {
    let pki = dir.join("pki");
    std::fs::create_dir_all(&pki).unwrap();
    let openssl = |args: &[&str]| {
        let out = Command::new("openssl").args(args).current_dir(&pki).output().unwrap();
        assert!(
            out.status.success(),
            "openssl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    let ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"];
    let mut ca = vec!["req", "-x509"];
    ca.extend(ec);
    ca.extend([
        "-days",
        "2",
        "-subj",
        "/CN=test cluster CA",
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
    ]);
    ca.extend([
        "-addext",
        "basicConstraints=critical,CA:TRUE",
        "-addext",
        "keyUsage=critical,keyCertSign,cRLSign",
    ]);
    openssl(&ca);
    for (who, usage, san) in [
        ("node", "serverAuth", "DNS:airlock-node"),
        ("replica", "clientAuth", "DNS:airlock-replica"),
    ] {
        let ext = format!(
            "subjectAltName={san}\nextendedKeyUsage={usage}\nbasicConstraints=CA:FALSE\nkeyUsage=digitalSignature\n"
        );
        std::fs::write(pki.join(format!("{who}.ext")), ext).unwrap();
        let (key, csr, crt, ext) = (
            format!("{who}.key"),
            format!("{who}.csr"),
            format!("{who}.crt"),
            format!("{who}.ext"),
        );
        let mut req = vec!["req"];
        req.extend(ec);
        req.extend(["-subj", "/CN=airlock", "-keyout", &key, "-out", &csr]);
        openssl(&req);
        openssl(&[
            "x509",
            "-req",
            "-in",
            &csr,
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "2",
            "-extfile",
            &ext,
            "-out",
            &crt,
        ]);
    }
    pki
}

/// `airlock node` on `data`, listening on `addr` with `secret` (and `extra` flags), its output
/// appended to `data/node.log`; returns once it listens.
fn start_node(data: &Path, addr: &str, secret: &Path, extra: &[&str]) -> ChildGuard {
    // The node binds its listener before it opens its runtime (a first start probes for KVM,
    // 10 s here): it answers once it logs that it serves, so that is what is waited for.
    let serving = |data: &Path| {
        std::fs::read_to_string(data.join("node.log"))
            .unwrap_or_default()
            .matches("serving on")
            .count()
    };
    let served_before = serving(data);
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(data.join("node.log"))
        .unwrap();
    let node = ChildGuard(
        Command::new(BIN)
            .arg("--data-dir")
            .arg(data)
            .args(["node", "--listen", addr, "--secret-file"])
            .arg(secret)
            .args(extra)
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap(),
    );
    let deadline = Instant::now() + Duration::from_secs(120);
    while std::net::TcpStream::connect(addr).is_err() || serving(data) <= served_before {
        assert!(
            Instant::now() < deadline,
            "the node did not serve; see {}",
            data.join("node.log").display()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    node
}

/// Object storage shares `seed` between nodes (issue 25, check 6): a node that has it puts it
/// there as it starts; a node with an empty data dir pulls it (every file checked against the
/// digest) rather than build it, and once it has it fetches nothing more; a sandbox runs on it.
pub(crate) fn a_cold_node_pulls_seed_from_object_storage() {
    let warm = own_data_dir("warm-node");
    let cold = PathBuf::from(format!("{}-cold-node", test_data_dir().display()));
    let objects = PathBuf::from(format!("{}-objects", test_data_dir().display()));
    for dir in [&cold, &objects] {
        let _ = std::fs::remove_dir_all(dir);
        std::fs::create_dir_all(dir).unwrap();
    }
    let secret = warm.join("cluster.secret");
    std::fs::write(&secret, "a cluster secret of at least thirty-two bytes\n").unwrap();
    let flag = format!("file://{}", objects.display());
    let addr = format!("127.0.0.1:{}", free_port());
    let log = |data: &Path| std::fs::read_to_string(data.join("node.log")).unwrap_or_default();
    let seed_digest = |data: &Path| {
        let manifest: Value =
            serde_json::from_slice(&std::fs::read(data.join("templates/seed.json")).unwrap()).unwrap();
        manifest["digest"].as_str().unwrap().to_string()
    };

    let mut node = start_node(&warm, &addr, &secret, &["--objects", &flag]);
    node.stop();
    assert!(log(&warm).contains("put in object storage"), "{}", log(&warm));
    let digest = seed_digest(&warm);

    let mut node = start_node(&cold, &addr, &secret, &["--objects", &flag]);
    node.stop();
    let fetched = |text: &str| -> Vec<u64> {
        text.lines()
            .filter_map(|l| l.split_once("from object storage (")?.1.split(' ').next()?.parse().ok())
            .collect()
    };
    assert_eq!(seed_digest(&cold), digest);
    let first = fetched(&log(&cold));
    assert!(first.len() == 1 && first[0] > 1 << 20, "{}", log(&cold));
    let mut node = start_node(&cold, &addr, &secret, &["--objects", &flag]);
    // The node may answer before its log has the line (a flake seen under load): wait for it.
    let deadline = Instant::now() + Duration::from_secs(20);
    while fetched(&log(&cold)).len() < 2 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(
        fetched(&log(&cold)),
        vec![first[0], 0],
        "the second start fetched again"
    );
    println!("cold node: pulled seed {digest}: {} bytes, then 0", first[0]);

    let api_data = own_data_dir("cold-replica");
    let s = Server::start_with(
        &api_data,
        &["--node", &addr, "--node-secret-file", secret.to_str().unwrap()],
    );
    let id = s.create(json!({ "template": "seed", "timeout": "5m" }));
    let sid = s.session(&id, json!({ "argv": ["echo", "from the cold node"] }));
    assert_eq!(
        decode(&s.events(&id, &sid, None, None), "stdout"),
        "from the cold node\n"
    );
    s.delete(&id);
    drop(s);
    node.stop();
    for dir in [&warm, &cold, &objects, &api_data] {
        let _ = std::fs::remove_dir_all(dir);
    }
}

/// A node's drain moves its sandboxes (issue 25, check 5): two sandboxes on node A (B not up
/// yet), each with a file written and a process running; SIGTERM to A. The replica parks both
/// in object storage (saved, uploaded, ended on A) and starts them again on B, which pulls
/// them; A exits 0. On B each has its file and its process, and A keeps nothing of them. A
/// third, paused, stays parked (its tenant stopped it); deleted so, its image leaves object
/// storage too. A snapshot taken on A outlives A: it starts on B, which pulls its image once,
/// and deleted, it leaves B and object storage.
pub(crate) fn a_draining_nodes_sandboxes_move_to_another_node() {
    let a_data = own_data_dir("node-a");
    let b_data = own_data_dir("node-b");
    let objects = PathBuf::from(format!("{}-moves", test_data_dir().display()));
    let _ = std::fs::remove_dir_all(&objects);
    std::fs::create_dir_all(&objects).unwrap();
    let secret = a_data.join("cluster.secret");
    std::fs::write(&secret, "a cluster secret of at least thirty-two bytes\n").unwrap();
    let flag = format!("file://{}", objects.display());
    let (a_addr, b_addr) = (
        format!("127.0.0.1:{}", free_port()),
        format!("127.0.0.1:{}", free_port()),
    );
    let node_flags = ["--objects", flag.as_str(), "--drain-seconds", "90"];
    let mut a = start_node(&a_data, &a_addr, &secret, &node_flags);
    let api_data = own_data_dir("moves-replica");
    let s = Server::start_with(
        &api_data,
        &[
            "--node",
            &a_addr,
            "--node",
            &b_addr,
            "--node-secret-file",
            secret.to_str().unwrap(),
        ],
    );
    // B does not answer yet: both land on A.
    let ids: Vec<String> = (0..2)
        .map(|_| s.create(json!({ "template": "seed", "timeout": "10m" })))
        .collect();
    for (n, id) in ids.iter().enumerate() {
        assert!(a_data.join("sandboxes").join(id).exists(), "{id} is not on node A");
        let (status, _) = s.call(
            "PUT",
            &format!("/v1/sandboxes/{id}/files?path=/home/user/moved.txt"),
            Some(json!(format!("written on A, #{n}"))),
        );
        assert!((200..300).contains(&status));
        s.session(id, json!({ "argv": ["sleep", "3600"] }));
    }
    let saving = Instant::now();
    let (status, snap) = s.call("POST", &format!("/v1/sandboxes/{}/snapshots", ids[0]), None);
    assert_eq!(status, 201, "{snap}");
    println!("snapshot on A, saved and shared, in {:?}", saving.elapsed());
    let snap_id = snap["id"].as_str().unwrap().to_string();
    let paused = s.create(json!({ "template": "seed", "timeout": "10m" }));
    let (status, r) = s.call("POST", &format!("/v1/sandboxes/{paused}/pause"), None);
    assert_eq!(status, 202, "{r}");
    assert_eq!(s.wait_op(r["operation"]["id"].as_str().unwrap())["state"], "succeeded");
    let b = start_node(&b_data, &b_addr, &secret, &node_flags);

    let stopping = Instant::now();
    a.drain(&a_data, Duration::from_secs(180));
    let drained = stopping.elapsed();
    for id in &ids {
        // Until its VM is on B: the replica may record the park a moment after A exits.
        let deadline = Instant::now() + Duration::from_secs(120);
        while !b_data.join("sandboxes").join(id).exists() {
            assert!(Instant::now() < deadline, "{id} never reached node B");
            std::thread::sleep(Duration::from_millis(100));
        }
        wait_state(&s, id, "running", Duration::from_secs(120)).unwrap_or_else(|sb| {
            panic!(
                "{id} did not run again: {sb}; see {}",
                b_data.join("node.log").display()
            )
        });
    }
    let moved = stopping.elapsed();
    println!("drain: node A exited 0 after {drained:?}; both sandboxes ran on B after {moved:?}");
    for (n, id) in ids.iter().enumerate() {
        assert!(b_data.join("sandboxes").join(id).exists(), "{id} is not on node B");
        assert!(!a_data.join("sandboxes").join(id).exists(), "node A kept {id}");
        let (status, body) = s.call(
            "GET",
            &format!("/v1/sandboxes/{id}/files?path=/home/user/moved.txt"),
            None,
        );
        assert_eq!((status, body), (200, json!(format!("written on A, #{n}"))));
        let sid = s.session(id, json!({ "argv": ["pgrep", "-x", "sleep"] }));
        assert!(
            !decode(&s.events(id, &sid, None, None), "stdout").trim().is_empty(),
            "the process {id} ran on A is gone"
        );
    }
    // The images were the move's only: neither node keeps a copy (A only its snapshot's).
    let images = |data: &Path| -> Vec<String> {
        std::fs::read_dir(data.join("images"))
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect()
    };
    assert_eq!(images(&a_data), vec![snap_id.clone()]);
    assert!(images(&b_data).is_empty(), "B keeps {:?}", images(&b_data));
    // Nor does object storage: each image (the guest's memory among it) left with its move.
    // The paused one's stays, for its resume, and the snapshot's.
    let parked = || -> Vec<_> {
        std::fs::read_dir(objects.join("image-ids"))
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.file_name())
            .collect()
    };
    assert_eq!(
        parked().len(),
        2,
        "object storage keeps the moved images: {:?}",
        parked()
    );
    // The snapshot outlives A: it starts on B, with what A's sandbox had then.
    let starting = Instant::now();
    let child = s.create(json!({ "template": snap_id.as_str(), "timeout": "10m" }));
    println!("a sandbox from it on B (image pulled) in {:?}", starting.elapsed());
    assert!(b_data.join("sandboxes").join(&child).exists(), "{child} is not on B");
    let (status, body) = s.call(
        "GET",
        &format!("/v1/sandboxes/{child}/files?path=/home/user/moved.txt"),
        None,
    );
    assert_eq!((status, body), (200, json!("written on A, #0")));
    s.delete(&child);
    assert_eq!(images(&b_data), vec![snap_id.clone()], "B keeps its copy for the next");
    let (status, _) = s.call("DELETE", &format!("/v1/snapshots/{snap_id}"), None);
    assert_eq!(status, 204);
    assert!(images(&b_data).is_empty(), "B keeps {:?}", images(&b_data));
    assert_eq!(
        parked().len(),
        1,
        "the snapshot stays in object storage: {:?}",
        parked()
    );
    let (_, sb) = s.call("GET", &format!("/v1/sandboxes/{paused}"), None);
    assert_eq!(sb["state"], "suspended", "{sb}");
    assert!(!b_data.join("sandboxes").join(&paused).exists());
    s.delete(&paused);
    assert!(
        parked().is_empty(),
        "the deleted sandbox's parked image stays: {:?}",
        parked()
    );
    // B has `seed`: of each image only the sandbox's own memory and disk came down.
    let log = std::fs::read_to_string(b_data.join("node.log")).unwrap_or_default();
    let pulled_bytes = |what: &str| -> Vec<u64> {
        log.lines()
            .filter(|l| l.contains(what))
            .filter_map(|l| l.split("bytes=").nth(1)?.split_whitespace().next()?.parse().ok())
            .collect()
    };
    let pulled = pulled_bytes("pulled the parked VM's image");
    let snapshot_pulled = pulled_bytes("pulled the shared snapshot's image");
    let seed: Value = serde_json::from_slice(&std::fs::read(b_data.join("templates/seed.json")).unwrap()).unwrap();
    let rootfs = seed["rootfs_bytes"].as_u64().unwrap();
    assert!(
        pulled.len() == 2 && pulled.iter().all(|b| *b < rootfs),
        "pulled {pulled:?} bytes; the root filesystem alone is {rootfs}: {log}"
    );
    assert!(
        snapshot_pulled.len() == 1 && snapshot_pulled[0] < rootfs,
        "the snapshot pulled {snapshot_pulled:?} bytes: {log}"
    );
    println!("moved: each image pulled {pulled:?} bytes (seed's root filesystem, {rootfs} bytes, linked); the snapshot {snapshot_pulled:?}");
    for id in &ids {
        s.delete(id);
    }
    drop(s);
    drop(b);
    for dir in [&a_data, &b_data, &objects, &api_data] {
        let _ = std::fs::remove_dir_all(dir);
    }
}

/// A child process ended (SIGTERM, then waited for) when dropped, also after a failed assert.
struct ChildGuard(std::process::Child);

impl ChildGuard {
    /// SIGTERM to a node on `data`, and its exit 0 once drained, within `within`.
    fn drain(&mut self, data: &Path, within: Duration) {
        let stopping = Instant::now();
        assert_eq!(unsafe { libc::kill(self.0.id() as i32, libc::SIGTERM) }, 0);
        let exit = loop {
            if let Some(status) = self.0.try_wait().unwrap() {
                break status;
            }
            assert!(
                stopping.elapsed() < within,
                "the node still drains after {within:?}; see {}",
                data.join("node.log").display()
            );
            std::thread::sleep(Duration::from_millis(100));
        };
        assert!(exit.success(), "the node exited {exit:?} after its drain");
    }

    fn stop(&mut self) {
        if matches!(self.0.try_wait(), Ok(None)) {
            unsafe { libc::kill(self.0.id() as i32, libc::SIGTERM) };
            let _ = self.0.wait();
        }
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        self.stop();
    }
}
