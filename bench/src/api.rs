//! A client of one server's `/v1` API for the benchmarks, and their statistics.

use serde_json::{json, Value};
use std::io::{BufRead, BufReader};
use std::time::{Duration, Instant};

pub fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

pub fn stats(v: &[f64], failures: usize) -> Value {
    if v.is_empty() {
        return json!({"n": 0, "failures": failures});
    }
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let pct = |p: f64| s[((s.len() as f64 - 1.0) * p).round() as usize];
    json!({"n": s.len(), "failures": failures, "p50_ms": pct(0.5), "p95_ms": pct(0.95), "p99_ms": pct(0.99),
           "min_ms": s[0], "max_ms": s[s.len() - 1], "samples_ms": v})
}

pub struct Api {
    pub url: String,
    pub auth: String,
    /// The platform account's token (`AIRLOCK_ADMIN_TOKEN`, else `airlock login`'s file): only
    /// it sees the warm pools (`/v1/admin/system`).
    pub admin_auth: Option<String>,
    pub disk_mib: u32,
}

impl Api {
    pub fn call(&self, method: &str, path: &str, body: Option<Value>) -> Result<Value, String> {
        let req = ureq::request(method, &format!("{}/v1{path}", self.url)).set("Authorization", &self.auth);
        let resp = match body {
            Some(b) => req.send_json(b),
            None => req.call(),
        };
        match resp {
            Ok(r) => Ok(r.into_json().unwrap_or(Value::Null)),
            Err(ureq::Error::Status(code, r)) => Err(format!(
                "{method} {path}: {code} {}",
                r.into_string().unwrap_or_default()
            )),
            Err(e) => Err(format!("{method} {path}: {e}")),
        }
    }

    /// Create a sandbox and wait until it runs; returns its id.
    pub fn create(&self, template: &str) -> Result<String, String> {
        let body = json!({"template": template, "timeout": "30m", "resources": {"disk_mib": self.disk_mib}});
        let accepted = self.call("POST", "/sandboxes", Some(body))?;
        let id = accepted["sandbox_id"].as_str().ok_or("no sandbox id")?.to_string();
        self.finished(&accepted)?;
        Ok(id)
    }

    /// Poll an accepted operation (every 5 ms) until it succeeds.
    pub fn finished(&self, accepted: &Value) -> Result<(), String> {
        let op = accepted["operation"]["id"].as_str().ok_or("no operation")?.to_string();
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let o = self.call("GET", &format!("/operations/{op}"), None)?;
            match o["state"].as_str() {
                Some("succeeded") => return Ok(()),
                Some("failed") => return Err(format!("{} failed: {o}", o["kind"])),
                _ if Instant::now() > deadline => return Err(format!("{} not done in 120 s", o["kind"])),
                _ => std::thread::sleep(Duration::from_millis(5)),
            }
        }
    }

    /// `POST /sandboxes/{id}/{change}` (suspend, resume) to its operation's end, in ms.
    pub fn change(&self, id: &str, change: &str) -> Result<f64, String> {
        let t = Instant::now();
        let accepted = self.call("POST", &format!("/sandboxes/{id}/{change}"), None)?;
        self.finished(&accepted)?;
        Ok(ms(t.elapsed()))
    }

    /// A fork of `count`: (ms to every child's operation done, ms to an echo answered in each,
    /// the children).
    pub fn fork(&self, id: &str, count: usize) -> Result<(f64, f64, Vec<String>), String> {
        let t = Instant::now();
        let forked = self.call(
            "POST",
            &format!("/sandboxes/{id}/fork"),
            Some(json!({"count": count, "timeout": "30m"})),
        )?;
        let children = forked["sandboxes"].as_array().cloned().unwrap_or_default();
        if children.len() != count {
            return Err(format!("fork made {} of {count}: {}", children.len(), forked["errors"]));
        }
        let ids: Vec<String> = children
            .iter()
            .filter_map(|c| c["sandbox_id"].as_str().map(String::from))
            .collect();
        for c in &children {
            self.finished(c)?;
        }
        let started = ms(t.elapsed());
        for child in &ids {
            self.exec(child, &["echo", "hi"], true)?;
        }
        Ok((started, ms(t.elapsed()), ids))
    }

    /// Run `argv` in a session and read its SSE stream until the first stdout event (`first`) or
    /// the exit: the session, then its stream (two calls).
    pub fn exec(&self, id: &str, argv: &[&str], until_stdout: bool) -> Result<(), String> {
        let s = self.call(
            "POST",
            &format!("/sandboxes/{id}/sessions"),
            Some(json!({"argv": argv})),
        )?;
        let sid = s["id"].as_str().ok_or("no session id")?;
        let resp = ureq::get(&format!("{}/v1/sandboxes/{id}/sessions/{sid}/stream", self.url))
            .set("Authorization", &self.auth)
            .call()
            .map_err(|e| format!("stream: {e}"))?;
        read_until(resp, argv, until_stdout)
    }

    /// The same in one call: the session's create answers with its event stream
    /// (`Accept: text/event-stream`).
    pub fn exec_one_call(&self, id: &str, argv: &[&str], until_stdout: bool) -> Result<(), String> {
        let resp = ureq::post(&format!("{}/v1/sandboxes/{id}/sessions", self.url))
            .set("Authorization", &self.auth)
            .set("Accept", "text/event-stream")
            .send_json(json!({"argv": argv}))
            .map_err(|e| format!("session: {e}"))?;
        read_until(resp, argv, until_stdout)
    }

    pub fn delete(&self, id: &str) {
        let _ = self.call("DELETE", &format!("/sandboxes/{id}"), None);
    }

    pub fn tti(&self, template: &str) -> Result<(f64, String), String> {
        let t = Instant::now();
        let id = self.create(template)?;
        self.exec_one_call(&id, &["echo", "hi"], true)?;
        Ok((ms(t.elapsed()), id))
    }
}

/// Read an SSE stream until its first `stdout` event (or `process_exited`).
fn read_until(resp: ureq::Response, argv: &[&str], until_stdout: bool) -> Result<(), String> {
    let want = if until_stdout {
        "event: stdout"
    } else {
        "event: process_exited"
    };
    for line in BufReader::new(resp.into_reader()).lines() {
        if line.map_err(|e| e.to_string())?.trim() == want {
            return Ok(());
        }
    }
    Err(format!("the stream of {argv:?} ended before `{want}`"))
}
