//! Custom templates, against a running server:
//!
//! - **cold build**: `POST /v1/templates` of a small Dockerfile (FROM seed, a COPY, a RUN, an
//!   ENV, a start command with its ready check) to the build `ready`, its content new each run
//!   (a nonce in the RUN), so nothing is reused: the build VM, the steps, the capture and the
//!   base snapshot;
//! - **cached build**: the same definition again to `ready` (the content was built: no VM);
//! - **first-create TTI**: the first sandbox of each new template to the first stdout byte of
//!   `echo` (restored from the base snapshot the build made), next to `seed`'s in the same run.
//!
//! ```text
//! AIRLOCK_API_KEY=... cargo run --release -p airlock-bench --bin build-bench -- --url http://127.0.0.1:8080
//! ```

// Its create, TTI and statistics; the rest is the other benches'.
#[allow(dead_code)]
mod api;
mod machine;

use api::{ms, stats, Api};
use clap::Parser;
use serde_json::{json, Value};
use std::path::PathBuf;
use std::time::{Duration, Instant};

#[derive(Parser)]
struct Args {
    #[arg(long, env = "AIRLOCK_URL", default_value = "http://127.0.0.1:8080")]
    url: String,
    #[arg(long, env = "AIRLOCK_API_KEY")]
    key: String,
    #[arg(long, default_value_t = 5)]
    runs: usize,
    #[arg(long, default_value = "bench/results")]
    out: PathBuf,
}

const DOCKERFILE: &str = "FROM seed
COPY app/ /opt/app/
RUN echo NONCE > /etc/bench-nonce && python3 -c 'print(1)'
ENV GREETING=hello
WORKDIR /opt/app
CMD [\"python3\", \"-m\", \"http.server\", \"8000\"]
";

/// A tar holding `app/index.html`, made by the host's tar.
fn context() -> Vec<u8> {
    let dir = std::env::temp_dir().join(format!("airlock-build-bench-{}", std::process::id()));
    std::fs::create_dir_all(dir.join("app")).unwrap();
    std::fs::write(dir.join("app/index.html"), "<p>bench</p>\n").unwrap();
    let out = std::process::Command::new("tar")
        .arg("-c")
        .arg("-C")
        .arg(&dir)
        .arg("app")
        .output()
        .unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(out.status.success(), "tar failed");
    out.stdout
}

fn build(api: &Api, name: &str, dockerfile: &str, ctx: &str) -> Result<(f64, Value), String> {
    let t = Instant::now();
    let b = api.call(
        "POST",
        "/templates",
        Some(json!({
            "name": name, "dockerfile": dockerfile, "context": ctx,
            "ready_cmd": "python3 -c 'import socket; socket.create_connection((\"127.0.0.1\", 8000))'",
        })),
    )?;
    let id = b["id"].as_str().ok_or("no build id")?.to_string();
    let deadline = Instant::now() + Duration::from_secs(600);
    loop {
        let b = api.call("GET", &format!("/builds/{id}"), None)?;
        match b["status"].as_str() {
            Some("ready") => return Ok((ms(t.elapsed()), b)),
            Some("error") => return Err(format!("build failed: {b}")),
            _ if Instant::now() > deadline => return Err(format!("build not done in 600 s: {b}")),
            _ => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

fn main() {
    let args = Args::parse();
    let api = Api {
        url: args.url.trim_end_matches('/').to_string(),
        auth: format!("Bearer {}", args.key),
        admin_auth: None,
        disk_mib: 2048,
    };
    let ctx = ureq::post(&format!("{}/v1/templates/contexts", api.url))
        .set("Authorization", &api.auth)
        .send_bytes(&context())
        .map_err(|e| e.to_string())
        .and_then(|r| r.into_json::<Value>().map_err(|e| e.to_string()))
        .expect("context upload");
    let ctx = ctx["hash"].as_str().unwrap().to_string();
    let tag = format!("bench-{}", std::process::id());
    let (mut cold, mut cached, mut custom_tti, mut seed_tti) = (vec![], vec![], vec![], vec![]);
    let mut failures = 0;
    for run in 0..args.runs {
        let dockerfile = DOCKERFILE.replace("NONCE", &format!("{}-{run}", std::process::id()));
        let name = format!("{tag}:r{run}");
        match build(&api, &name, &dockerfile, &ctx) {
            Ok((t, _)) => cold.push(t),
            Err(e) => {
                eprintln!("{e}");
                failures += 1;
                continue;
            }
        }
        match build(&api, &format!("{tag}:c{run}"), &dockerfile, &ctx) {
            Ok((t, _)) => cached.push(t),
            Err(e) => eprintln!("{e}"),
        }
        // Alternated, so both see the same machine state.
        for (template, into) in [(name.as_str(), &mut custom_tti), ("seed", &mut seed_tti)] {
            match api.tti(template) {
                Ok((t, id)) => {
                    into.push(t);
                    api.delete(&id);
                }
                Err(e) => eprintln!("tti {template}: {e}"),
            }
        }
        eprintln!(
            "run {run}: cold {:.0} ms, cached {:.0} ms, first create {:.0} ms (seed {:.0} ms)",
            cold.last().copied().unwrap_or(f64::NAN),
            cached.last().copied().unwrap_or(f64::NAN),
            custom_tti.last().copied().unwrap_or(f64::NAN),
            seed_tti.last().copied().unwrap_or(f64::NAN)
        );
    }
    let _ = api.call("DELETE", &format!("/templates/{tag}"), None);
    let p50 = |v: &Value| v["p50_ms"].as_f64().unwrap_or(f64::NAN);
    let report = json!({
        "when": humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string(),
        "machine": machine::machine(),
        "runs": args.runs,
        "cold_build": stats(&cold, failures),
        "cached_build": stats(&cached, 0),
        "first_create_tti_custom": stats(&custom_tti, 0),
        "first_create_tti_seed": stats(&seed_tti, 0),
    });
    let mut table = String::from("| measure | p50 ms | p95 ms | failures |\n| --- | --- | --- | --- |\n");
    for (name, key) in [
        ("cold build (VM, steps, capture, base snapshot)", "cold_build"),
        ("cached build (same content)", "cached_build"),
        ("first create TTI, the custom template", "first_create_tti_custom"),
        ("create TTI, seed (same run)", "first_create_tti_seed"),
    ] {
        let s = &report[key];
        let f = |k: &str| s[k].as_f64().map_or("-".into(), |v| format!("{v:.1}"));
        table.push_str(&format!(
            "| {name} | {} | {} | {} |\n",
            f("p50_ms"),
            f("p95_ms"),
            s["failures"]
        ));
    }
    table.push_str(&format!(
        "\nfirst create of a custom template / seed create, p50: {:.2}; cold / cached build, p50: {:.0}\n\nMachine: {}\n",
        p50(&report["first_create_tti_custom"]) / p50(&report["first_create_tti_seed"]),
        p50(&report["cold_build"]) / p50(&report["cached_build"]),
        report["machine"]
    ));
    print!("{table}");
    std::fs::create_dir_all(&args.out).unwrap();
    let date = report["when"].as_str().unwrap().replace([':', '-'], "");
    let path = args.out.join(format!("build-{}.json", &date[..15]));
    std::fs::write(&path, serde_json::to_vec_pretty(&report).unwrap()).unwrap();
    std::fs::write(path.with_extension("md"), format!("# {}\n\n{table}", path.display())).unwrap();
    println!("raw results: {}", path.display());
}
