//! envd on the airlock listener: process and filesystem Connect RPC, `/files`, `/health`.
//! Everything here is a translation onto the guest agent client; no process or file logic.

use super::connect::{self, as_bytes, as_u64, field, RpcError};
use crate::api::AppState;
use crate::model::SandboxState;
use crate::store::{token_hash, SandboxRow};
use airlock_proto::frame::EventKind;
use airlock_proto::{FileKind, FileStat, ProcessInfo, ProcessSpec, ProcessState, WatchEventKind};
use airlock_runtime::AgentClient;
use axum::body::Body;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use bytes::Bytes;
use futures_util::{Stream, StreamExt};
use serde::Deserialize;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Polling watchers (`CreateWatcher` / `GetWatcherEvents` / `RemoveWatcher`).
#[derive(Default)]
pub struct Watchers {
    map: Mutex<HashMap<String, Watcher>>,
}

struct Watcher {
    sandbox_id: String,
    events: Arc<Mutex<Vec<Value>>>,
    task: tokio::task::JoinHandle<()>,
}

/// 502 the way E2B's proxy answers for a sandbox that is gone (the SDK maps it to "not running").
fn sandbox_gone(id: &str) -> Response {
    (
        StatusCode::BAD_GATEWAY,
        axum::Json(json!({ "sandboxId": id, "message": "The sandbox was not found", "code": 502 })),
    )
        .into_response()
}

fn header<'a>(h: &'a HeaderMap, name: &str) -> Option<&'a str> {
    h.get(name)
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
        .filter(|v| !v.is_empty())
}

/// The sandbox a request is for: `E2b-Sandbox-Id`, else the `X-Access-Token`. A token, when
/// sent, must be the sandbox's own.
async fn resolve(
    state: &AppState,
    h: &HeaderMap,
    allow_without_token: bool,
) -> Result<(SandboxRow, AgentClient), Response> {
    let token = header(h, "x-access-token");
    let row = match (header(h, "e2b-sandbox-id"), token) {
        (Some(id), _) => state.store.sandbox_by_id(id).await.ok().flatten(),
        (None, Some(t)) => state.store.sandbox_by_access_hash(&token_hash(t)).await.ok().flatten(),
        (None, None) => None,
    };
    let Some(row) = row.filter(|r| r.state == SandboxState::Running) else {
        return Err(sandbox_gone(header(h, "e2b-sandbox-id").unwrap_or("")));
    };
    let expected = state.store.access_hash(&row.id).await.ok().flatten();
    match (expected, token) {
        // A sandbox without a token never came through the E2B door: envd is closed to it.
        (None, _) => {
            return Err(RpcError::new(
                "unauthenticated",
                "this sandbox has no envd access token; connect to it through the E2B API first",
            )
            .into_response())
        }
        (Some(e), Some(t)) if e != token_hash(t) => {
            return Err(RpcError::new("unauthenticated", "X-Access-Token does not match the sandbox").into_response())
        }
        (Some(_), None) if !allow_without_token => {
            return Err(RpcError::new("unauthenticated", "X-Access-Token is required for this sandbox").into_response())
        }
        _ => {}
    }
    let Ok(sb) = state.runtime.get(&row.id) else {
        return Err(sandbox_gone(&row.id));
    };
    match sb.agent().await {
        Ok(agent) => Ok((row, agent)),
        Err(_) => Err(sandbox_gone(&row.id)),
    }
}

/// `Authorization: Basic base64("<user>:")`; the default user is `user`.
fn rpc_user(h: &HeaderMap) -> String {
    header(h, "authorization")
        .and_then(|v| v.strip_prefix("Basic ").or_else(|| v.strip_prefix("basic ")))
        .and_then(|b| base64::engine::general_purpose::STANDARD.decode(b.trim()).ok())
        .and_then(|raw| String::from_utf8(raw).ok())
        .map(|s| s.split(':').next().unwrap_or("").to_string())
        .filter(|u| !u.is_empty())
        .unwrap_or_else(|| "user".into())
}

fn home_of(user: &str) -> String {
    if user == "root" {
        "/root".into()
    } else {
        format!("/home/{user}")
    }
}

/// Relative paths resolve against the user's home, as envd does.
fn abs_path(path: &str, user: &str) -> String {
    if path.starts_with('/') {
        path.to_string()
    } else if path.is_empty() || path == "~" {
        home_of(user)
    } else {
        format!("{}/{}", home_of(user), path.trim_start_matches("~/"))
    }
}

fn permissions(kind: FileKind, mode: u32) -> String {
    let t = match kind {
        FileKind::Dir => 'd',
        FileKind::Symlink => 'l',
        _ => '-',
    };
    let mut s = String::from(t);
    for shift in [6, 3, 0] {
        let bits = (mode >> shift) & 7;
        s.push(if bits & 4 != 0 { 'r' } else { '-' });
        s.push(if bits & 2 != 0 { 'w' } else { '-' });
        s.push(if bits & 1 != 0 { 'x' } else { '-' });
    }
    s
}

fn entry_info(s: &FileStat) -> Value {
    let ty = match s.kind {
        FileKind::Dir => "FILE_TYPE_DIRECTORY",
        FileKind::File | FileKind::Symlink => "FILE_TYPE_FILE",
        FileKind::Other => "FILE_TYPE_UNSPECIFIED",
    };
    let mut v = json!({
        "name": s.name,
        "type": ty,
        "path": s.path,
        "size": s.size.to_string(),
        "mode": s.mode,
        "permissions": permissions(s.kind, s.mode),
        "owner": s.owner,
        "group": s.group,
        "modifiedTime": crate::store::rfc3339(s.modified_ms as i64).replace(".000Z", "Z"),
    });
    if let Some(t) = &s.symlink_target {
        v["symlinkTarget"] = json!(t);
    }
    v
}

fn ok(v: Value) -> Response {
    (
        StatusCode::OK,
        [("content-type", "application/json")],
        serde_json::to_vec(&v).expect("json"),
    )
        .into_response()
}

fn rpc_result(r: Result<Value, RpcError>) -> Response {
    match r {
        Ok(v) => ok(v),
        Err(e) => e.into_response(),
    }
}

fn stream_response(s: impl Stream<Item = Bytes> + Send + 'static) -> Response {
    Response::builder()
        .status(StatusCode::OK)
        .header("content-type", "application/connect+json")
        .body(Body::from_stream(s.map(Ok::<_, std::io::Error>)))
        .expect("valid response")
}

/// Keepalive period from `Keepalive-Ping-Interval` (seconds), as envd reads it.
fn keepalive_every(h: &HeaderMap) -> Duration {
    let secs = header(h, "keepalive-ping-interval")
        .and_then(|v| v.parse::<u64>().ok())
        .filter(|s| *s > 0)
        .unwrap_or(50);
    Duration::from_secs(secs.min(3600))
}

/// The `pty.size` of a Start or Update request (80x24 where a side is missing).
fn pty_size(req: &Value) -> Option<airlock_proto::PtySize> {
    let size = field(req, "pty", "pty")?.get("size")?;
    let side = |key: &str, default: u64| as_u64(size.get(key)).unwrap_or(default).clamp(1, u16::MAX as u64) as u16;
    Some(airlock_proto::PtySize {
        cols: side("cols", 80),
        rows: side("rows", 24),
    })
}

/// When a stream must end: `connect-timeout-ms` less a margin, so our `deadline_exceeded`
/// reaches the client before its own read timeout (set to the same value) fires.
fn stream_deadline(h: &HeaderMap) -> Option<tokio::time::Instant> {
    let ms = header(h, "connect-timeout-ms")
        .and_then(|v| v.parse::<u64>().ok())
        .filter(|t| *t > 0)?;
    let margin = (ms / 10).min(500);
    Some(tokio::time::Instant::now() + Duration::from_millis(ms - margin))
}

/// Find a process by selector `{pid}` or `{tag}`; the newest wins when a pid was reused.
async fn select(agent: &AgentClient, selector: Option<&Value>) -> Result<ProcessInfo, RpcError> {
    let sel = selector.ok_or_else(|| RpcError::invalid("process selector is required"))?;
    let procs = agent.processes().await?;
    let found = if let Some(pid) = as_u64(sel.get("pid")) {
        procs.into_iter().filter(|p| p.pid as u64 == pid).max_by_key(|p| p.id)
    } else if let Some(tag) = sel.get("tag").and_then(Value::as_str) {
        procs
            .into_iter()
            .filter(|p| p.tag.as_deref() == Some(tag))
            .max_by_key(|p| p.id)
    } else {
        return Err(RpcError::invalid("process selector needs pid or tag"));
    };
    found.ok_or_else(|| RpcError::not_found("process not found"))
}

fn end_event(exit: &airlock_proto::ExitStatus) -> Value {
    match (exit.exit_code, exit.signal) {
        (Some(code), _) => {
            let mut end = json!({ "exitCode": code, "exited": true, "status": format!("exit status {code}") });
            if code != 0 {
                end["error"] = json!(format!("exit status {code}"));
            }
            json!({ "event": { "end": end } })
        }
        (None, sig) => {
            let name = match sig {
                Some(9) => "killed".to_string(),
                Some(15) => "terminated".to_string(),
                Some(2) => "interrupt".to_string(),
                Some(n) => format!("signal {n}"),
                None => "unknown".into(),
            };
            let status = format!("signal: {name}");
            json!({ "event": { "end": { "exitCode": -1, "exited": false, "status": status, "error": status } } })
        }
    }
}

/// Stream a process's events as `StartResponse`/`ConnectResponse` messages: `start` first,
/// then output, keepalives while idle, `end`, and the end-of-stream envelope.
/// `deadline` (from `connect-timeout-ms`) ends the stream with `deadline_exceeded` a little
/// before the client's own read timeout fires; with `kill_at_deadline` (Start) the process is
/// killed then too, as envd bounds a started process's life by that deadline.
fn process_stream(
    agent: AgentClient,
    info: ProcessInfo,
    keepalive: Duration,
    deadline: Option<tokio::time::Instant>,
    kill_at_deadline: bool,
) -> impl Stream<Item = Bytes> + Send + 'static {
    let start = connect::message(&json!({ "event": { "start": { "pid": info.pid } } }));
    let pty = info.pty;
    let rest = async_stream(move |tx| async move {
        let events = match agent.events(info.id, 0).await {
            Ok(e) => e,
            Err(e) => {
                let _ = tx.send(connect::end_of_stream(Some(&RpcError::from(e)))).await;
                return;
            }
        };
        let mut events = Box::pin(events);
        loop {
            let now = tokio::time::Instant::now();
            let wait = match deadline {
                Some(d) if d <= now => {
                    if kill_at_deadline {
                        let _ = agent.signal(info.id, 9).await;
                    }
                    let err = RpcError::new("deadline_exceeded", "the command ran past its timeout and was killed");
                    let _ = tx.send(connect::end_of_stream(Some(&err))).await;
                    return;
                }
                Some(d) => keepalive.min(d - now),
                None => keepalive,
            };
            let next = tokio::time::timeout(wait, events.next()).await;
            let ev = match next {
                Err(_) => {
                    if deadline.is_some_and(|d| d <= tokio::time::Instant::now()) {
                        continue;
                    }
                    if tx
                        .send(connect::message(&json!({ "event": { "keepalive": {} } })))
                        .await
                        .is_err()
                    {
                        return;
                    }
                    continue;
                }
                Ok(None) => break,
                Ok(Some(Err(e))) => {
                    let _ = tx.send(connect::end_of_stream(Some(&RpcError::from(e)))).await;
                    return;
                }
                Ok(Some(Ok(ev))) => ev,
            };
            let b64 = |d: &[u8]| base64::engine::general_purpose::STANDARD.encode(d);
            let msg = match ev.kind {
                EventKind::Stdout(d) if pty => json!({ "event": { "data": { "pty": b64(&d) } } }),
                EventKind::Stdout(d) => json!({ "event": { "data": { "stdout": b64(&d) } } }),
                EventKind::Stderr(d) => json!({ "event": { "data": { "stderr": b64(&d) } } }),
                EventKind::Exit(exit) => end_event(&exit),
            };
            if tx.send(connect::message(&msg)).await.is_err() {
                return; // the client went away; the process keeps running
            }
        }
        let _ = tx.send(connect::end_of_stream(None)).await;
    });
    futures_util::stream::once(async move { start }).chain(rest)
}

/// A stream fed by a task through a small channel (backpressure from the HTTP body).
fn async_stream<F, Fut>(f: F) -> impl Stream<Item = Bytes> + Send + 'static
where
    F: FnOnce(tokio::sync::mpsc::Sender<Bytes>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let (tx, rx) = tokio::sync::mpsc::channel(16);
    tokio::spawn(f(tx));
    tokio_stream::wrappers::ReceiverStream::new(rx)
}

/// What every RPC needs: its sandbox and agent, the calling user, and the request message.
async fn rpc_call(
    state: &AppState,
    headers: &HeaderMap,
    body: &[u8],
    streaming: bool,
) -> Result<(SandboxRow, AgentClient, String, Value), Response> {
    let (row, agent) = resolve(state, headers, false).await?;
    let req = if streaming {
        connect::stream_request(body)
    } else {
        connect::unary_request(body)
    };
    let req = req.map_err(IntoResponse::into_response)?;
    Ok((row, agent, rpc_user(headers), req))
}

pub async fn process_rpc(
    State(state): State<AppState>,
    Path(method): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let streaming = matches!(method.as_str(), "Start" | "Connect");
    let (row, agent, user, req) = match rpc_call(&state, &headers, &body, streaming).await {
        Ok(x) => x,
        Err(r) => return r,
    };
    match method.as_str() {
        "Start" => {
            let p = field(&req, "process", "process").cloned().unwrap_or(json!({}));
            let cmd = p.get("cmd").and_then(Value::as_str).unwrap_or("").to_string();
            if cmd.is_empty() {
                return RpcError::invalid("process.cmd is required").into_response();
            }
            let mut argv = vec![cmd];
            argv.extend(
                p.get("args")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                    .filter_map(|a| a.as_str().map(String::from)),
            );
            let mut env = row.env.clone();
            if let Some(envs) = p.get("envs").and_then(Value::as_object) {
                env.extend(
                    envs.iter()
                        .filter_map(|(k, v)| v.as_str().map(|v| (k.clone(), v.to_string()))),
                );
            }
            let pty = pty_size(&req);
            // envd bounds the process's life by the stream's deadline.
            let timeout_ms = header(&headers, "connect-timeout-ms")
                .and_then(|v| v.parse::<u64>().ok())
                .filter(|t| *t > 0);
            let spec = ProcessSpec {
                argv,
                cwd: p.get("cwd").and_then(Value::as_str).map(|c| abs_path(c, &user)),
                env,
                user: Some(user),
                timeout_ms,
                stdin: field(&req, "stdin", "stdin").and_then(Value::as_bool).unwrap_or(true),
                pty,
                tag: field(&req, "tag", "tag").and_then(Value::as_str).map(String::from),
            };
            match agent.spawn(&spec).await {
                Ok(info) => stream_response(process_stream(
                    agent,
                    info,
                    keepalive_every(&headers),
                    stream_deadline(&headers),
                    true,
                )),
                Err(e) => RpcError::from(e).into_response(),
            }
        }
        "Connect" => match select(&agent, field(&req, "process", "process")).await {
            Ok(info) => stream_response(process_stream(
                agent,
                info,
                keepalive_every(&headers),
                stream_deadline(&headers),
                false,
            )),
            Err(e) => e.into_response(),
        },
        "List" => rpc_result(
            async {
                let procs = agent.processes().await?;
                let list: Vec<Value> = procs
                    .into_iter()
                    .filter(|p| p.state == ProcessState::Running)
                    .map(|p| {
                        let mut v = json!({ "config": { "cmd": p.argv.first().cloned().unwrap_or_default(),
                        "args": p.argv.iter().skip(1).collect::<Vec<_>>(), "envs": {}, "cwd": p.cwd }, "pid": p.pid });
                        if let Some(t) = p.tag {
                            v["tag"] = json!(t);
                        }
                        v
                    })
                    .collect();
                Ok(json!({ "processes": list }))
            }
            .await,
        ),
        "SendInput" => rpc_result(
            async {
                let p = select(&agent, field(&req, "process", "process")).await?;
                let input = field(&req, "input", "input").cloned().unwrap_or(json!({}));
                let data = as_bytes(input.get("stdin").or_else(|| input.get("pty")))?;
                agent.write_stdin(p.id, data).await?;
                Ok(json!({}))
            }
            .await,
        ),
        "SendSignal" => rpc_result(
            async {
                let p = select(&agent, field(&req, "process", "process")).await?;
                let sig = match field(&req, "signal", "signal") {
                    Some(Value::String(s)) if s == "SIGNAL_SIGKILL" => 9,
                    Some(Value::String(s)) if s == "SIGNAL_SIGTERM" => 15,
                    Some(Value::Number(n)) if n.as_i64() == Some(9) || n.as_i64() == Some(15) => {
                        n.as_i64().unwrap_or(9) as i32
                    }
                    other => return Err(RpcError::invalid(format!("unsupported signal {other:?}"))),
                };
                if p.state == ProcessState::Exited {
                    return Err(RpcError::not_found("process has already exited"));
                }
                agent.signal(p.id, sig).await?;
                Ok(json!({}))
            }
            .await,
        ),
        "Update" => rpc_result(
            async {
                let p = select(&agent, field(&req, "process", "process")).await?;
                if let Some(size) = pty_size(&req) {
                    agent.resize(p.id, size).await?;
                }
                Ok(json!({}))
            }
            .await,
        ),
        "CloseStdin" => rpc_result(
            async {
                let p = select(&agent, field(&req, "process", "process")).await?;
                agent.close_stdin(p.id).await?;
                Ok(json!({}))
            }
            .await,
        ),
        other => RpcError::new("unimplemented", format!("process.Process/{other} is not supported")).into_response(),
    }
}

fn watch_event(kind: WatchEventKind, path: &str, root: &str) -> Value {
    let ty = match kind {
        WatchEventKind::Create => "EVENT_TYPE_CREATE",
        WatchEventKind::Write => "EVENT_TYPE_WRITE",
        WatchEventKind::Remove => "EVENT_TYPE_REMOVE",
        WatchEventKind::Rename => "EVENT_TYPE_RENAME",
        WatchEventKind::Chmod => "EVENT_TYPE_CHMOD",
    };
    let name = path.strip_prefix(root).unwrap_or(path).trim_start_matches('/');
    json!({ "name": name, "type": ty })
}

pub async fn filesystem_rpc(
    State(state): State<AppState>,
    Path(method): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let streaming = method == "WatchDir";
    let (row, agent, user, req) = match rpc_call(&state, &headers, &body, streaming).await {
        Ok(x) => x,
        Err(r) => return r,
    };
    let path = || abs_path(req.get("path").and_then(Value::as_str).unwrap_or(""), &user);
    match method.as_str() {
        "Stat" => rpc_result(async { Ok(json!({ "entry": entry_info(&agent.stat(&path()).await?) })) }.await),
        "MakeDir" => rpc_result(
            async {
                let made = agent.mkdir(&path(), Some(&user)).await?;
                if !made.created {
                    return Err(RpcError::new("already_exists", format!("{} already exists", path())));
                }
                Ok(json!({ "entry": entry_info(&made.stat) }))
            }
            .await,
        ),
        "Move" => rpc_result(
            async {
                let src = abs_path(
                    field(&req, "source", "source").and_then(Value::as_str).unwrap_or(""),
                    &user,
                );
                let dst = abs_path(
                    field(&req, "destination", "destination")
                        .and_then(Value::as_str)
                        .unwrap_or(""),
                    &user,
                );
                Ok(json!({ "entry": entry_info(&agent.rename(&src, &dst).await?) }))
            }
            .await,
        ),
        "ListDir" => rpc_result(
            async {
                let depth = as_u64(req.get("depth")).unwrap_or(1).clamp(1, 32) as u32;
                let entries: Vec<Value> = agent.list(&path(), depth).await?.iter().map(entry_info).collect();
                Ok(json!({ "entries": entries }))
            }
            .await,
        ),
        "Remove" => rpc_result(
            async {
                agent.remove(&path()).await?;
                Ok(json!({}))
            }
            .await,
        ),
        "WatchDir" => {
            let root = path();
            let recursive = req.get("recursive").and_then(Value::as_bool).unwrap_or(false);
            let events = match agent.watch(&root, recursive).await {
                Ok(e) => e,
                Err(e) => return RpcError::from(e).into_response(),
            };
            let keepalive = keepalive_every(&headers);
            let body = async_stream(move |tx| async move {
                if tx.send(connect::message(&json!({ "start": {} }))).await.is_err() {
                    return;
                }
                let mut events = Box::pin(events);
                loop {
                    match tokio::time::timeout(keepalive, events.next()).await {
                        Err(_) => {
                            if tx.send(connect::message(&json!({ "keepalive": {} }))).await.is_err() {
                                return;
                            }
                        }
                        Ok(Some(Ok(ev))) => {
                            let msg = json!({ "filesystem": watch_event(ev.kind, &ev.path, &root) });
                            if tx.send(connect::message(&msg)).await.is_err() {
                                return;
                            }
                        }
                        Ok(Some(Err(e))) => {
                            let _ = tx.send(connect::end_of_stream(Some(&RpcError::from(e)))).await;
                            return;
                        }
                        Ok(None) => break,
                    }
                }
                let _ = tx.send(connect::end_of_stream(None)).await;
            });
            stream_response(body)
        }
        "CreateWatcher" => rpc_result(
            async {
                let root = path();
                let recursive = req.get("recursive").and_then(Value::as_bool).unwrap_or(false);
                let events = agent.watch(&root, recursive).await?;
                let buf = Arc::new(Mutex::new(Vec::new()));
                let sink = buf.clone();
                let task = tokio::spawn(async move {
                    let mut events = Box::pin(events);
                    while let Some(Ok(ev)) = events.next().await {
                        sink.lock().unwrap().push(watch_event(ev.kind, &ev.path, &root));
                    }
                });
                let id = format!("w{}", airlock_runtime::datadir::random_hex(8));
                state.watchers.map.lock().unwrap().insert(
                    id.clone(),
                    Watcher {
                        sandbox_id: row.id.clone(),
                        events: buf,
                        task,
                    },
                );
                Ok(json!({ "watcherId": id }))
            }
            .await,
        ),
        "GetWatcherEvents" | "RemoveWatcher" => rpc_result(
            async {
                let id = field(&req, "watcherId", "watcher_id")
                    .and_then(Value::as_str)
                    .unwrap_or("")
                    .to_string();
                let mut map = state.watchers.map.lock().unwrap();
                let w = map
                    .get(&id)
                    .filter(|w| w.sandbox_id == row.id)
                    .ok_or_else(|| RpcError::not_found(format!("watcher {id:?} not found")))?;
                if method == "RemoveWatcher" {
                    w.task.abort();
                    map.remove(&id);
                    return Ok(json!({}));
                }
                let events: Vec<Value> = std::mem::take(&mut *w.events.lock().unwrap());
                Ok(json!({ "events": events }))
            }
            .await,
        ),
        other => RpcError::new(
            "unimplemented",
            format!("filesystem.Filesystem/{other} is not supported"),
        )
        .into_response(),
    }
}

pub async fn health(State(state): State<AppState>, headers: HeaderMap) -> Response {
    match resolve(&state, &headers, true).await {
        Ok(_) => StatusCode::NO_CONTENT.into_response(),
        Err(r) => r,
    }
}

#[derive(Debug, Deserialize)]
pub struct FilesQuery {
    pub path: Option<String>,
    pub username: Option<String>,
    pub signature: Option<String>,
    pub signature_expiration: Option<i64>,
}

fn files_error(status: StatusCode, message: impl Into<String>) -> Response {
    (
        status,
        axum::Json(json!({ "code": status.as_u16(), "message": message.into() })),
    )
        .into_response()
}

fn agent_files_error(e: airlock_runtime::agent::AgentError) -> Response {
    let status = match e.code() {
        Some(airlock_proto::ErrorCode::NotFound) => StatusCode::NOT_FOUND,
        Some(airlock_proto::ErrorCode::Internal) => StatusCode::INTERNAL_SERVER_ERROR,
        Some(airlock_proto::ErrorCode::PermissionDenied) => StatusCode::UNAUTHORIZED,
        Some(_) => StatusCode::BAD_REQUEST,
        None => StatusCode::BAD_GATEWAY,
    };
    files_error(status, e.to_string())
}

/// `v1_` + unpadded base64 of sha256(`path:op:user:token[:exp]`), as the SDK signs URLs.
pub fn signature(path: &str, op: &str, user: &str, token: &str, exp: Option<i64>) -> String {
    use sha2::Digest;
    let mut s = format!("{path}:{op}:{user}:{token}");
    if let Some(e) = exp {
        s.push_str(&format!(":{e}"));
    }
    format!(
        "v1_{}",
        base64::engine::general_purpose::STANDARD_NO_PAD.encode(sha2::Sha256::digest(s.as_bytes()))
    )
}

/// `/files` needs the access token (signed URLs are refused for now, see below).
async fn files_target(
    state: &AppState,
    h: &HeaderMap,
    q: &FilesQuery,
    op: &str,
) -> Result<(SandboxRow, AgentClient), Response> {
    let signed = q.signature.is_some() && header(h, "x-access-token").is_none();
    let (row, agent) = resolve(state, h, signed).await?;
    if signed {
        // TODO(store): the store keeps only the access token's hash and a signature is a hash
        // over the plain token (see `signature`), so it cannot be checked until the token can be
        // re-derived (e.g. from a server secret). Refused until then.
        let _ = op;
        return Err(files_error(
            StatusCode::UNAUTHORIZED,
            "signed URLs are not supported by this server; send X-Access-Token",
        ));
    }
    Ok((row, agent))
}

pub async fn files_get(State(state): State<AppState>, headers: HeaderMap, Query(q): Query<FilesQuery>) -> Response {
    let (_row, agent) = match files_target(&state, &headers, &q, "read").await {
        Ok(x) => x,
        Err(r) => return r,
    };
    let user = q.username.clone().unwrap_or_else(|| "user".into());
    let Some(path) = q.path.as_deref().map(|p| abs_path(p, &user)) else {
        return files_error(StatusCode::BAD_REQUEST, "query parameter `path` is required");
    };
    match agent.read_file_stream(&path).await {
        Ok(s) => Response::builder()
            .status(StatusCode::OK)
            .header("content-type", "application/octet-stream")
            .body(Body::from_stream(s.map(|r| r.map_err(std::io::Error::other))))
            .expect("valid response"),
        Err(e) => agent_files_error(e),
    }
}

pub async fn files_post(
    State(state): State<AppState>,
    headers: HeaderMap,
    Query(q): Query<FilesQuery>,
    req: axum::extract::Request,
) -> Response {
    let (_row, agent) = match files_target(&state, &headers, &q, "write").await {
        Ok(x) => x,
        Err(r) => return r,
    };
    let user = q.username.clone().unwrap_or_else(|| "user".into());
    // gzip was decoded by the route's layer; anything still encoded is a coding we lack.
    if let Some(coding) = header(&headers, "content-encoding").filter(|c| !c.eq_ignore_ascii_case("identity")) {
        return files_error(
            StatusCode::BAD_REQUEST,
            format!("Content-Encoding {coding:?} is not supported; send the bytes as they are or gzip them"),
        );
    }
    let content_type = header(&headers, "content-type").unwrap_or("").to_ascii_lowercase();
    let mut written = Vec::new();
    let info = |path: &str| json!({ "name": path.rsplit('/').next().unwrap_or(path), "type": "file", "path": path });
    if content_type.starts_with("multipart/form-data") {
        let mut mp = match axum::extract::Multipart::from_request(req, &()).await {
            Ok(m) => m,
            Err(e) => return files_error(StatusCode::BAD_REQUEST, format!("bad multipart body: {e}")),
        };
        loop {
            let field = match mp.next_field().await {
                Ok(Some(f)) => f,
                Ok(None) => break,
                Err(e) => return files_error(StatusCode::BAD_REQUEST, format!("bad multipart body: {e}")),
            };
            // One file: `?path=`; several: each part's filename is its destination.
            let dest = q
                .path
                .clone()
                .filter(|_| written.is_empty())
                .or_else(|| field.file_name().map(String::from));
            let Some(dest) = dest.map(|d| abs_path(&d, &user)) else {
                return files_error(
                    StatusCode::BAD_REQUEST,
                    "each file part needs a filename or the query needs `path`",
                );
            };
            let data = field.map(|r| r.map_err(std::io::Error::other));
            // Multipart fields borrow the body; collect each into memory-bounded chunks first.
            let chunks: Vec<Result<Bytes, std::io::Error>> = data.collect().await;
            if let Some(Err(e)) = chunks.iter().find(|c| c.is_err()) {
                return files_error(StatusCode::BAD_REQUEST, format!("upload interrupted: {e}"));
            }
            if let Err(e) = agent
                .write_file_stream(&dest, Some(&user), futures_util::stream::iter(chunks))
                .await
            {
                return agent_files_error(e);
            }
            written.push(info(&dest));
        }
    } else {
        let Some(dest) = q.path.as_deref().map(|p| abs_path(p, &user)) else {
            return files_error(StatusCode::BAD_REQUEST, "query parameter `path` is required");
        };
        // A body that breaks off (a corrupt gzip stream, a dropped client) is the upload's fault:
        // remember why, so the reply is a 400 naming it rather than a 502 about the agent. The
        // agent keeps the old file in that case.
        let body_error = Arc::new(std::sync::Mutex::new(None::<String>));
        let seen = body_error.clone();
        let data = req.into_body().into_data_stream().map(move |r| {
            r.map_err(|e| {
                *seen.lock().unwrap_or_else(|p| p.into_inner()) = Some(e.to_string());
                std::io::Error::other(e)
            })
        });
        if let Err(e) = agent.write_file_stream(&dest, Some(&user), data).await {
            if let Some(why) = body_error.lock().unwrap_or_else(|p| p.into_inner()).take() {
                return files_error(
                    StatusCode::BAD_REQUEST,
                    format!("could not read the upload body: {why}"),
                );
            }
            return agent_files_error(e);
        }
        written.push(info(&dest));
    }
    if written.is_empty() {
        return files_error(StatusCode::BAD_REQUEST, "no file in the upload");
    }
    (StatusCode::OK, axum::Json(Value::Array(written))).into_response()
}

use axum::extract::FromRequest as _;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_permissions_and_signatures() {
        assert_eq!(abs_path("a.txt", "user"), "/home/user/a.txt");
        assert_eq!(abs_path("/etc/x", "root"), "/etc/x");
        assert_eq!(abs_path("", "root"), "/root");
        assert_eq!(permissions(FileKind::Dir, 0o755), "drwxr-xr-x");
        assert_eq!(permissions(FileKind::File, 0o640), "-rw-r-----");
        let s = signature("/home/user/a", "read", "user", "tok", None);
        assert!(s.starts_with("v1_") && !s.ends_with('='));
        assert_ne!(s, signature("/home/user/a", "write", "user", "tok", None));
    }
}
