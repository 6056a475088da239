//! The CLI's HTTP client for a running `airlock serve`: the same API any other client uses.

use anyhow::{anyhow, bail, Context, Result};
use base64::Engine as _;
use serde_json::{json, Value};
use std::io::{BufRead, Write};
use std::path::Path;
use std::time::{Duration, Instant};

pub struct Client {
    base: String,
    key: String,
    agent: ureq::Agent,
}

/// `NAME=value` from `<data-dir>/credentials`.
fn credential(data_dir: &Path, name: &str) -> Option<String> {
    let creds = std::fs::read_to_string(data_dir.join("credentials")).unwrap_or_default();
    creds
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{name}=")).map(|v| v.trim().to_string()))
}

/// Where the admin token from `airlock login` is kept (0600).
pub fn admin_token_path(data_dir: &Path) -> std::path::PathBuf {
    data_dir.join("admin-token")
}

impl Client {
    /// URL and key from `AIRLOCK_URL` / `AIRLOCK_API_KEY`, else `<data-dir>/credentials`.
    pub fn from_env(data_dir: &Path) -> Result<Self> {
        let key = std::env::var("AIRLOCK_API_KEY")
            .ok()
            .or_else(|| credential(data_dir, "AIRLOCK_API_KEY"))
            .ok_or_else(|| {
                anyhow!(
                    "no API key: set AIRLOCK_API_KEY or start `airlock serve` once so it writes {}",
                    data_dir.join("credentials").display()
                )
            })?;
        Ok(Self::with_key(data_dir, key))
    }

    /// The platform account: the token from `AIRLOCK_ADMIN_TOKEN`, else from `airlock login`.
    pub fn admin(data_dir: &Path) -> Result<Self> {
        let token = std::env::var("AIRLOCK_ADMIN_TOKEN")
            .ok()
            .or_else(|| std::fs::read_to_string(admin_token_path(data_dir)).ok())
            .map(|t| t.trim().to_string())
            .filter(|t| !t.is_empty())
            .ok_or_else(|| anyhow!("not signed in: run `airlock login` first (as root@local)"))?;
        Ok(Self::with_key(data_dir, token))
    }

    /// Calls without a credential (signing in).
    pub fn anonymous(data_dir: &Path) -> Self {
        Self::with_key(data_dir, String::new())
    }

    fn with_key(data_dir: &Path, key: String) -> Self {
        let base = std::env::var("AIRLOCK_URL")
            .ok()
            .or_else(|| credential(data_dir, "AIRLOCK_URL"))
            .unwrap_or_else(|| "http://127.0.0.1:7420".into());
        let agent = ureq::AgentBuilder::new()
            .timeout_connect(Duration::from_secs(5))
            .build();
        Self {
            base: base.trim_end_matches('/').to_string(),
            key,
            agent,
        }
    }

    fn call(&self, method: &str, path: &str, body: Option<Value>) -> Result<ureq::Response> {
        self.call_accepting(method, path, body, "application/json")
    }

    fn call_accepting(&self, method: &str, path: &str, body: Option<Value>, accept: &str) -> Result<ureq::Response> {
        let mut req = self
            .agent
            .request(method, &format!("{}{}", self.base, path))
            .set("Accept", accept);
        if !self.key.is_empty() {
            req = req.set("Authorization", &format!("Bearer {}", self.key));
        }
        let res = match body {
            Some(b) => req.send_json(b),
            None => req.call(),
        };
        match res {
            Ok(r) => Ok(r),
            Err(ureq::Error::Status(code, r)) => {
                let body: Value = r.into_json().unwrap_or(Value::Null);
                let msg = body["message"].as_str().unwrap_or("request failed");
                let code_name = body["code"].as_str().unwrap_or("error");
                bail!("{msg} ({code_name}, HTTP {code})")
            }
            Err(e) => Err(anyhow!(
                "cannot reach airlock at {}: {e}; is `airlock serve` running?",
                self.base
            )),
        }
    }

    /// POST `bytes` as the body (`application/octet-stream`); the answer as JSON.
    pub fn upload(&self, path: &str, bytes: Vec<u8>) -> Result<Value> {
        let req = self
            .agent
            .post(&format!("{}{}", self.base, path))
            .set("Authorization", &format!("Bearer {}", self.key))
            .set("Content-Type", "application/octet-stream");
        match req.send_bytes(&bytes) {
            Ok(r) => r.into_json().context("response is not JSON"),
            Err(ureq::Error::Status(code, r)) => {
                let body: Value = r.into_json().unwrap_or(Value::Null);
                bail!(
                    "{} ({}, HTTP {code})",
                    body["message"].as_str().unwrap_or("request failed"),
                    body["code"].as_str().unwrap_or("error")
                )
            }
            Err(e) => Err(anyhow!("cannot reach airlock at {}: {e}", self.base)),
        }
    }

    /// GET `path` as a server-sent event stream.
    pub fn stream_get(&self, path: &str) -> Result<ureq::Response> {
        self.call_accepting("GET", path, None, "text/event-stream")
    }

    pub fn json(&self, method: &str, path: &str, body: Option<Value>) -> Result<Value> {
        let r = self.call(method, path, body)?;
        if r.status() == 204 {
            return Ok(Value::Null);
        }
        r.into_json().context("response is not JSON")
    }

    /// Wait for an operation to finish; an error if it failed.
    pub fn wait_operation(&self, op_id: &str) -> Result<Value> {
        let started = Instant::now();
        loop {
            let op = self.json("GET", &format!("/v1/operations/{op_id}"), None)?;
            match op["state"].as_str() {
                Some("succeeded") => return Ok(op),
                Some("failed") => bail!(
                    "{} failed: {}",
                    op["kind"].as_str().unwrap_or("operation"),
                    op["error"]["message"].as_str().unwrap_or("unknown error")
                ),
                _ if started.elapsed() > Duration::from_secs(300) => {
                    bail!("operation {op_id} did not finish in 5 minutes")
                }
                _ => std::thread::sleep(Duration::from_millis(100)),
            }
        }
    }

    /// Stream a session to this terminal, from `first` (the session's create answered as its
    /// event stream, whose first event names it) or else from its stream; a dropped connection
    /// resumes after the last event seen. Returns the exit code to exit with.
    fn stream(&self, sandbox: &str, mut session: Option<String>, mut first: Option<ureq::Response>) -> Result<i32> {
        let mut last_id: Option<String> = None;
        for _attempt in 0..5 {
            if let Some(resp) = first.take() {
                if let Some(code) = self.print_events(resp, &mut session, &mut last_id)? {
                    return Ok(code);
                }
                continue;
            }
            let Some(session) = &session else {
                bail!("the output stream ended before it named its session");
            };
            let path = format!("/v1/sandboxes/{sandbox}/sessions/{session}/stream");
            let mut req = self
                .agent
                .get(&format!("{}{}", self.base, path))
                .set("Authorization", &format!("Bearer {}", self.key));
            if let Some(id) = &last_id {
                req = req.set("Last-Event-ID", id);
            }
            let resp = match req.call() {
                Ok(r) => r,
                Err(ureq::Error::Status(code, r)) => {
                    let body: Value = r.into_json().unwrap_or(Value::Null);
                    bail!("{} (HTTP {code})", body["message"].as_str().unwrap_or("stream failed"));
                }
                Err(e) => return Err(anyhow!("stream: {e}")),
            };
            if let Some(code) = self.print_events(resp, &mut None, &mut last_id)? {
                return Ok(code);
            }
            // The connection dropped before the exit: resume after the last event seen.
        }
        bail!("the output stream kept dropping")
    }

    /// Print an event stream's output until the process exits (its exit code) or the stream
    /// ends early (`None`). A `session` event names the session.
    fn print_events(
        &self,
        resp: ureq::Response,
        session: &mut Option<String>,
        last_id: &mut Option<String>,
    ) -> Result<Option<i32>> {
        let reader = std::io::BufReader::new(resp.into_reader());
        let (mut event, mut data, mut id) = (String::new(), String::new(), None::<String>);
        for line in reader.lines() {
            let Ok(line) = line else { break };
            if line.is_empty() {
                if let Some(i) = id.take() {
                    *last_id = Some(i);
                }
                let payload: Value = serde_json::from_str(&data).unwrap_or(Value::Null);
                match event.as_str() {
                    "stdout" | "stderr" => {
                        let bytes = base64::engine::general_purpose::STANDARD
                            .decode(payload["data"].as_str().unwrap_or(""))
                            .unwrap_or_default();
                        if event == "stdout" {
                            std::io::stdout().write_all(&bytes)?;
                            std::io::stdout().flush()?;
                        } else {
                            std::io::stderr().write_all(&bytes)?;
                        }
                    }
                    "session" => *session = payload["id"].as_str().map(String::from),
                    "process_exited" => {
                        return Ok(Some(
                            match (payload["exit_code"].as_i64(), payload["signal"].as_str()) {
                                (Some(c), _) => c as i32,
                                (None, Some(sig)) => {
                                    eprintln!("airlock: process terminated by {sig}");
                                    128 + super::signal_number(sig)
                                }
                                _ => 1,
                            },
                        ));
                    }
                    "output_truncated" => {
                        eprintln!(
                            "airlock: {}",
                            payload["message"].as_str().unwrap_or("output was dropped")
                        )
                    }
                    "error" => bail!("{}", payload["message"].as_str().unwrap_or("stream error")),
                    _ => {}
                }
                event.clear();
                data.clear();
            } else if let Some(v) = line.strip_prefix("event:") {
                event = v.trim().to_string();
            } else if let Some(v) = line.strip_prefix("data:") {
                data.push_str(v.trim_start());
            } else if let Some(v) = line.strip_prefix("id:") {
                id = Some(v.trim().to_string());
            }
        }
        Ok(None)
    }

    pub fn create_sandbox(&self, body: Value, wait: bool) -> Result<String> {
        let r = self.json("POST", "/v1/sandboxes", Some(body))?;
        let id = r["sandbox_id"]
            .as_str()
            .ok_or_else(|| anyhow!("no sandbox_id in the answer"))?
            .to_string();
        if wait {
            self.wait_operation(r["operation"]["id"].as_str().unwrap_or_default())?;
        }
        Ok(id)
    }

    /// Run a command and stream its output, in one call (the session answered as its events).
    pub fn exec(&self, sandbox: &str, body: Value) -> Result<i32> {
        let path = format!("/v1/sandboxes/{sandbox}/sessions");
        let resp = self.call_accepting("POST", &path, Some(body), "text/event-stream")?;
        self.stream(sandbox, None, Some(resp))
    }

    pub fn delete_sandbox(&self, id: &str, wait: bool) -> Result<()> {
        let r = self.json("DELETE", &format!("/v1/sandboxes/{id}"), None)?;
        if wait {
            self.wait_operation(r["operation"]["id"].as_str().unwrap_or_default())?;
        }
        Ok(())
    }
}

pub fn session_body(
    argv: &[String],
    user: Option<&str>,
    cwd: Option<&str>,
    env: &[String],
    timeout: Option<&str>,
) -> Result<Value> {
    let mut envs = serde_json::Map::new();
    for kv in env {
        let (k, v) = kv
            .split_once('=')
            .ok_or_else(|| anyhow!("--env takes KEY=VALUE, got {kv:?}"))?;
        envs.insert(k.into(), json!(v));
    }
    let mut body = json!({ "argv": argv, "env": envs });
    if let Some(u) = user {
        body["user"] = json!(u);
    }
    if let Some(c) = cwd {
        body["cwd"] = json!(c);
    }
    if let Some(t) = timeout {
        body["timeout"] = json!(t);
    }
    Ok(body)
}
