//! `GET /metrics` scraped by a real Prometheus (Debian's `prometheus`, started here on a free
//! loopback port with a data dir of its own, stopped by its PID however the test ends): PromQL
//! sees the creates made (their counter and their duration histogram's count), a session
//! running, and a sandbox's egress denials. One scrape job presents a scrape token minted with
//! the CLI on the main listener, the other reads `--metrics-listen` without one; a revoked token
//! takes its job down.

use super::*;
use std::process::{Child, Stdio};

const PROMETHEUS: &str = "/usr/bin/prometheus";

/// A Prometheus of this test's own; ended (SIGTERM, then waited for) when dropped.
struct Prometheus {
    child: Child,
    url: String,
}

impl Prometheus {
    fn start(dir: &Path, config: &str) -> Prometheus {
        assert!(
            Path::new(PROMETHEUS).exists(),
            "{PROMETHEUS} is missing: scripts/install-host-deps installs Debian's prometheus"
        );
        std::fs::create_dir_all(dir).unwrap();
        let config_path = dir.join("prometheus.yml");
        std::fs::write(&config_path, config).unwrap();
        let port = free_port();
        let log = std::fs::File::create(dir.join("prometheus.log")).unwrap();
        let child = Command::new(PROMETHEUS)
            .arg(format!("--config.file={}", config_path.display()))
            .arg(format!("--storage.tsdb.path={}", dir.join("tsdb").display()))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap();
        let p = Prometheus {
            child,
            url: format!("http://127.0.0.1:{port}"),
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        while ureq::get(&format!("{}/-/ready", p.url)).call().is_err() {
            assert!(
                Instant::now() < deadline,
                "prometheus never got ready; see {}",
                dir.join("prometheus.log").display()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
        p
    }

    /// The value of an instant query that answers one series (None: no series).
    fn query(&self, promql: &str) -> Option<f64> {
        let r: Value = ureq::get(&format!("{}/api/v1/query", self.url))
            .query("query", promql)
            .call()
            .unwrap_or_else(|e| panic!("{promql}: {e}"))
            .into_json()
            .unwrap();
        assert_eq!(r["status"], "success", "{promql}: {r}");
        let result = r["data"]["result"].as_array().unwrap();
        assert!(result.len() <= 1, "{promql}: one series expected: {r}");
        result.first().map(|s| s["value"][1].as_str().unwrap().parse().unwrap())
    }

    /// Wait (up to a minute: a few scrapes) until `promql` answers `want`.
    fn wait_for(&self, promql: &str, want: impl Fn(f64) -> bool, what: &str) -> f64 {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let got = self.query(promql);
            if let Some(v) = got.filter(|v| want(*v)) {
                return v;
            }
            assert!(Instant::now() < deadline, "{what}: `{promql}` answers {got:?}");
            std::thread::sleep(Duration::from_millis(500));
        }
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let _ = self.child.wait();
    }
}

pub fn prometheus_scrapes_creates_sessions_and_egress_denials() {
    let data = own_data_dir("metrics");
    let private = free_port();
    let private_addr = format!("127.0.0.1:{private}");
    let mut s = Server::start_with(&data, &["--metrics-listen", &private_addr]);
    let token = s.cli_ok(&["scrape-token", "create", "--name", "prometheus"]);
    let token = token.as_str().expect("the token alone").to_string();
    assert!(token.starts_with("ast_"), "{token}");
    let listed = s.cli_ok(&["scrape-token", "ls"]);
    let id = listed["tokens"][0]["id"].as_str().unwrap().to_string();
    assert!(!listed.to_string().contains(&token), "never listed: {listed}");

    let main = s.url.trim_start_matches("http://");
    let config = format!(
        "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n\
         scrape_configs:\n\
         \x20 - job_name: airlock\n    authorization:\n      credentials: {token}\n    static_configs:\n      - targets: ['{main}']\n\
         \x20 - job_name: airlock-private\n    static_configs:\n      - targets: ['{private_addr}']\n"
    );
    let prom = Prometheus::start(&data.join("prometheus"), &config);
    prom.wait_for("up{job=\"airlock\"}", |v| v == 1.0, "the token's job is up");
    prom.wait_for(
        "up{job=\"airlock-private\"}",
        |v| v == 1.0,
        "the private listener's job is up",
    );

    let first = s.create(json!({ "template": "seed", "timeout": "10m" }));
    let second = s.create(json!({ "template": "seed", "timeout": "10m" }));
    let sleeper = s.session(&first, json!({ "argv": ["sleep", "300"] }));
    // Denials: a name outside the sandbox's policy (DNS), and a connection whose Host is one.
    let (out, _) = sh(
        &s,
        &second,
        "getent hosts blocked.test || echo refused; \
         python3 -c \"import socket; c = socket.create_connection(('198.51.100.7', 80), timeout=10); \
         c.sendall(b'GET / HTTP/1.1\\r\\nHost: blocked.test\\r\\n\\r\\n'); print(c.recv(200)[:12])\" || true",
    );
    assert!(out.contains("refused"), "{out}");
    let (_, egress) = s.call("GET", &format!("/v1/sandboxes/{second}/egress"), None);

    // What Prometheus sees: every create, once, in the counter and in the histogram.
    for job in ["airlock", "airlock-private"] {
        prom.wait_for(
            &format!("airlock_sandbox_creates_total{{job=\"{job}\",result=\"ok\"}}"),
            |v| v == 2.0,
            "two creates counted",
        );
        prom.wait_for(
            &format!("sum(airlock_sandbox_create_duration_seconds_count{{job=\"{job}\"}})"),
            |v| v == 2.0,
            "the create duration histogram counts each create once",
        );
    }
    let p50 = prom.query(
        "histogram_quantile(0.5, sum by (le) (airlock_sandbox_create_duration_seconds_bucket{job=\"airlock\"}))",
    );
    assert!(p50.is_some_and(|v| v > 0.0 && v < 300.0), "{p50:?}");
    prom.wait_for(
        "sum(airlock_sessions_running{job=\"airlock\"})",
        |v| v == 1.0,
        "the sleeping session runs",
    );
    prom.wait_for(
        "sum(airlock_sandboxes{job=\"airlock\",state=\"running\",template=\"seed\"})",
        |v| v == 2.0,
        "two sandboxes run",
    );
    prom.wait_for(
        "airlock_egress_dns_refused_total{job=\"airlock\",tenant=\"default\"}",
        |v| v >= 1.0,
        "the refused lookup",
    );
    let tcp_denied = egress["counters"]["tcp_denied"].as_u64().unwrap_or(0) as f64;
    assert!(tcp_denied >= 1.0, "the proxy judged the connection: {egress} ({out})");
    prom.wait_for(
        "airlock_egress_connections_total{job=\"airlock\",tenant=\"default\",verdict=\"denied\"}",
        |v| v >= tcp_denied,
        "the denied connection",
    );
    prom.wait_for(
        "airlock_http_request_duration_seconds_count{job=\"airlock\",method=\"POST\",route=\"/v1/sandboxes\",status=\"202\"}",
        |v| v == 2.0,
        "creates by route template",
    );
    prom.wait_for(
        "sum(airlock_agent_call_duration_seconds_count{job=\"airlock\",route=\"spawn\",outcome=\"ok\"})",
        |v| v >= 2.0,
        "agent calls",
    );

    // Revoked: the next scrapes are refused, and the job goes down.
    s.cli_ok(&["scrape-token", "rm", &id]);
    prom.wait_for("up{job=\"airlock\"}", |v| v == 0.0, "a revoked token's job is down");
    prom.wait_for(
        "up{job=\"airlock-private\"}",
        |v| v == 1.0,
        "the private listener asks no token",
    );

    let (status, _) = s.call(
        "POST",
        &format!("/v1/sandboxes/{first}/sessions/{sleeper}/signal"),
        Some(json!({"signal": "KILL"})),
    );
    assert!((200..300).contains(&status));
    drop(prom);
    s.delete(&first);
    s.delete(&second);
    s.stop();
    let _ = std::fs::remove_dir_all(data.join("prometheus"));
}
