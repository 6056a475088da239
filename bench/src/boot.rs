//! Cold boot to agent-ready and exec round trip, airlock next to raw QEMU.
//!
//! "raw" starts `qemu-system-x86_64` by hand with exactly the arguments airlock uses (same
//! kernel, initramfs, image, devices) on a fresh qcow2 overlay, and times until the guest agent
//! answers the session hello on the socket: no airlock code in the path. "airlock" times
//! `Runtime::create` (overlay, VMM, channel, HTTP/2, health). Runs alternate so drift hits both.
//!
//!     cargo run --release -p airlock-bench -- --runs 10

mod machine;
mod raw;

use airlock_proto::ProcessSpec;
use airlock_runtime::qemu::{Attach, QemuVmm};
use airlock_runtime::vmm::{wait_exit, VmSpec};
use airlock_runtime::{CreateVm, Resources, Runtime, RuntimeOptions};
use clap::Parser;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

#[derive(Parser)]
struct Args {
    /// Boots per side.
    #[arg(long, default_value_t = 10)]
    runs: usize,
    /// Exec round trips on one warm sandbox.
    #[arg(long, default_value_t = 50)]
    execs: usize,
    #[arg(long, env = "AIRLOCK_DATA_DIR", default_value = "/var/lib/airlock-bench")]
    data_dir: PathBuf,
    /// Where to write the raw results (JSON).
    #[arg(long, default_value = "bench/results")]
    out: PathBuf,
}

fn seed(resources: Resources) -> CreateVm {
    CreateVm {
        id: None,
        template: "seed".into(),
        resources,
        image: None,
        env: Default::default(),
        volumes: Vec::new(),
    }
}

fn stats(v: &[f64]) -> serde_json::Value {
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let pct = |p: f64| s[((s.len() as f64 - 1.0) * p).round() as usize];
    serde_json::json!({ "n": s.len(), "median_ms": pct(0.5), "p95_ms": pct(0.95), "min_ms": s[0], "max_ms": s[s.len() - 1], "samples_ms": v })
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// Boot the template with raw QEMU and time until the agent answers hello.
fn raw_boot(qemu: &Path, spec: &VmSpec) -> f64 {
    let started = Instant::now();
    let raw::RawFiles {
        overlay,
        agent,
        qmp,
        console,
    } = raw::prepare(&spec.dir, &spec.rootfs, "raw", spec.disk_mib);
    let child = std::process::Command::new(qemu)
        .args(QemuVmm::args(
            spec,
            &Attach::paths(&overlay, &agent, &qmp, &console, spec),
        ))
        .stdin(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let vmm = raw::KillOnDrop(child);
    let stream = loop {
        match UnixStream::connect(&agent) {
            Ok(s) => break s,
            Err(_) => std::thread::sleep(Duration::from_millis(2)),
        }
    };
    let mut w = stream.try_clone().unwrap();
    let mut r = BufReader::new(stream);
    r.get_ref().set_read_timeout(Some(Duration::from_millis(1000))).unwrap();
    let elapsed = 'outer: loop {
        writeln!(w, "{}raw", airlock_proto::SESSION_HELLO).unwrap();
        let mut line = Vec::new();
        while r.read_until(b'\n', &mut line).is_ok() {
            if line.ends_with(format!("{}raw\n", airlock_proto::SESSION_READY).as_bytes()) {
                break 'outer started.elapsed();
            }
            if !line.ends_with(b"\n") {
                break;
            }
        }
        assert!(started.elapsed() < Duration::from_secs(120), "raw boot never answered");
    };
    drop(vmm);
    let _ = std::fs::remove_dir_all(&spec.dir);
    ms(elapsed)
}

/// The shared description, with the QEMU that ran the raw side.
fn machine_with_qemu() -> serde_json::Value {
    let qemu = std::process::Command::new("qemu-system-x86_64")
        .arg("--version")
        .output()
        .ok();
    let mut m = machine::machine();
    m["qemu"] = qemu
        .map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .next()
                .unwrap_or("")
                .to_string()
        })
        .into();
    m
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    let store =
        airlock_runtime::template::TemplateStore::new(airlock_runtime::datadir::DataDir::open(&args.data_dir).unwrap());
    let (template, _) = tokio::task::spawn_blocking(move || store.build_seed(&Default::default()))
        .await
        .unwrap()
        .unwrap();
    let rt = Runtime::open(RuntimeOptions::new(&args.data_dir)).await.unwrap();
    let accel = rt.accel().await;
    let qemu = QemuVmm::locate(None).unwrap();
    let resources = Resources {
        vcpu: 1,
        memory_mib: 256,
        disk_mib: 1024,
    };
    let raw_spec = VmSpec::for_template("rawbench", args.data_dir.join("raw-bench"), &template, resources, accel);

    let (mut raw, mut airlock) = (Vec::new(), Vec::new());
    for i in 0..args.runs {
        let q = qemu.binary().to_path_buf();
        let spec = raw_spec.clone();
        raw.push(tokio::task::spawn_blocking(move || raw_boot(&q, &spec)).await.unwrap());
        let t = Instant::now();
        let sb = rt.create(seed(resources)).await.unwrap();
        airlock.push(ms(t.elapsed()));
        let pid = sb.handle.pid;
        rt.delete(sb.id()).await.unwrap();
        wait_exit(pid, Duration::from_secs(5)).await;
        eprintln!(
            "run {}/{}: raw {:.0} ms, airlock {:.0} ms",
            i + 1,
            args.runs,
            raw[i],
            airlock[i]
        );
    }

    let sb = rt.create(seed(resources)).await.unwrap();
    let agent = sb.agent().await.unwrap();
    let (mut exec, mut health) = (Vec::new(), Vec::new());
    for _ in 0..args.execs {
        let t = Instant::now();
        let out = sb
            .run(ProcessSpec {
                argv: vec!["true".into()],
                ..Default::default()
            })
            .await
            .unwrap();
        exec.push(ms(t.elapsed()));
        assert_eq!(out.exit.exit_code, Some(0));
        let t = Instant::now();
        agent.health().await.unwrap();
        health.push(ms(t.elapsed()));
    }
    rt.delete(sb.id()).await.unwrap();

    let (raw_s, air_s) = (stats(&raw), stats(&airlock));
    let ratio = air_s["median_ms"].as_f64().unwrap() / raw_s["median_ms"].as_f64().unwrap();
    let report = serde_json::json!({
        "bench": "boot",
        "when": humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string(),
        "machine": machine_with_qemu(),
        "accel": accel.to_string(),
        "template": template.manifest.digest,
        "kernel": template.manifest.kernel_version,
        "resources": { "vcpu": resources.vcpu, "memory_mib": resources.memory_mib, "disk_mib": resources.disk_mib },
        "raw_qemu_boot_to_agent": raw_s,
        "airlock_create_to_ready": air_s,
        "boot_ratio_median": ratio,
        "exec_true_round_trip": stats(&exec),
        "agent_health_round_trip": stats(&health),
    });
    println!("accel {accel}, {} boots per side, {} execs", args.runs, args.execs);
    println!("{:<34} {:>10} {:>10}", "", "median ms", "p95 ms");
    for (name, s) in [
        ("raw qemu: boot -> agent hello", &report["raw_qemu_boot_to_agent"]),
        ("airlock: create -> agent ready", &report["airlock_create_to_ready"]),
        ("airlock: exec `true` round trip", &report["exec_true_round_trip"]),
        ("agent /health round trip", &report["agent_health_round_trip"]),
    ] {
        println!(
            "{name:<34} {:>10.1} {:>10.1}",
            s["median_ms"].as_f64().unwrap(),
            s["p95_ms"].as_f64().unwrap()
        );
    }
    println!("boot ratio airlock/raw (median): {ratio:.3}");
    std::fs::create_dir_all(&args.out).unwrap();
    let date = report["when"].as_str().unwrap().replace([':', '-'], "");
    let path = args.out.join(format!("boot-{}.json", &date[..15]));
    std::fs::write(&path, serde_json::to_vec_pretty(&report).unwrap()).unwrap();
    println!("raw results: {}", path.display());
}
