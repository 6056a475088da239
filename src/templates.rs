//! `airlock template build -f Dockerfile -t name:tag DIR`, `ls`, `rm`, `logs`: a tenant's own
//! templates through the API (the build runs on the server, in a microVM). The context DIR is
//! packed as a tar (`.git` left out), uploaded once, and named by the build.

use crate::client::Client;
use anyhow::{anyhow, bail, Context, Result};
use serde_json::{json, Value};
use std::io::BufRead;
use std::path::Path;

/// Pack `dir` as a tar (symlinks kept as links, `.git` left out).
fn pack(dir: &Path) -> Result<Vec<u8>> {
    let mut tar = tar::Builder::new(Vec::new());
    tar.follow_symlinks(false);
    for entry in std::fs::read_dir(dir).with_context(|| format!("reading the context {}", dir.display()))? {
        let entry = entry?;
        let name = entry.file_name();
        if name == ".git" {
            continue;
        }
        let path = entry.path();
        if entry.file_type()?.is_dir() {
            tar.append_dir_all(&name, &path)
        } else {
            tar.append_path_with_name(&path, &name)
        }
        .with_context(|| format!("packing {}", path.display()))?;
    }
    Ok(tar.into_inner()?)
}

/// Build `tag` (`name[:tag]`) from `dockerfile` with context `dir`; prints the build's log as it
/// runs and its template at the end. An error when the build fails (its step and message).
pub fn build(c: &Client, dockerfile: &Path, dir: &Path, tag: &str, no_cache: bool) -> Result<()> {
    let text = std::fs::read_to_string(dockerfile).with_context(|| format!("reading {}", dockerfile.display()))?;
    let needs_context = text.lines().any(|l| {
        let w = l.trim_start().to_ascii_uppercase();
        w.starts_with("COPY ") || w.starts_with("ADD ")
    });
    let context = match needs_context {
        true => {
            let tar = pack(dir)?;
            eprintln!(
                "airlock: uploading the context {} ({} KiB)",
                dir.display(),
                tar.len() >> 10
            );
            let up = c.upload("/v1/templates/contexts", tar)?;
            Some(up["hash"].as_str().unwrap_or_default().to_string())
        }
        false => None,
    };
    let build = c.json(
        "POST",
        "/v1/templates",
        Some(json!({ "name": tag, "dockerfile": text, "context": context, "force": no_cache })),
    )?;
    let id = build["id"]
        .as_str()
        .ok_or_else(|| anyhow!("no build id in the answer"))?;
    eprintln!("airlock: build {id} of {tag}");
    let end = follow(c, id)?;
    match end["status"].as_str() {
        Some("ready") => {
            println!("{tag} {}", end["digest"].as_str().unwrap_or(""));
            Ok(())
        }
        _ => bail!(
            "the build failed at step {}: {}",
            end["error"]["step"].as_str().unwrap_or("?"),
            end["error"]["message"].as_str().unwrap_or("unknown error")
        ),
    }
}

/// Print build `id`'s log until it ends (the SSE stream); returns the build as it ended.
pub fn follow(c: &Client, id: &str) -> Result<Value> {
    let resp = c.stream_get(&format!("/v1/builds/{id}/logs"))?;
    let mut event = String::new();
    for line in std::io::BufReader::new(resp.into_reader()).lines() {
        let line = line?;
        if let Some(e) = line.strip_prefix("event:") {
            event = e.trim().to_string();
        } else if let Some(d) = line.strip_prefix("data:") {
            let v: Value = serde_json::from_str(d.trim()).unwrap_or(Value::Null);
            if event == "end" {
                return Ok(v);
            }
            let step = v["step"].as_str().unwrap_or("");
            let message = v["message"].as_str().unwrap_or("");
            match v["level"].as_str() {
                Some("debug") => {}
                _ => eprintln!("[{step:>8}] {message}"),
            }
        }
    }
    // The stream broke off: the build as it is now.
    c.json("GET", &format!("/v1/builds/{id}"), None)
}

/// The server's templates and the caller's own.
pub fn list(c: &Client) -> Result<()> {
    let list = c.json("GET", "/v1/templates", None)?;
    println!("{:<32} {:<12} {:<73} {:>9}  BUILT", "NAME", "TAG", "DIGEST", "SIZE");
    for t in list["templates"].as_array().into_iter().flatten() {
        println!(
            "{:<32} {:<12} {:<73} {:>6}MiB  {}",
            t["name"].as_str().unwrap_or(""),
            t["tag"].as_str().unwrap_or("-"),
            t["digest"].as_str().unwrap_or(""),
            t["size_bytes"].as_u64().unwrap_or(0) >> 20,
            t["built_at"].as_str().unwrap_or("")
        );
    }
    Ok(())
}
