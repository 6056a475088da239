//! envd on the airlock listener: process and filesystem Connect RPC, `/files`, `/health`.
//! Everything here is a translation onto the core's sessions and files; no process or file logic.

use super::connect::{self, as_bytes, as_u64, field, RpcError};
use super::{E2bError, E2bState};
use crate::core::files::Files;
use crate::core::principal::SignedUrl;
use crate::core::sandboxes::MAX_TIMEOUT;
use crate::core::sessions::{parse_signal, signal_description, Running, Selector, SessionEvent, StartSession};
use crate::core::{Accept, CoreError, Credentials, Kind, Principal, Via};
use crate::records::SandboxRecord;
use airlock_proto::frame::EventKind;
use airlock_proto::{FileKind, FileStat, ProcessState, WatchEventKind};
use axum::body::Body;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use bytes::Bytes;
use futures_util::{Stream, StreamExt};
use serde::Deserialize;
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::Duration;

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

/// The running sandbox a request is for (`E2b-Sandbox-Id`, else the one whose `X-Access-Token`
/// it carries) and the principal that may use it. envd accepts only the sandbox's access token;
/// `no_token` lets signed `/files` URLs through to their own check.
async fn resolve(state: &E2bState, h: &HeaderMap, no_token: bool) -> Result<SandboxRecord, Response> {
    let id = header(h, "e2b-sandbox-id");
    // Never the traffic token: it opens the sandbox's ports, not its processes and files.
    let accept = Accept {
        owner_key: false,
        traffic_token: false,
        no_token,
    };
    let sandbox = match state
        .core
        .sandbox_principal(&Credentials::from_headers(h), id, accept)
        .await
    {
        // A signed URL's sandbox is settled after its signature is checked (`files_target`).
        Ok(Principal::Sandbox {
            sandbox,
            via: Via::Unverified,
        }) if state.core.settling(&sandbox.id) => return Ok(sandbox),
        Ok(Principal::Sandbox { sandbox, .. }) => sandbox,
        // A caller that proved nothing about the sandbox (no token, a wrong one, a sandbox never
        // opened to tokens) learns nothing either: exactly the answer for a missing one.
        Ok(Principal::Key { .. } | Principal::Federated { .. })
        | Err(CoreError::NotFound { .. } | CoreError::Unauthenticated(_)) => {
            return Err(sandbox_gone(id.unwrap_or("")))
        }
        Err(e) => return Err(RpcError::from(e).into_response()),
    };
    if !sandbox.answers_requests() {
        return Err(sandbox_gone(&sandbox.id));
    }
    Ok(sandbox)
}

/// The sandbox an envd request is for, resolved by [`require_sandbox`] before any body is read.
#[derive(Clone)]
pub struct EnvdSandbox(pub SandboxRecord);

/// Whether a `/files` request proves itself by a signed URL instead of a token.
fn signed_url(h: &HeaderMap, q: &FilesQuery) -> bool {
    q.signature.is_some() && header(h, "x-access-token").is_none()
}

/// Every envd route's gate, run before the handler and so before the body is read: the request
/// must resolve to a running sandbox (see [`resolve`]), or it is answered as for a missing one.
/// Only signed `/files` URLs need no token here (the signature is checked next, by the handler,
/// against the sandbox found here, and a bad one gets the same missing-sandbox answer).
/// `/health` needs the token like every other route (the SDK always sends it): answering it
/// without one would tell anyone which sandbox ids exist.
pub async fn require_sandbox(
    State(state): State<E2bState>,
    mut req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let signed = match req.uri().path() {
        "/files" => Query::<FilesQuery>::try_from_uri(req.uri())
            .ok()
            .map(|q| q.0)
            .filter(|q| signed_url(req.headers(), q)),
        _ => None,
    };
    let resolved = match &signed {
        // Nothing names the sandbox (a signed URL used under `E2B_SANDBOX_URL`): the signature
        // does; `files_target` then checks it as for any signed URL.
        Some(q) if header(req.headers(), "e2b-sandbox-id").is_none() => {
            let op = if req.method() == axum::http::Method::POST {
                "write"
            } else {
                "read"
            };
            match state.core.sandbox_by_signed_url(&q.signed(), op).await {
                Ok(sandbox) if sandbox.answers_requests() => Ok(sandbox),
                Ok(sandbox) => Err(sandbox_gone(&sandbox.id)),
                Err(CoreError::NotFound { .. }) => Err(sandbox_gone("")),
                Err(e) => Err(RpcError::from(e).into_response()),
            }
        }
        _ => resolve(&state, req.headers(), signed.is_some()).await,
    };
    match resolved {
        Ok(sandbox) => {
            req.extensions_mut().insert(EnvdSandbox(sandbox));
            next.run(req).await
        }
        Err(r) => r,
    }
}

/// An RPC body within [`crate::MAX_JSON_BODY`]; a larger one is a 413 in Connect's error shape.
// The error is the handler's finished answer, made at most once per request.
#[allow(clippy::result_large_err)]
fn rpc_body(body: Result<Bytes, axum::extract::rejection::BytesRejection>) -> Result<Bytes, Response> {
    body.map_err(|e| {
        let status = e.status();
        let code = if status == StatusCode::PAYLOAD_TOO_LARGE {
            "resource_exhausted"
        } else {
            "invalid_argument"
        };
        (status, axum::Json(RpcError::new(code, e.body_text()).json())).into_response()
    })
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

/// Go's `FileMode.String()` of the entry itself, which envd reports: a letter for each of
/// directory, symlink, setuid, setgid and sticky that applies (`-` for none), then `rwxrwxrwx`.
fn permissions(kind: FileKind, mode: u32) -> String {
    let mut s = String::new();
    for (set, c) in [
        (kind == FileKind::Dir, 'd'),
        (kind == FileKind::Symlink, 'L'),
        (mode & 0o4000 != 0, 'u'),
        (mode & 0o2000 != 0, 'g'),
        (mode & 0o1000 != 0, 't'),
    ] {
        if set {
            s.push(c);
        }
    }
    if s.is_empty() {
        s.push('-');
    }
    for shift in [6, 3, 0] {
        let bits = (mode >> shift) & 7;
        s.push(if bits & 4 != 0 { 'r' } else { '-' });
        s.push(if bits & 2 != 0 { 'w' } else { '-' });
        s.push(if bits & 1 != 0 { 'x' } else { '-' });
    }
    s
}

/// envd's `EntryInfo`. A symlink is described by what it resolves to (type and permission bits
/// of the target, unspecified when dangling), marked `isSymlink`, with `symlinkTarget` the
/// target fully resolved; its size, times, owner and `permissions` are the link's own. `mode`
/// is the permission bits only (Go's `FileMode.Perm()`).
fn entry_info(s: &FileStat) -> Value {
    let file_type = |kind: FileKind| match kind {
        FileKind::Dir => "FILE_TYPE_DIRECTORY",
        FileKind::File => "FILE_TYPE_FILE",
        FileKind::Symlink | FileKind::Other => "FILE_TYPE_UNSPECIFIED",
    };
    let (ty, mode) = match (s.kind, &s.link_target) {
        (FileKind::Symlink, Some(t)) => (file_type(t.kind), t.mode),
        (FileKind::Symlink, None) => ("FILE_TYPE_UNSPECIFIED", 0),
        (kind, _) => (file_type(kind), s.mode),
    };
    let mut v = json!({
        "name": s.name,
        "type": ty,
        "path": s.path,
        "size": s.size.to_string(),
        "mode": mode & 0o777,
        "permissions": permissions(s.kind, s.mode),
        "owner": s.owner,
        "group": s.group,
        "modifiedTime": crate::records::rfc3339(s.modified_ms as i64).replace(".000Z", "Z"),
    });
    if s.kind == FileKind::Symlink {
        v["isSymlink"] = json!(true);
        if let Some(t) = crate::core::files::resolved_link(s) {
            v["symlinkTarget"] = json!(t);
        }
    }
    if !s.metadata.is_empty() {
        v["metadata"] = json!(s.metadata);
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
    // A stream never outlives the longest sandbox: larger values (up to u64::MAX) are clamped
    // before any arithmetic, and the addition is checked all the same.
    let ms = header(h, "connect-timeout-ms")
        .and_then(|v| v.parse::<u64>().ok())
        .filter(|t| *t > 0)?
        .min(MAX_TIMEOUT.as_millis() as u64);
    let margin = (ms / 10).min(500);
    tokio::time::Instant::now().checked_add(Duration::from_millis(ms - margin))
}

/// A process selector `{pid}` or `{tag}`, as the core takes it.
fn selector(sel: Option<&Value>) -> Result<Selector, RpcError> {
    let sel = sel.ok_or_else(|| RpcError::invalid("process selector is required"))?;
    if let Some(pid) = as_u64(sel.get("pid")) {
        return u32::try_from(pid)
            .map(Selector::Pid)
            .map_err(|_| RpcError::invalid(format!("pid {pid} is out of range")));
    }
    match sel.get("tag").and_then(Value::as_str) {
        Some(tag) => Ok(Selector::Tag(tag.into())),
        None => Err(RpcError::invalid("process selector needs pid or tag")),
    }
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
            // Go's wording, which envd reports: `signal: killed`.
            let status = format!(
                "signal: {}",
                sig.map(signal_description).unwrap_or_else(|| "unknown".into())
            );
            json!({ "event": { "end": { "exitCode": -1, "exited": false, "status": status, "error": status } } })
        }
    }
}

/// How long a stream past its deadline waits for the exit of the process it killed.
const KILL_SETTLE: Duration = Duration::from_secs(2);

/// Stream a process's events as `StartResponse`/`ConnectResponse` messages: `start` first,
/// then output, keepalives while idle, `end`, and the end-of-stream envelope.
/// `deadline` (from `connect-timeout-ms`) ends the stream with `deadline_exceeded` a little
/// before the client's own read timeout fires; with `kill_at_deadline` (Start) the process is
/// killed then too, as envd bounds a started process's life by that deadline.
fn process_stream(
    state: E2bState,
    sandbox: SandboxRecord,
    run: Running,
    keepalive: Duration,
    deadline: Option<tokio::time::Instant>,
    kill_at_deadline: bool,
) -> impl Stream<Item = Bytes> + Send + 'static {
    let start = connect::message(&json!({ "event": { "start": { "pid": run.process.pid } } }));
    let pty = run.session.pty;
    let rest = async_stream(move |tx| async move {
        let session = run.session;
        let events = match state.core.session_events(&sandbox, session.clone(), 0).await {
            Ok(e) => e,
            Err(e) => {
                let _ = tx.send(connect::end_of_stream(Some(&RpcError::from(e)))).await;
                return;
            }
        };
        let mut events = events;
        loop {
            let now = tokio::time::Instant::now();
            let wait = match deadline {
                Some(d) if d <= now => {
                    if kill_at_deadline {
                        let _ = state.core.session_signal(&sandbox, &session, 9).await;
                        // Said only once true: the client may list processes at once, and the
                        // killed one must be gone by then (its exit, briefly awaited).
                        let exited = async {
                            while let Some(ev) = events.next().await {
                                if matches!(ev, Ok(SessionEvent::Event(ref e)) if matches!(e.kind, EventKind::Exit(_)))
                                {
                                    break;
                                }
                            }
                        };
                        let _ = tokio::time::timeout(KILL_SETTLE, exited).await;
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
                Ok(Some(Ok(SessionEvent::Event(ev)))) => ev,
                // envd's stream has no way to say output was dropped (and real envd replays
                // nothing at all): the reader gets what is still kept.
                Ok(Some(Ok(SessionEvent::Truncated { first, last }))) => {
                    tracing::debug!(sandbox = %sandbox.id, first, last, "output no longer kept");
                    continue;
                }
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

/// What every RPC needs besides its sandbox: the calling user and the request message.
// The error is the handler's finished answer, as for `rpc_body`.
#[allow(clippy::result_large_err)]
fn rpc_call(
    headers: &HeaderMap,
    body: Result<Bytes, axum::extract::rejection::BytesRejection>,
    streaming: bool,
) -> Result<(String, Value), Response> {
    let body = rpc_body(body)?;
    let body = &body[..];
    let req = if streaming {
        connect::stream_request(body)
    } else {
        connect::unary_request(body)
    };
    let req = req.map_err(IntoResponse::into_response)?;
    Ok((rpc_user(headers), req))
}

/// E2B's `ProcessInfo` of a session.
fn process_info(run: &Running) -> Value {
    let argv = &run.session.argv;
    json!({
        "config": {
            "cmd": argv.first().cloned().unwrap_or_default(),
            "args": argv.iter().skip(1).collect::<Vec<_>>(),
            "envs": {},
            "cwd": run.session.cwd,
        },
        "pid": run.process.pid,
        // Sessions started without a tag (e.g. through /v1) are known by their session id.
        "tag": run.session.tag.clone().unwrap_or_else(|| run.session.id.clone()),
    })
}

/// The `Start` request as the core's `StartSession`.
fn start_request(req: &Value, headers: &HeaderMap, user: &str) -> Result<StartSession, RpcError> {
    let p = field(req, "process", "process").cloned().unwrap_or(json!({}));
    let cmd = p.get("cmd").and_then(Value::as_str).unwrap_or("").to_string();
    if cmd.is_empty() {
        return Err(RpcError::invalid("process.cmd is required"));
    }
    let mut argv = vec![cmd];
    argv.extend(
        p.get("args")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .filter_map(|a| a.as_str().map(String::from)),
    );
    let env = p
        .get("envs")
        .and_then(Value::as_object)
        .into_iter()
        .flatten()
        .filter_map(|(k, v)| v.as_str().map(|v| (k.clone(), v.to_string())))
        .collect();
    // envd bounds the process's life by the stream's deadline.
    let timeout = header(headers, "connect-timeout-ms")
        .and_then(|v| v.parse::<u64>().ok())
        .filter(|t| *t > 0)
        .map(|ms| Duration::from_millis(ms).clamp(Duration::from_secs(1), MAX_TIMEOUT));
    Ok(StartSession {
        argv,
        cwd: p.get("cwd").and_then(Value::as_str).map(|c| abs_path(c, user)),
        env,
        user: Some(user.to_string()),
        timeout,
        stdin: field(req, "stdin", "stdin").and_then(Value::as_bool).unwrap_or(true),
        pty: pty_size(req),
        tag: field(req, "tag", "tag").and_then(Value::as_str).map(String::from),
    })
}

pub async fn process_rpc(
    State(state): State<E2bState>,
    Path(method): Path<String>,
    axum::Extension(EnvdSandbox(sandbox)): axum::Extension<EnvdSandbox>,
    headers: HeaderMap,
    body: Result<Bytes, axum::extract::rejection::BytesRejection>,
) -> Response {
    let streaming = matches!(method.as_str(), "Start" | "Connect");
    let (user, req) = match rpc_call(&headers, body, streaming) {
        Ok(x) => x,
        Err(r) => return r,
    };
    let core = &state.core;
    let find = || async {
        Ok::<_, RpcError>(
            core.find_session(&sandbox, &selector(field(&req, "process", "process"))?)
                .await?,
        )
    };
    match method.as_str() {
        "Start" => {
            let started = async {
                let start = start_request(&req, &headers, &user)?;
                // What the agent reported at the spawn: no second round trip for the pid.
                Ok::<_, RpcError>(core.start_session(&sandbox, start).await?)
            }
            .await;
            match started {
                Ok(run) => stream_response(process_stream(
                    state.clone(),
                    sandbox,
                    run,
                    keepalive_every(&headers),
                    stream_deadline(&headers),
                    true,
                )),
                Err(e) => e.into_response(),
            }
        }
        "Connect" => match find().await {
            Ok(run) => stream_response(process_stream(
                state.clone(),
                sandbox,
                run,
                keepalive_every(&headers),
                stream_deadline(&headers),
                false,
            )),
            Err(e) => e.into_response(),
        },
        "List" => rpc_result(
            async {
                let list: Vec<Value> = core
                    .running_sessions(&sandbox)
                    .await?
                    .iter()
                    .map(process_info)
                    .collect();
                Ok(json!({ "processes": list }))
            }
            .await,
        ),
        "SendInput" => rpc_result(
            async {
                let run = find().await?;
                let input = field(&req, "input", "input").cloned().unwrap_or(json!({}));
                let data = as_bytes(input.get("stdin").or_else(|| input.get("pty")))?;
                core.session_stdin(&sandbox, &run.session, data, false).await?;
                Ok(json!({}))
            }
            .await,
        ),
        "SendSignal" => rpc_result(
            async {
                let run = find().await?;
                // envd's enum spells them `SIGNAL_SIGKILL` (or the number): the core's table reads both.
                let sig = match field(&req, "signal", "signal") {
                    Some(Value::String(s)) => parse_signal(s.strip_prefix("SIGNAL_").unwrap_or(s))?,
                    Some(Value::Number(n)) => parse_signal(&n.to_string())?,
                    other => return Err(RpcError::invalid(format!("unsupported signal {other:?}"))),
                };
                if run.process.state == ProcessState::Exited {
                    return Err(RpcError::not_found("process has already exited"));
                }
                core.session_signal(&sandbox, &run.session, sig).await?;
                Ok(json!({}))
            }
            .await,
        ),
        "Update" => rpc_result(
            async {
                let run = find().await?;
                if let Some(size) = pty_size(&req) {
                    core.session_resize(&sandbox, &run.session, size).await?;
                }
                Ok(json!({}))
            }
            .await,
        ),
        "CloseStdin" => rpc_result(
            async {
                let run = find().await?;
                core.session_stdin(&sandbox, &run.session, Vec::new(), true).await?;
                Ok(json!({}))
            }
            .await,
        ),
        other => RpcError::new("unimplemented", format!("process.Process/{other} is not supported")).into_response(),
    }
}

fn watch_event(ev: &airlock_proto::WatchEvent, root: &str) -> Value {
    let mut v = watch_event_of(ev.kind, &ev.path, root);
    if let Some(entry) = &ev.entry {
        v["entry"] = entry_info(entry);
    }
    v
}

fn watch_event_of(kind: WatchEventKind, path: &str, root: &str) -> Value {
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

/// `includeEntry` of a watch request (newer SDKs' `include_entry=True`).
fn include_entry(req: &Value) -> bool {
    field(req, "includeEntry", "include_entry")
        .and_then(Value::as_bool)
        .unwrap_or(false)
}

pub async fn filesystem_rpc(
    State(state): State<E2bState>,
    Path(method): Path<String>,
    axum::Extension(EnvdSandbox(sandbox)): axum::Extension<EnvdSandbox>,
    headers: HeaderMap,
    body: Result<Bytes, axum::extract::rejection::BytesRejection>,
) -> Response {
    let streaming = method == "WatchDir";
    let (user, req) = match rpc_call(&headers, body, streaming) {
        Ok(x) => x,
        Err(r) => return r,
    };
    let files = match state.core.files(&sandbox).await {
        Ok(f) => f,
        Err(_) => return sandbox_gone(&sandbox.id),
    };
    let path = || abs_path(req.get("path").and_then(Value::as_str).unwrap_or(""), &user);
    match method.as_str() {
        "Stat" => rpc_result(async { Ok(json!({ "entry": entry_info(&files.stat(&path()).await?) })) }.await),
        "MakeDir" => rpc_result(
            async {
                let made = files.mkdir(&path(), &user).await?;
                if !made.created {
                    return Err(RpcError::new("already_exists", format!("{} already exists", path())));
                }
                Ok(json!({ "entry": entry_info(&made.stat) }))
            }
            .await,
        ),
        "Move" => rpc_result(
            async {
                let arg =
                    |camel, snake| abs_path(field(&req, camel, snake).and_then(Value::as_str).unwrap_or(""), &user);
                let moved = files
                    .rename(&arg("source", "source"), &arg("destination", "destination"))
                    .await?;
                Ok(json!({ "entry": entry_info(&moved) }))
            }
            .await,
        ),
        "ListDir" => rpc_result(
            async {
                let depth = as_u64(req.get("depth")).unwrap_or(1).clamp(1, 32) as u32;
                let entries: Vec<Value> = files.list(&path(), depth).await?.iter().map(entry_info).collect();
                Ok(json!({ "entries": entries }))
            }
            .await,
        ),
        "Remove" => rpc_result(
            async {
                files.remove(&path()).await?;
                Ok(json!({}))
            }
            .await,
        ),
        "WatchDir" => {
            let root = path();
            let recursive = req.get("recursive").and_then(Value::as_bool).unwrap_or(false);
            let events = match files.watch(&root, recursive, include_entry(&req)).await {
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
                            let msg = json!({ "filesystem": watch_event(&ev, &root) });
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
                state.watchers.check_room(&sandbox.id)?;
                let root = path();
                let recursive = req.get("recursive").and_then(Value::as_bool).unwrap_or(false);
                let events = files
                    .watch(&root, recursive, include_entry(&req))
                    .await?
                    .take_while(|ev| std::future::ready(ev.is_ok()))
                    .filter_map(move |ev| std::future::ready(ev.ok().map(|ev| watch_event(&ev, &root))));
                let id = state.watchers.create(&state.core, &sandbox.id, events)?;
                Ok(json!({ "watcherId": id }))
            }
            .await,
        ),
        "GetWatcherEvents" | "RemoveWatcher" => rpc_result(
            async {
                let id = field(&req, "watcherId", "watcher_id")
                    .and_then(Value::as_str)
                    .unwrap_or("");
                let missing = || RpcError::from(CoreError::not_found(Kind::Watcher, id));
                if method == "RemoveWatcher" {
                    return match state.watchers.remove(&sandbox.id, id) {
                        true => Ok(json!({})),
                        false => Err(missing()),
                    };
                }
                let events = state.watchers.take_events(&sandbox.id, id).ok_or_else(missing)?;
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

/// `require_sandbox` found the sandbox running.
pub async fn health() -> Response {
    StatusCode::NO_CONTENT.into_response()
}

#[derive(Debug, Deserialize)]
pub struct FilesQuery {
    pub path: Option<String>,
    pub username: Option<String>,
    pub signature: Option<String>,
    pub signature_expiration: Option<i64>,
}

/// Upload headers that carry the written files' metadata (`X-Metadata-<key>`), lowercase as
/// header names arrive.
const METADATA_HEADER: &str = "x-metadata-";

impl FilesQuery {
    fn signed(&self) -> SignedUrl<'_> {
        SignedUrl {
            path: self.path.as_deref().unwrap_or(""),
            user: self.username.as_deref().unwrap_or(""),
            signature: self.signature.as_deref().unwrap_or(""),
            expiration: self.signature_expiration,
        }
    }
}

fn files_error(e: impl Into<E2bError>) -> Response {
    e.into().into_response()
}

/// `/files` accepts the access token, or a valid signed-URL signature instead.
async fn files_target(
    state: &E2bState,
    sandbox: SandboxRecord,
    h: &HeaderMap,
    q: &FilesQuery,
    op: &str,
) -> Result<Files, Response> {
    if signed_url(h, q) {
        let url = q.signed();
        // A signature that does not match proves nothing: the answer for a missing sandbox.
        state.core.check_signed_url(&sandbox, &url, op).map_err(|e| match e {
            CoreError::NotFound {
                kind: Kind::Sandbox, ..
            } => sandbox_gone(&sandbox.id),
            e => files_error(e),
        })?;
    }
    let id = sandbox.id.clone();
    let sandbox = match state.core.current(sandbox).await {
        Ok(row) if row.answers_requests() => row,
        Ok(_) | Err(CoreError::NotFound { .. }) => return Err(sandbox_gone(&id)),
        Err(e) => return Err(files_error(e)),
    };
    state.core.files(&sandbox).await.map_err(|_| sandbox_gone(&sandbox.id))
}

pub async fn files_get(
    State(state): State<E2bState>,
    axum::Extension(EnvdSandbox(sandbox)): axum::Extension<EnvdSandbox>,
    headers: HeaderMap,
    Query(q): Query<FilesQuery>,
) -> Response {
    let files = match files_target(&state, sandbox, &headers, &q, "read").await {
        Ok(x) => x,
        Err(r) => return r,
    };
    let user = q.username.clone().unwrap_or_else(|| "user".into());
    let Some(path) = q.path.as_deref().map(|p| abs_path(p, &user)) else {
        return files_error(E2bError::bad_request("query parameter `path` is required"));
    };
    match files.read(&path).await {
        Ok(s) => Response::builder()
            .status(StatusCode::OK)
            .header("content-type", "application/octet-stream")
            .body(Body::from_stream(s))
            .expect("valid response"),
        Err(e) => files_error(e),
    }
}

pub async fn files_post(
    State(state): State<E2bState>,
    axum::Extension(EnvdSandbox(sandbox)): axum::Extension<EnvdSandbox>,
    headers: HeaderMap,
    Query(q): Query<FilesQuery>,
    req: axum::extract::Request,
) -> Response {
    let files = match files_target(&state, sandbox, &headers, &q, "write").await {
        Ok(x) => x,
        Err(r) => return r,
    };
    let signed = signed_url(&headers, &q);
    let user = q.username.clone().unwrap_or_else(|| "user".into());
    // gzip was decoded by the route's layer; anything still encoded is a coding we lack.
    if let Some(coding) = header(&headers, "content-encoding").filter(|c| !c.eq_ignore_ascii_case("identity")) {
        return files_error(E2bError::bad_request(format!(
            "Content-Encoding {coding:?} is not supported; send the bytes as they are or gzip them"
        )));
    }
    // `X-Metadata-<key>: <value>` headers (newer SDKs' `metadata=`): the written files' metadata.
    let metadata = match crate::core::files::check_metadata(headers.iter().filter_map(|(name, value)| {
        let key = name.as_str().strip_prefix(METADATA_HEADER).filter(|k| !k.is_empty())?;
        Some((key.to_string(), String::from_utf8_lossy(value.as_bytes()).into_owned()))
    })) {
        Ok(m) => m,
        Err(e) => return files_error(E2bError::bad_request(format!("invalid {e}"))),
    };
    let content_type = header(&headers, "content-type").unwrap_or("").to_ascii_lowercase();
    let mut written = Vec::new();
    // Exactly `name`, `type` and `path` (older SDKs take no other key), and `metadata` when the
    // file has some, as envd answers: only an upload that set metadata leaves any.
    let info = |path: &str, stat: &FileStat| {
        let mut v = json!({ "name": path.rsplit('/').next().unwrap_or(path), "type": "file", "path": path });
        if !stat.metadata.is_empty() {
            v["metadata"] = json!(stat.metadata);
        }
        v
    };
    if content_type.starts_with("multipart/form-data") {
        let mut mp = match axum::extract::Multipart::from_request(req, &()).await {
            Ok(m) => m,
            Err(e) => return files_error(E2bError::bad_request(format!("bad multipart body: {e}"))),
        };
        loop {
            let field = match mp.next_field().await {
                Ok(Some(f)) => f,
                Ok(None) => break,
                Err(e) => return files_error(E2bError::bad_request(format!("bad multipart body: {e}"))),
            };
            // A signed URL covers one path: one part, written there.
            if signed && !written.is_empty() {
                return files_error(E2bError::bad_request(
                    "a signed upload URL writes one file; send one part",
                ));
            }
            // One file: `?path=`; several: each part's filename is its destination.
            let dest = if signed {
                q.path.clone()
            } else {
                q.path
                    .clone()
                    .filter(|_| written.is_empty())
                    .or_else(|| field.file_name().map(String::from))
            };
            let Some(dest) = dest.map(|d| abs_path(&d, &user)) else {
                return files_error(E2bError::bad_request(
                    "each file part needs a filename or the query needs `path`",
                ));
            };
            // The part streams to the agent as it arrives. It borrows the request, and the write
            // takes a stream of its own: a small channel carries its chunks, read while it runs.
            let (tx, rx) = tokio::sync::mpsc::channel(4);
            let data = tokio_stream::wrappers::ReceiverStream::new(rx);
            let (read, wrote) = tokio::join!(
                read_part(field, tx),
                files.write_with_metadata(&dest, &user, &metadata, data)
            );
            match (read, wrote) {
                // The agent saw the stream break and kept the old file.
                (Err((status, why)), _) => {
                    return files_error(E2bError::new(status, format!("upload interrupted: {why}")))
                }
                (Ok(()), Ok(stat)) => written.push(info(&dest, &stat)),
                (Ok(()), Err(e)) => return files_error(e),
            }
        }
    } else {
        let Some(dest) = q.path.as_deref().map(|p| abs_path(p, &user)) else {
            return files_error(E2bError::bad_request("query parameter `path` is required"));
        };
        // A body that breaks off (a corrupt gzip stream, a dropped client, past the cap) is the
        // upload's fault: remember why, so the reply is a 400 (413) naming it rather than a 502
        // about the agent. The agent keeps the old file in that case. The cap counts the bytes
        // as written (a gzip body decoded), as for multipart.
        let body_error = Arc::new(std::sync::Mutex::new(None::<(StatusCode, String)>));
        let seen = body_error.clone();
        let body = axum::RequestExt::with_limited_body(req).into_body();
        let data = body.into_data_stream().map(move |r| {
            r.map_err(|e| {
                *seen.lock().unwrap_or_else(|p| p.into_inner()) = Some((body_error_status(&e), e.to_string()));
                std::io::Error::other(e)
            })
        });
        match files.write_with_metadata(&dest, &user, &metadata, data).await {
            Ok(stat) => written.push(info(&dest, &stat)),
            Err(e) => {
                if let Some((status, why)) = body_error.lock().unwrap_or_else(|p| p.into_inner()).take() {
                    return files_error(E2bError::new(status, format!("could not read the upload body: {why}")));
                }
                return files_error(e);
            }
        }
    }
    if written.is_empty() {
        return files_error(E2bError::bad_request("no file in the upload"));
    }
    (StatusCode::OK, axum::Json(Value::Array(written))).into_response()
}

/// A request body that could not be read is the upload's fault (400), or past the upload cap
/// (413: the limit's error lies deep in the chain of body layers, where axum's own check does
/// not look).
fn body_error_status(e: &(dyn std::error::Error + 'static)) -> StatusCode {
    let mut cause = Some(e);
    while let Some(e) = cause {
        if e.is::<http_body_util::LengthLimitError>() {
            return StatusCode::PAYLOAD_TOO_LARGE;
        }
        cause = e.source();
    }
    StatusCode::BAD_REQUEST
}

/// Send a multipart part's chunks to `tx` until it ends; a broken body (or one past the upload
/// cap: 413) is sent on as an error (so the write fails and the agent keeps the old file) and
/// returned. A write that ended early (refused) stops the reading; its own error says why.
async fn read_part(
    mut part: axum::extract::multipart::Field<'_>,
    tx: tokio::sync::mpsc::Sender<Result<Bytes, std::io::Error>>,
) -> Result<(), (StatusCode, String)> {
    loop {
        match part.chunk().await {
            Ok(Some(chunk)) => {
                if tx.send(Ok(chunk)).await.is_err() {
                    return Ok(());
                }
            }
            Ok(None) => return Ok(()),
            Err(e) => {
                let why = e.body_text();
                let _ = tx.send(Err(std::io::Error::other(why.clone()))).await;
                return Err((body_error_status(&e), why));
            }
        }
    }
}

use axum::extract::FromRequest as _;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_and_permissions() {
        assert_eq!(abs_path("a.txt", "user"), "/home/user/a.txt");
        assert_eq!(abs_path("/etc/x", "root"), "/etc/x");
        assert_eq!(abs_path("", "root"), "/root");
        assert_eq!(permissions(FileKind::Dir, 0o755), "drwxr-xr-x");
        assert_eq!(permissions(FileKind::File, 0o640), "-rw-r-----");
    }

    #[tokio::test]
    async fn hostile_stream_headers_are_clamped() {
        let mut h = HeaderMap::new();
        h.insert("connect-timeout-ms", u64::MAX.to_string().parse().unwrap());
        h.insert("keepalive-ping-interval", u64::MAX.to_string().parse().unwrap());
        let deadline = stream_deadline(&h).expect("a deadline");
        assert!(deadline <= tokio::time::Instant::now() + MAX_TIMEOUT);
        assert_eq!(keepalive_every(&h), Duration::from_secs(3600));
        h.insert("connect-timeout-ms", "-1".parse().unwrap());
        h.insert("keepalive-ping-interval", "0".parse().unwrap());
        assert!(stream_deadline(&h).is_none());
        assert_eq!(keepalive_every(&h), Duration::from_secs(50));
    }
}
