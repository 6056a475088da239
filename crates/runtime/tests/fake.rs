//! The runtime over the fake VMM and fake agent: create/run/delete, VMs that die on their own
//! (`kill -9`, power-off from inside), re-attach after a restart, pause across a restart.
//! No VM boots; each test takes milliseconds.

use airlock_proto::frame::EventKind;
use airlock_proto::ProcessSpec;
use airlock_runtime::fake;
use airlock_runtime::vmm::pid_alive;
use airlock_runtime::{AgentClient, CreateVm, Resources, Runtime, RuntimeError};
use futures_util::StreamExt;
use std::path::Path;
use std::time::{Duration, Instant};

async fn node(dir: &Path) -> Runtime {
    fake::install_template(dir, "seed").unwrap();
    Runtime::open(fake::options(dir)).await.unwrap()
}

fn seed(id: Option<&str>) -> CreateVm {
    CreateVm {
        id: id.map(Into::into),
        template: "seed".into(),
        resources: Resources::default(),
        image: None,
        env: Default::default(),
        volumes: Vec::new(),
    }
}

fn argv(a: &[&str]) -> ProcessSpec {
    ProcessSpec {
        argv: a.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    }
}

/// No fake VM of this data dir may outlive the test.
fn assert_no_vms(dir: &Path) {
    let deadline = Instant::now() + Duration::from_secs(2);
    while !fake::live_vms(dir).is_empty() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(fake::live_vms(dir), Vec::<u32>::new(), "fake VMs left behind");
}

async fn next_exit(rx: &mut tokio::sync::broadcast::Receiver<String>) -> String {
    tokio::time::timeout(Duration::from_secs(3), rx.recv())
        .await
        .expect("an exit within 3 s")
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn create_run_delete() {
    let tmp = tempfile::tempdir().unwrap();
    let rt = node(tmp.path()).await;
    assert_eq!(rt.runtime_name(), "fake");
    let sb = rt.create(seed(None)).await.unwrap();
    assert!(pid_alive(sb.handle.pid));
    assert_eq!(fake::live_vms(tmp.path()), vec![sb.handle.pid]);

    let out = sb.run(argv(&["echo", "hello", "world"])).await.unwrap();
    assert_eq!(out.stdout, b"hello world\n");
    assert_eq!(out.exit.exit_code, Some(0));
    let out = sb.run(argv(&["sh", "-c", "exit 3"])).await.unwrap();
    assert_eq!(out.exit.exit_code, Some(3));
    let out = sb.run(argv(&["gcc", "x.c"])).await.unwrap();
    assert_eq!(out.exit.exit_code, Some(127));
    assert!(String::from_utf8_lossy(&out.stderr).contains("command not found"));

    // A session: a long process, streamed, resumed after a seq, signalled.
    let agent = sb.agent().await.unwrap();
    let cat = agent
        .spawn(&ProcessSpec {
            stdin: true,
            ..argv(&["cat"])
        })
        .await
        .unwrap();
    agent.write_stdin(cat.id, "one\n").await.unwrap();
    agent.write_stdin(cat.id, "two\n").await.unwrap();
    agent.close_stdin(cat.id).await.unwrap();
    let events: Vec<_> = agent.events(cat.id, 1).await.unwrap().collect().await;
    let kinds: Vec<_> = events.into_iter().map(|e| e.unwrap()).collect();
    assert_eq!(kinds.len(), 2, "resumed after seq 1: {kinds:?}");
    assert_eq!(kinds[0].kind, EventKind::Stdout("two\n".into()));
    assert!(matches!(&kinds[1].kind, EventKind::Exit(e) if e.exit_code == Some(0)));

    let sleep = agent.spawn(&argv(&["sleep", "30"])).await.unwrap();
    assert_eq!(agent.processes().await.unwrap().len(), 5);
    agent.signal(sleep.id, 9).await.unwrap();
    let mut events = Box::pin(agent.events(sleep.id, 0).await.unwrap());
    let ev = events.next().await.unwrap().unwrap();
    assert!(matches!(ev.kind, EventKind::Exit(e) if e.signal == Some(9)));
    let timed = sb
        .run(ProcessSpec {
            timeout_ms: Some(50),
            ..argv(&["sleep", "infinity"])
        })
        .await
        .unwrap();
    assert!(timed.exit.timed_out);

    // Files.
    agent
        .write_file("/home/user/a/b.txt", Some("user"), "data")
        .await
        .unwrap();
    assert_eq!(agent.read_file("/home/user/a/b.txt").await.unwrap(), "data");
    let listed = agent.list("/home/user", 2).await.unwrap();
    let paths: Vec<_> = listed.iter().map(|s| s.path.as_str()).collect();
    assert_eq!(paths, ["/home/user/a", "/home/user/a/b.txt"]);
    agent.rename("/home/user/a", "/tmp/c").await.unwrap();
    assert_eq!(agent.stat("/tmp/c/b.txt").await.unwrap().size, 4);
    agent.remove("/tmp/c").await.unwrap();
    let gone = agent.stat("/tmp/c/b.txt").await.unwrap_err();
    assert_eq!(gone.code(), Some(airlock_proto::ErrorCode::NotFound));
    assert!(agent.metrics().await.unwrap().mem_total_bytes > 0);

    let (pid, dir) = (sb.handle.pid, sb.handle.dir.clone());
    let mut exits = rt.exits();
    rt.delete(sb.id()).await.unwrap();
    assert!(!dir.exists());
    assert!(!pid_alive(pid));
    assert!(matches!(rt.get(sb.id()), Err(RuntimeError::UnknownSandbox(_))));
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(exits.try_recv().is_err(), "a delete is not an exit");
    assert_no_vms(tmp.path());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_is_reported_and_cleaned_up() {
    let tmp = tempfile::tempdir().unwrap();
    let rt = node(tmp.path()).await;
    let sb = rt.create(seed(None)).await.unwrap();
    let other = rt.create(seed(None)).await.unwrap();
    let mut exits = rt.exits();
    let started = Instant::now();
    fake::kill_vm(sb.handle.pid);
    assert_eq!(next_exit(&mut exits).await, sb.id());
    eprintln!("kill -9 reported after {:?}", started.elapsed());
    assert!(matches!(rt.get(sb.id()), Err(RuntimeError::UnknownSandbox(_))));
    assert!(!sb.handle.dir.exists());
    // The other sandbox is untouched.
    assert_eq!(other.run(argv(&["echo", "ok"])).await.unwrap().stdout, b"ok\n");
    rt.delete(other.id()).await.unwrap();
    assert_no_vms(tmp.path());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poweroff_from_inside_is_reported() {
    let tmp = tempfile::tempdir().unwrap();
    let rt = node(tmp.path()).await;
    let mut exits = rt.exits();

    // The guest powers itself off (`poweroff` in the sandbox).
    let sb = rt.create(seed(None)).await.unwrap();
    let agent = sb.agent().await.unwrap();
    agent.spawn(&argv(&["poweroff"])).await.unwrap();
    assert_eq!(next_exit(&mut exits).await, sb.id());
    assert!(matches!(rt.get(sb.id()), Err(RuntimeError::UnknownSandbox(_))));
    assert!(!sb.handle.dir.exists());

    // The same through the test control.
    let sb = rt.create(seed(None)).await.unwrap();
    assert!(fake::power_off(&sb.handle));
    assert_eq!(next_exit(&mut exits).await, sb.id());
    assert!(rt.list().is_empty());
    assert_no_vms(tmp.path());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_reattaches_running_and_paused_vms() {
    let tmp = tempfile::tempdir().unwrap();
    let rt = node(tmp.path()).await;
    let running = rt.create(seed(None)).await.unwrap();
    let paused = rt.create(seed(None)).await.unwrap();
    let agent = running.agent().await.unwrap();
    let sleeper = agent.spawn(&argv(&["sleep", "60"])).await.unwrap();
    rt.pause(paused.id()).await.unwrap();
    assert!(paused.is_paused());
    // A frozen guest does not answer.
    let frozen = AgentClient::connect_ready(&paused.handle.agent_socket, Duration::from_millis(300)).await;
    assert!(frozen.is_err(), "a paused VM's agent answered");
    let (running_id, paused_id) = (running.id().to_string(), paused.id().to_string());
    let pids = (running.handle.pid, paused.handle.pid);

    // Restart: the old runtime goes away, a new one (with a new FakeVmm) opens the same dir.
    drop((running, paused, agent, rt));
    let rt = Runtime::open(fake::options(tmp.path())).await.unwrap();
    assert_eq!(rt.list().len(), 2);
    let running = rt.get(&running_id).unwrap();
    let paused = rt.get(&paused_id).unwrap();
    assert_eq!((running.handle.pid, paused.handle.pid), pids);
    // The running VM's agent still answers, and its processes are still there.
    let agent = running.agent().await.unwrap();
    let info = agent.process(sleeper.id).await.unwrap();
    assert_eq!(info.state, airlock_proto::ProcessState::Running);
    assert_eq!(running.run(argv(&["echo", "again"])).await.unwrap().stdout, b"again\n");
    // The paused one is re-attached as paused, then resumes.
    assert!(paused.is_paused());
    assert!(matches!(paused.agent().await, Err(RuntimeError::NotRunning(_))));
    rt.resume(&paused_id).await.unwrap();
    assert!(!paused.is_paused());
    assert_eq!(paused.run(argv(&["echo", "awake"])).await.unwrap().stdout, b"awake\n");

    // A VM killed after the restart is reported by the new runtime.
    let mut exits = rt.exits();
    fake::kill_vm(running.handle.pid);
    assert_eq!(next_exit(&mut exits).await, running_id);

    // A paused VM can be deleted.
    rt.pause(&paused_id).await.unwrap();
    rt.delete(&paused_id).await.unwrap();
    assert!(rt.list().is_empty());
    assert_no_vms(tmp.path());
}

/// With `reconcile_in_background` (what the server uses), `open` returns before the VMs of the
/// last life are re-attached, several at a time: each sandbox is reported settled once it is
/// re-attached (running or paused) or removed (its VM died), never before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn background_reconcile_settles_each_sandbox() {
    let tmp = tempfile::tempdir().unwrap();
    let rt = node(tmp.path()).await;
    let mut sandboxes = Vec::new();
    // More than are reconciled at once.
    for _ in 0..airlock_runtime::sandbox::RECONCILE_AT_ONCE + 4 {
        sandboxes.push(rt.create(seed(None)).await.unwrap());
    }
    rt.pause(sandboxes[0].id()).await.unwrap();
    let ids: Vec<String> = sandboxes.iter().map(|s| s.id().to_string()).collect();
    let pids: Vec<u32> = sandboxes.iter().map(|s| s.handle.pid).collect();
    let dead = [1, 2];
    drop((sandboxes, rt));
    for i in dead {
        fake::kill_vm(pids[i]);
    }
    let deadline = Instant::now() + Duration::from_secs(2);
    while dead.iter().any(|i| pid_alive(pids[*i])) && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }

    let opts = airlock_runtime::RuntimeOptions {
        reconcile_in_background: true,
        ..fake::options(tmp.path())
    };
    let rt = Runtime::open(opts).await.unwrap();
    assert!(rt.is_settled("neverexisted0"), "an unknown id is settled");
    for (i, id) in ids.iter().enumerate() {
        // Unsettled means unknown to `get`, whatever the VM is; settled means decided. Asked
        // in this order since the background may settle it between the two questions.
        if rt.get(id).is_ok() {
            assert!(rt.is_settled(id), "{i} found before it was settled");
        }
        tokio::time::timeout(Duration::from_secs(5), rt.settled(id))
            .await
            .expect("settled within 5 s");
        assert!(rt.is_settled(id));
        if dead.contains(&i) {
            assert!(matches!(rt.get(id), Err(RuntimeError::UnknownSandbox(_))), "{i}");
            assert!(!tmp.path().join("sandboxes").join(id).exists(), "{i}");
        } else {
            let sb = rt.get(id).unwrap();
            assert_eq!(sb.handle.pid, pids[i], "re-attached, not replaced");
            assert_eq!(sb.is_paused(), i == 0);
        }
    }
    tokio::time::timeout(Duration::from_secs(5), rt.settled_all())
        .await
        .expect("all settled");
    assert_eq!(rt.list().len(), ids.len() - dead.len());
    let alive = &ids[3];
    assert_eq!(
        rt.get(alive)
            .unwrap()
            .run(argv(&["echo", "back"]))
            .await
            .unwrap()
            .stdout,
        b"back\n"
    );
    for (i, id) in ids.iter().enumerate() {
        if !dead.contains(&i) {
            rt.delete(id).await.unwrap();
        }
    }
    assert_no_vms(tmp.path());
}

/// Wait until the runtime's trimmer has cut `log` back under the cap.
async fn await_trimmed(log: &Path) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while std::fs::metadata(log).unwrap().len() > airlock_runtime::vmm::CONSOLE_CAP {
        assert!(Instant::now() < deadline, "{} was not trimmed in 5 s", log.display());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn console_logs_are_trimmed_before_and_after_a_restart() {
    use std::io::Write;
    let tmp = tempfile::tempdir().unwrap();
    let rt = node(tmp.path()).await;
    let sb = rt.create(seed(None)).await.unwrap();
    let log = sb.handle.console_log.clone();
    let flood = |last: &str| {
        let mut f = std::fs::OpenOptions::new().append(true).open(&log).unwrap();
        let line = "a guest printing to its console forever\n".repeat(1024);
        while f.metadata().unwrap().len() <= 2 * airlock_runtime::vmm::CONSOLE_CAP {
            f.write_all(line.as_bytes()).unwrap();
        }
        f.write_all(last.as_bytes()).unwrap();
    };
    flood("first flood ends\n");
    await_trimmed(&log).await;
    assert!(
        sb.handle.console_tail(1).contains("first flood ends"),
        "{}",
        sb.handle.console_tail(1)
    );

    // The VM outlives the runtime; the next one trims its log too.
    let id = sb.id().to_string();
    drop((sb, rt));
    let rt = Runtime::open(fake::options(tmp.path())).await.unwrap();
    flood("second flood ends\n");
    await_trimmed(&log).await;
    let sb = rt.get(&id).unwrap();
    assert!(sb.handle.console_tail(1).contains("second flood ends"));
    rt.delete(&id).await.unwrap();
    assert_no_vms(tmp.path());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_removes_dead_vms() {
    let tmp = tempfile::tempdir().unwrap();
    let rt = node(tmp.path()).await;
    let sb = rt.create(seed(None)).await.unwrap();
    let (id, dir, pid) = (sb.id().to_string(), sb.handle.dir.clone(), sb.handle.pid);
    drop((sb, rt));
    // Dies while no runtime watches it.
    fake::kill_vm(pid);
    let deadline = Instant::now() + Duration::from_secs(2);
    while pid_alive(pid) && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let rt = Runtime::open(fake::options(tmp.path())).await.unwrap();
    assert!(matches!(rt.get(&id), Err(RuntimeError::UnknownSandbox(_))));
    assert!(!dir.exists());
    assert_no_vms(tmp.path());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn typed_errors_for_ids() {
    let tmp = tempfile::tempdir().unwrap();
    let rt = node(tmp.path()).await;
    let bad = rt.create(seed(Some("Not-Valid!"))).await.err().unwrap();
    assert!(matches!(bad, RuntimeError::InvalidSandboxId(_)), "{bad}");
    let sb = rt.create(seed(Some("abcdef0123"))).await.unwrap();
    let taken = rt.create(seed(Some("abcdef0123"))).await.err().unwrap();
    assert!(matches!(taken, RuntimeError::SandboxIdTaken(_)), "{taken}");
    let missing = rt
        .create(CreateVm {
            template: "nope".into(),
            ..seed(None)
        })
        .await
        .err()
        .unwrap();
    assert!(matches!(missing, RuntimeError::UnknownTemplate(_)), "{missing}");
    // A saved image that is gone (its snapshot's files removed) is a missing image, not template.
    let vanished = rt
        .create(CreateVm {
            image: Some("0123456789abcdef".into()),
            ..seed(None)
        })
        .await
        .err()
        .unwrap();
    assert!(matches!(vanished, RuntimeError::UnknownImage(_)), "{vanished}");
    rt.delete(sb.id()).await.unwrap();
    assert!(rt.list().is_empty());
    assert_no_vms(tmp.path());
}

/// A restart that also replaces the tokio runtime (as a real server restart would): the fake
/// agents do not live on the test's runtime, so they still answer.
#[test]
fn restart_with_a_new_tokio_runtime() {
    let tmp = tempfile::tempdir().unwrap();
    let tokio_rt = || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    };
    let (id, pid) = tokio_rt().block_on(async {
        let rt = node(tmp.path()).await;
        let sb = rt.create(seed(None)).await.unwrap();
        (sb.id().to_string(), sb.handle.pid)
    });
    tokio_rt().block_on(async {
        let rt = Runtime::open(fake::options(tmp.path())).await.unwrap();
        let sb = rt.get(&id).unwrap();
        assert_eq!(sb.handle.pid, pid);
        assert_eq!(
            sb.run(argv(&["echo", "still", "here"])).await.unwrap().stdout,
            b"still here\n"
        );
        rt.delete(&id).await.unwrap();
    });
    assert_no_vms(tmp.path());
}

/// Every rebuild of a template leaves its old image behind: a runtime that opens removes the
/// images no template names and nothing was made from, and keeps the rest.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn opening_prunes_template_images_nothing_uses() {
    let tmp = tempfile::tempdir().unwrap();
    let rt = node(tmp.path()).await;
    let sb = rt.create(seed(None)).await.unwrap();
    let blobs = rt.data_dir().blobs();
    let named = sb.record.template_digest.trim_start_matches("sha256:").to_string();
    let (stale, used) = ("a".repeat(64), "b".repeat(64));
    for d in [&stale, &used] {
        std::fs::create_dir_all(blobs.join(d)).unwrap();
        std::fs::write(blobs.join(d).join("rootfs.ext4"), b"old").unwrap();
    }
    // The sandbox was made from `used` (as if before a rebuild).
    let record = tmp.path().join("sandboxes").join(sb.id()).join("sandbox.json");
    let mut v: serde_json::Value = serde_json::from_slice(&std::fs::read(&record).unwrap()).unwrap();
    v["template_digest"] = format!("sha256:{used}").into();
    std::fs::write(&record, serde_json::to_vec(&v).unwrap()).unwrap();
    let id = sb.id().to_string();
    drop((sb, rt));
    let rt = Runtime::open(fake::options(tmp.path())).await.unwrap();
    assert!(!blobs.join(&stale).exists(), "an image nothing uses stays");
    assert!(blobs.join(&used).exists() && blobs.join(&named).exists());
    rt.delete(&id).await.unwrap();
    assert_no_vms(tmp.path());
}

/// An agent reached through its node: a stand-in for the node's agent route (parse the call,
/// check the caller, `forward` it) on one end of a stream, a client `at` that route on the
/// other. Calls, event streams, file reads and the agent's own errors pass through unchanged;
/// a call without the node's token never reaches the agent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_forwarded_through_a_node_reach_the_agent_unchanged() {
    use http_body_util::BodyExt;
    use hyper::service::service_fn;
    let tmp = tempfile::tempdir().unwrap();
    let rt = node(tmp.path()).await;
    let sb = rt.create(seed(None)).await.unwrap();
    let local = sb.agent().await.unwrap();
    let prefix = format!("/vms/{}/agent", sb.id());

    let (node_end, caller_end) = tokio::io::duplex(1 << 20);
    let service = service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
        let (local, prefix) = (local.clone(), prefix.clone());
        async move {
            let reply = |status: u16, body: &'static str| {
                let body = http_body_util::Full::new(bytes::Bytes::from(body))
                    .map_err(|n| match n {})
                    .boxed_unsync();
                Ok::<_, std::convert::Infallible>(hyper::Response::builder().status(status).body(body).unwrap())
            };
            if req.headers().get("authorization").map(|v| v.as_bytes()) != Some(b"Bearer node-token") {
                return reply(401, r#"{"code":"internal","message":"no token"}"#);
            }
            let Some(path) = req.uri().path().strip_prefix(&prefix) else {
                return reply(404, r#"{"code":"not_found","message":"no such vm"}"#);
            };
            let route = match airlock_proto::routes::Route::parse(req.method().as_str(), path, req.uri().query()) {
                Ok(r) => r,
                Err(_) => return reply(404, r#"{"code":"not_found","message":"no such route"}"#),
            };
            let body = req.into_body().map_err(std::io::Error::other).boxed_unsync();
            match local.forward(&route, body).await {
                Ok(resp) => Ok(resp.map(|b| b.map_err(std::io::Error::other).boxed_unsync())),
                Err(_) => reply(502, r#"{"code":"internal","message":"agent unreachable"}"#),
            }
        }
    });
    tokio::spawn(async move {
        let _ = hyper::server::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
            .serve_connection(hyper_util::rt::TokioIo::new(node_end), service)
            .await;
    });
    let remote = AgentClient::handshake(caller_end).await.unwrap();
    let token = Some(http::HeaderValue::from_static("Bearer node-token"));
    let agent = remote.at(&format!("http://node/vms/{}/agent/", sb.id()), token);

    let p = agent.spawn(&argv(&["echo", "through the node"])).await.unwrap();
    let events: Vec<_> = agent.events(p.id, 0).await.unwrap().collect().await;
    let stdout: Vec<u8> = events
        .iter()
        .filter_map(|e| match &e.as_ref().unwrap().kind {
            EventKind::Stdout(b) => Some(b.to_vec()),
            _ => None,
        })
        .flatten()
        .collect();
    assert_eq!(stdout, b"through the node\n");
    agent.write_file("/tmp/forwarded", None, &b"bytes"[..]).await.unwrap();
    assert_eq!(&agent.read_file("/tmp/forwarded").await.unwrap()[..], b"bytes");
    // The agent's own error, as it sent it.
    let missing = agent.stat("/no/such/file").await.unwrap_err();
    assert_eq!(missing.code(), Some(airlock_proto::ErrorCode::NotFound), "{missing}");
    // Without the node's token the call stops at the node.
    let refused = remote.at(&format!("http://node/vms/{}/agent", sb.id()), None);
    assert!(matches!(
        refused.health().await.unwrap_err(),
        airlock_agent_client::AgentError::Api { status: 401, .. }
    ));
    rt.delete(sb.id()).await.unwrap();
    assert_no_vms(tmp.path());
}
