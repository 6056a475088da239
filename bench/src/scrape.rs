//! What `GET /metrics` costs the sandboxes' users, against a running server: create TTI (to the
//! first stdout byte of `echo`) and the exec round trip (`true`, one call to its exit) while a
//! scraper reads `/metrics` every `--every-ms` (a Prometheus at 1 s), next to the same with no
//! scraper, alternated run by run so both see the same machine. Also each scrape's time and size.
//!
//! ```text
//! AIRLOCK_API_KEY=... AIRLOCK_SCRAPE_TOKEN=$(airlock scrape-token create) \
//!   cargo run --release -p airlock-bench --bin scrape-bench -- --url http://127.0.0.1:8080
//! ```

// Its create, exec and statistics; the rest is the other benches'.
#[allow(dead_code)]
mod api;
mod machine;

use api::{ms, stats, Api};
use clap::Parser;
use serde_json::json;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

#[derive(Parser)]
struct Args {
    #[arg(long, env = "AIRLOCK_URL", default_value = "http://127.0.0.1:8080")]
    url: String,
    #[arg(long, env = "AIRLOCK_API_KEY")]
    key: String,
    /// A scrape token (`airlock scrape-token create`).
    #[arg(long, env = "AIRLOCK_SCRAPE_TOKEN")]
    scrape_token: String,
    #[arg(long, default_value_t = 5)]
    runs: usize,
    /// Exec round trips per run and phase.
    #[arg(long, default_value_t = 20)]
    execs: usize,
    #[arg(long, default_value_t = 1000)]
    every_ms: u64,
    #[arg(long, default_value = "seed")]
    template: String,
    #[arg(long, default_value = "bench/results")]
    out: PathBuf,
}

/// Scrapes until dropped; each scrape's (ms, bytes).
struct Scraper {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Scraper {
    fn start(url: &str, token: &str, every: Duration, seen: Arc<Mutex<Vec<(f64, usize)>>>) -> Scraper {
        let stop = Arc::new(AtomicBool::new(false));
        let (url, auth, flag) = (format!("{url}/metrics"), format!("Bearer {token}"), stop.clone());
        let thread = std::thread::spawn(move || {
            while !flag.load(Ordering::Relaxed) {
                let t = Instant::now();
                match ureq::get(&url).set("Authorization", &auth).call() {
                    Ok(r) => {
                        let n = r.into_string().map(|s| s.len()).unwrap_or(0);
                        seen.lock().unwrap().push((ms(t.elapsed()), n));
                    }
                    Err(e) => eprintln!("scrape: {e}"),
                }
                std::thread::sleep(every.saturating_sub(t.elapsed()));
            }
        });
        Scraper {
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for Scraper {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[derive(Default)]
struct Phase {
    tti: Vec<f64>,
    exec: Vec<f64>,
    failures: usize,
}

fn run_phase(api: &Api, args: &Args, phase: &mut Phase) {
    match api.tti(&args.template) {
        Ok((t, id)) => {
            phase.tti.push(t);
            api.delete(&id);
        }
        Err(e) => {
            eprintln!("tti: {e}");
            phase.failures += 1;
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
    // The scrape token must work before anything is measured.
    ureq::get(&format!("{}/metrics", api.url))
        .set("Authorization", &format!("Bearer {}", args.scrape_token))
        .call()
        .expect("GET /metrics with --scrape-token");
    let execer = api.create(&args.template).expect("the exec sandbox");
    let scrapes = Arc::new(Mutex::new(Vec::new()));
    let (mut quiet, mut scraped) = (Phase::default(), Phase::default());
    for run in 0..args.runs {
        for scraping in [false, true] {
            let _scraper = scraping.then(|| {
                Scraper::start(
                    &api.url,
                    &args.scrape_token,
                    Duration::from_millis(args.every_ms),
                    scrapes.clone(),
                )
            });
            let phase = if scraping { &mut scraped } else { &mut quiet };
            run_phase(&api, &args, phase);
            for _ in 0..args.execs {
                let t = Instant::now();
                match api.exec_one_call(&execer, &["true"], false) {
                    Ok(()) => phase.exec.push(ms(t.elapsed())),
                    Err(e) => {
                        eprintln!("exec: {e}");
                        phase.failures += 1;
                    }
                }
            }
        }
        eprintln!(
            "run {run}: create TTI {:.0} ms scraped, {:.0} ms not",
            scraped.tti.last().copied().unwrap_or(f64::NAN),
            quiet.tti.last().copied().unwrap_or(f64::NAN)
        );
    }
    api.delete(&execer);
    let scrapes = scrapes.lock().unwrap().clone();
    let scrape_ms: Vec<f64> = scrapes.iter().map(|s| s.0).collect();
    let bytes = scrapes.iter().map(|s| s.1).max().unwrap_or(0);
    let report = json!({
        "when": humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string(),
        "machine": machine::machine(),
        "runs": args.runs,
        "execs_per_run": args.execs,
        "scrape_every_ms": args.every_ms,
        "template": args.template,
        "create_tti_scraped": stats(&scraped.tti, scraped.failures),
        "create_tti_not_scraped": stats(&quiet.tti, quiet.failures),
        "exec_scraped": stats(&scraped.exec, 0),
        "exec_not_scraped": stats(&quiet.exec, 0),
        "scrape": stats(&scrape_ms, 0),
        "scrape_bytes_max": bytes,
    });
    let p = |k: &str, q: &str| report[k][q].as_f64().unwrap_or(f64::NAN);
    let mut table = String::from(
        "| measure | scraped p50 ms | not scraped p50 ms | ratio p50 | scraped p95 | not scraped p95 |\n| --- | --- | --- | --- | --- | --- |\n",
    );
    for (label, key) in [("create TTI", "create_tti"), ("exec round trip", "exec")] {
        let (s, n) = (format!("{key}_scraped"), format!("{key}_not_scraped"));
        table.push_str(&format!(
            "| {label} | {:.1} | {:.1} | {:.2} | {:.1} | {:.1} |\n",
            p(&s, "p50_ms"),
            p(&n, "p50_ms"),
            p(&s, "p50_ms") / p(&n, "p50_ms"),
            p(&s, "p95_ms"),
            p(&n, "p95_ms"),
        ));
    }
    table.push_str(&format!(
        "\nA scrape every {} ms: {} scrapes, p50 {:.1} ms, p95 {:.1} ms, at most {bytes} bytes.\n\nMachine: {}\n",
        args.every_ms,
        scrape_ms.len(),
        p("scrape", "p50_ms"),
        p("scrape", "p95_ms"),
        report["machine"]
    ));
    print!("{table}");
    std::fs::create_dir_all(&args.out).unwrap();
    let date = report["when"].as_str().unwrap().replace([':', '-'], "");
    let path = args.out.join(format!("scrape-{}.json", &date[..15]));
    std::fs::write(&path, serde_json::to_vec_pretty(&report).unwrap()).unwrap();
    std::fs::write(path.with_extension("md"), format!("# {}\n\n{table}", path.display())).unwrap();
    eprintln!("wrote {}", path.display());
}
