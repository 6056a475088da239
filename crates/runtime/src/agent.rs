//! Host side of the guest agent protocol: an HTTP/2 client over the VM's channel socket.
//!
//! The transport is any byte stream; today it is the unix socket QEMU exposes for the
//! virtio-serial port. Each method is one call of `airlock_proto`'s API.

use airlock_proto::frame::{Decoder, Event};
use airlock_proto::{
    ErrorBody, ErrorCode, FileStat, Health, Metrics, MkdirRequest, MkdirResponse, ProcessInfo, ProcessSpec, PtySize,
    RenameRequest, SignalRequest, WatchEvent,
};
use bytes::Bytes;
use futures_util::{Stream, StreamExt};
use http::{Method, Request};
use http_body_util::{combinators::UnsyncBoxBody, BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use std::path::Path;
use std::time::Duration;
use tokio::net::UnixStream;

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

/// How long to wait for `READY` before saying `HELLO` again (the guest may still be booting, or
/// may have swallowed the first hello into a dying session).
const HELLO_RETRY: Duration = Duration::from_millis(1000);

/// Resynchronize the channel: say hello with a fresh nonce until the agent answers it.
async fn start_session(stream: &mut UnixStream) -> Result<(), AgentError> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let io_err = |e: std::io::Error| AgentError::Transport(format!("session start: {e}"));
    loop {
        let nonce = crate::random::random_hex(8);
        stream
            .write_all(format!("{}{nonce}\n", airlock_proto::SESSION_HELLO).as_bytes())
            .await
            .map_err(io_err)?;
        let want = format!("{}{nonce}", airlock_proto::SESSION_READY);
        let wait_ready = async {
            let mut line = Vec::with_capacity(64);
            loop {
                let mut b = [0u8; 1];
                if stream.read(&mut b).await? == 0 {
                    return Err(std::io::Error::from(std::io::ErrorKind::UnexpectedEof));
                }
                if b[0] != b'\n' {
                    line.push(b[0]);
                    if line.len() > airlock_proto::SESSION_LINE_MAX {
                        line.clear();
                    }
                    continue;
                }
                // Bytes of an older session may precede our line: match its end.
                if line.ends_with(want.as_bytes()) {
                    return Ok(());
                }
                line.clear();
            }
        };
        match tokio::time::timeout(HELLO_RETRY, wait_ready).await {
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
}

fn empty() -> ReqBody {
    Full::new(Bytes::new()).map_err(|n| match n {}).boxed_unsync()
}

fn bytes_body(b: impl Into<Bytes>) -> ReqBody {
    Full::new(b.into()).map_err(|n| match n {}).boxed_unsync()
}

fn q(value: &str) -> String {
    url::form_urlencoded::byte_serialize(value.as_bytes()).collect()
}

impl AgentClient {
    /// Open a session on the channel socket (does not wait for the guest).
    pub async fn connect(socket: &Path) -> Result<Self, AgentError> {
        let mut stream = UnixStream::connect(socket)
            .await
            .map_err(|e| AgentError::Transport(format!("connect {}: {e}", socket.display())))?;
        start_session(&mut stream).await?;
        let (send, conn) = hyper::client::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
            .initial_stream_window_size(4 << 20)
            .initial_connection_window_size(8 << 20)
            .max_frame_size(256 << 10)
            .handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .map_err(|e| AgentError::Transport(format!("handshake: {e}")))?;
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!("agent connection ended: {e}");
            }
        });
        Ok(Self { send })
    }

    /// Connect and wait until the agent answers `/health`, up to `limit`.
    pub async fn connect_ready(socket: &Path, limit: Duration) -> Result<(Self, Health), AgentError> {
        let attempt = async {
            // The VMM creates the socket shortly after it starts: retry until it is there.
            let client = loop {
                match Self::connect(socket).await {
                    Ok(c) => break c,
                    Err(e) => {
                        tracing::trace!("agent connect: {e}");
                        tokio::time::sleep(Duration::from_millis(10)).await
                    }
                }
            };
            let health = client.health().await?;
            Ok::<_, AgentError>((client, health))
        };
        tokio::time::timeout(limit, attempt)
            .await
            .map_err(|_| AgentError::Transport(format!("agent did not answer within {limit:?}")))?
    }

    pub fn is_closed(&self) -> bool {
        self.send.is_closed()
    }

    async fn call(&self, method: Method, uri: &str, body: ReqBody) -> Result<hyper::Response<Incoming>, AgentError> {
        let req = Request::builder()
            .method(method)
            .uri(format!("http://agent{uri}"))
            .body(body)
            .expect("valid request");
        let mut send = self.send.clone();
        send.ready().await.map_err(|e| AgentError::Transport(e.to_string()))?;
        let resp = send
            .send_request(req)
            .await
            .map_err(|e| AgentError::Transport(e.to_string()))?;
        if resp.status().is_success() {
            return Ok(resp);
        }
        let status = resp.status();
        let body = resp
            .into_body()
            .collect()
            .await
            .map_err(|e| AgentError::Transport(e.to_string()))?
            .to_bytes();
        Err(match serde_json::from_slice::<ErrorBody>(&body) {
            Ok(e) => AgentError::Api {
                status: status.as_u16(),
                code: e.code,
                message: e.message,
            },
            Err(_) => AgentError::Protocol(format!("{status}: {}", String::from_utf8_lossy(&body))),
        })
    }

    async fn call_json<T: serde::de::DeserializeOwned>(
        &self,
        method: Method,
        uri: &str,
        body: ReqBody,
    ) -> Result<T, AgentError> {
        let resp = self.call(method, uri, body).await?;
        let bytes = resp
            .into_body()
            .collect()
            .await
            .map_err(|e| AgentError::Transport(e.to_string()))?
            .to_bytes();
        serde_json::from_slice(&bytes).map_err(|e| AgentError::Protocol(format!("{uri}: {e}")))
    }

    fn json_body<T: serde::Serialize>(v: &T) -> ReqBody {
        bytes_body(serde_json::to_vec(v).expect("serializable"))
    }

    pub async fn health(&self) -> Result<Health, AgentError> {
        self.call_json(Method::GET, "/health", empty()).await
    }

    pub async fn metrics(&self) -> Result<Metrics, AgentError> {
        self.call_json(Method::GET, "/metrics", empty()).await
    }

    /// Flush the guest's page cache to the disk.
    pub async fn sync(&self) -> Result<(), AgentError> {
        self.call(Method::POST, "/system/sync", empty()).await.map(drop)
    }

    /// Ask the guest to sync and power off.
    pub async fn shutdown(&self) -> Result<(), AgentError> {
        self.call(Method::POST, "/system/shutdown", empty()).await.map(drop)
    }

    pub async fn spawn(&self, spec: &ProcessSpec) -> Result<ProcessInfo, AgentError> {
        self.call_json(Method::POST, "/processes", Self::json_body(spec)).await
    }

    pub async fn processes(&self) -> Result<Vec<ProcessInfo>, AgentError> {
        self.call_json(Method::GET, "/processes", empty()).await
    }

    pub async fn process(&self, id: u64) -> Result<ProcessInfo, AgentError> {
        self.call_json(Method::GET, &format!("/processes/{id}"), empty()).await
    }

    /// The process's events after `after` (0 = from the start), ending with its exit.
    pub async fn events(
        &self,
        id: u64,
        after: u64,
    ) -> Result<impl Stream<Item = Result<Event, AgentError>> + Send + 'static, AgentError> {
        let resp = self
            .call(Method::GET, &format!("/processes/{id}/events?after={after}"), empty())
            .await?;
        let body = resp.into_body();
        Ok(futures_util::stream::unfold(
            (body, Decoder::default(), false),
            |(mut body, mut dec, done)| async move {
                if done {
                    return None;
                }
                loop {
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
        self.call(Method::POST, &format!("/processes/{id}/stdin"), bytes_body(data))
            .await
            .map(drop)
    }

    pub async fn close_stdin(&self, id: u64) -> Result<(), AgentError> {
        self.call(Method::POST, &format!("/processes/{id}/stdin/close"), empty())
            .await
            .map(drop)
    }

    pub async fn signal(&self, id: u64, signal: i32) -> Result<(), AgentError> {
        let body = Self::json_body(&SignalRequest { signal });
        self.call(Method::POST, &format!("/processes/{id}/signal"), body)
            .await
            .map(drop)
    }

    pub async fn resize(&self, id: u64, size: PtySize) -> Result<(), AgentError> {
        self.call(Method::POST, &format!("/processes/{id}/resize"), Self::json_body(&size))
            .await
            .map(drop)
    }

    /// File content as a stream of chunks.
    pub async fn read_file_stream(
        &self,
        path: &str,
    ) -> Result<impl Stream<Item = Result<Bytes, AgentError>> + Send + 'static, AgentError> {
        let resp = self
            .call(Method::GET, &format!("/files?path={}", q(path)), empty())
            .await?;
        let body = resp.into_body();
        Ok(body
            .into_data_stream()
            .map(|r| r.map_err(|e| AgentError::Transport(e.to_string()))))
    }

    pub async fn read_file(&self, path: &str) -> Result<Bytes, AgentError> {
        let resp = self
            .call(Method::GET, &format!("/files?path={}", q(path)), empty())
            .await?;
        Ok(resp
            .into_body()
            .collect()
            .await
            .map_err(|e| AgentError::Transport(e.to_string()))?
            .to_bytes())
    }

    /// Write a file from a stream of chunks, creating parent directories.
    pub async fn write_file_stream<S>(&self, path: &str, user: Option<&str>, data: S) -> Result<FileStat, AgentError>
    where
        S: Stream<Item = Result<Bytes, std::io::Error>> + Send + 'static,
    {
        let mut uri = format!("/files?path={}", q(path));
        if let Some(u) = user {
            uri.push_str(&format!("&user={}", q(u)));
        }
        let body = BodyExt::boxed_unsync(StreamBody::new(data.map(|r| r.map(Frame::data))));
        self.call_json(Method::PUT, &uri, body).await
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
        self.call_json(Method::GET, &format!("/files/stat?path={}", q(path)), empty())
            .await
    }

    pub async fn list(&self, path: &str, depth: u32) -> Result<Vec<FileStat>, AgentError> {
        self.call_json(
            Method::GET,
            &format!("/files/list?path={}&depth={depth}", q(path)),
            empty(),
        )
        .await
    }

    pub async fn mkdir(&self, path: &str, user: Option<&str>) -> Result<MkdirResponse, AgentError> {
        let body = Self::json_body(&MkdirRequest {
            path: path.into(),
            user: user.map(Into::into),
        });
        self.call_json(Method::POST, "/files/mkdir", body).await
    }

    pub async fn remove(&self, path: &str) -> Result<(), AgentError> {
        self.call(Method::DELETE, &format!("/files?path={}", q(path)), empty())
            .await
            .map(drop)
    }

    pub async fn rename(&self, from: &str, to: &str) -> Result<FileStat, AgentError> {
        let body = Self::json_body(&RenameRequest {
            from: from.into(),
            to: to.into(),
        });
        self.call_json(Method::POST, "/files/rename", body).await
    }

    /// A byte stream to `127.0.0.1:<port>` inside the guest (port forwarding). Closing the write
    /// side ends the guest socket's input; the read side ends when the guest closes.
    pub async fn tunnel(&self, port: u16) -> Result<tokio::io::DuplexStream, AgentError> {
        let (ours, theirs) = tokio::io::duplex(256 << 10);
        let (from_client, mut to_client) = tokio::io::split(theirs);
        // The client's EOF ends the request body: EOF in the guest.
        let upstream = tokio_util::io::ReaderStream::with_capacity(from_client, 64 << 10);
        let body = BodyExt::boxed_unsync(StreamBody::new(upstream.map(|r| r.map(Frame::data))));
        let resp = self.call(Method::POST, &format!("/tcp/{port}"), body).await?;
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
    pub async fn watch(
        &self,
        path: &str,
        recursive: bool,
    ) -> Result<impl Stream<Item = Result<WatchEvent, AgentError>> + Send + 'static, AgentError> {
        let resp = self
            .call(
                Method::GET,
                &format!("/files/watch?path={}&recursive={recursive}", q(path)),
                empty(),
            )
            .await?;
        let body = resp.into_body();
        Ok(futures_util::stream::unfold(
            (body, Vec::<u8>::new()),
            |(mut body, mut buf)| async move {
                loop {
                    if let Some(nl) = buf.iter().position(|b| *b == b'\n') {
                        let line: Vec<u8> = buf.drain(..=nl).collect();
                        let ev = serde_json::from_slice(&line[..nl]).map_err(|e| AgentError::Protocol(e.to_string()));
                        return Some((ev, (body, buf)));
                    }
                    match body.frame().await? {
                        Err(e) => return Some((Err(AgentError::Transport(e.to_string())), (body, buf))),
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
