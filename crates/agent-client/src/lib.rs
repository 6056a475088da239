//! Host side of the guest agent protocol: an HTTP/2 client over the VM's channel socket.
//!
//! The transport is any byte stream ([`AgentClient::handshake`]); on a node it is the unix socket
//! QEMU exposes for the virtio-serial port ([`AgentClient::connect`]). Each method is one call of `airlock_proto`'s API.
//!
//! The guest is not trusted: root inside it can replace the agent and speak this protocol
//! itself. So everything read from the channel is bounded, and a misbehaving agent can only fail
//! the calls of its own sandbox:
//! - in size: every reply body this client collects is read through [`Limited`] (see the
//!   `*_MAX` constants), a watch line is capped, event frames are capped by
//!   `airlock_proto::frame::MAX_PAYLOAD` (the decoder refuses a larger length prefix before
//!   buffering its payload), response headers by hyper's HTTP/2 default (16 KiB), and data the
//!   host has not read yet by the HTTP/2 flow-control windows set in [`AgentClient::handshake`];
//! - in time: every call that waits for an answer has a deadline ([`Deadlines`]); streams that
//!   are long-lived by design (events, watches, file reads, tunnels) only have a deadline for
//!   their response headers.

mod calls;
mod session;
mod transport;

pub use session::{AgentClient, Sign};
pub use transport::{chain as error_chain, ReqBody};

use airlock_proto::ErrorCode;
use std::time::Duration;

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

/// How a call to an agent ended, as the call metrics count it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CallOutcome {
    /// The agent answered with success (for a stream: its response headers).
    Ok,
    /// The agent answered with an error of its own.
    Refused,
    /// No usable answer: the channel is down, the deadline passed, or the reply was malformed.
    Failed,
}

impl CallOutcome {
    pub fn as_str(self) -> &'static str {
        match self {
            CallOutcome::Ok => "ok",
            CallOutcome::Refused => "refused",
            CallOutcome::Failed => "failed",
        }
    }
}

/// Told of every call this process makes to any agent: the route's name
/// ([`airlock_proto::routes::Route::name`]), the time to its answer's headers, how it ended.
pub type CallObserver = Box<dyn Fn(&'static str, Duration, CallOutcome) + Send + Sync>;

static CALL_OBSERVER: std::sync::OnceLock<CallObserver> = std::sync::OnceLock::new();

/// Set the process's call observer (the server's metrics); only the first one set counts.
pub fn observe_calls(observer: CallObserver) {
    let _ = CALL_OBSERVER.set(observer);
}

pub(crate) fn observed(route: &'static str, took: Duration, outcome: CallOutcome) {
    if let Some(observer) = CALL_OBSERVER.get() {
        observer(route, took, outcome);
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
