//! The session on a VM's channel: the HELLO/READY resynchronization, then one HTTP/2
//! connection that every clone of an `AgentClient` shares.

use super::transport::ReqBody;
use super::*;
use airlock_proto::Health;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::BufReader;
use tokio::net::UnixStream;

/// How long to wait for `READY` before saying `HELLO` again: the guest may still be booting (its
/// agent answers the newest of the hellos queued meanwhile, so a short period costs a booting
/// guest nothing and saves up to a period on every boot), or a VM restored from a save made while
/// a host was connected still serves that host's session, and the first hello only ends it.
pub(super) const HELLO_RETRY: Duration = Duration::from_millis(100);

/// Resynchronize the channel: say hello with a fresh nonce until the agent answers it. The
/// channel is read a buffer at a time (a guest flooding it must not cost the host a syscall per
/// byte for as long as the hello lasts); what follows `READY` stays in the buffer for the
/// HTTP/2 session.
pub(super) async fn start_session(stream: &mut BufReader<UnixStream>) -> Result<(), AgentError> {
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt};
    let io_err = |e: std::io::Error| AgentError::Transport(format!("session start: {e}"));
    loop {
        let nonce = nonce();
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

/// 8 random bytes in hex: tells this hello's `READY` from an older session's.
fn nonce() -> String {
    let mut buf = [0u8; 8];
    getrandom::getrandom(&mut buf).expect("the kernel's CSPRNG is readable");
    hex::encode(buf)
}

/// A connected agent session. Cheap to clone; all clones share one HTTP/2 connection.
#[derive(Clone)]
pub struct AgentClient {
    pub(super) send: hyper::client::conn::http2::SendRequest<ReqBody>,
    pub(super) deadlines: Deadlines,
    /// The task driving the connection (see [`AgentClient::close`]).
    pub(super) conn: tokio::task::AbortHandle,
    /// What each request's path follows: `http://agent` on the channel itself, a node's agent
    /// route for a caller on another host ([`AgentClient::at`]).
    pub(super) base: Arc<str>,
    pub(super) authorization: Option<http::HeaderValue>,
    /// Headers made for each request from its method and URI (a node's signature of it).
    pub(super) sign: Option<Sign>,
}

/// What signs each request of a client for the node that passes it on: its headers, from the
/// request's method and URI.
pub type Sign = Arc<dyn Fn(&http::Method, &http::Uri) -> Vec<(http::HeaderName, http::HeaderValue)> + Send + Sync>;

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
        Self::handshake(stream).await
    }

    /// Speak HTTP/2 to the agent over `io`, a stream already at the start of a session: the
    /// channel after its resynchronization here, or whatever carries it to a remote node.
    pub async fn handshake<IO>(io: IO) -> Result<Self, AgentError>
    where
        IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    {
        // The windows bound what the agent can make the host buffer for replies it has not read
        // yet: 4 MiB per stream, 8 MiB for the connection.
        let (send, conn) = hyper::client::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
            .initial_stream_window_size(4 << 20)
            .initial_connection_window_size(8 << 20)
            .max_frame_size(256 << 10)
            .handshake(hyper_util::rt::TokioIo::new(io))
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
            base: Arc::from("http://agent"),
            authorization: None,
            sign: None,
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
    /// The same connection, its calls sent under `base` (`http://node/vms/<id>/agent`) with
    /// `authorization`: an agent reached through the node that holds its VM, which passes each
    /// call on ([`AgentClient::forward`]).
    pub fn at(&self, base: &str, authorization: Option<http::HeaderValue>) -> Self {
        Self {
            base: Arc::from(base.trim_end_matches('/')),
            authorization,
            ..self.clone()
        }
    }

    /// The same client, each request signed by `sign` (its headers added to the request's).
    pub fn signed_by(mut self, sign: Sign) -> Self {
        self.sign = Some(sign);
        self
    }

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
