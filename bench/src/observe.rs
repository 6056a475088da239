//! What the operator's view costs the sandboxes' users, against a running server: create TTI (to
//! the first stdout byte of `echo`) and the exec round trip (`true`, one call to its exit)
//!
//! - while a scraper reads `/metrics` every `--every-ms` (a Prometheus at 1 s),
//! - while a webhook of every event points at a receiver that takes `--receiver-sleep-ms` (5 s)
//!   to answer (deliveries are off the lifecycle path: creates must not wait for them),
//!
//! next to the same with neither, alternated run by run so all see the same machine. Also each
//! scrape's time and size, and the deliveries the slow receiver got.
//!
//! ```text
//! airlock serve --webhook-allow-private ...   # the receiver is on loopback
//! AIRLOCK_API_KEY=... AIRLOCK_SCRAPE_TOKEN=$(airlock scrape-token create) \
//!   cargo run --release -p airlock-bench --bin observe-bench -- --url http://127.0.0.1:8080
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
    #[arg(long, default_value_t = 100)]
    execs: usize,
    #[arg(long, default_value_t = 1000)]
    every_ms: u64,
    /// How long the webhook receiver takes to answer each delivery.
    #[arg(long, default_value_t = 5000)]
    receiver_sleep_ms: u64,
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

/// A webhook receiver on loopback that reads each delivery and answers 204 after `sleep`; the
/// deliveries it got.
fn slow_receiver(sleep: Duration) -> (String, Arc<std::sync::atomic::AtomicUsize>) {
    use std::io::{BufRead, BufReader, Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}/hook", listener.local_addr().unwrap());
    let got = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let count = got.clone();
    std::thread::spawn(move || {
        for conn in listener.incoming().flatten() {
            let count = count.clone();
            std::thread::spawn(move || {
                let mut reader = BufReader::new(conn.try_clone().unwrap());
                let mut length = 0;
                loop {
                    let mut line = String::new();
                    if reader.read_line(&mut line).unwrap_or(0) == 0 || line == "\r\n" {
                        break;
                    }
                    if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                        length = v.trim().parse().unwrap_or(0);
                    }
                }
                let mut body = vec![0; length];
                let _ = reader.read_exact(&mut body);
                std::thread::sleep(sleep);
                count.fetch_add(1, Ordering::Relaxed);
                let mut conn = conn;
                let _ = conn.write_all(b"HTTP/1.1 204 No Content\r\nConnection: close\r\n\r\n");
            });
        }
    });
    (url, got)
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
    // Warm: the template's base snapshot exists and the first create's one-offs are paid.
    let (_, warm) = api.tti(&args.template).expect("a first create");
    api.delete(&warm);
    let execer = api.create(&args.template).expect("the exec sandbox");
    let scrapes = Arc::new(Mutex::new(Vec::new()));
    let (receiver, delivered) = slow_receiver(Duration::from_millis(args.receiver_sleep_ms));
    let hook = api
        .call(
            "POST",
            "/webhooks",
            Some(json!({"url": receiver, "name": "observe-bench"})),
        )
        .expect("a webhook to the slow receiver (serve --webhook-allow-private)");
    let hook = hook["id"].as_str().unwrap().to_string();
    let set_hook = |on: bool| {
        api.call("PATCH", &format!("/webhooks/{hook}"), Some(json!({ "enabled": on })))
            .expect("webhook on/off");
    };
    set_hook(false);
    let (mut quiet, mut scraped, mut hooked) = (Phase::default(), Phase::default(), Phase::default());
    for run in 0..args.runs {
        for which in ["quiet", "scraped", "webhook"] {
            let _scraper = (which == "scraped").then(|| {
                Scraper::start(
                    &api.url,
                    &args.scrape_token,
                    Duration::from_millis(args.every_ms),
                    scrapes.clone(),
                )
            });
            if which == "webhook" {
                set_hook(true);
            }
            let phase = match which {
                "quiet" => &mut quiet,
                "scraped" => &mut scraped,
                _ => &mut hooked,
            };
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
            if which == "webhook" {
                set_hook(false);
            }
        }
        eprintln!(
            "run {run}: create TTI {:.0} ms quiet, {:.0} ms scraped, {:.0} ms with a slow webhook",
            quiet.tti.last().copied().unwrap_or(f64::NAN),
            scraped.tti.last().copied().unwrap_or(f64::NAN),
            hooked.tti.last().copied().unwrap_or(f64::NAN),
        );
    }
    let _ = api.call("DELETE", &format!("/webhooks/{hook}"), None);
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
        "receiver_sleep_ms": args.receiver_sleep_ms,
        "create_tti_quiet": stats(&quiet.tti, quiet.failures),
        "create_tti_scraped": stats(&scraped.tti, scraped.failures),
        "create_tti_webhook": stats(&hooked.tti, hooked.failures),
        "exec_quiet": stats(&quiet.exec, 0),
        "exec_scraped": stats(&scraped.exec, 0),
        "exec_webhook": stats(&hooked.exec, 0),
        "deliveries_received": delivered.load(Ordering::Relaxed),
        "scrape": stats(&scrape_ms, 0),
        "scrape_bytes_max": bytes,
    });
    let p = |k: &str, q: &str| report[k][q].as_f64().unwrap_or(f64::NAN);
    let mut table = String::from(
        "| measure | quiet p50 ms | scraped p50 ms | ratio | slow webhook p50 ms | ratio | quiet p95 | scraped p95 | webhook p95 |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- |\n",
    );
    for (label, key) in [("create TTI", "create_tti"), ("exec round trip", "exec")] {
        let (q, s, w) = (
            format!("{key}_quiet"),
            format!("{key}_scraped"),
            format!("{key}_webhook"),
        );
        table.push_str(&format!(
            "| {label} | {:.1} | {:.1} | {:.2} | {:.1} | {:.2} | {:.1} | {:.1} | {:.1} |\n",
            p(&q, "p50_ms"),
            p(&s, "p50_ms"),
            p(&s, "p50_ms") / p(&q, "p50_ms"),
            p(&w, "p50_ms"),
            p(&w, "p50_ms") / p(&q, "p50_ms"),
            p(&q, "p95_ms"),
            p(&s, "p95_ms"),
            p(&w, "p95_ms"),
        ));
    }
    table.push_str(&format!(
        "\nA scrape every {} ms: {} scrapes, p50 {:.1} ms, p95 {:.1} ms, at most {bytes} bytes. The webhook's receiver took {} ms per delivery and got {} during the run.\n\nMachine: {}\n",
        args.every_ms,
        scrape_ms.len(),
        p("scrape", "p50_ms"),
        p("scrape", "p95_ms"),
        args.receiver_sleep_ms,
        report["deliveries_received"],
        report["machine"]
    ));
    print!("{table}");
    std::fs::create_dir_all(&args.out).unwrap();
    let date = report["when"].as_str().unwrap().replace([':', '-'], "");
    let path = args.out.join(format!("observe-{}.json", &date[..15]));
    std::fs::write(&path, serde_json::to_vec_pretty(&report).unwrap()).unwrap();
    std::fs::write(path.with_extension("md"), format!("# {}\n\n{table}", path.display())).unwrap();
    eprintln!("wrote {}", path.display());
}
