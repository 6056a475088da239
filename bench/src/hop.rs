//! The cost of the hop (issue 25): the same work through an API replica whose node is another
//! process (`airlock serve --node` over `airlock node`, over loopback) next to single-host mode
//! (`airlock serve` with the node in its process), in the same run on the same machine.
//!
//! - **TTI**: `POST /v1/sandboxes` to the first stdout byte of `echo` (the create's operation
//!   polled every 5 ms, then the session answered as its event stream), restored from a base
//!   snapshot on both sides.
//! - **exec round trip**: `true` on a warm sandbox, as one call (the session answered as its
//!   event stream, read to the exit).
//!
//! - **creates per second, 3 nodes next to 1**: a burst of `--burst` concurrent creates (each to
//!   its sandbox running) through a replica over one node and through a replica over three, the
//!   wall time of the whole burst. On one machine the three nodes share its CPUs: this measures
//!   what spreading costs or gains in the control plane and the nodes' admission (at most
//!   `--max-starts` starts at once per node), not added hardware.
//!
//! Rounds alternate the setups, so drift hits both. It starts the servers itself, each on a data
//! dir of its own under `--work` holding hard links of `--seed-from`'s templates, and stops them
//! (by their pids) at the end.
//!
//! ```text
//! cargo run --release -p airlock-bench --bin hop-bench -- --airlock target/release/airlock \
//!     --seed-from /var/lib/airlock-test --rounds 15 --execs 50
//! ```

// Shared with create-bench, which uses all of it.
#[allow(dead_code)]
mod api;
mod machine;

use api::{ms, stats, Api};
use clap::Parser;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

#[derive(Parser)]
struct Args {
    /// The airlock binary to run.
    #[arg(long, default_value = "target/release/airlock")]
    airlock: PathBuf,
    /// A data dir whose `seed` template (`blobs/`, `templates/`) the servers start from.
    #[arg(long, default_value = "/var/lib/airlock-test")]
    seed_from: PathBuf,
    /// Where the three servers' data dirs go (removed first).
    #[arg(long, default_value = "/var/lib/airlock-hop")]
    work: PathBuf,
    #[arg(long, default_value_t = 15)]
    rounds: usize,
    #[arg(long, default_value_t = 50)]
    execs: usize,
    /// Creates at once in each burst.
    #[arg(long, default_value_t = 6)]
    burst: usize,
    /// Bursts per side.
    #[arg(long, default_value_t = 5)]
    bursts: usize,
    #[arg(long, default_value = "bench/results")]
    out: PathBuf,
}

/// A process this benchmark started, ended (SIGTERM, then waited for) when dropped.
struct Started(Child);

impl Drop for Started {
    fn drop(&mut self) {
        if matches!(self.0.try_wait(), Ok(None)) {
            unsafe { libc::kill(self.0.id() as i32, libc::SIGTERM) };
            let _ = self.0.wait();
        }
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A fresh data dir `name` under `work` with `seed_from`'s templates linked in.
fn data_dir(work: &Path, name: &str, seed_from: &Path) -> PathBuf {
    let dir = work.join(name);
    std::fs::create_dir_all(&dir).unwrap();
    for part in ["blobs", "templates"] {
        let ok = Command::new("cp")
            .arg("-al")
            .arg(seed_from.join(part))
            .arg(&dir)
            .status()
            .unwrap();
        assert!(ok.success(), "cp -al {}", seed_from.join(part).display());
    }
    let _ = std::fs::copy(seed_from.join("accel.json"), dir.join("accel.json"));
    dir
}

/// `airlock --data-dir dir <args>`, its output in `dir/<log>`, VMs under its own uid range.
fn start(airlock: &Path, dir: &Path, args: &[&str], uid_base: u32, log: &str) -> Started {
    let log = std::fs::File::create(dir.join(log)).unwrap();
    let child = Command::new(airlock)
        .arg("--data-dir")
        .arg(dir)
        .args(args)
        .env("AIRLOCK_VMM_UID_BASE", uid_base.to_string())
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .unwrap();
    Started(child)
}

/// The API of a server started on `dir` and listening on `port`, once it answers.
fn api_of(dir: &Path, port: u16) -> Api {
    let url = format!("http://127.0.0.1:{port}");
    let deadline = Instant::now() + Duration::from_secs(180);
    while ureq::get(&format!("{url}/readyz")).call().is_err() {
        assert!(Instant::now() < deadline, "{} did not come up", dir.display());
        std::thread::sleep(Duration::from_millis(100));
    }
    let creds = std::fs::read_to_string(dir.join("credentials")).unwrap();
    let key = creds
        .lines()
        .find_map(|l| l.strip_prefix("AIRLOCK_API_KEY="))
        .expect("the bootstrap key");
    Api {
        url,
        auth: format!("Bearer {key}"),
        admin_auth: None,
        disk_mib: 768,
    }
}

/// The VMs a stopped earlier run left under `work` (VMs outlive their server by design; its
/// dirs are about to go): each ended by the pid it recorded, if that process still names its
/// dir.
fn end_vms_left_in(work: &Path) {
    for server in std::fs::read_dir(work).into_iter().flatten().flatten() {
        for vm in std::fs::read_dir(server.path().join("sandboxes"))
            .into_iter()
            .flatten()
            .flatten()
        {
            airlock_testnet::end_vmm_of(&vm.path());
        }
    }
}

/// Until no server under `work` has a VM left (the deletes asked for are done), at most a
/// minute: a server stopped mid-delete would leave its VM behind.
fn until_no_vms(work: &Path) {
    let deadline = Instant::now() + Duration::from_secs(60);
    let busy =
        || {
            std::fs::read_dir(work).into_iter().flatten().flatten().any(|server| {
                std::fs::read_dir(server.path().join("sandboxes")).is_ok_and(|mut vms| vms.next().is_some())
            })
        };
    while busy() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn main() {
    let args = Args::parse();
    end_vms_left_in(&args.work);
    let _ = std::fs::remove_dir_all(&args.work);
    let secret = args.work.join("cluster.secret");
    std::fs::create_dir_all(&args.work).unwrap();
    std::fs::write(&secret, "the hop benchmark's cluster secret, long enough\n").unwrap();
    let secret = secret.to_str().unwrap().to_string();

    let single_dir = data_dir(&args.work, "single", &args.seed_from);
    let node_dir = data_dir(&args.work, "node", &args.seed_from);
    let replica_dir = args.work.join("replica");
    std::fs::create_dir_all(&replica_dir).unwrap();
    let (single_port, node_port, replica_port) = (free_port(), free_port(), free_port());
    let node_addr = format!("127.0.0.1:{node_port}");
    let shared = ["--tenant-share", "1", "--max-creates-per-minute", "10000"];
    let listen = |port: u16| format!("127.0.0.1:{port}");

    let _single = start(
        &args.airlock,
        &single_dir,
        &[&["serve", "--listen", &listen(single_port)][..], &shared[..]].concat(),
        300_000,
        "serve.log",
    );
    let _node = start(
        &args.airlock,
        &node_dir,
        &["node", "--listen", &node_addr, "--secret-file", &secret],
        400_000,
        "node.log",
    );
    while std::net::TcpStream::connect(&node_addr).is_err() {
        std::thread::sleep(Duration::from_millis(100));
    }
    let _replica = start(
        &args.airlock,
        &replica_dir,
        &[
            &["serve", "--listen", &listen(replica_port), "--node", &node_addr][..],
            &["--node-secret-file", &secret],
            &shared[..],
        ]
        .concat(),
        500_000,
        "serve.log",
    );
    // Two more nodes, and a replica over all three, for the bursts.
    let mut spread_nodes = vec![node_addr.clone()];
    let mut _more_nodes = Vec::new();
    for (n, uid_base) in [(2, 600_000), (3, 700_000)] {
        let dir = data_dir(&args.work, &format!("node{n}"), &args.seed_from);
        let addr = format!("127.0.0.1:{}", free_port());
        _more_nodes.push(start(
            &args.airlock,
            &dir,
            &["node", "--listen", &addr, "--secret-file", &secret],
            uid_base,
            "node.log",
        ));
        while std::net::TcpStream::connect(&addr).is_err() {
            std::thread::sleep(Duration::from_millis(100));
        }
        spread_nodes.push(addr);
    }
    let spread_dir = args.work.join("replica3");
    std::fs::create_dir_all(&spread_dir).unwrap();
    let spread_port = free_port();
    let _spread = start(
        &args.airlock,
        &spread_dir,
        &[
            &[
                "serve",
                "--listen",
                &listen(spread_port),
                "--node",
                &spread_nodes.join(","),
            ][..],
            &["--node-secret-file", &secret],
            &shared[..],
        ]
        .concat(),
        800_000,
        "serve.log",
    );
    let sides = [
        ("single-host", api_of(&single_dir, single_port)),
        ("replica + node", api_of(&replica_dir, replica_port)),
    ];
    let spread = api_of(&spread_dir, spread_port);

    // The first create on each side builds its base snapshot: not measured.
    for (name, api) in &sides {
        let t = Instant::now();
        let (_, id) = api.tti("seed").expect("a first create");
        api.delete(&id);
        println!(
            "{name}: first create (base snapshot built) in {:.0} ms",
            ms(t.elapsed())
        );
    }

    let mut tti: Vec<Vec<f64>> = vec![Vec::new(), Vec::new()];
    let mut tti_failed = [0usize; 2];
    for round in 0..args.rounds {
        for (i, (name, api)) in sides.iter().enumerate() {
            match api.tti("seed") {
                Ok((t, id)) => {
                    tti[i].push(t);
                    api.delete(&id);
                }
                Err(e) => {
                    eprintln!("{name}: round {round}: {e}");
                    tti_failed[i] += 1;
                }
            }
        }
    }

    let warm: Vec<String> = sides
        .iter()
        .map(|(_, api)| api.create("seed").expect("a warm sandbox"))
        .collect();
    let mut exec: Vec<Vec<f64>> = vec![Vec::new(), Vec::new()];
    let mut exec_failed = [0usize; 2];
    for _ in 0..args.execs {
        for (i, (_, api)) in sides.iter().enumerate() {
            let t = Instant::now();
            match api.exec_one_call(&warm[i], &["true"], false) {
                Ok(()) => exec[i].push(ms(t.elapsed())),
                Err(_) => exec_failed[i] += 1,
            }
        }
    }
    for (i, (_, api)) in sides.iter().enumerate() {
        api.delete(&warm[i]);
    }

    // Bursts: 1 node next to 3, alternating. Each node builds its base snapshot first.
    for _ in 0..spread_nodes.len() {
        burst(&spread, spread_nodes.len()).expect("a first burst");
    }
    let bursters = [("1 node", &sides[1].1), ("3 nodes", &spread)];
    let mut rates: Vec<Vec<f64>> = vec![Vec::new(), Vec::new()];
    let mut burst_failed = [0usize; 2];
    for _ in 0..args.bursts {
        for (i, (_, api)) in bursters.iter().enumerate() {
            match burst(api, args.burst) {
                Ok(wall) => rates[i].push(args.burst as f64 / wall.as_secs_f64()),
                Err(e) => {
                    eprintln!("{}: burst: {e}", bursters[i].0);
                    burst_failed[i] += 1;
                }
            }
        }
    }

    let p50 = |v: &Value| v["p50_ms"].as_f64().unwrap_or(f64::NAN);
    let p95 = |v: &Value| v["p95_ms"].as_f64().unwrap_or(f64::NAN);
    let mut report = json!({
        "benchmark": "hop",
        "machine": machine::machine(),
        "rounds": args.rounds,
        "execs": args.execs,
    });
    let mut md = format!(
        "# hop-bench\n\n{} rounds of TTI, {} exec round trips per side, alternating.\n\n\
         | | TTI p50 / p95 | exec `true` p50 / p95 |\n| --- | --- | --- |\n",
        args.rounds, args.execs
    );
    let mut rows = Vec::new();
    for (i, (name, _)) in sides.iter().enumerate() {
        let (t, e) = (stats(&tti[i], tti_failed[i]), stats(&exec[i], exec_failed[i]));
        md.push_str(&format!(
            "| {name} | {:.0} / {:.0} ms | {:.1} / {:.1} ms |\n",
            p50(&t),
            p95(&t),
            p50(&e),
            p95(&e)
        ));
        report[*name] = json!({ "tti": t.clone(), "exec": e.clone() });
        rows.push((t, e));
    }
    let ratio_tti = p50(&rows[1].0) / p50(&rows[0].0);
    let ratio_exec = p50(&rows[1].1) / p50(&rows[0].1);
    report["ratio_p50"] = json!({ "tti": ratio_tti, "exec": ratio_exec });
    md.push_str(&format!(
        "| ratio (replica + node / single-host), p50 | {ratio_tti:.3} | {ratio_exec:.3} |\n\nMachine: {}\n",
        report["machine"]
    ));
    md.push_str(&format!(
        "\n{} bursts of {} concurrent creates per side, alternating (creates per second, each burst to its last sandbox running):\n\n| | creates/s p50 | min | max |\n| --- | --- | --- | --- |\n",
        args.bursts, args.burst
    ));
    for (i, (name, _)) in bursters.iter().enumerate() {
        let mut r = rates[i].clone();
        r.sort_by(|a, b| a.total_cmp(b));
        let median = r.get(r.len() / 2).copied().unwrap_or(f64::NAN);
        let (min, max) = (
            r.first().copied().unwrap_or(f64::NAN),
            r.last().copied().unwrap_or(f64::NAN),
        );
        md.push_str(&format!("| {name} | {median:.2} | {min:.2} | {max:.2} |\n"));
        report["creates_per_second"][*name] = json!({
            "p50": median, "min": min, "max": max, "samples": rates[i], "failures": burst_failed[i],
        });
    }
    let rate = |name: &str| report["creates_per_second"][name]["p50"].as_f64().unwrap_or(f64::NAN);
    let ratio_burst = rate("3 nodes") / rate("1 node");
    report["ratio_p50"]["creates_per_second_3_over_1"] = json!(ratio_burst);
    md.push_str(&format!("| ratio (3 nodes / 1 node), p50 | {ratio_burst:.3} | | |\n"));
    println!("{md}");
    let stamp = humantime::format_rfc3339_seconds(std::time::SystemTime::now())
        .to_string()
        .replace([':', '-'], "")
        .trim_end_matches('Z')
        .to_string();
    std::fs::create_dir_all(&args.out).unwrap();
    let base = args.out.join(format!("hop-{stamp}"));
    std::fs::write(
        base.with_extension("json"),
        serde_json::to_string_pretty(&report).unwrap(),
    )
    .unwrap();
    std::fs::write(base.with_extension("md"), md).unwrap();
    println!("wrote {}.json and .md", base.display());
    until_no_vms(&args.work);
}

/// `n` creates at once through `api`, each to its sandbox running, then deleted: the wall time
/// of the creates.
fn burst(api: &Api, n: usize) -> Result<Duration, String> {
    let t = Instant::now();
    let made: Vec<Result<String, String>> = std::thread::scope(|s| {
        let all: Vec<_> = (0..n).map(|_| s.spawn(|| api.create("seed"))).collect();
        all.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let wall = t.elapsed();
    std::thread::scope(|s| {
        for id in made.iter().flatten() {
            s.spawn(move || api.delete(id));
        }
    });
    made.into_iter().collect::<Result<Vec<_>, _>>()?;
    Ok(wall)
}
