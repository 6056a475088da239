//! Where a cold boot's time goes: raw QEMU booting a template exactly as airlock boots it (same
//! arguments, a NIC on a tap in a namespace of the bench's own), timed from the host to the
//! agent's READY, then split by the guest's own clock: the kernel log (`dmesg`, timestamps since
//! the kernel's clock started) and `/proc/uptime` read right after READY.
//!
//! - before the kernel's clock: QEMU start, firmware, loading and decompressing the kernel
//!   (host time to READY minus the guest's uptime at READY);
//! - the kernel until it runs `/init` (the agent's initramfs stage);
//! - the initramfs stage: virtio modules, the root disk, switch root;
//! - the root fs stage until the agent answers.
//!
//! A second set of boots adds `initcall_debug` (the kernel log only; the console stays quiet)
//! and lists the slowest initcalls. Extra kernel arguments to try: `--append "..."`.
//!
//!     cargo run --release -p airlock-bench --bin boot-profile -- --runs 5

mod machine;
mod raw;

use airlock_proto::frame::EventKind;
use airlock_proto::ProcessSpec;
use airlock_runtime::agent::AgentClient;
use airlock_runtime::qemu::{Attach, QemuVmm};
use airlock_runtime::vmm::VmSpec;
use airlock_runtime::{Accel, Resources};
use clap::Parser;
use futures_util::StreamExt;
use serde_json::json;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

#[derive(Parser)]
struct Args {
    /// Boots per set.
    #[arg(long, default_value_t = 5)]
    runs: usize,
    #[arg(long, default_value = "seed")]
    template: String,
    /// Extra kernel arguments for every boot (to try a cut).
    #[arg(long, default_value = "")]
    append: String,
    /// Boot this kernel instead of the template's (e.g. an uncompressed vmlinux, booted via PVH).
    #[arg(long)]
    kernel: Option<PathBuf>,
    #[arg(long, env = "AIRLOCK_DATA_DIR", default_value = "/var/lib/airlock-bench")]
    data_dir: PathBuf,
    #[arg(long, default_value = "bench/results")]
    out: PathBuf,
}

/// The kernel log's milestones: (name, a substring of its line).
const MILESTONES: &[(&str, &str)] = &[
    ("kernel: init runs", "Run /init as init process"),
    ("initramfs: virtio disk found", "virtio_blk virtio"),
    ("initramfs: root mounted", "EXT4-fs (vda): mounted"),
];

struct Boot {
    qemu_up_ms: f64,
    host_to_ready_ms: f64,
    uptime_at_ready_ms: f64,
    milestones_ms: Vec<Option<f64>>,
    dmesg: String,
}

/// `[    1.234567] text` -> (1234.567 ms, text)
fn parse_line(line: &str) -> Option<(f64, &str)> {
    let rest = line.strip_prefix('[')?;
    let (ts, text) = rest.split_once(']')?;
    Some((ts.trim().parse::<f64>().ok()? * 1000.0, text.trim()))
}

async fn output(client: &AgentClient, argv: &[&str]) -> String {
    let spec = ProcessSpec {
        argv: argv.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    };
    let info = client.spawn(&spec).await.unwrap();
    let mut events = Box::pin(client.events(info.id, 0).await.unwrap());
    let mut out = Vec::new();
    while let Some(ev) = events.next().await {
        match ev.unwrap().kind {
            EventKind::Stdout(d) => out.extend(d),
            EventKind::Exit(_) => break,
            EventKind::Stderr(_) => {}
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

async fn boot(qemu: &Path, netns: &str, spec: &VmSpec, append: &str) -> Boot {
    let dir = &spec.dir;
    let started = Instant::now();
    let raw::RawFiles {
        overlay,
        agent,
        qmp,
        console,
    } = raw::prepare(dir, &spec.rootfs, "raw", spec.disk_mib);
    let mut args = QemuVmm::args(
        spec,
        &Attach::paths(&overlay, &agent, &qmp, &console, spec)
            .with_netdev("tap,ifname=proftap0,script=no,downscript=no,vhost=off"),
    );
    if !append.is_empty() {
        let at = args.iter().position(|a| a == "-append").unwrap() + 1;
        args[at] = format!("{} {append}", args[at]);
    }
    let child = std::process::Command::new("ip")
        .args(["netns", "exec", netns])
        .arg(qemu)
        .args(&args)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(dir.join("qemu.log")).unwrap())
        .spawn()
        .unwrap();
    let vmm = raw::KillOnDrop(child);
    // QEMU's own start: until its monitor answers (the guest starts running about then).
    let mut qmp_client = loop {
        if let Ok(q) = airlock_runtime::qmp::Qmp::connect(&qmp).await {
            break q;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    };
    qmp_client.execute("query-status", None).await.unwrap();
    let qemu_up_ms = started.elapsed().as_secs_f64() * 1000.0;
    drop(qmp_client);
    let (client, _) = AgentClient::connect_ready(&agent, Duration::from_secs(120))
        .await
        .unwrap_or_else(|e| panic!("the guest never answered ({e}); console: {}", console.display()));
    let host_to_ready_ms = started.elapsed().as_secs_f64() * 1000.0;
    // The uptime first, as close to READY as one round trip; that round trip is taken off.
    let asked = Instant::now();
    let uptime = output(&client, &["cat", "/proc/uptime"]).await;
    let rtt_ms = asked.elapsed().as_secs_f64() * 1000.0;
    let uptime_ms = uptime
        .split_whitespace()
        .next()
        .and_then(|u| u.parse::<f64>().ok())
        .unwrap()
        * 1000.0;
    let dmesg = output(&client, &["dmesg"]).await;
    let milestones_ms = MILESTONES
        .iter()
        .map(|(_, needle)| {
            dmesg
                .lines()
                .filter_map(parse_line)
                .find(|(_, t)| t.contains(needle))
                .map(|(ts, _)| ts)
        })
        .collect::<Vec<_>>();
    drop(client);
    drop(vmm);
    let _ = std::fs::remove_dir_all(dir);
    Boot {
        qemu_up_ms,
        host_to_ready_ms,
        uptime_at_ready_ms: uptime_ms - rtt_ms / 2.0,
        milestones_ms,
        dmesg,
    }
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

/// The slowest initcalls of a boot with `initcall_debug`: (name, ms).
fn initcalls(dmesg: &str) -> Vec<(String, f64)> {
    let mut calls: Vec<(String, f64)> = dmesg
        .lines()
        .filter_map(parse_line)
        .filter_map(|(_, t)| {
            // "initcall foo_init+0x0/0x50 returned 0 after 1234 usecs"
            let rest = t.strip_prefix("initcall ")?;
            let (name, tail) = rest.split_once(' ')?;
            let usecs = tail
                .split("after ")
                .nth(1)?
                .split_whitespace()
                .next()?
                .parse::<f64>()
                .ok()?;
            Some((name.split('+').next().unwrap_or(name).to_string(), usecs / 1000.0))
        })
        .collect();
    calls.sort_by(|a, b| b.1.partial_cmp(&a.1).unwrap());
    calls
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    let store =
        airlock_runtime::template::TemplateStore::new(airlock_runtime::datadir::DataDir::open(&args.data_dir).unwrap());
    let template = store
        .resolve(&args.template)
        .unwrap_or_else(|e| panic!("template {}: {e} (build it first)", args.template));
    let qemu = QemuVmm::locate(None).unwrap();
    let resources = Resources {
        vcpu: 1,
        memory_mib: 512,
        disk_mib: template.manifest.rootfs_bytes.div_ceil(1 << 20) as u32 + 256,
    };
    let mut spec = VmSpec::for_template(
        "profile",
        args.data_dir.join("boot-profile"),
        &template,
        resources,
        Accel::Tcg,
    );
    if let Some(kernel) = &args.kernel {
        spec.kernel = kernel.clone();
    }
    let netns = raw::Netns::add(format!("airlock-profile-{}", std::process::id()));

    let mut boots = Vec::new();
    for i in 0..args.runs {
        let b = boot(qemu.binary(), &netns.0, &spec, &args.append).await;
        eprintln!(
            "boot {}/{}: {:.0} ms to READY, uptime at READY {:.0} ms",
            i + 1,
            args.runs,
            b.host_to_ready_ms,
            b.uptime_at_ready_ms
        );
        boots.push(b);
    }
    let mut traced = Vec::new();
    for _ in 0..args.runs.min(3) {
        traced.push(
            boot(
                qemu.binary(),
                &netns.0,
                &spec,
                &format!("{} initcall_debug", args.append),
            )
            .await,
        );
    }
    drop(netns);

    // Medians of each phase over the plain boots.
    let col = |f: &dyn Fn(&Boot) -> Option<f64>| {
        let mut v: Vec<f64> = boots.iter().filter_map(f).collect();
        if v.is_empty() {
            f64::NAN
        } else {
            median(&mut v)
        }
    };
    let total = col(&|b| Some(b.host_to_ready_ms));
    let uptime = col(&|b| Some(b.uptime_at_ready_ms));
    let init = col(&|b| b.milestones_ms[0]);
    let disk = col(&|b| b.milestones_ms[1]);
    let root = col(&|b| b.milestones_ms[2]);
    let qemu_up = col(&|b| Some(b.qemu_up_ms));
    let phases = vec![
        ("overlay + QEMU start (until its monitor answers)", qemu_up),
        (
            "firmware, kernel load and decompress (host time - guest uptime at READY - the above)",
            total - uptime - qemu_up,
        ),
        ("kernel: clock start -> runs /init", init),
        (
            "initramfs stage: /init -> virtio disk found (modules loaded)",
            disk - init,
        ),
        ("initramfs stage: disk found -> root mounted", root - disk),
        (
            "root mounted -> agent READY (switch root, root fs stage, agent start)",
            uptime - root,
        ),
    ];
    // Initcalls summed by name over the traced boots, then averaged.
    let mut sums: std::collections::BTreeMap<String, f64> = Default::default();
    for b in &traced {
        for (name, ms) in initcalls(&b.dmesg) {
            *sums.entry(name).or_default() += ms / traced.len() as f64;
        }
    }
    let mut top: Vec<(String, f64)> = sums.into_iter().collect();
    top.sort_by(|a, b| b.1.partial_cmp(&a.1).unwrap());
    top.truncate(15);
    let initcall_total: f64 = traced
        .iter()
        .map(|b| initcalls(&b.dmesg).iter().map(|c| c.1).sum::<f64>())
        .sum::<f64>()
        / traced.len().max(1) as f64;

    let when = humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string();
    let report = json!({
        "bench": "boot-profile",
        "when": when,
        "machine": machine::machine(),
        "template": template.manifest.digest,
        "kernel": template.manifest.kernel_version,
        "initrd_bytes": std::fs::metadata(&spec.initrd).map(|m| m.len()).unwrap_or(0),
        "kernel_bytes": std::fs::metadata(&spec.kernel).map(|m| m.len()).unwrap_or(0),
        "append": args.append,
        "kernel_override": args.kernel,
        "resources": { "vcpu": resources.vcpu, "memory_mib": resources.memory_mib },
        "boots": boots.iter().map(|b| json!({
            "qemu_up_ms": b.qemu_up_ms,
            "host_to_ready_ms": b.host_to_ready_ms,
            "uptime_at_ready_ms": b.uptime_at_ready_ms,
            "milestones_ms": MILESTONES.iter().zip(&b.milestones_ms).map(|((n, _), v)| (n.to_string(), json!(v))).collect::<serde_json::Map<_, _>>(),
        })).collect::<Vec<_>>(),
        "phases_median_ms": phases.iter().map(|(n, v)| (n.to_string(), json!(v))).collect::<serde_json::Map<_, _>>(),
        "initcall_debug": {
            "boots": traced.len(),
            "host_to_ready_ms": traced.iter().map(|b| b.host_to_ready_ms).collect::<Vec<_>>(),
            "initcalls_total_ms": initcall_total,
            "slowest": top.iter().map(|(n, v)| json!({"initcall": n, "ms": v})).collect::<Vec<_>>(),
        },
        "dmesg_first_boot": boots.first().map(|b| b.dmesg.clone()),
    });
    let mut md = format!(
        "# boot profile {when}\n\n{} ({}), kernel {}, {} boots, 1 vCPU, TCG; extra kernel args `{}`{}\n\n| phase | median ms |\n| --- | ---: |\n",
        args.template,
        template.manifest.digest,
        template.manifest.kernel_version,
        boots.len(),
        args.append,
        args.kernel.as_ref().map(|k| format!("; kernel {}", k.display())).unwrap_or_default()
    );
    for (name, v) in &phases {
        md.push_str(&format!("| {name} | {v:.0} |\n"));
    }
    md.push_str(&format!("| **host: start -> agent READY** | **{total:.0}** |\n\n"));
    md.push_str(&format!(
        "Slowest initcalls (`initcall_debug`, mean of {} boots; all initcalls together {initcall_total:.0} ms):\n\n| initcall | ms |\n| --- | ---: |\n",
        traced.len()
    ));
    for (name, v) in &top {
        md.push_str(&format!("| `{name}` | {v:.1} |\n"));
    }
    print!("{md}");
    std::fs::create_dir_all(&args.out).unwrap();
    let stamp = when.replace([':', '-'], "");
    let base = args.out.join(format!("boot-profile-{}", &stamp[..15]));
    std::fs::write(base.with_extension("json"), serde_json::to_vec_pretty(&report).unwrap()).unwrap();
    std::fs::write(base.with_extension("md"), md).unwrap();
    eprintln!("raw results: {}.{{json,md}}", base.display());
}
