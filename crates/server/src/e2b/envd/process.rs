//! envd's `process.Process` service: Start and Connect (server streams), List, SendInput,
//! SendSignal, Update and CloseStdin, each decoded into its request message and answered with
//! its response message. A translation onto the core's sessions; no process logic here. A
//! started process's life is bounded by the core (the session's timeout, from
//! `connect-timeout-ms`), never by this door: the stream only reports the end.

use super::messages::{
    Base64, CloseStdinRequest, CloseStdinResponse, ConnectRequest, DataEvent, EndEvent, ListRequest, ListResponse,
    ProcessConfig, ProcessEvent, ProcessEventMessage, ProcessInfo, ProcessSelector, Pty, SendInputRequest,
    SendInputResponse, SendSignalRequest, SendSignalResponse, SignalValue, StartRequest, UpdateRequest, UpdateResponse,
};
use super::{abs_path, async_stream, header, keepalive_every, rpc_request, stream_response, EnvdSandbox};
use crate::core::sandboxes::MAX_TIMEOUT;
use crate::core::sessions::{parse_signal, signal_description, Running, Selector, SessionEvent, StartSession};
use crate::e2b::connect::{self, unary_response, Code, RpcError};
use crate::e2b::E2bState;
use crate::records::SandboxRecord;
use airlock_proto::frame::EventKind;
use airlock_proto::{ExitStatus, ProcessState, PtySize};
use axum::extract::{Path, State};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use futures_util::{Stream, StreamExt};
use std::time::Duration;
use tokio::time::Instant;

/// The methods this service answers, by their path segment (`StreamInput` is client-streaming,
/// which the SDK never calls: unimplemented, as before).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Method {
    Start,
    Connect,
    List,
    SendInput,
    SendSignal,
    Update,
    CloseStdin,
}

impl Method {
    fn from_name(name: &str) -> Option<Self> {
        Some(match name {
            "Start" => Method::Start,
            "Connect" => Method::Connect,
            "List" => Method::List,
            "SendInput" => Method::SendInput,
            "SendSignal" => Method::SendSignal,
            "Update" => Method::Update,
            "CloseStdin" => Method::CloseStdin,
            _ => return None,
        })
    }
}

/// How long a started process's stream waits past the process's timeout for the exit the core
/// reports (its kill by the agent), before it ends with `deadline_exceeded` regardless.
const KILL_SETTLE: Duration = Duration::from_secs(2);

/// `connect-timeout-ms`, clamped to the longest sandbox (larger values, up to u64::MAX, are
/// clamped before any arithmetic).
fn connect_timeout_ms(h: &HeaderMap) -> Option<u64> {
    header(h, "connect-timeout-ms")
        .and_then(|v| v.parse::<u64>().ok())
        .filter(|t| *t > 0)
        .map(|ms| ms.min(MAX_TIMEOUT.as_millis() as u64))
}

/// `connect-timeout-ms` less a margin: when the process must be over and the stream must say
/// so, for the answer to reach the client before its own read timeout (set to the same value)
/// fires.
fn deadline_ms(h: &HeaderMap) -> Option<u64> {
    let ms = connect_timeout_ms(h)?;
    Some(ms - (ms / 10).min(500))
}

/// When a stream must say something (see [`deadline_ms`]).
fn stream_deadline(h: &HeaderMap) -> Option<Instant> {
    Instant::now().checked_add(Duration::from_millis(deadline_ms(h)?))
}

/// envd bounds a started process's life by `connect-timeout-ms`: the core's session timeout,
/// ending at the stream's deadline so the client learns of the end before it gives up.
fn process_timeout(h: &HeaderMap) -> Option<Duration> {
    deadline_ms(h).map(|ms| Duration::from_millis(ms).clamp(Duration::from_secs(1), MAX_TIMEOUT))
}

/// The `pty.size` of a Start or Update request (80x24 where a side is missing).
fn pty_size(pty: Option<&Pty>) -> Option<PtySize> {
    let size = pty?.size.as_ref()?;
    let side = |v: Option<u64>, default: u64| v.unwrap_or(default).clamp(1, u16::MAX as u64) as u16;
    Some(PtySize {
        cols: side(size.cols, 80),
        rows: side(size.rows, 24),
    })
}

/// A process selector `{pid}` or `{tag}`, as the core takes it.
fn selector(sel: Option<&ProcessSelector>) -> Result<Selector, RpcError> {
    let sel = sel.ok_or_else(|| RpcError::invalid("process selector is required"))?;
    if let Some(pid) = sel.pid {
        return u32::try_from(pid)
            .map(Selector::Pid)
            .map_err(|_| RpcError::invalid(format!("pid {pid} is out of range")));
    }
    match &sel.tag {
        Some(tag) => Ok(Selector::Tag(tag.clone())),
        None => Err(RpcError::invalid("process selector needs pid or tag")),
    }
}

/// envd's `EndEvent`: Go's `ProcessState.String()` as its status (`exit status 1`,
/// `signal: killed`), an error unless it exited 0, and -1 for a process a signal ended.
fn end_event(exit: &ExitStatus) -> EndEvent {
    match (exit.exit_code, exit.signal) {
        (Some(code), _) => EndEvent {
            exit_code: code,
            exited: true,
            status: format!("exit status {code}"),
            error: (code != 0).then(|| format!("exit status {code}")),
        },
        (None, sig) => {
            let status = format!(
                "signal: {}",
                sig.map(signal_description).unwrap_or_else(|| "unknown".into())
            );
            EndEvent {
                exit_code: -1,
                exited: false,
                error: Some(status.clone()),
                status,
            }
        }
    }
}

/// E2B's `ProcessInfo` of a session.
fn process_info(run: &Running) -> ProcessInfo {
    let argv = &run.session.argv;
    ProcessInfo {
        config: ProcessConfig {
            cmd: argv.first().cloned().unwrap_or_default(),
            args: argv.iter().skip(1).cloned().collect(),
            envs: Default::default(),
            cwd: Some(run.session.cwd.clone()),
        },
        pid: run.process.pid,
        // Sessions started without a tag (e.g. through /v1) are known by their session id.
        tag: run.session.tag.clone().unwrap_or_else(|| run.session.id.clone()),
    }
}

/// The `Start` request as the core's `StartSession`.
fn start_session(req: StartRequest, headers: &HeaderMap, user: &str) -> Result<StartSession, RpcError> {
    let p = req.process.unwrap_or_default();
    if p.cmd.is_empty() {
        return Err(RpcError::invalid("process.cmd is required"));
    }
    let mut argv = vec![p.cmd];
    argv.extend(p.args);
    Ok(StartSession {
        argv,
        cwd: p.cwd.map(|c| abs_path(&c, user)),
        env: p.envs,
        user: Some(user.to_string()),
        timeout: process_timeout(headers),
        stdin: req.stdin.unwrap_or(true),
        pty: pty_size(req.pty.as_ref()),
        tag: req.tag,
    })
}

/// What bounds a process stream besides the process's end.
#[derive(Debug, Clone, Copy)]
enum Bound {
    /// No `connect-timeout-ms`: the stream lasts as long as the process.
    None,
    /// `Connect`: the stream's own deadline; it ends with `deadline_exceeded` then, and the
    /// process runs on.
    Stream(Instant),
    /// `Start`: the core ends the process at its timeout (`settle_by` less [`KILL_SETTLE`]); at
    /// `say_by` the stream sends a keepalive (its client's read timeout is the same value), then
    /// waits for that end and reports it as `deadline_exceeded`.
    Process { say_by: Instant, settle_by: Instant },
}

fn event(event: ProcessEvent) -> Bytes {
    connect::message(&ProcessEventMessage { event })
}

/// Stream a process's events as `StartResponse`/`ConnectResponse` messages: `start` first,
/// then output, keepalives while idle, `end` (or, for a process the core ended at its timeout,
/// `deadline_exceeded`), and the end-of-stream envelope.
fn process_stream(
    state: E2bState,
    sandbox: SandboxRecord,
    run: Running,
    keepalive: Duration,
    bound: Bound,
) -> impl Stream<Item = Bytes> + Send + 'static {
    let start = event(ProcessEvent::Start { pid: run.process.pid });
    let pty = run.session.pty;
    let rest = async_stream(move |tx| async move {
        let mut events = match state.core.session_events(&sandbox, run.session, 0).await {
            Ok(e) => e,
            Err(e) => {
                let _ = tx.send(connect::end_of_stream(Some(&RpcError::from(e)))).await;
                return;
            }
        };
        let mut said = false;
        loop {
            let now = Instant::now();
            // The next moment something must be sent even if the process says nothing.
            let wake = match bound {
                Bound::Stream(d) if d <= now => {
                    let err = RpcError::new(
                        Code::DeadlineExceeded,
                        "the stream reached its deadline (connect-timeout-ms); the process runs on",
                    );
                    let _ = tx.send(connect::end_of_stream(Some(&err))).await;
                    return;
                }
                Bound::Process { settle_by, .. } if settle_by <= now => {
                    let _ = tx.send(connect::end_of_stream(Some(&timed_out()))).await;
                    return;
                }
                Bound::Process { say_by, .. } if !said && say_by <= now => {
                    said = true;
                    Some(now)
                }
                Bound::Process { say_by, settle_by } => Some(if said { settle_by } else { say_by }),
                Bound::Stream(d) => Some(d),
                Bound::None => None,
            };
            let wait = wake.map_or(keepalive, |w| keepalive.min(w.saturating_duration_since(now)));
            let ev = match tokio::time::timeout(wait, events.next()).await {
                Err(_) => {
                    // Idle: a keepalive, unless a bound fell due (handled at the loop's top).
                    let due = matches!(bound, Bound::Stream(d) if d <= Instant::now())
                        || matches!(bound, Bound::Process { settle_by, .. } if settle_by <= Instant::now());
                    if !due && tx.send(event(ProcessEvent::Keepalive {})).await.is_err() {
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
            let msg = match ev.kind {
                EventKind::Stdout(d) if pty => ProcessEvent::Data(DataEvent::Pty(Base64(d.to_vec()))),
                EventKind::Stdout(d) => ProcessEvent::Data(DataEvent::Stdout(Base64(d.to_vec()))),
                EventKind::Stderr(d) => ProcessEvent::Data(DataEvent::Stderr(Base64(d.to_vec()))),
                // The core ended it at its timeout: envd answers that as the deadline.
                EventKind::Exit(exit) if exit.timed_out && matches!(bound, Bound::Process { .. }) => {
                    let _ = tx.send(connect::end_of_stream(Some(&timed_out()))).await;
                    return;
                }
                EventKind::Exit(exit) => ProcessEvent::End(end_event(&exit)),
            };
            if tx.send(event(msg)).await.is_err() {
                return; // the client went away; the process keeps running
            }
        }
        let _ = tx.send(connect::end_of_stream(None)).await;
    });
    futures_util::stream::once(async move { start }).chain(rest)
}

fn timed_out() -> RpcError {
    RpcError::new(
        Code::DeadlineExceeded,
        "the command ran past its timeout and was killed",
    )
}

pub async fn process_rpc(
    State(state): State<E2bState>,
    Path(method): Path<String>,
    axum::Extension(EnvdSandbox(sandbox)): axum::Extension<EnvdSandbox>,
    headers: HeaderMap,
    body: Result<Bytes, axum::extract::rejection::BytesRejection>,
) -> Response {
    let (m, body) = match super::rpc_method("process.Process", &method, Method::from_name, body) {
        Ok(started) => started,
        Err(answer) => return answer,
    };
    let call = super::Call {
        state: &state,
        sandbox: &sandbox,
        headers: &headers,
    };
    match m {
        Method::Start => match rpc_request(&headers, &body, true) {
            Ok((user, req)) => call.start(&user, req).await,
            Err(r) => r,
        },
        Method::Connect => match rpc_request(&headers, &body, true) {
            Ok((_, req)) => call.connect(req).await,
            Err(r) => r,
        },
        Method::List => call.unary(&body, |req| call.list(req)).await,
        Method::SendInput => call.unary(&body, |req| call.send_input(req)).await,
        Method::SendSignal => call.unary(&body, |req| call.send_signal(req)).await,
        Method::Update => call.unary(&body, |req| call.update(req)).await,
        Method::CloseStdin => call.unary(&body, |req| call.close_stdin(req)).await,
    }
}

impl super::Call<'_> {
    /// Decode a unary request, run `f` on it, answer its response message or its error.
    async fn unary<T, R, F, Fut>(&self, body: &[u8], f: F) -> Response
    where
        T: serde::de::DeserializeOwned,
        R: serde::Serialize,
        F: FnOnce(T) -> Fut,
        Fut: std::future::Future<Output = Result<R, RpcError>>,
    {
        match rpc_request::<T>(self.headers, body, false) {
            Ok((_, req)) => unary_response(f(req).await),
            Err(r) => r,
        }
    }

    async fn find(&self, sel: Option<&ProcessSelector>) -> Result<Running, RpcError> {
        Ok(self.state.core.find_session(self.sandbox, &selector(sel)?).await?)
    }

    fn stream(&self, run: Running, bound: Bound) -> Response {
        stream_response(process_stream(
            self.state.clone(),
            self.sandbox.clone(),
            run,
            keepalive_every(self.headers),
            bound,
        ))
    }

    async fn start(&self, user: &str, req: StartRequest) -> Response {
        let started = async {
            let start = start_session(req, self.headers, user)?;
            // What the agent reported at the spawn: no second round trip for the pid.
            Ok::<_, RpcError>(self.state.core.start_session(self.sandbox, start).await?)
        }
        .await;
        let run = match started {
            Ok(run) => run,
            Err(e) => return e.into_response(),
        };
        let bound = match (stream_deadline(self.headers), process_timeout(self.headers)) {
            (Some(say_by), Some(timeout)) => Bound::Process {
                say_by,
                settle_by: Instant::now() + timeout + KILL_SETTLE,
            },
            _ => Bound::None,
        };
        self.stream(run, bound)
    }

    async fn connect(&self, req: ConnectRequest) -> Response {
        match self.find(req.process.as_ref()).await {
            Ok(run) => {
                let bound = stream_deadline(self.headers).map_or(Bound::None, Bound::Stream);
                self.stream(run, bound)
            }
            Err(e) => e.into_response(),
        }
    }

    async fn list(&self, _: ListRequest) -> Result<ListResponse, RpcError> {
        let running = self.state.core.running_sessions(self.sandbox).await?;
        Ok(ListResponse {
            processes: running.iter().map(process_info).collect(),
        })
    }

    async fn send_input(&self, req: SendInputRequest) -> Result<SendInputResponse, RpcError> {
        let run = self.find(req.process.as_ref()).await?;
        let input = req.input.unwrap_or_default();
        let data = input.stdin.or(input.pty).unwrap_or_default().0;
        self.state
            .core
            .session_stdin(self.sandbox, &run.session, data, false)
            .await?;
        Ok(SendInputResponse {})
    }

    async fn send_signal(&self, req: SendSignalRequest) -> Result<SendSignalResponse, RpcError> {
        let run = self.find(req.process.as_ref()).await?;
        // envd's enum spells them `SIGNAL_SIGKILL` (or the number): the core's table reads both.
        let sig = match &req.signal {
            Some(SignalValue::Name(s)) => parse_signal(s.strip_prefix("SIGNAL_").unwrap_or(s))?,
            Some(SignalValue::Number(n)) => parse_signal(&n.to_string())?,
            None => return Err(RpcError::invalid("unsupported signal None")),
        };
        if run.process.state == ProcessState::Exited {
            return Err(RpcError::not_found("process has already exited"));
        }
        self.state.core.session_signal(self.sandbox, &run.session, sig).await?;
        Ok(SendSignalResponse {})
    }

    async fn update(&self, req: UpdateRequest) -> Result<UpdateResponse, RpcError> {
        let run = self.find(req.process.as_ref()).await?;
        if let Some(size) = pty_size(req.pty.as_ref()) {
            self.state.core.session_resize(self.sandbox, &run.session, size).await?;
        }
        Ok(UpdateResponse {})
    }

    async fn close_stdin(&self, req: CloseStdinRequest) -> Result<CloseStdinResponse, RpcError> {
        let run = self.find(req.process.as_ref()).await?;
        self.state
            .core
            .session_stdin(self.sandbox, &run.session, Vec::new(), true)
            .await?;
        Ok(CloseStdinResponse {})
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn hostile_stream_headers_are_clamped() {
        let mut h = HeaderMap::new();
        h.insert("connect-timeout-ms", u64::MAX.to_string().parse().unwrap());
        h.insert("keepalive-ping-interval", u64::MAX.to_string().parse().unwrap());
        let deadline = stream_deadline(&h).expect("a deadline");
        assert!(deadline <= Instant::now() + MAX_TIMEOUT);
        assert_eq!(process_timeout(&h), Some(MAX_TIMEOUT - Duration::from_millis(500)));
        assert_eq!(keepalive_every(&h), Duration::from_secs(3600));
        h.insert("connect-timeout-ms", "-1".parse().unwrap());
        h.insert("keepalive-ping-interval", "0".parse().unwrap());
        assert!(stream_deadline(&h).is_none() && process_timeout(&h).is_none());
        assert_eq!(keepalive_every(&h), Duration::from_secs(50));
        h.insert("connect-timeout-ms", "200".parse().unwrap());
        assert_eq!(process_timeout(&h), Some(Duration::from_secs(1)), "at least a second");
        h.insert("connect-timeout-ms", "2000".parse().unwrap());
        assert_eq!(
            process_timeout(&h),
            Some(Duration::from_millis(1800)),
            "over before the client gives up"
        );
    }

    #[test]
    fn ends_read_as_envds() {
        let end = |exit_code, signal| {
            end_event(&ExitStatus {
                exit_code,
                signal,
                timed_out: false,
            })
        };
        let e = end(Some(1), None);
        assert_eq!(
            (e.exit_code, e.exited, e.error.as_deref()),
            (1, true, Some("exit status 1"))
        );
        assert_eq!(end(Some(0), None).error, None);
        let e = end(None, Some(9));
        assert_eq!(
            (e.exit_code, e.exited, e.status.as_str()),
            (-1, false, "signal: killed")
        );
        assert_eq!(Method::from_name("StreamInput"), None);
    }
}
