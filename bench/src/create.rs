//! Fast create, against a running server, next to the raw VMM restoring the same snapshot.
//!
//! - **TTI**: `POST /v1/sandboxes` to the first stdout byte of `echo` streamed over SSE (the
//!   create's operation polled every 5 ms, then the session answered as its event stream), for `--sequential`
//!   creates one after another and a burst of `--burst` at once.
//! - **raw restore + exec**: `qemu-system-x86_64` started by hand on the base snapshot the
//!   server restores these creates from (same arguments, paths instead of a jail's fds, a fresh
//!   overlay), its state loaded over QMP, then the agent's hello and one `echo` through the
//!   runtime's agent client: the same work with no server in the path.
//! - **exec round trip**: `true` through the API on a warm sandbox, two ways (a session, then its
//!   SSE stream to the exit; and one call, the session answered as its event stream), next to the
//!   same through the agent client on the raw VM.
//! - **idle memory**: the host's MemAvailable drop over `--idle` idle sandboxes, per sandbox.
//! - **suspend / resume**: `--suspends` cycles on a sandbox running a process: the suspend
//!   operation (its memory to disk, its VMM gone), the resume operation, and the resume to the
//!   first stdout of `echo`.
//! - **fork**: `--forks` forks of `--fork-count` children each, from the fork call to every
//!   child's operation done, then to an `echo` answered in each.
//!
//! ```text
//! AIRLOCK_API_KEY=... cargo run --release -p airlock-bench --bin create-bench -- \
//!     --url http://127.0.0.1:8080 --data-dir /var/lib/airlock
//! ```

mod api;
mod machine;
mod raw;

use api::{ms, stats, Api};

use airlock_proto::frame::EventKind;
use airlock_proto::ProcessSpec;
use airlock_runtime::agent::AgentClient;
use airlock_runtime::qemu::{Attach, QemuVmm};
use airlock_runtime::sandbox::base_snapshot::{BaseSnapshot, BaseSnapshotManifest};
use airlock_runtime::template::TemplateStore;
use airlock_runtime::vmm::{SnapshotRole, VmSpec};
use clap::Parser;
use futures_util::StreamExt;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

#[derive(Parser)]
struct Args {
    #[arg(long, env = "AIRLOCK_URL", default_value = "http://127.0.0.1:8080")]
    url: String,
    #[arg(long, env = "AIRLOCK_API_KEY")]
    key: String,
    /// The server's data dir (where its base snapshots are).
    #[arg(long, env = "AIRLOCK_DATA_DIR", default_value = "/var/lib/airlock")]
    data_dir: PathBuf,
    #[arg(long, default_value = "seed")]
    template: String,
    /// The sandboxes' disk (small enough that `--idle` of them fit the node's disk budget).
    #[arg(long, default_value_t = 768)]
    disk_mib: u32,
    #[arg(long, default_value_t = 50)]
    sequential: usize,
    #[arg(long, default_value_t = 10)]
    burst: usize,
    /// Raw restores by hand.
    #[arg(long, default_value_t = 10)]
    raw: usize,
    #[arg(long, default_value_t = 50)]
    execs: usize,
    #[arg(long, default_value_t = 20)]
    idle: usize,
    #[arg(long, default_value_t = 10)]
    suspends: usize,
    #[arg(long, default_value_t = 3)]
    forks: usize,
    #[arg(long, default_value_t = 5)]
    fork_count: usize,
    #[arg(long, default_value = "bench/results")]
    out: PathBuf,
}

/// Wait (at most 5 min) until every warm pool the server shows is full; the pools then. Without
/// the platform account's token the pools can't be seen: no wait (`null`).
async fn wait_pool_full(api: &std::sync::Arc<Api>) -> Value {
    let Some(admin) = api.admin_auth.clone() else {
        eprintln!("no admin token (AIRLOCK_ADMIN_TOKEN or `airlock login`): not waiting for warm pools");
        return Value::Null;
    };
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        let (url, admin) = (format!("{}/v1/admin/system", api.url), admin.clone());
        let system = tokio::task::spawn_blocking(move || {
            ureq::get(&url)
                .set("Authorization", &admin)
                .call()
                .ok()
                .and_then(|r| r.into_json::<Value>().ok())
        })
        .await
        .unwrap()
        .unwrap_or_default();
        let pools = system["pools"].clone();
        let full = pools
            .as_array()
            .is_none_or(|p| p.iter().all(|p| p["ready"] == p["size"]));
        if full || Instant::now() > deadline {
            return pools;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn mem_available_mib() -> f64 {
    let info = std::fs::read_to_string("/proc/meminfo").unwrap();
    let kib: f64 = info
        .lines()
        .find(|l| l.starts_with("MemAvailable:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap();
    kib / 1024.0
}

/// The base snapshot the server restores `template` (at its digest) with `resources` from.
fn find_snapshot(data_dir: &Path, digest: &str, resources: &Value) -> Option<BaseSnapshot> {
    let root = data_dir.join("snapshots");
    std::fs::read_dir(&root).ok()?.flatten().find_map(|e| {
        let key = e.file_name().to_string_lossy().to_string();
        let snap = BaseSnapshot::find(&root, &key)?;
        let m: &BaseSnapshotManifest = &snap.manifest;
        let r = &m.resources;
        (m.template_digest == digest
            && resources["vcpu"] == r.vcpu
            && resources["memory_mib"] == r.memory_mib
            && resources["disk_mib"] == r.disk_mib)
            .then_some(snap)
    })
}

/// Restore `snap` with raw QEMU, then one `echo` through the agent client: (to the agent's
/// READY, to the first stdout byte), plus `execs` round trips of `true` if asked.
/// `between` runs after each of those round trips (the API's exec, so both sides are sampled
/// alternately and drift on a noisy machine hits both).
async fn raw_restore(
    qemu: &Path,
    netns: &str,
    spec: &VmSpec,
    snap: &BaseSnapshot,
    execs: usize,
    between: &mut dyn FnMut(),
) -> (f64, f64, Vec<f64>) {
    let dir = &spec.dir;
    let started = Instant::now();
    let raw::RawFiles {
        overlay,
        agent,
        qmp,
        console,
    } = raw::prepare(dir, &snap.disk(), "qcow2", spec.disk_mib);
    // In a namespace of the bench's own, where QEMU makes its tap: the device state wants one,
    // and nothing there leads anywhere.
    let child = std::process::Command::new("ip")
        .args(["netns", "exec", netns])
        .arg(qemu)
        .args(QemuVmm::args(
            spec,
            &Attach::paths(&overlay, &agent, &qmp, &console, spec)
                .with_netdev("tap,ifname=rawtap0,script=no,downscript=no,vhost=off"),
        ))
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(dir.join("qemu.log")).unwrap())
        .spawn()
        .unwrap();
    let mut vmm = raw::KillOnDrop(child);
    let mut q = loop {
        if let Ok(Some(status)) = vmm.0.try_wait() {
            panic!(
                "raw QEMU exited ({status}): {}",
                std::fs::read_to_string(dir.join("qemu.log")).unwrap_or_default()
            );
        }
        match airlock_runtime::qmp::Qmp::connect(&qmp).await {
            Ok(q) => break q,
            Err(_) => tokio::time::sleep(Duration::from_millis(2)).await,
        }
    };
    let caps = json!({"capabilities": [{"capability": "x-ignore-shared", "state": true}]});
    q.execute("migrate-set-capabilities", Some(caps)).await.unwrap();
    let uri = json!({"uri": format!("file:{}", snap.state().display())});
    q.execute("migrate-incoming", Some(uri)).await.unwrap();
    while q.execute("query-migrate", None).await.unwrap()["status"] != "completed" {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    q.execute("cont", None).await.unwrap();
    let (client, _) = AgentClient::connect_ready(&agent, Duration::from_secs(30))
        .await
        .unwrap();
    let ready = ms(started.elapsed());
    run_until(&client, &["echo", "hi"], |k| matches!(k, EventKind::Stdout(_))).await;
    let first = ms(started.elapsed());
    let mut rtts = Vec::new();
    for _ in 0..execs {
        let t = Instant::now();
        run_until(&client, &["true"], |k| matches!(k, EventKind::Exit(_))).await;
        rtts.push(ms(t.elapsed()));
        between();
    }
    drop(client);
    drop(vmm);
    let _ = std::fs::remove_dir_all(dir);
    (ready, first, rtts)
}

fn spec_of(argv: &[&str]) -> ProcessSpec {
    ProcessSpec {
        argv: argv.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    }
}

/// Spawn `argv` through the agent client and read its events until the first that `until` takes.
async fn run_until(client: &AgentClient, argv: &[&str], until: fn(&EventKind) -> bool) {
    let info = client.spawn(&spec_of(argv)).await.unwrap();
    let mut events = Box::pin(client.events(info.id, 0).await.unwrap());
    while let Some(ev) = events.next().await {
        if until(&ev.unwrap().kind) {
            return;
        }
    }
    panic!("{argv:?} ended before the event waited for");
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    let api = std::sync::Arc::new(Api {
        url: args.url.trim_end_matches('/').to_string(),
        auth: format!("Bearer {}", args.key),
        admin_auth: std::env::var("AIRLOCK_ADMIN_TOKEN")
            .ok()
            .or_else(|| std::fs::read_to_string(args.data_dir.join("admin-token")).ok())
            .map(|t| t.trim().to_string())
            .filter(|t| !t.is_empty())
            .map(|t| format!("Bearer {t}")),
        disk_mib: args.disk_mib,
    });
    let template = args.template.clone();

    // The first create of the shape has the server build its base snapshot; wait for it.
    let b = api.clone();
    let t = template.clone();
    let (first_ms, first_id) = tokio::task::spawn_blocking(move || b.tti(&t))
        .await
        .unwrap()
        .expect("a first create");
    let sandbox = api.call("GET", &format!("/sandboxes/{first_id}"), None).unwrap();
    api.delete(&first_id);
    eprintln!("first create: {first_ms:.0} ms ({})", sandbox["start"]);
    let digest = sandbox["template_digest"].as_str().unwrap().to_string();
    let resources = sandbox["resources"].clone();
    let deadline = Instant::now() + Duration::from_secs(300);
    let snap = loop {
        if let Some(s) = find_snapshot(&args.data_dir, &digest, &resources) {
            break s;
        }
        assert!(
            Instant::now() < deadline,
            "no base snapshot in {} after 300 s",
            args.data_dir.display()
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    };

    // TTI, sequential. Every sandbox is deleted before the next create.
    let (mut seq, mut seq_failures, mut restored, mut pooled) = (Vec::new(), 0, 0, 0);
    for i in 0..args.sequential {
        let (b, t) = (api.clone(), template.clone());
        match tokio::task::spawn_blocking(move || b.tti(&t)).await.unwrap() {
            Ok((v, id)) => {
                seq.push(v);
                let sb = api.call("GET", &format!("/sandboxes/{id}"), None).unwrap_or_default();
                restored += (sb["start"]["from"] == "restore") as usize;
                pooled += (sb["start"]["from"] == "pool") as usize;
                api.delete(&id);
            }
            Err(e) => {
                eprintln!("sequential {i}: {e}");
                seq_failures += 1;
            }
        }
    }
    eprintln!(
        "sequential: {} creates, {restored} restored, {pooled} from a warm pool",
        seq.len()
    );

    // With a warm pool, the burst starts from a full one (`/v1/system` says when).
    let pool_before_burst = wait_pool_full(&api).await;

    // TTI, a burst at once.
    let tasks: Vec<_> = (0..args.burst)
        .map(|_| {
            let (b, t) = (api.clone(), template.clone());
            tokio::task::spawn_blocking(move || b.tti(&t))
        })
        .collect();
    let (mut burst, mut burst_failures, mut burst_ids) = (Vec::new(), 0, Vec::new());
    for task in tasks {
        match task.await.unwrap() {
            Ok((v, id)) => {
                burst.push(v);
                burst_ids.push(id);
            }
            Err(e) => {
                eprintln!("burst: {e}");
                burst_failures += 1;
            }
        }
    }
    for id in &burst_ids {
        api.delete(id);
    }

    // Suspend and resume, on a sandbox with a process running.
    let (b, t) = (api.clone(), template.clone());
    let held = tokio::task::spawn_blocking(move || b.create(&t))
        .await
        .unwrap()
        .unwrap();
    let (b, h, suspends) = (api.clone(), held.clone(), args.suspends);
    let cycles = tokio::task::spawn_blocking(move || {
        let _ = b.call(
            "POST",
            &format!("/sandboxes/{h}/sessions"),
            Some(json!({"argv": ["sleep", "3600"]})),
        );
        let (mut suspend, mut resume, mut to_stdout, mut failures) = (Vec::new(), Vec::new(), Vec::new(), 0);
        for i in 0..suspends {
            let cycle = || -> Result<(f64, f64, f64), String> {
                let s = b.change(&h, "suspend")?;
                let t = Instant::now();
                let r = b.change(&h, "resume")?;
                b.exec(&h, &["echo", "hi"], true)?;
                Ok((s, r, ms(t.elapsed())))
            };
            match cycle() {
                Ok((s, r, e)) => {
                    suspend.push(s);
                    resume.push(r);
                    to_stdout.push(e);
                }
                Err(e) => {
                    eprintln!("suspend/resume {i}: {e}");
                    failures += 1;
                }
            }
        }
        (suspend, resume, to_stdout, failures)
    })
    .await
    .unwrap();
    api.delete(&held);
    let (suspend_ms, resume_ms, resume_stdout_ms, suspend_failures) = cycles;

    // Forks of a sandbox with a process running.
    let (b, t) = (api.clone(), template.clone());
    let parent = tokio::task::spawn_blocking(move || b.create(&t))
        .await
        .unwrap()
        .unwrap();
    let (mut fork_started, mut fork_answered, mut fork_failures) = (Vec::new(), Vec::new(), 0);
    for i in 0..args.forks {
        let (b, p, n) = (api.clone(), parent.clone(), args.fork_count);
        match tokio::task::spawn_blocking(move || b.fork(&p, n)).await.unwrap() {
            Ok((started, answered, children)) => {
                fork_started.push(started);
                fork_answered.push(answered);
                for c in &children {
                    api.delete(c);
                }
            }
            Err(e) => {
                eprintln!("fork {i}: {e}");
                fork_failures += 1;
            }
        }
    }
    api.delete(&parent);

    // The raw VMM restoring the same snapshot, and the runtime-level exec on it.
    let qemu = QemuVmm::locate(None).unwrap();
    let store = TemplateStore::new(airlock_runtime::datadir::DataDir::open(&args.data_dir).unwrap());
    let tpl = store.resolve(&digest).unwrap();
    let r = &snap.manifest.resources;
    let raw_dir = std::env::temp_dir().join(format!("airlock-raw-restore-{}", std::process::id()));
    let mut spec = VmSpec::for_template("rawrestore", raw_dir.clone(), &tpl, *r, snap.manifest.accel);
    spec.snapshot = Some(SnapshotRole::Clone {
        memory: snap.memory(),
        state: snap.state(),
        disk: snap.disk(),
        cmdline: snap.manifest.cmdline.clone(),
    });
    let (mut raw_ready, mut raw_first, mut runtime_exec) = (Vec::new(), Vec::new(), Vec::new());
    // Exec round trips on a warm sandbox through the API, alternating with the runtime-level
    // ones on the first raw restore.
    let (b, t) = (api.clone(), template.clone());
    let warm = tokio::task::spawn_blocking(move || b.create(&t))
        .await
        .unwrap()
        .unwrap();
    let (mut api_exec, mut api_exec_one) = (Vec::new(), Vec::new());
    let mut api_round = || {
        tokio::task::block_in_place(|| {
            let t = Instant::now();
            api.exec(&warm, &["true"], false).unwrap();
            api_exec.push(ms(t.elapsed()));
            let t = Instant::now();
            api.exec_one_call(&warm, &["true"], false).unwrap();
            api_exec_one.push(ms(t.elapsed()));
        })
    };
    let netns = raw::Netns::add(format!("airlock-rawbench-{}", std::process::id()));
    for i in 0..args.raw {
        let (execs, between): (usize, &mut dyn FnMut()) = if i == 0 {
            (args.execs, &mut api_round)
        } else {
            (0, &mut || {})
        };
        let (ready, first, rtts) = raw_restore(qemu.binary(), &netns.0, &spec, &snap, execs, between).await;
        raw_ready.push(ready);
        raw_first.push(first);
        runtime_exec.extend(rtts);
    }
    let _ = std::fs::remove_dir_all(&raw_dir);
    drop(netns);
    api.delete(&warm);

    // Memory per idle sandbox.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let before = mem_available_mib();
    let mut idle_ids = Vec::new();
    for _ in 0..args.idle {
        let (b, t) = (api.clone(), template.clone());
        if let Ok(id) = tokio::task::spawn_blocking(move || b.create(&t)).await.unwrap() {
            idle_ids.push(id);
        }
    }
    tokio::time::sleep(Duration::from_secs(10)).await;
    let after = mem_available_mib();
    for id in &idle_ids {
        api.delete(id);
    }
    // Gone before the bench ends (VMs outlive a server stopped meanwhile, by design).
    let deadline = Instant::now() + Duration::from_secs(120);
    for id in &idle_ids {
        while Instant::now() < deadline
            && api
                .call("GET", &format!("/sandboxes/{id}"), None)
                .is_ok_and(|s| s["state"] != "deleted")
        {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    let per_sandbox = (before - after) / idle_ids.len().max(1) as f64;

    let p50 = |v: &Value| v["p50_ms"].as_f64().unwrap_or(f64::NAN);
    let (seq_s, burst_s) = (stats(&seq, seq_failures), stats(&burst, burst_failures));
    let (raw_first_s, api_exec_s, runtime_exec_s) =
        (stats(&raw_first, 0), stats(&api_exec, 0), stats(&runtime_exec, 0));
    let api_exec_one_s = stats(&api_exec_one, 0);
    let report = json!({
        "bench": "create",
        "when": humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string(),
        "machine": machine::machine(),
        "template": digest,
        "resources": resources,
        "snapshot": snap.manifest,
        "first_create_tti_ms": first_ms,
        "tti_sequential": seq_s,
        "tti_sequential_restored": restored,
        "tti_burst": burst_s,
        "pools_before_burst": pool_before_burst,
        "tti_sequential_from_pool": pooled,
        "raw_restore_to_agent_ready": stats(&raw_ready, 0),
        "raw_restore_to_first_stdout": raw_first_s,
        "tti_ratio_p50_vs_raw": p50(&seq_s) / p50(&raw_first_s),
        "exec_true_api": api_exec_s,
        "exec_true_runtime": runtime_exec_s,
        "exec_ratio_p50": p50(&api_exec_s) / p50(&runtime_exec_s),
        "exec_true_api_one_call": api_exec_one_s,
        "exec_one_call_ratio_p50": p50(&api_exec_one_s) / p50(&runtime_exec_s),
        "idle_sandboxes": idle_ids.len(),
        "idle_memory_mib_per_sandbox": per_sandbox,
        "suspend": stats(&suspend_ms, suspend_failures),
        "resume": stats(&resume_ms, suspend_failures),
        "resume_to_first_stdout": stats(&resume_stdout_ms, suspend_failures),
        "fork_count": args.fork_count,
        "fork_to_children_running": stats(&fork_started, fork_failures),
        "fork_to_echo_in_every_child": stats(&fork_answered, fork_failures),
    });
    // The markdown table, printed and written next to the JSON.
    let mut table =
        String::from("| measure | p50 ms | p95 ms | p99 ms | failures |\n| --- | --- | --- | --- | --- |\n");
    for (name, s) in [
        ("TTI, sequential", &report["tti_sequential"]),
        ("TTI, burst", &report["tti_burst"]),
        ("raw QEMU restore -> agent ready", &report["raw_restore_to_agent_ready"]),
        (
            "raw QEMU restore -> first stdout (runtime exec)",
            &report["raw_restore_to_first_stdout"],
        ),
        (
            "exec `true`, API (session, then its SSE stream)",
            &report["exec_true_api"],
        ),
        (
            "exec `true`, API one call (session answered as SSE)",
            &report["exec_true_api_one_call"],
        ),
        ("exec `true`, runtime (agent client)", &report["exec_true_runtime"]),
        ("suspend (operation)", &report["suspend"]),
        ("resume (operation)", &report["resume"]),
        ("resume -> first stdout of echo", &report["resume_to_first_stdout"]),
        (
            "fork of --fork-count -> children running",
            &report["fork_to_children_running"],
        ),
        (
            "fork of --fork-count -> echo in every child",
            &report["fork_to_echo_in_every_child"],
        ),
    ] {
        let f = |k: &str| s[k].as_f64().map_or("-".into(), |v| format!("{v:.1}"));
        table.push_str(&format!(
            "| {name} | {} | {} | {} | {} |\n",
            f("p50_ms"),
            f("p95_ms"),
            f("p99_ms"),
            s["failures"]
        ));
    }
    table.push_str(&format!(
        "\nTTI p50 / raw restore+exec p50: {:.2}; exec API / runtime p50: {:.2} (two calls), {:.2} (one call); idle memory per sandbox: {per_sandbox:.1} MiB over {}; {restored}/{} sequential creates restored",
        report["tti_ratio_p50_vs_raw"].as_f64().unwrap_or(f64::NAN),
        report["exec_ratio_p50"].as_f64().unwrap_or(f64::NAN),
        report["exec_one_call_ratio_p50"].as_f64().unwrap_or(f64::NAN),
        idle_ids.len(),
        seq.len()
    ));
    table.push_str(&format!(
        "; {pooled} from a warm pool\n\nMachine: {}\n",
        report["machine"]
    ));
    print!("{table}");
    std::fs::create_dir_all(&args.out).unwrap();
    let date = report["when"].as_str().unwrap().replace([':', '-'], "");
    let path = args.out.join(format!("create-{}.json", &date[..15]));
    std::fs::write(&path, serde_json::to_vec_pretty(&report).unwrap()).unwrap();
    std::fs::write(path.with_extension("md"), format!("# {}\n\n{table}", path.display())).unwrap();
    println!("raw results: {}", path.display());
}
