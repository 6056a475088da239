//! Passing a decided connection's bytes on: as bytes both ways ([`splice`]), or, on a plain-HTTP
//! connection, request by request ([`http`]): every request head the guest sends is judged before
//! it is passed on (framed by `http1`); responses pass as bytes.
//!
//! A refused request is not passed on; the upstream gets EOF, the responses to what came before
//! it are passed on until the upstream closes (or is quiet for [`DRAIN_QUIET`]), then the guest
//! gets the 403 and the connection closes. An upgrade is passed on only as a connection's first
//! request, so the first answer back is its answer: a `101` to `websocket` makes the rest of the
//! connection opaque (the allowed site's own protocol); a `101` to anything else (h2c would name
//! hosts in its own frames) is not passed on, and the connection is refused.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot};
use tokio::time::{timeout, Instant};

use crate::http1::{RequestFramer, Step};
use crate::policy::Decision;
use crate::sandbox::{ByteCounts, Path, SandboxEgress};
use crate::sniff::{self, Sniffed};

/// After a refused request, how long the upstream may stay quiet before the 403 goes out.
const DRAIN_QUIET: Duration = Duration::from_secs(2);
const OTHER_UPGRADE: &str = "upgrade to a protocol other than websocket";

/// The answer a refused HTTP request gets.
pub(crate) fn denied_reply(destination: &str, rule: &str) -> Vec<u8> {
    let body = format!("airlock egress denied: {destination} ({rule})\n");
    format!(
        "HTTP/1.1 403 Forbidden\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// When a connection last moved a byte, in ms since `start`; the watchdog closes it after `idle`.
/// The bytes it passes on are counted into its sandbox's [`ByteCounts`] as they go.
struct Activity {
    start: Instant,
    last: AtomicU64,
    bytes: Arc<ByteCounts>,
}

/// Which way bytes went: from the sandbox, or to it.
#[derive(Clone, Copy)]
enum Way {
    Sent,
    Received,
}

impl Activity {
    fn new(bytes: Arc<ByteCounts>) -> Arc<Self> {
        Arc::new(Activity {
            start: Instant::now(),
            last: AtomicU64::new(0),
            bytes,
        })
    }

    fn touch(&self) {
        self.last
            .store(self.start.elapsed().as_millis() as u64, Ordering::Relaxed);
    }

    /// `n` bytes passed on `way`.
    fn moved(&self, way: Way, n: usize) {
        self.touch();
        let counter = match way {
            Way::Sent => &self.bytes.sent,
            Way::Received => &self.bytes.received,
        };
        counter.fetch_add(n as u64, Ordering::Relaxed);
    }

    /// Ends once nothing moved for `idle`.
    async fn watchdog(&self, idle: Duration) {
        loop {
            let since = (self.start.elapsed().as_millis() as u64).saturating_sub(self.last.load(Ordering::Relaxed));
            let since = Duration::from_millis(since);
            if since >= idle {
                return;
            }
            tokio::time::sleep(idle - since).await;
        }
    }
}

/// Writes `head` (what was read while sniffing) to `upstream`, then copies both ways until both
/// sides are done or nothing moved for `idle`. Each side's EOF is passed on as a half-close.
pub(crate) async fn splice(
    client: TcpStream,
    mut upstream: TcpStream,
    head: Vec<u8>,
    idle: Duration,
    bytes: Arc<ByteCounts>,
) {
    if !head.is_empty()
        && timeout(idle, upstream.write_all(&head))
            .await
            .map(|r| r.is_err())
            .unwrap_or(true)
    {
        return;
    }
    let activity = Activity::new(bytes);
    activity.moved(Way::Sent, head.len());
    let (cr, cw) = client.into_split();
    let (ur, uw) = upstream.into_split();
    tokio::select! {
        _ = async { tokio::join!(pump(cr, uw, &activity, Way::Sent), pump(ur, cw, &activity, Way::Received)) } => {}
        _ = activity.watchdog(idle) => {}
    }
}

async fn pump(mut from: OwnedReadHalf, mut to: OwnedWriteHalf, activity: &Activity, way: Way) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        match from.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                activity.touch();
                if to.write_all(&buf[..n]).await.is_err() {
                    break;
                }
                activity.moved(way, n);
            }
        }
    }
    let _ = to.shutdown().await;
}

/// Judges a request head's name on a connection already decided: `Err` is the denial
/// (destination, decision) to record and answer.
pub(crate) type Judge<'a> = &'a (dyn Fn(&Sniffed) -> Result<(), (String, Decision)> + Sync);

pub(crate) struct HttpRelay<'a> {
    pub sandbox: &'a SandboxEgress,
    /// The connection's destination as recorded, for refusals that are not about a name.
    pub destination: &'a str,
    pub judge: Judge<'a>,
    /// The largest request (and response) head.
    pub max_head: usize,
    pub idle: Duration,
}

/// From the requests' side to the responses' side.
enum Ctl {
    /// The first request asks to switch protocols: read its answer and say what it was.
    Upgrade {
        websocket: bool,
        switched: oneshot::Sender<Switch>,
    },
    /// A request was refused: once the upstream is done, append this and close.
    Deny(Vec<u8>),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Switch {
    /// A `101` to websocket, passed on: the rest is opaque.
    Yes,
    /// A final answer, passed on: still HTTP.
    No,
    /// A `101` to another protocol: not passed on, the connection refused.
    Refused,
    /// The upstream closed or answered something that is not HTTP.
    Closed,
}

/// Relays a plain-HTTP connection: `first` (the bytes read while sniffing) and everything after
/// it from the guest, framed and judged request by request.
pub(crate) async fn http(client: TcpStream, upstream: TcpStream, first: Vec<u8>, relay: HttpRelay<'_>) {
    let activity = Activity::new(relay.sandbox.bytes());
    let (cr, cw) = client.into_split();
    let (ur, uw) = upstream.into_split();
    let (ctl, ctl_rx) = mpsc::channel(2);
    let requests = Requests {
        framer: RequestFramer::new(relay.max_head),
        uw,
        ctl,
        relay: &relay,
        activity: &activity,
    };
    tokio::select! {
        _ = async { tokio::join!(requests.run(cr, first), responses(ur, cw, ctl_rx, &relay, &activity)) } => {}
        _ = activity.watchdog(relay.idle) => {}
    }
}

/// What to do after some of the guest's bytes.
enum Flow {
    Continue,
    /// Refused or failed: pass nothing more on.
    Stop,
    /// Switched protocols: pass everything on as bytes.
    Opaque,
}

struct Requests<'a> {
    framer: RequestFramer,
    uw: OwnedWriteHalf,
    ctl: mpsc::Sender<Ctl>,
    relay: &'a HttpRelay<'a>,
    activity: &'a Activity,
}

impl Requests<'_> {
    async fn run(mut self, mut cr: OwnedReadHalf, first: Vec<u8>) {
        let mut flow = self.feed(&first).await;
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            match flow {
                Flow::Continue => {}
                Flow::Opaque => return pump(cr, self.uw, self.activity, Way::Sent).await,
                Flow::Stop => {
                    // Read and drop what the guest still sends, so closing doesn't reset the
                    // connection under the answer it is owed.
                    while let Ok(n) = cr.read(&mut buf).await {
                        if n == 0 {
                            break;
                        }
                    }
                    return;
                }
            }
            match cr.read(&mut buf).await {
                Ok(0) | Err(_) => {
                    let _ = self.uw.shutdown().await;
                    return;
                }
                Ok(n) => {
                    self.activity.touch();
                    flow = self.feed(&buf[..n]).await;
                }
            }
        }
    }

    async fn feed(&mut self, mut input: &[u8]) -> Flow {
        loop {
            match self.framer.step(&mut input) {
                Step::More => return Flow::Continue,
                Step::Pass(bytes) => {
                    if self.write(bytes).await.is_err() {
                        return Flow::Stop;
                    }
                }
                Step::Refuse(why) => return self.deny(self.relay.destination.to_string(), Decision::deny(why)).await,
                Step::Head(head) => {
                    let structural = if head.connect {
                        Some("CONNECT is not proxied")
                    } else if head.upgrade.is_some() && head.index > 1 {
                        Some("upgrade after the connection's first request")
                    } else if head.upgrade.is_some() && head.has_body {
                        Some("upgrade request with a body")
                    } else {
                        None
                    };
                    let verdict = match structural {
                        Some(rule) => Err((self.relay.destination.to_string(), Decision::deny(rule))),
                        None => (self.relay.judge)(&head.name),
                    };
                    if let Err((destination, decision)) = verdict {
                        return self.deny(destination, decision).await;
                    }
                    let Some(upgrade) = head.upgrade else {
                        if self.write(&head.bytes).await.is_err() {
                            return Flow::Stop;
                        }
                        continue;
                    };
                    // Asked before the head goes out, so the answer is read as its answer.
                    let (switched, answer) = oneshot::channel();
                    let websocket = upgrade == crate::http1::Upgrade::WebSocket;
                    if self.ctl.send(Ctl::Upgrade { websocket, switched }).await.is_err()
                        || self.write(&head.bytes).await.is_err()
                    {
                        return Flow::Stop;
                    }
                    match answer.await.unwrap_or(Switch::Closed) {
                        Switch::Yes => {
                            return match self.write(input).await {
                                Ok(()) => Flow::Opaque,
                                Err(_) => Flow::Stop,
                            };
                        }
                        Switch::No => {}
                        Switch::Refused => {
                            let d = Decision::deny(OTHER_UPGRADE);
                            self.relay.sandbox.record(Path::Tcp, self.relay.destination, &d);
                            return Flow::Stop;
                        }
                        Switch::Closed => return Flow::Stop,
                    }
                }
            }
        }
    }

    async fn write(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        if bytes.is_empty() {
            return Ok(());
        }
        self.uw.write_all(bytes).await?;
        self.activity.moved(Way::Sent, bytes.len());
        Ok(())
    }

    /// Records the denial, closes the upstream's side, and has the 403 follow the answers due.
    async fn deny(&mut self, destination: String, decision: Decision) -> Flow {
        self.relay.sandbox.record(Path::Tcp, &destination, &decision);
        let _ = self
            .ctl
            .send(Ctl::Deny(denied_reply(&destination, &decision.rule)))
            .await;
        let _ = self.uw.shutdown().await;
        Flow::Stop
    }
}

async fn responses(
    mut ur: OwnedReadHalf,
    mut cw: OwnedWriteHalf,
    mut ctl: mpsc::Receiver<Ctl>,
    relay: &HttpRelay<'_>,
    activity: &Activity,
) {
    let mut buf = vec![0u8; 64 * 1024];
    let mut deny = None;
    let mut listening = true;
    loop {
        tokio::select! {
            biased;
            c = ctl.recv(), if listening => match c {
                None => listening = false,
                Some(Ctl::Deny(reply)) => {
                    deny = Some(reply);
                    listening = false;
                }
                Some(Ctl::Upgrade { websocket, switched }) => {
                    let switch = upgrade_answer(&mut ur, &mut cw, websocket, relay, activity).await;
                    let _ = switched.send(switch);
                    match switch {
                        Switch::Yes | Switch::No => {}
                        Switch::Refused => {
                            deny = Some(denied_reply(relay.destination, OTHER_UPGRADE));
                            break;
                        }
                        Switch::Closed => break,
                    }
                }
            },
            n = read_some(&mut ur, &mut buf, deny.is_some()) => match n {
                Some(n) => {
                    activity.touch();
                    if cw.write_all(&buf[..n]).await.is_err() {
                        return;
                    }
                    activity.moved(Way::Received, n);
                }
                None => break,
            },
        }
    }
    if let Some(reply) = deny {
        let _ = timeout(DRAIN_QUIET, cw.write_all(&reply)).await;
    }
    let _ = cw.shutdown().await;
}

/// A read of at least one byte (None: EOF, an error, or, `draining`, [`DRAIN_QUIET`] of quiet).
async fn read_some(ur: &mut OwnedReadHalf, buf: &mut [u8], draining: bool) -> Option<usize> {
    let read = async {
        match ur.read(buf).await {
            Ok(n) if n > 0 => Some(n),
            _ => None,
        }
    };
    if draining {
        timeout(DRAIN_QUIET, read).await.ok().flatten()
    } else {
        read.await
    }
}

/// Reads the answer to an upgrade request: interim answers are passed on, a final one too (still
/// HTTP), a `101` only if it switches to websocket as asked.
async fn upgrade_answer(
    ur: &mut OwnedReadHalf,
    cw: &mut OwnedWriteHalf,
    websocket: bool,
    relay: &HttpRelay<'_>,
    activity: &Activity,
) -> Switch {
    let mut head = Vec::new();
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        loop {
            let mut headers = [httparse::EMPTY_HEADER; sniff::MAX_HEADERS];
            let mut resp = httparse::Response::new(&mut headers);
            let (len, code, to_websocket) = match resp.parse(&head) {
                Ok(httparse::Status::Partial) => break,
                Err(_) => return Switch::Closed,
                Ok(httparse::Status::Complete(len)) => (
                    len,
                    resp.code.unwrap_or(0),
                    resp.headers.iter().any(|h| {
                        h.name.eq_ignore_ascii_case("upgrade")
                            && std::str::from_utf8(h.value).is_ok_and(|v| v.trim().eq_ignore_ascii_case("websocket"))
                    }),
                ),
            };
            let (pass, switch) = match code {
                101 if websocket && to_websocket => (head.len(), Some(Switch::Yes)),
                101 => return Switch::Refused,
                100..=199 => (len, None),
                _ => (head.len(), Some(Switch::No)),
            };
            if cw.write_all(&head[..pass]).await.is_err() {
                return Switch::Closed;
            }
            activity.moved(Way::Received, pass);
            match switch {
                Some(s) => return s,
                None => {
                    head.drain(..len);
                }
            }
        }
        if head.len() >= relay.max_head {
            return Switch::Closed;
        }
        match timeout(relay.idle, ur.read(&mut buf)).await {
            Ok(Ok(n)) if n > 0 => {
                activity.touch();
                head.extend_from_slice(&buf[..n]);
            }
            _ => return Switch::Closed,
        }
    }
}
