//! What the real-VM suites share: an `airlock serve` process on a data dir, its API with the
//! admin key, and host-side checks on its VMs (`tests/api.rs`, `tests/hostile.rs`).
#![allow(dead_code)] // each suite uses its own part

use base64::Engine as _;
use serde_json::Value;
use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub const BIN: &str = env!("CARGO_BIN_EXE_airlock");
/// `root@local`'s password on every server the suites start (`AIRLOCK_CONSOLE_PASSWORD`).
pub const CONSOLE_PASSWORD: &str = "airlock-test-console-password";

pub fn test_data_dir() -> PathBuf {
    std::env::var_os("AIRLOCK_TEST_DATA_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| "/var/lib/airlock-test".into())
}

/// `airlock template build <name>` on `data` (a no-op when its recipe is unchanged).
pub fn build_template(data: &Path, name: &str) {
    std::fs::create_dir_all(data).unwrap();
    let built = Command::new(BIN)
        .arg("--data-dir")
        .arg(data)
        .args(["template", "build", name])
        .status()
        .unwrap();
    assert!(built.success(), "template build {name} failed");
}

/// A test case of a suite with its own `main` (the suites share one server, so they run under
/// libtest-mimic): a panic in `f` fails it.
pub fn trial(name: &'static str, f: fn()) -> libtest_mimic::Trial {
    libtest_mimic::Trial::test(name, move || -> Result<(), libtest_mimic::Failed> {
        f();
        Ok(())
    })
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// How many servers' logs a data dir keeps.
const KEPT_LOGS: usize = 40;

/// Remove all but the `keep` newest `<prefix>*.log` files in `dir`.
fn keep_newest_logs(dir: &Path, prefix: &str, keep: usize) {
    let mut logs: Vec<(std::time::SystemTime, PathBuf)> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| {
            let name = e.file_name().to_string_lossy().to_string();
            name.starts_with(prefix) && name.ends_with(".log")
        })
        .filter_map(|e| Some((e.metadata().ok()?.modified().ok()?, e.path())))
        .collect();
    logs.sort();
    let old = logs.len().saturating_sub(keep);
    for (_, path) in logs.into_iter().take(old) {
        let _ = std::fs::remove_file(path);
    }
}

/// A test that fails (panics) before it stops its server does not leave it serving: stopped
/// as `stop` does (its pool VMs go with it; sandboxes outlive it by design).
impl Drop for Server {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            self.stop();
        }
    }
}

pub struct Server {
    pub child: Child,
    pub url: String,
    pub key: String,
    pub data: PathBuf,
    /// Where its stdout and stderr go.
    pub log: PathBuf,
}

impl Server {
    pub fn start(data: &Path) -> Server {
        Server::start_with(data, &[])
    }

    pub fn start_with(data: &Path, extra: &[&str]) -> Server {
        Server::start_console(data, extra, Some(CONSOLE_PASSWORD))
    }

    /// A server whose console password is `console_password`, or (with `None`) left to the
    /// server: generated on a first start. Its output goes to `serve-<port>.log` in `data`
    /// (the newest logs are kept for a look after a run, the older ones removed).
    pub fn start_console(data: &Path, extra: &[&str], console_password: Option<&str>) -> Server {
        let port = free_port();
        keep_newest_logs(data, "serve-", KEPT_LOGS);
        let log_path = data.join(format!("serve-{port}.log"));
        let log = std::fs::File::create(&log_path).unwrap();
        let mut cmd = Command::new(BIN);
        cmd.args(["--data-dir"])
            .arg(data)
            .args(["serve", "--listen", &format!("127.0.0.1:{port}")])
            .args(extra)
            .env_remove("AIRLOCK_CONSOLE_PASSWORD");
        // The tests' servers are single-tenant nodes: what the suite holds at once is bounded by
        // the node's budget (503 when full), not by half of the machine's free disk, which varies
        // between machines. Quotas have tests of their own; a test's own `--tenant-share` wins.
        if !extra.contains(&"--tenant-share") {
            cmd.args(["--tenant-share", "1"]);
        }
        // Image builds pull only from registries the tests start on loopback.
        cmd.args(["--registry-allow", "127.0.0.1"]);
        if let Some(password) = console_password {
            cmd.env("AIRLOCK_CONSOLE_PASSWORD", password);
        }
        let child = cmd
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap();
        let url = format!("http://127.0.0.1:{port}");
        let deadline = Instant::now() + Duration::from_secs(120);
        while ureq::get(&format!("{url}/openapi-m1.json")).call().is_err() {
            assert!(
                Instant::now() < deadline,
                "server did not come up; see {}",
                data.display()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        let creds = std::fs::read_to_string(data.join("credentials")).unwrap();
        let key = creds
            .lines()
            .find_map(|l| l.strip_prefix("AIRLOCK_API_KEY="))
            .unwrap()
            .to_string();
        Server {
            child,
            url,
            key,
            data: data.to_path_buf(),
            log: log_path,
        }
    }

    /// `airlock <args>` against this server, signed in as `root@local` (an admin command).
    pub fn cli(&self, args: &[&str]) -> std::process::Output {
        let run = |args: &[&str]| {
            Command::new(BIN)
                .arg("--data-dir")
                .arg(&self.data)
                .args(args)
                .env("AIRLOCK_URL", &self.url)
                .env("AIRLOCK_CONSOLE_PASSWORD", CONSOLE_PASSWORD)
                .env_remove("AIRLOCK_ADMIN_TOKEN")
                .stdin(Stdio::null())
                .output()
                .unwrap()
        };
        let login = run(&["login"]);
        assert!(
            login.status.success(),
            "login: {}",
            String::from_utf8_lossy(&login.stderr)
        );
        run(args)
    }

    /// [`Server::cli`] that must succeed; its stdout as JSON (or as a string).
    pub fn cli_ok(&self, args: &[&str]) -> Value {
        let out = self.cli(args);
        assert!(
            out.status.success(),
            "airlock {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let text = String::from_utf8_lossy(&out.stdout).trim().to_string();
        serde_json::from_str(&text).unwrap_or(Value::String(text))
    }

    pub fn kill9(&mut self) {
        unsafe { libc::kill(self.child.id() as i32, libc::SIGKILL) };
        let _ = self.child.wait();
    }

    pub fn stop(&mut self) {
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let _ = self.child.wait();
    }

    /// (status, JSON body) of a request as the platform account (`/v1/admin/*`), signed in
    /// for it.
    pub fn admin_call(&self, method: &str, path: &str, body: Option<Value>) -> (u16, Value) {
        let login = serde_json::json!({"username": "root@local", "password": CONSOLE_PASSWORD});
        let (status, t) = self.call_with("POST", "/v1/admin/login", Some(login), None, &[]);
        assert_eq!(status, 200, "sign in: {t}");
        self.call_with(method, path, body, t["token"].as_str(), &[])
    }

    /// (status, JSON body) of a request with the admin key.
    pub fn call(&self, method: &str, path: &str, body: Option<Value>) -> (u16, Value) {
        self.call_with(method, path, body, Some(&self.key), &[])
    }

    pub fn call_with(
        &self,
        method: &str,
        path: &str,
        body: Option<Value>,
        key: Option<&str>,
        headers: &[(&str, &str)],
    ) -> (u16, Value) {
        let mut req = ureq::request(method, &format!("{}{path}", self.url)).timeout(Duration::from_secs(60));
        if let Some(k) = key {
            req = req.set("Authorization", &format!("Bearer {k}"));
        }
        for (h, v) in headers {
            req = req.set(h, v);
        }
        let res = match body {
            Some(b) => req.send_json(b),
            None => req.call(),
        };
        let resp = match res {
            Ok(r) => r,
            Err(ureq::Error::Status(_, r)) => r,
            Err(e) => panic!("{method} {path}: {e}"),
        };
        let status = resp.status();
        let text = resp.into_string().unwrap_or_default();
        (status, serde_json::from_str(&text).unwrap_or(Value::String(text)))
    }

    pub fn raw_post(&self, path: &str, body: &str) -> (u16, Value) {
        let res = ureq::post(&format!("{}{path}", self.url))
            .set("Authorization", &format!("Bearer {}", self.key))
            .set("Content-Type", "application/json")
            .send_string(body);
        let resp = match res {
            Ok(r) => r,
            Err(ureq::Error::Status(_, r)) => r,
            Err(e) => panic!("POST {path}: {e}"),
        };
        (resp.status(), resp.into_json().unwrap_or(Value::Null))
    }

    pub fn wait_op(&self, op_id: &str) -> Value {
        let deadline = Instant::now() + Duration::from_secs(180);
        loop {
            let (status, op) = self.call("GET", &format!("/v1/operations/{op_id}"), None);
            assert_eq!(status, 200, "{op}");
            if op["state"] == "succeeded" || op["state"] == "failed" {
                return op;
            }
            assert!(Instant::now() < deadline, "operation {op_id} never finished: {op}");
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Wait (up to a minute) for the server to delete the sandbox on its own, e.g. at its timeout.
    /// `POST /v1/sandboxes/{id}/{change}` (pause, suspend, resume), waited for: the operation
    /// must succeed. Returns the sandbox as it is then.
    pub fn change(&self, id: &str, change: &str) -> Value {
        let (status, r) = self.call("POST", &format!("/v1/sandboxes/{id}/{change}"), None);
        assert_eq!(status, 202, "{change}: {r}");
        let op = self.wait_op(r["operation"]["id"].as_str().unwrap());
        assert_eq!(op["state"], "succeeded", "{change}: {op}");
        self.call("GET", &format!("/v1/sandboxes/{id}"), None).1
    }

    pub fn wait_expired(&self, id: &str) {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let (_, sb) = self.call("GET", &format!("/v1/sandboxes/{id}"), None);
            if sb["state"] == "deleted" {
                return;
            }
            assert!(Instant::now() < deadline, "sandbox outlived its timeout: {sb}");
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    pub fn create(&self, body: Value) -> String {
        let (status, r) = self.call("POST", "/v1/sandboxes", Some(body));
        assert_eq!(status, 202, "{r}");
        let op = self.wait_op(r["operation"]["id"].as_str().unwrap());
        assert_eq!(op["state"], "succeeded", "{op}");
        r["sandbox_id"].as_str().unwrap().to_string()
    }

    pub fn delete(&self, id: &str) {
        let (status, r) = self.call("DELETE", &format!("/v1/sandboxes/{id}"), None);
        assert_eq!(status, 202, "{r}");
        assert_eq!(
            self.wait_op(r["operation"]["id"].as_str().unwrap())["state"],
            "succeeded"
        );
    }

    pub fn session(&self, sandbox: &str, body: Value) -> String {
        let (status, s) = self.call("POST", &format!("/v1/sandboxes/{sandbox}/sessions"), Some(body));
        assert_eq!(status, 201, "{s}");
        s["id"].as_str().unwrap().to_string()
    }

    /// Read SSE events (event, id, data) until `process_exited` or `stop_after` events.
    pub fn events(
        &self,
        sandbox: &str,
        session: &str,
        last_id: Option<&str>,
        stop_after: Option<usize>,
    ) -> Vec<(String, Option<String>, Value)> {
        let mut req = ureq::get(&format!(
            "{}/v1/sandboxes/{sandbox}/sessions/{session}/stream",
            self.url
        ))
        .set("Authorization", &format!("Bearer {}", self.key))
        .timeout(Duration::from_secs(120));
        if let Some(id) = last_id {
            req = req.set("Last-Event-ID", id);
        }
        let resp = req.call().unwrap();
        assert_eq!(resp.header("content-type"), Some("text/event-stream"));
        let reader = std::io::BufReader::new(resp.into_reader());
        let (mut out, mut event, mut id, mut data) = (Vec::new(), String::new(), None, String::new());
        for line in reader.lines() {
            let line = line.unwrap();
            if line.is_empty() {
                if !event.is_empty() {
                    let done = event == "process_exited";
                    out.push((
                        std::mem::take(&mut event),
                        id.take(),
                        serde_json::from_str(&data).unwrap_or(Value::Null),
                    ));
                    data.clear();
                    if done || stop_after.is_some_and(|n| out.len() >= n) {
                        break;
                    }
                }
            } else if let Some(v) = line.strip_prefix("event:") {
                event = v.trim().into();
            } else if let Some(v) = line.strip_prefix("id:") {
                id = Some(v.trim().to_string());
            } else if let Some(v) = line.strip_prefix("data:") {
                data.push_str(v.trim_start());
            }
        }
        out
    }
}

pub fn decode(events: &[(String, Option<String>, Value)], kind: &str) -> String {
    events
        .iter()
        .filter(|(e, _, _)| e == kind)
        .map(|(_, _, d)| {
            String::from_utf8(
                base64::engine::general_purpose::STANDARD
                    .decode(d["data"].as_str().unwrap())
                    .unwrap(),
            )
            .unwrap()
        })
        .collect()
}

/// Run `cmd` in sandbox `id` as its user; (stdout + stderr, exit code).
pub fn sh(s: &Server, id: &str, cmd: &str) -> (String, i64) {
    let sid = s.session(id, serde_json::json!({ "argv": ["sh", "-c", cmd], "timeout": "120s" }));
    let events = s.events(id, &sid, None, None);
    let code = events.last().unwrap().2["exit_code"].as_i64().unwrap_or(-1);
    (
        format!("{}{}", decode(&events, "stdout"), decode(&events, "stderr")),
        code,
    )
}

pub fn wait_state(s: &Server, id: &str, state: &str, within: Duration) -> Result<Duration, Value> {
    let start = Instant::now();
    loop {
        let (_, sb) = s.call("GET", &format!("/v1/sandboxes/{id}"), None);
        if sb["state"] == state {
            return Ok(start.elapsed());
        }
        if start.elapsed() > within {
            return Err(sb);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

pub fn listed_by_default(s: &Server, id: &str) -> bool {
    let (_, list) = s.call("GET", "/v1/sandboxes?limit=100", None);
    list["sandboxes"].as_array().unwrap().iter().any(|x| x["id"] == id)
}

pub fn qemu_pid(s: &Server, id: &str) -> i32 {
    let vm: Value =
        serde_json::from_slice(&std::fs::read(s.data.join("sandboxes").join(id).join("vm.json")).unwrap()).unwrap();
    let pid = vm["pid"].as_u64().expect("vm.json has a pid") as i32;
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
    assert!(
        cmdline.contains("qemu") && cmdline.contains(id),
        "pid {pid} is not sandbox {id}'s QEMU: {cmdline}"
    );
    pid
}

/// QEMUs whose server was killed re-parent to this process (a subreaper): collect them.
pub fn reap_orphans() {
    let me = std::process::id();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let stat = std::fs::read_to_string(entry.path().join("stat")).unwrap_or_default();
        let fields: Vec<&str> = stat
            .rsplit_once(')')
            .map(|(_, r)| r.split_whitespace().collect())
            .unwrap_or_default();
        if fields.len() > 2 && fields[0] == "Z" && fields[1] == me.to_string() {
            unsafe { libc::waitpid(pid, std::ptr::null_mut(), libc::WNOHANG) };
        }
    }
}

/// Upload `body` to `path` in sandbox `id`.
pub fn put_file(s: &Server, id: &str, path: &str, body: &[u8]) {
    let r = ureq::put(&format!("{}/v1/sandboxes/{id}/files?path={path}", s.url))
        .set("Authorization", &format!("Bearer {}", s.key))
        .send_bytes(body);
    assert!(r.is_ok(), "upload {path}: {r:?}");
}

/// An empty data dir `<shared>-<suffix>` with the shared one's templates (built there first),
/// as hard links (templates are immutable), so a server or node on it starts without building
/// `seed`. What an earlier run left in it goes first ([`end_vms_left_in`]).
pub fn data_dir_with_templates(suffix: &str) -> PathBuf {
    let data = PathBuf::from(format!("{}-{suffix}", test_data_dir().display()));
    end_vms_left_in(&data);
    let _ = std::fs::remove_dir_all(&data);
    std::fs::create_dir_all(&data).unwrap();
    let src = test_data_dir();
    let ok = Command::new("cp")
        .arg("-al")
        .arg(src.join("blobs"))
        .arg(src.join("templates"))
        .arg(&data)
        .status()
        .unwrap();
    assert!(ok.success());
    let _ = std::fs::copy(src.join("accel.json"), data.join("accel.json"));
    data
}

/// End the VMs a failed earlier run left in `data` (VMs outlive their server by design, and the
/// dir is about to go): each by the pid it recorded, if that process still names the dir; and
/// remove their networks (a server or node on `data` named them).
pub fn end_vms_left_in(data: &Path) {
    for dir in std::fs::read_dir(data.join("sandboxes"))
        .into_iter()
        .flatten()
        .flatten()
    {
        airlock_testnet::end_vmm_of(&dir.path());
        let (netns, _) = airlock_runtime::net::names(data, &dir.file_name().to_string_lossy());
        if Path::new("/run/netns").join(&netns).exists() {
            let _ = Command::new("ip").args(["netns", "del", &netns]).status();
            // Its host table, for a server that ran in this namespace (a node in a namespace
            // of its own took its table with it).
            let _ = Command::new("nft")
                .args(["delete", "table", "inet", &netns])
                .stderr(Stdio::null())
                .status();
        }
    }
}

/// A raw HTTP/1.1 GET with our own Host header (as wildcard DNS would deliver it).
pub fn get_with_host(s: &Server, host: &str, path: &str, headers: &[(&str, &str)]) -> (u16, String) {
    use std::io::{Read, Write};
    let addr = s.url.trim_start_matches("http://");
    let mut conn = std::net::TcpStream::connect(addr).unwrap();
    conn.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let mut req = format!("GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n");
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    conn.write_all(req.as_bytes()).unwrap();
    let mut raw = Vec::new();
    let _ = conn.read_to_end(&mut raw);
    let text = String::from_utf8_lossy(&raw).to_string();
    let status = text.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    (status, body)
}
