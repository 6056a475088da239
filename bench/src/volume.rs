//! Volumes, against a running server, each measure next to its baseline in the same run:
//!
//! - **I/O in the guest**: sequential write (256 MiB, fsync'd) and read (page cache dropped)
//!   throughput and the small-file create rate (1000 files of 4 KiB, then a sync), on a volume
//!   and on the sandbox's own root disk, in the same sandbox;
//! - **create TTI**: a create with one volume mounted to the first stdout byte of `echo`, next
//!   to a create without (alternated).
//!
//! ```text
//! AIRLOCK_API_KEY=... cargo run --release -p airlock-bench --bin volume-bench -- --url http://127.0.0.1:8080
//! ```

// Its create, exec and statistics; the rest is the other benches'.
#[allow(dead_code)]
mod api;
mod machine;

use api::{ms, stats, Api};
use clap::Parser;
use serde_json::{json, Value};
use std::path::PathBuf;
use std::time::Instant;

#[derive(Parser)]
struct Args {
    #[arg(long, env = "AIRLOCK_URL", default_value = "http://127.0.0.1:8080")]
    url: String,
    #[arg(long, env = "AIRLOCK_API_KEY")]
    key: String,
    #[arg(long, default_value_t = 5)]
    runs: usize,
    #[arg(long, default_value = "seed")]
    template: String,
    #[arg(long, default_value = "bench/results")]
    out: PathBuf,
}

/// Measures directory `argv[1]` and appends one JSON line to `/tmp/volume-bench.jsonl`.
const MEASURE: &str = r#"
import json, os, sys, time
d = sys.argv[1]
os.makedirs(d, exist_ok=True)
big = os.path.join(d, "big.bin")
chunk = os.urandom(1 << 20)
t = time.monotonic()
fd = os.open(big, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
for _ in range(256):
    os.write(fd, chunk)
os.fsync(fd)
os.close(fd)
write_s = time.monotonic() - t
os.sync()
with open("/proc/sys/vm/drop_caches", "w") as f:
    f.write("3")
t = time.monotonic()
fd = os.open(big, os.O_RDONLY)
while os.read(fd, 1 << 20):
    pass
os.close(fd)
read_s = time.monotonic() - t
small = os.path.join(d, "small")
os.makedirs(small, exist_ok=True)
page = b"x" * 4096
t = time.monotonic()
for i in range(1000):
    with open(os.path.join(small, f"f{i}"), "wb") as f:
        f.write(page)
os.sync()
small_s = time.monotonic() - t
os.remove(big)
for i in range(1000):
    os.remove(os.path.join(small, f"f{i}"))
with open("/tmp/volume-bench.jsonl", "a") as f:
    f.write(json.dumps({"dir": d, "write_mib_s": 256 / write_s, "read_mib_s": 256 / read_s,
                        "small_files_s": 1000 / small_s}) + "\n")
"#;

fn create(api: &Api, template: &str, volume: Option<&str>) -> Result<String, String> {
    let mut body = json!({"template": template, "timeout": "30m", "resources": {"disk_mib": api.disk_mib}});
    if let Some(v) = volume {
        body["volumes"] = json!([{"volume": v, "path": "/vol"}]);
    }
    let accepted = api.call("POST", "/sandboxes", Some(body))?;
    let id = accepted["sandbox_id"].as_str().ok_or("no sandbox id")?.to_string();
    api.finished(&accepted)?;
    Ok(id)
}

fn tti(api: &Api, template: &str, volume: Option<&str>) -> Result<f64, String> {
    let t = Instant::now();
    let id = create(api, template, volume)?;
    let r = api.exec_one_call(&id, &["echo", "hi"], true);
    let took = ms(t.elapsed());
    api.delete(&id);
    // The next create with the volume waits for this one to let it go.
    wait_gone(api, &id);
    r.map(|()| took)
}

fn wait_gone(api: &Api, id: &str) {
    for _ in 0..600 {
        match api.call("GET", &format!("/sandboxes/{id}"), None) {
            Ok(s) if s["state"] == "deleted" => return,
            Err(_) => return,
            _ => std::thread::sleep(std::time::Duration::from_millis(50)),
        }
    }
}

/// The measures in `dir` of sandbox `id` (as root), read back from the guest.
fn measure(api: &Api, id: &str, dir: &str) -> Result<Value, String> {
    let s = api.call(
        "POST",
        &format!("/sandboxes/{id}/sessions"),
        Some(json!({"argv": ["python3", "-c", MEASURE, dir], "user": "root", "timeout": "300s"})),
    )?;
    let sid = s["id"].as_str().ok_or("no session id")?.to_string();
    for _ in 0..6000 {
        let s = api.call("GET", &format!("/sandboxes/{id}/sessions/{sid}"), None)?;
        if s["state"] == "exited" {
            if s["exit_code"] != 0 {
                return Err(format!("measure {dir}: {s}"));
            }
            let out = ureq::get(&format!(
                "{}/v1/sandboxes/{id}/files?path=/tmp/volume-bench.jsonl",
                api.url
            ))
            .set("Authorization", &api.auth)
            .call()
            .map_err(|e| e.to_string())?
            .into_string()
            .map_err(|e| e.to_string())?;
            let last = out.lines().last().ok_or("no result line")?;
            return serde_json::from_str(last).map_err(|e| e.to_string());
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    Err(format!("measure {dir}: not done in 300 s"))
}

fn main() {
    let args = Args::parse();
    let api = Api {
        url: args.url.trim_end_matches('/').to_string(),
        auth: format!("Bearer {}", args.key),
        admin_auth: None,
        disk_mib: 2048,
    };
    let name = format!("bench-{}", std::process::id());
    let vol = api
        .call("POST", "/volumes", Some(json!({"name": name, "size_mib": 2048})))
        .expect("volume create");
    let vol = vol["id"].as_str().unwrap().to_string();
    let (mut with, mut without, mut failures) = (vec![], vec![], 0);
    let mut io: Vec<(String, Vec<f64>)> = ["vol", "root"]
        .iter()
        .flat_map(|w| ["write_mib_s", "read_mib_s", "small_files_s"].map(|m| (format!("{w}.{m}"), vec![])))
        .collect();
    for run in 0..args.runs {
        // Alternated, so both see the same machine state.
        for (volume, into) in [(None, &mut without), (Some(vol.as_str()), &mut with)] {
            match tti(&api, &args.template, volume) {
                Ok(t) => into.push(t),
                Err(e) => {
                    eprintln!("tti: {e}");
                    failures += 1;
                }
            }
        }
        match create(&api, &args.template, Some(&vol)) {
            Ok(id) => {
                for (which, dir) in [("vol", "/vol/bench"), ("root", "/var/tmp/bench")] {
                    match measure(&api, &id, dir) {
                        Ok(m) => {
                            for (key, v) in io.iter_mut() {
                                if let Some(metric) = key.strip_prefix(&format!("{which}.")) {
                                    v.push(m[metric].as_f64().unwrap_or(f64::NAN));
                                }
                            }
                        }
                        Err(e) => {
                            eprintln!("{e}");
                            failures += 1;
                        }
                    }
                }
                api.delete(&id);
                wait_gone(&api, &id);
            }
            Err(e) => {
                eprintln!("create: {e}");
                failures += 1;
            }
        }
        eprintln!(
            "run {run}: create TTI {:.0} ms with a volume, {:.0} ms without",
            with.last().copied().unwrap_or(f64::NAN),
            without.last().copied().unwrap_or(f64::NAN)
        );
    }
    let _ = api.call("DELETE", &format!("/volumes/{vol}"), None);
    // Throughputs are not times: their medians and spread, by the same statistics.
    let mut report = json!({
        "when": humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string(),
        "machine": machine::machine(),
        "runs": args.runs,
        "template": args.template,
        "failures": failures,
        "create_tti_with_volume": stats(&with, 0),
        "create_tti_without": stats(&without, 0),
    });
    for (key, v) in &io {
        report[key] = stats(v, 0);
    }
    let p50 = |k: &str| report[k]["p50_ms"].as_f64().unwrap_or(f64::NAN);
    let mut table =
        String::from("| measure | volume p50 | root disk p50 | volume / root |\n| --- | --- | --- | --- |\n");
    for (label, metric) in [
        ("sequential write, MiB/s (256 MiB, fsync)", "write_mib_s"),
        ("sequential read, MiB/s (cache dropped)", "read_mib_s"),
        ("small files created per s (4 KiB, then sync)", "small_files_s"),
    ] {
        let (v, r) = (p50(&format!("vol.{metric}")), p50(&format!("root.{metric}")));
        table.push_str(&format!("| {label} | {v:.1} | {r:.1} | {:.2} |\n", v / r));
    }
    table.push_str(&format!(
        "\n| create TTI | p50 ms | p95 ms |\n| --- | --- | --- |\n| with one volume | {:.0} | {:.0} |\n| without | {:.0} | {:.0} |\n\nwith / without, p50: {:.2}; failures: {failures}\n\nMachine: {}\n",
        p50("create_tti_with_volume"),
        report["create_tti_with_volume"]["p95_ms"].as_f64().unwrap_or(f64::NAN),
        p50("create_tti_without"),
        report["create_tti_without"]["p95_ms"].as_f64().unwrap_or(f64::NAN),
        p50("create_tti_with_volume") / p50("create_tti_without"),
        report["machine"]
    ));
    print!("{table}");
    std::fs::create_dir_all(&args.out).unwrap();
    let date = report["when"].as_str().unwrap().replace([':', '-'], "");
    let path = args.out.join(format!("volume-{}.json", &date[..15]));
    std::fs::write(&path, serde_json::to_vec_pretty(&report).unwrap()).unwrap();
    std::fs::write(path.with_extension("md"), format!("# {}\n\n{table}", path.display())).unwrap();
    println!("raw results: {}", path.display());
}
