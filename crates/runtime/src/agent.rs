//! Host side of the guest agent protocol: an HTTP/2 client over the VM's channel socket.
//!
//! The transport is any byte stream; today it is the unix socket QEMU exposes for the
//! virtio-serial port. Each method is one call of `airlock_proto`'s API.
//!
//! The guest is not trusted: root inside it can replace the agent and speak this protocol
//! itself. So everything read from the channel is bounded, and a misbehaving agent can only fail
//! the calls of its own sandbox:
//! - in size: every reply body this client collects is read through [`Limited`] (see the
//!   `*_MAX` constants), a watch line is capped, event frames are capped by
//!   `airlock_proto::frame::MAX_PAYLOAD` (the decoder refuses a larger length prefix before
//!   buffering its payload), response headers by hyper's HTTP/2 default (16 KiB), and data the
//!   host has not read yet by the HTTP/2 flow-control windows set in [`AgentClient::connect`];
//! - in time: every call that waits for an answer has a deadline ([`Deadlines`]); streams that
//!   are long-lived by design (events, watches, file reads, tunnels) only have a deadline for
//!   their response headers.

use airlock_proto::frame::{Decoder, Event};
use airlock_proto::routes::{self, Route, WriteFile};
use airlock_proto::{
    ErrorBody, ErrorCode, FileStat, Health, Metrics, MkdirRequest, MkdirResponse, ProcessInfo, ProcessSpec, PtySize,
    RenameRequest, SignalRequest, WatchEvent,
};
use bytes::Bytes;
use futures_util::{Stream, StreamExt};
use http::{Method, Request};
use http_body_util::{combinators::UnsyncBoxBody, BodyExt, Full, LengthLimitError, Limited, StreamBody};
use hyper::body::{Frame, Incoming};
use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::BufReader;
use tokio::net::UnixStream;
use tokio::sync::watch;
use tokio::time::Instant;

/// Largest reply holding one record (health, metrics, a process, a file's stat, mkdir, rename).
/// The largest such record is a process with its argv, which the guest's `execve` caps at
/// `ARG_MAX` (2 MiB by default); everything else is a few hundred bytes.
pub const RECORD_MAX: usize = 4 << 20;
/// Largest reply holding a list (processes, a directory listing): a deep listing of a big tree
/// is tens of thousands of entries of ~300 bytes each.
pub const LIST_MAX: usize = 16 << 20;
/// Largest error body read (`{"code","message"}`; a message is one line naming a path or two).
pub const ERROR_BODY_MAX: usize = 64 << 10;
/// Largest file [`AgentClient::read_file`] collects; larger files are read as a stream
/// ([`AgentClient::read_file_stream`]), which buffers one chunk at a time.
pub const READ_FILE_MAX: usize = 64 << 20;
/// Longest line of a watch stream: one JSON event naming one path (at most `PATH_MAX`, 4 KiB).
pub const WATCH_LINE_MAX: usize = 64 << 10;

/// How long a call may wait for the agent. A call past its deadline fails with
/// [`AgentError::Transport`] ("... did not answer within ...").
///
/// The clock runs while the agent holds the call up: from the start until the request body is
/// sent, while the agent is not taking the request body (HTTP/2 flow control), and from the end
/// of the request body until the reply has been read. It restarts with each chunk of request
/// body the agent takes, and stops while the body's own source is slow (an upload from a slow
/// client), so an upload is never cut while data flows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Deadlines {
    /// Calls that do a bounded amount of work in the guest (health, spawn, signal, stat, ...),
    /// and the response headers of streams (events, file reads, tunnels).
    pub call: Duration,
    /// Calls whose work grows with the guest's disk: `sync` (flushes the page cache),
    /// `list` (walks a tree to `depth`), `watch` (arms a recursive watch on every directory).
    pub slow_call: Duration,
}

impl Default for Deadlines {
    /// 30 s for a call: a loaded guest under TCG answers a health check in well under a second,
    /// so 30 s only ends calls to an agent that is gone or stuck. 5 min for the slow ones: a
    /// `sync` of a few GiB of dirty pages to a throttled disk.
    fn default() -> Self {
        Self {
            call: Duration::from_secs(30),
            slow_call: Duration::from_secs(300),
        }
    }
}

#[derive(Debug, Clone, thiserror::Error)]
pub enum AgentError {
    /// The channel is down (VM gone, or not booted yet).
    #[error("channel: {0}")]
    Transport(String),
    /// The agent answered with an error.
    #[error("{message}")]
    Api {
        status: u16,
        code: ErrorCode,
        message: String,
    },
    #[error("bad response from agent: {0}")]
    Protocol(String),
}

impl AgentError {
    pub fn code(&self) -> Option<ErrorCode> {
        match self {
            AgentError::Api { code, .. } => Some(*code),
            _ => None,
        }
    }
}

type ReqBody = UnsyncBoxBody<Bytes, std::io::Error>;

/// How long to wait for `READY` before saying `HELLO` again: the guest may still be booting (its
/// agent answers the newest of the hellos queued meanwhile, so a short period costs a booting
/// guest nothing and saves up to a period on every boot), or a VM restored from a save made while
/// a host was connected still serves that host's session, and the first hello only ends it.
const HELLO_RETRY: Duration = Duration::from_millis(100);

/// Resynchronize the channel: say hello with a fresh nonce until the agent answers it. The
/// channel is read a buffer at a time (a guest flooding it must not cost the host a syscall per
/// byte for as long as the hello lasts); what follows `READY` stays in the buffer for the
/// HTTP/2 session.
async fn start_session(stream: &mut BufReader<UnixStream>) -> Result<(), AgentError> {
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt};
    let io_err = |e: std::io::Error| AgentError::Transport(format!("session start: {e}"));
    loop {
        let nonce = crate::random::random_hex(8);
        stream
            .write_all(format!("{}{nonce}\n", airlock_proto::SESSION_HELLO).as_bytes())
            .await
            .map_err(io_err)?;
        let want = format!("{}{nonce}", airlock_proto::SESSION_READY);
        let wait_ready = async {
            // The end of the current line: its last SESSION_LINE_MAX bytes at most.
            let mut line = Vec::with_capacity(2 * airlock_proto::SESSION_LINE_MAX);
            loop {
                let buf = stream.fill_buf().await?;
                if buf.is_empty() {
                    return Err(std::io::Error::from(std::io::ErrorKind::UnexpectedEof));
                }
                let newline = buf.iter().position(|&b| b == b'\n');
                let taken = newline.map_or(buf.len(), |i| i + 1);
                line.extend_from_slice(&buf[..newline.unwrap_or(buf.len())]);
                stream.consume(taken);
                if line.len() > airlock_proto::SESSION_LINE_MAX {
                    line.drain(..line.len() - airlock_proto::SESSION_LINE_MAX);
                }
                if newline.is_some() {
                    // Bytes of an older session may precede our line: match its end.
                    if line.ends_with(want.as_bytes()) {
                        return Ok(());
                    }
                    line.clear();
                }
            }
        };
        let waited = tokio::time::timeout(HELLO_RETRY, wait_ready).await;
        match waited {
            Ok(Ok(())) => return Ok(()),
            Ok(Err(e)) => return Err(io_err(e)),
            Err(_) => tracing::debug!("no READY for {nonce} yet; saying hello again"),
        }
    }
}

/// A connected agent session. Cheap to clone; all clones share one HTTP/2 connection.
#[derive(Clone)]
pub struct AgentClient {
    send: hyper::client::conn::http2::SendRequest<ReqBody>,
    deadlines: Deadlines,
    /// The task driving the connection (see [`AgentClient::close`]).
    conn: tokio::task::AbortHandle,
}

fn empty() -> ReqBody {
    Full::new(Bytes::new()).map_err(|n| match n {}).boxed_unsync()
}

fn bytes_body(b: impl Into<Bytes>) -> ReqBody {
    Full::new(b.into()).map_err(|n| match n {}).boxed_unsync()
}

/// The HTTP method of a route.
fn method(route: &Route) -> Method {
    match route.method() {
        routes::Method::Get => Method::GET,
        routes::Method::Post => Method::POST,
        routes::Method::Put => Method::PUT,
        routes::Method::Delete => Method::DELETE,
    }
}

/// How a call's deadline runs (see [`Deadlines`]).
#[derive(Debug, Clone, Copy)]
enum Clock {
    /// While the agent holds the call up; the reply body is read by the same deadline.
    Agent(Duration),
    /// Response headers within this long of the start, whatever the request body does (a
    /// tunnel's request body is a long-lived byte stream; the agent answers once connected).
    Headers(Duration),
}

/// A request body that tells its call when the agent is the one holding it up: since when the
/// call has been waiting on the agent (`Some`), or that it waits on the body's source (`None`).
struct Watched {
    inner: ReqBody,
    waiting_since: Arc<watch::Sender<Option<Instant>>>,
}

impl hyper::body::Body for Watched {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, std::io::Error>>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.inner).poll_frame(cx);
        // Pending: the source is slow, not the agent. Ready: hyper asks for the next chunk only
        // when the agent's flow-control window has room, and after the end the answer is due.
        this.waiting_since.send_replace(polled.is_ready().then(Instant::now));
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for Watched {
    fn drop(&mut self) {
        // Sent (or abandoned by hyper): whatever comes now is up to the agent.
        self.waiting_since.send_if_modified(|w| {
            let was_waiting_on_source = w.is_none();
            if was_waiting_on_source {
                *w = Some(Instant::now());
            }
            was_waiting_on_source
        });
    }
}

/// When a call that got its response headers must have read its reply.
#[derive(Debug, Clone, Copy)]
struct Due {
    at: Instant,
    limit: Duration,
}

/// An error with its causes (hyper's own text is terse: "http2 error").
fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(&format!(": {s}"));
        source = s.source();
    }
    text
}

fn late(what: &str, limit: Duration) -> AgentError {
    AgentError::Transport(format!("{what}: the agent did not answer within {limit:?}"))
}

/// A reply body, read whole within `due`, at most `max` bytes.
async fn collect_limited(body: Incoming, max: usize, what: &str, due: Due) -> Result<Bytes, AgentError> {
    let collected = tokio::time::timeout_at(due.at, Limited::new(body, max).collect())
        .await
        .map_err(|_| late(what, due.limit))?;
    match collected {
        Ok(c) => Ok(c.to_bytes()),
        Err(e) if e.is::<LengthLimitError>() => Err(AgentError::Protocol(format!(
            "{what}: reply body exceeds the limit of {max} bytes"
        ))),
        Err(e) => Err(AgentError::Transport(format!("{what}: {}", chain(e.as_ref())))),
    }
}

impl AgentClient {
    /// Open a session on the channel socket (does not wait for the guest: without a `READY` it
    /// keeps saying hello; bound it with a timeout or use [`AgentClient::connect_ready`]).
    pub async fn connect(socket: &Path) -> Result<Self, AgentError> {
        let mut stream = BufReader::new(
            UnixStream::connect(socket)
                .await
                .map_err(|e| AgentError::Transport(format!("connect {}: {e}", socket.display())))?,
        );
        start_session(&mut stream).await?;
        // The windows bound what the agent can make the host buffer for replies it has not read
        // yet: 4 MiB per stream, 8 MiB for the connection.
        let (send, conn) = hyper::client::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
            .initial_stream_window_size(4 << 20)
            .initial_connection_window_size(8 << 20)
            .max_frame_size(256 << 10)
            .handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .map_err(|e| AgentError::Transport(format!("handshake: {e}")))?;
        let conn = tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!("agent connection ended: {e}");
            }
        })
        .abort_handle();
        Ok(Self {
            send,
            deadlines: Deadlines::default(),
            conn,
        })
    }

    /// Connect and wait until the agent answers `/health`, up to `limit`.
    pub async fn connect_ready(socket: &Path, limit: Duration) -> Result<(Self, Health), AgentError> {
        let attempt = async {
            let client = Self::connect_retrying(socket).await;
            let health = client.health().await?;
            Ok::<_, AgentError>((client, health))
        };
        tokio::time::timeout(limit, attempt)
            .await
            .map_err(|_| AgentError::Transport(format!("agent did not answer within {limit:?}")))?
    }

    /// Connect, up to `limit`: the agent has answered the hello, and the session's first
    /// request is the caller's (a start sends the identity at once: one round trip fewer than
    /// asking `/health` first, and under TCG each first call into a restored guest is slow).
    pub async fn connect_within(socket: &Path, limit: Duration) -> Result<Self, AgentError> {
        tokio::time::timeout(limit, Self::connect_retrying(socket))
            .await
            .map_err(|_| AgentError::Transport(format!("agent did not answer within {limit:?}")))
    }

    /// The VMM creates the socket shortly after it starts: retry until it is there.
    async fn connect_retrying(socket: &Path) -> Self {
        loop {
            match Self::connect(socket).await {
                Ok(c) => return c,
                Err(e) => {
                    tracing::trace!("agent connect: {e}");
                    tokio::time::sleep(Duration::from_millis(10)).await
                }
            }
        }
    }

    /// The same session with other deadlines (tests use short ones).
    pub fn with_deadlines(mut self, deadlines: Deadlines) -> Self {
        self.deadlines = deadlines;
        self
    }

    pub fn deadlines(&self) -> Deadlines {
        self.deadlines
    }

    /// End the session for every clone at once (its calls and streams fail): the guest sees the
    /// host leave, as before a VM is saved, so a later host starts a clean session.
    pub fn close(&self) {
        self.conn.abort();
    }

    pub fn is_closed(&self) -> bool {
        self.send.is_closed()
    }

    /// Send a request; the response once its headers are in, and when its body is due.
    async fn request(
        &self,
        route: &Route,
        body: ReqBody,
        clock: Clock,
    ) -> Result<(hyper::Response<Incoming>, Due), AgentError> {
        let uri = route.uri();
        let what = format!("{} {uri}", route.method());
        let start = Instant::now();
        let (limit, waiting_since, body) = match clock {
            Clock::Agent(limit) => {
                let waiting_since = Arc::new(watch::Sender::new(Some(start)));
                let body = Watched {
                    inner: body,
                    waiting_since: waiting_since.clone(),
                };
                (limit, Some(waiting_since), BodyExt::boxed_unsync(body))
            }
            Clock::Headers(limit) => (limit, None, body),
        };
        let req = Request::builder()
            .method(method(route))
            .uri(format!("http://agent{uri}"))
            .body(body)
            .expect("valid request");
        let mut send = self.send.clone();
        let exchange = async move {
            send.ready().await?;
            send.send_request(req).await
        };
        let resp = match waiting_since {
            None => tokio::time::timeout_at(start + limit, exchange)
                .await
                .map_err(|_| late(&what, limit))?
                .map(|r| (r, start + limit)),
            Some(waiting_since) => {
                let mut rx = waiting_since.subscribe();
                let mut exchange = std::pin::pin!(exchange);
                loop {
                    let since = *rx.borrow_and_update();
                    let expired = async {
                        match since {
                            Some(t) => tokio::time::sleep_until(t + limit).await,
                            None => std::future::pending().await,
                        }
                    };
                    tokio::select! {
                        r = &mut exchange => break r.map(|r| (r, since.unwrap_or_else(Instant::now) + limit)),
                        _ = rx.changed() => {} // `waiting_since` lives here too: never closed
                        _ = expired => return Err(late(&what, limit)),
                    }
                }
            }
        };
        let (resp, at) = resp.map_err(|e| AgentError::Transport(format!("{what}: {}", chain(&e))))?;
        let due = Due { at, limit };
        if resp.status().is_success() {
            return Ok((resp, due));
        }
        let status = resp.status();
        let body = collect_limited(resp.into_body(), ERROR_BODY_MAX, &what, due).await?;
        Err(match serde_json::from_slice::<ErrorBody>(&body) {
            Ok(e) => AgentError::Api {
                status: status.as_u16(),
                code: e.code,
                message: e.message,
            },
            Err(_) => AgentError::Protocol(format!("{status}: {}", String::from_utf8_lossy(&body))),
        })
    }

    /// A call whose answer is only its status (the body, `{}`, is read and dropped).
    async fn call(&self, route: Route, body: ReqBody) -> Result<(), AgentError> {
        let what = format!("{} {}", route.method(), route.uri());
        let (resp, due) = self.request(&route, body, Clock::Agent(self.deadlines.call)).await?;
        collect_limited(resp.into_body(), RECORD_MAX, &what, due)
            .await
            .map(drop)
    }

    /// The response headers of a stream (events, file reads): the body is the caller's.
    async fn open_stream(&self, route: Route, limit: Duration) -> Result<Incoming, AgentError> {
        let (resp, _) = self.request(&route, empty(), Clock::Agent(limit)).await?;
        Ok(resp.into_body())
    }

    async fn call_json<T: serde::de::DeserializeOwned>(
        &self,
        route: Route,
        body: ReqBody,
        max: usize,
        limit: Duration,
    ) -> Result<T, AgentError> {
        let what = format!("{} {}", route.method(), route.uri());
        let (resp, due) = self.request(&route, body, Clock::Agent(limit)).await?;
        let bytes = collect_limited(resp.into_body(), max, &what, due).await?;
        serde_json::from_slice(&bytes).map_err(|e| AgentError::Protocol(format!("{what}: {e}")))
    }

    /// A call answered by one record.
    async fn call_record<T: serde::de::DeserializeOwned>(&self, route: Route, body: ReqBody) -> Result<T, AgentError> {
        self.call_json(route, body, RECORD_MAX, self.deadlines.call).await
    }

    fn json_body<T: serde::Serialize>(v: &T) -> ReqBody {
        bytes_body(serde_json::to_vec(v).expect("serializable"))
    }

    pub async fn health(&self) -> Result<Health, AgentError> {
        self.call_record(Route::Health, empty()).await
    }

    pub async fn metrics(&self) -> Result<Metrics, AgentError> {
        self.call_record(Route::Metrics, empty()).await
    }

    /// Flush the guest's page cache to the disk.
    pub async fn sync(&self) -> Result<(), AgentError> {
        let (resp, due) = self
            .request(&Route::Sync, empty(), Clock::Agent(self.deadlines.slow_call))
            .await?;
        collect_limited(resp.into_body(), RECORD_MAX, "POST /system/sync", due)
            .await
            .map(drop)
    }

    /// Give the guest its identity (after every boot or restore; see `airlock_proto::Identity`).
    pub async fn set_identity(&self, identity: &airlock_proto::Identity) -> Result<(), AgentError> {
        self.call(Route::Identity, Self::json_body(identity)).await
    }

    /// Ask the guest to sync and power off.
    pub async fn shutdown(&self) -> Result<(), AgentError> {
        self.call(Route::Shutdown, empty()).await
    }

    pub async fn spawn(&self, spec: &ProcessSpec) -> Result<ProcessInfo, AgentError> {
        self.call_record(Route::Spawn, Self::json_body(spec)).await
    }

    pub async fn processes(&self) -> Result<Vec<ProcessInfo>, AgentError> {
        self.call_json(Route::Processes, empty(), LIST_MAX, self.deadlines.call)
            .await
    }

    pub async fn process(&self, id: u64) -> Result<ProcessInfo, AgentError> {
        self.call_record(Route::Process { id }, empty()).await
    }

    /// The process's events after `after` (0 = from the start), ending with its exit. The
    /// stream is long-lived (as long as the process); each frame is at most
    /// `airlock_proto::frame::MAX_PAYLOAD` bytes, and a larger length prefix ends it with
    /// [`AgentError::Protocol`] before its payload is buffered.
    pub async fn events(
        &self,
        id: u64,
        after: u64,
    ) -> Result<impl Stream<Item = Result<Event, AgentError>> + Send + 'static, AgentError> {
        let body = self
            .open_stream(Route::Events { id, after }, self.deadlines.call)
            .await?;
        Ok(futures_util::stream::unfold(
            (body, Decoder::default(), false),
            |(mut body, mut dec, done)| async move {
                if done {
                    return None;
                }
                loop {
                    // The decoder holds at most one frame's header and payload plus one HTTP/2
                    // DATA frame (`max_frame_size`): a whole frame is taken out before more is
                    // pushed, and a length prefix over `MAX_PAYLOAD` is an error at once.
                    match dec.next_event() {
                        Ok(Some(ev)) => return Some((Ok(ev), (body, dec, false))),
                        Ok(None) => {}
                        Err(e) => return Some((Err(AgentError::Protocol(e.to_string())), (body, dec, true))),
                    }
                    match body.frame().await {
                        None if dec.pending() == 0 => return None,
                        None => {
                            let err = AgentError::Protocol("event stream ended mid-frame".into());
                            return Some((Err(err), (body, dec, true)));
                        }
                        Some(Err(e)) => return Some((Err(AgentError::Transport(e.to_string())), (body, dec, true))),
                        Some(Ok(frame)) => {
                            if let Ok(data) = frame.into_data() {
                                dec.push(&data);
                            }
                        }
                    }
                }
            },
        ))
    }

    pub async fn write_stdin(&self, id: u64, data: impl Into<Bytes>) -> Result<(), AgentError> {
        self.call(Route::Stdin { id }, bytes_body(data)).await
    }

    pub async fn close_stdin(&self, id: u64) -> Result<(), AgentError> {
        self.call(Route::CloseStdin { id }, empty()).await
    }

    pub async fn signal(&self, id: u64, signal: i32) -> Result<(), AgentError> {
        let body = Self::json_body(&SignalRequest { signal });
        self.call(Route::Signal { id }, body).await
    }

    pub async fn resize(&self, id: u64, size: PtySize) -> Result<(), AgentError> {
        self.call(Route::Resize { id }, Self::json_body(&size)).await
    }

    /// File content as a stream of chunks (each at most one HTTP/2 DATA frame). Long-lived by
    /// design: only the response headers have a deadline.
    pub async fn read_file_stream(
        &self,
        path: &str,
    ) -> Result<impl Stream<Item = Result<Bytes, AgentError>> + Send + 'static, AgentError> {
        let body = self
            .open_stream(Route::ReadFile { path: path.into() }, self.deadlines.call)
            .await?;
        Ok(body
            .into_data_stream()
            .map(|r| r.map_err(|e| AgentError::Transport(e.to_string()))))
    }

    /// A whole file, at most [`READ_FILE_MAX`] bytes, within the call deadline.
    pub async fn read_file(&self, path: &str) -> Result<Bytes, AgentError> {
        let route = Route::ReadFile { path: path.into() };
        let (resp, due) = self.request(&route, empty(), Clock::Agent(self.deadlines.call)).await?;
        collect_limited(resp.into_body(), READ_FILE_MAX, &format!("GET {}", route.uri()), due).await
    }

    /// Write a file from a stream of chunks, creating parent directories. No deadline runs
    /// while `data` is slow; the agent must take each chunk, and answer after the last, within
    /// the call deadline.
    pub async fn write_file_stream<S>(&self, path: &str, user: Option<&str>, data: S) -> Result<FileStat, AgentError>
    where
        S: Stream<Item = Result<Bytes, std::io::Error>> + Send + 'static,
    {
        self.write_file_with_metadata(path, user, &Default::default(), data)
            .await
    }

    /// [`Self::write_file_stream`], the file's user metadata (its `user.e2b.*` xattrs) replaced
    /// by `metadata` (none: cleared).
    pub async fn write_file_with_metadata<S>(
        &self,
        path: &str,
        user: Option<&str>,
        metadata: &std::collections::BTreeMap<String, String>,
        data: S,
    ) -> Result<FileStat, AgentError>
    where
        S: Stream<Item = Result<Bytes, std::io::Error>> + Send + 'static,
    {
        let mut route = WriteFile {
            path: path.into(),
            user: user.map(Into::into),
            ..Default::default()
        };
        // The metadata (up to a few KiB, too much for a header) leads the body, its length in
        // the query.
        let lead = match metadata.is_empty() {
            true => None,
            false => {
                let m = Bytes::from(serde_json::to_vec(metadata).expect("a map of strings"));
                route.metadata_len = m.len();
                Some(Ok(m))
            }
        };
        let data = futures_util::stream::iter(lead).chain(data);
        let body = BodyExt::boxed_unsync(StreamBody::new(data.map(|r| r.map(Frame::data))));
        self.call_record(Route::WriteFile(route), body).await
    }

    pub async fn write_file(
        &self,
        path: &str,
        user: Option<&str>,
        data: impl Into<Bytes>,
    ) -> Result<FileStat, AgentError> {
        let data: Bytes = data.into();
        // Chunked so a large file does not sit in one HTTP/2 DATA frame buffer.
        let chunks: Vec<Result<Bytes, std::io::Error>> = (0..data.len())
            .step_by(256 << 10)
            .map(|i| Ok(data.slice(i..(i + (256 << 10)).min(data.len()))))
            .collect();
        self.write_file_stream(path, user, futures_util::stream::iter(chunks))
            .await
    }

    pub async fn stat(&self, path: &str) -> Result<FileStat, AgentError> {
        self.call_record(Route::Stat { path: path.into() }, empty()).await
    }

    pub async fn list(&self, path: &str, depth: u32) -> Result<Vec<FileStat>, AgentError> {
        self.call_json(
            Route::List {
                path: path.into(),
                depth,
            },
            empty(),
            LIST_MAX,
            self.deadlines.slow_call,
        )
        .await
    }

    pub async fn mkdir(&self, path: &str, user: Option<&str>) -> Result<MkdirResponse, AgentError> {
        let body = Self::json_body(&MkdirRequest {
            path: path.into(),
            user: user.map(Into::into),
        });
        self.call_record(Route::Mkdir, body).await
    }

    pub async fn remove(&self, path: &str) -> Result<(), AgentError> {
        self.call(Route::Remove { path: path.into() }, empty()).await
    }

    pub async fn rename(&self, from: &str, to: &str) -> Result<FileStat, AgentError> {
        let body = Self::json_body(&RenameRequest {
            from: from.into(),
            to: to.into(),
        });
        self.call_record(Route::Rename, body).await
    }

    /// A byte stream to `127.0.0.1:<port>` inside the guest (port forwarding). Closing the write
    /// side ends the guest socket's input; the read side ends when the guest closes. The agent
    /// must answer within the call deadline; the stream itself lives as long as its ends do.
    pub async fn tunnel(&self, port: u16) -> Result<tokio::io::DuplexStream, AgentError> {
        let (ours, theirs) = tokio::io::duplex(256 << 10);
        let (from_client, mut to_client) = tokio::io::split(theirs);
        // The client's EOF ends the request body: EOF in the guest.
        let upstream = tokio_util::io::ReaderStream::with_capacity(from_client, 64 << 10);
        let body = BodyExt::boxed_unsync(StreamBody::new(upstream.map(|r| r.map(Frame::data))));
        let (resp, _) = self
            .request(&Route::Tunnel { port }, body, Clock::Headers(self.deadlines.call))
            .await?;
        let downstream = resp
            .into_body()
            .into_data_stream()
            .map(|r| r.map_err(std::io::Error::other));
        tokio::spawn(async move {
            use tokio::io::AsyncWriteExt;
            let _ = tokio::io::copy(&mut tokio_util::io::StreamReader::new(downstream), &mut to_client).await;
            let _ = to_client.shutdown().await;
        });
        Ok(ours)
    }

    /// Watch a directory; the stream is armed when this returns. Dropping it stops the watch.
    /// Each event is one line of at most [`WATCH_LINE_MAX`] bytes: a longer one ends the stream
    /// with [`AgentError::Protocol`].
    pub async fn watch(
        &self,
        path: &str,
        recursive: bool,
    ) -> Result<impl Stream<Item = Result<WatchEvent, AgentError>> + Send + 'static, AgentError> {
        self.watch_with_entries(path, recursive, false).await
    }

    /// [`Self::watch`]; with `entries`, creates, writes and chmods carry the entry's stat.
    pub async fn watch_with_entries(
        &self,
        path: &str,
        recursive: bool,
        entries: bool,
    ) -> Result<impl Stream<Item = Result<WatchEvent, AgentError>> + Send + 'static, AgentError> {
        let route = Route::Watch {
            path: path.into(),
            recursive,
            entry: entries,
        };
        let body = self.open_stream(route, self.deadlines.slow_call).await?;
        Ok(futures_util::stream::unfold(
            (body, Vec::<u8>::new(), false),
            |(mut body, mut buf, done)| async move {
                if done {
                    return None;
                }
                loop {
                    if let Some(nl) = buf.iter().position(|b| *b == b'\n') {
                        let line: Vec<u8> = buf.drain(..=nl).collect();
                        let ev = serde_json::from_slice(&line[..nl]).map_err(|e| AgentError::Protocol(e.to_string()));
                        return Some((ev, (body, buf, false)));
                    }
                    if buf.len() > WATCH_LINE_MAX {
                        let err = AgentError::Protocol(format!(
                            "watch event longer than the limit of {WATCH_LINE_MAX} bytes"
                        ));
                        return Some((Err(err), (body, Vec::new(), true)));
                    }
                    match body.frame().await? {
                        Err(e) => return Some((Err(AgentError::Transport(e.to_string())), (body, buf, true))),
                        Ok(frame) => {
                            if let Ok(data) = frame.into_data() {
                                buf.extend_from_slice(&data);
                            }
                        }
                    }
                }
            },
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};

    /// Garbage (a line far past the limit, lines of an older session) before `READY`, and the
    /// first bytes of the session right behind it in the same write: the session starts, and
    /// those bytes are still there for HTTP/2.
    #[tokio::test]
    async fn hello_skips_garbage_and_keeps_what_follows_ready() {
        let (host, mut guest) = UnixStream::pair().unwrap();
        let guest = tokio::spawn(async move {
            let mut guest = BufReader::new(&mut guest);
            let mut hello = String::new();
            guest.read_line(&mut hello).await.unwrap();
            let nonce = hello
                .trim_end()
                .strip_prefix(airlock_proto::SESSION_HELLO)
                .unwrap()
                .to_string();
            let mut out = vec![b'x'; 1 << 20];
            out.extend_from_slice(format!("\n{}stale\n", airlock_proto::SESSION_READY).as_bytes());
            out.extend_from_slice(format!("junk{}{nonce}\nSESSION", airlock_proto::SESSION_READY).as_bytes());
            guest.get_mut().write_all(&out).await.unwrap();
        });
        let mut host = BufReader::new(host);
        tokio::time::timeout(Duration::from_secs(10), start_session(&mut host))
            .await
            .expect("in time")
            .expect("the session starts");
        guest.await.unwrap();
        let mut rest = [0u8; 7];
        host.read_exact(&mut rest).await.unwrap();
        assert_eq!(&rest, b"SESSION");
    }
}
