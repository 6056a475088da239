//! The listeners' connections (the plain one, the TLS one, the code-interpreter port): every
//! listener faces the network, so each connection is bounded in time and their number is capped.
//!
//! - **Header read** (`Limits::header_read`): a request head must arrive whole within this time
//!   of its first byte, and the first request within this time of the connection's accept (of the
//!   end of the TLS handshake, which has the same bound). Past it the socket is closed at once: a
//!   client that trickles a head, or connects and says nothing, holds a connection no longer.
//! - **Idle** (`Limits::idle`): a connection with no request in flight (no request being handled,
//!   no response body still being sent) for this long is shut down gracefully (HTTP/1: closed;
//!   HTTP/2: GOAWAY). A long SSE response or a streamed download is a request in flight, never
//!   idle; an upgraded connection (WebSocket, the port proxy) leaves HTTP and these timers.
//! - **Connections** (`Limits::max_connections`): each open socket holds a permit of one
//!   semaphore (upgraded sockets too, until they close). At the cap the listener stops accepting:
//!   further connections wait in the kernel's listen backlog and are taken as permits come back.
//!   They cost no file descriptor and no task while they wait, and they are served (not refused)
//!   once slow connections time out, which happens within the header-read bound; a connection
//!   accepted only to be closed would cost an fd and tell the client nothing it can act on.
//! - **Connections per client** (`Limits::max_connections_per_client`): one client address (an
//!   IPv6 client: its /64, which one host holds whole) holds at most this many of a listener's
//!   connections; past it a new one is reset at once, so one client can no longer take every
//!   permit above while others wait behind it (its excess cannot wait in the backlog as above:
//!   the backlog is every client's, and a waiting one would hold up the others). Loopback counts as one client too (tests and
//!   local tools share it); the default is far above what one SDK client opens (the E2B SDK
//!   pools 20 idle connections per host and multiplexes HTTP/2) and below a tenth of the cap.
//!   Behind a reverse proxy every client is the proxy's address: raise it there.
//!
//! HTTP/1 keeps hyper's own header timer off: it starts when hyper waits for a head, so it would
//! also be the idle time between requests. Here the idle wait ends at a request's first byte, and
//! only then the header clock starts (as Go's `IdleTimeout` / `ReadHeaderTimeout`). On HTTP/2
//! the header clock covers only the first request; hyper's pings (every `ping`) find peers that
//! vanished under a long stream. A ping may go unanswered for as long as the idle timeout: a
//! synchronous HTTP/2 client (the E2B SDK's) reads its socket only while it has a request, so it
//! answers no ping on an idle pooled connection, and closing that connection earlier than its
//! pool keeps it makes the client's next request fail (it writes to a closed socket).

use axum::body::Body;
use axum::Router;
use hyper::body::{Frame, Incoming, SizeHint};
use hyper::service::Service as _;
use hyper::{Request, Version};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::service::TowerToHyperService;
use std::collections::HashMap;
use std::convert::Infallible;
use std::io;
use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpListener;
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};

/// How long a request head may take from its first byte (and a new connection, to its first
/// request).
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a connection may sit with no request in flight: longer than clients keep pooled
/// connections (the E2B SDK keeps them 300 s, `E2B_KEEPALIVE_EXPIRY`), so the server never closes
/// one a client is about to reuse (over TLS + HTTP/2 the SDK's next request then met a closed
/// socket: "EOF occurred in violation of protocol").
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(330);
/// HTTP/2 keep-alive pings this often; a peer that leaves one unanswered for the idle timeout is
/// dropped (see the module doc).
pub const PING_INTERVAL: Duration = Duration::from_secs(60);
/// Open connections per listener.
pub const MAX_CONNECTIONS: usize = 4096;
/// Open connections per client address (an IPv6 /64) on one listener.
pub const MAX_CONNECTIONS_PER_CLIENT: usize = 256;
/// Refused connections are logged at most this often (a client at its cap may retry in a loop).
const REFUSAL_LOG_INTERVAL: Duration = Duration::from_secs(60);

#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub header_read: Duration,
    pub idle: Duration,
    pub ping: Duration,
    pub max_connections: usize,
    pub max_connections_per_client: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            header_read: HEADER_READ_TIMEOUT,
            idle: IDLE_TIMEOUT,
            ping: PING_INTERVAL,
            max_connections: MAX_CONNECTIONS,
            max_connections_per_client: MAX_CONNECTIONS_PER_CLIENT,
        }
    }
}

/// On each request that came over a TLS listener (the console's cookies are then `Secure`).
#[derive(Debug, Clone, Copy)]
pub struct OverTls;

/// Serve `app` on `listener` (over TLS when `tls` is given) until the listener fails for good.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    tls: Option<Arc<rustls::ServerConfig>>,
    limits: Limits,
) -> io::Result<()> {
    let permits = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let clients = Arc::new(Clients::new(limits.max_connections_per_client));
    let app = match tls {
        Some(_) => app.layer(axum::Extension(OverTls)),
        None => app,
    };
    let tls = tls.map(tokio_rustls::TlsAcceptor::from);
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        // Our own header clock (see the module doc), not hyper's.
        .header_read_timeout(None)
        .keep_alive(true);
    builder
        .http2()
        .timer(TokioTimer::new())
        .keep_alive_interval(Some(limits.ping))
        .keep_alive_timeout(limits.idle);
    let builder = Arc::new(builder);
    loop {
        // At the cap, wait here: further connections stay in the backlog (see the module doc).
        let permit = permits
            .clone()
            .acquire_owned()
            .await
            .expect("the semaphore is never closed");
        let (stream, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(e) if is_connection_error(&e) => continue,
            Err(e) => {
                // EMFILE and the like: wait for descriptors to come back rather than spin.
                tracing::warn!("accept on {:?}: {e}", listener.local_addr().ok());
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            }
        };
        let Some(client) = clients.admit(peer.ip()) else {
            // At its cap: reset at once (no FIN handshake, no TIME_WAIT here); the permit returns.
            let _ = stream.set_zero_linger();
            continue;
        };
        let permit = Held {
            _listener: permit,
            _client: client,
        };
        let _ = stream.set_nodelay(true);
        let (app, tls, builder) = (app.clone(), tls.clone(), builder.clone());
        tokio::spawn(async move {
            let conn = Arc::new(Conn::new());
            match tls {
                None => drive(stream, peer, permit, conn, app, &builder, limits).await,
                Some(acceptor) => {
                    match tokio::time::timeout(limits.header_read, acceptor.accept(stream)).await {
                        Ok(Ok(stream)) => {
                            // The first request's clock starts after the handshake.
                            conn.state.lock().unwrap().head_since = Some(Instant::now());
                            drive(stream, peer, permit, conn, app, &builder, limits).await
                        }
                        Ok(Err(e)) => tracing::debug!("TLS handshake: {e}"),
                        Err(_) => tracing::debug!("TLS handshake timed out"),
                    }
                }
            }
        });
    }
}

fn is_connection_error(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionRefused | io::ErrorKind::ConnectionAborted | io::ErrorKind::ConnectionReset
    )
}

/// The open connections of each client address on one listener.
struct Clients {
    max: usize,
    state: Mutex<ClientsState>,
}

struct ClientsState {
    open: HashMap<IpAddr, usize>,
    /// Connections refused since the last log line, and when that was.
    refused: u64,
    logged: Option<Instant>,
}

/// What a connection holds while it is open: its permit of the listener's cap and its place in
/// its client's count.
struct Held {
    _listener: OwnedSemaphorePermit,
    _client: ClientSlot,
}

struct ClientSlot {
    clients: Arc<Clients>,
    key: IpAddr,
}

impl Clients {
    fn new(max: usize) -> Clients {
        Clients {
            max: max.max(1),
            state: Mutex::new(ClientsState {
                open: HashMap::new(),
                refused: 0,
                logged: None,
            }),
        }
    }

    /// A place for one more connection from `peer`, or None at its cap.
    fn admit(self: &Arc<Self>, peer: IpAddr) -> Option<ClientSlot> {
        let key = client_key(peer);
        let mut s = self.state.lock().unwrap();
        let open = s.open.entry(key).or_insert(0);
        if *open < self.max {
            *open += 1;
            return Some(ClientSlot {
                clients: self.clone(),
                key,
            });
        }
        s.refused += 1;
        if s.logged.is_none_or(|t| t.elapsed() >= REFUSAL_LOG_INTERVAL) {
            tracing::warn!(
                "refused {} connection(s) from clients at their cap of {} open connections (the latest from {key})",
                s.refused,
                self.max
            );
            s.refused = 0;
            s.logged = Some(Instant::now());
        }
        None
    }
}

impl Drop for ClientSlot {
    fn drop(&mut self) {
        let mut s = self.clients.state.lock().unwrap();
        if let Some(open) = s.open.get_mut(&self.key) {
            *open -= 1;
            if *open == 0 {
                s.open.remove(&self.key);
            }
        }
    }
}

/// The address a client is counted by: an IPv4 address (also when mapped into IPv6), or an
/// IPv6 address's /64 (a host is routinely handed a whole /64 and picks addresses from it).
fn client_key(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(v4) => IpAddr::V4(v4),
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6(Ipv6Addr::from_bits(v6.to_bits() & !((1u128 << 64) - 1))),
        },
    }
}

/// One connection: hyper serves it while the watchdog below enforces the limits.
async fn drive<S>(
    io: S,
    peer: SocketAddr,
    permit: Held,
    conn: Arc<Conn>,
    app: Router,
    builder: &auto::Builder<TokioExecutor>,
    limits: Limits,
) where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let io = TokioIo::new(Watched {
        io,
        conn: conn.clone(),
        _permit: permit,
    });
    let app = TowerToHyperService::new(app);
    let c = conn.clone();
    let service = hyper::service::service_fn(move |mut req: Request<Incoming>| {
        // The peer's address, as axum's `ConnectInfo` (the sign-in throttle's client).
        req.extensions_mut().insert(axum::extract::ConnectInfo(peer));
        let guard = InFlight::begin(c.clone(), req.version() == Version::HTTP_2);
        let response = app.call(req);
        async move {
            let response = response.await?;
            Ok::<_, Infallible>(response.map(|body| Body::new(Tracked { body, _guard: guard })))
        }
    });
    let serving = builder.serve_connection_with_upgrades(io, service);
    tokio::pin!(serving);
    loop {
        let (deadline, why) = conn.deadline(&limits);
        let changed = conn.changed.notified();
        tokio::select! {
            _ = serving.as_mut() => return,
            _ = changed => continue,
            _ = tokio::time::sleep_until(tokio::time::Instant::from_std(deadline)) => {
                if conn.deadline(&limits).0 > Instant::now() {
                    continue;
                }
                match why {
                    // Closed at once: the socket goes with the connection.
                    Expiry::Head => return,
                    Expiry::Idle => {
                        serving.as_mut().graceful_shutdown();
                        let _ = tokio::time::timeout(limits.header_read, serving.as_mut()).await;
                        return;
                    }
                    Expiry::None => continue,
                }
            }
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Expiry {
    Head,
    Idle,
    None,
}

/// What the watchdog knows of a connection.
struct Conn {
    state: Mutex<Activity>,
    /// Signalled on every change that moves the deadline.
    changed: Notify,
}

struct Activity {
    /// Requests being handled or still sending their response body.
    in_flight: usize,
    /// Since when nothing has been in flight.
    idle_since: Instant,
    /// Since when a request head has been arriving (or the connection waited for its first).
    head_since: Option<Instant>,
    /// An HTTP/2 connection: bytes between requests are frames, not a head.
    h2: bool,
}

impl Conn {
    fn new() -> Conn {
        let now = Instant::now();
        Conn {
            state: Mutex::new(Activity {
                in_flight: 0,
                idle_since: now,
                head_since: Some(now),
                h2: false,
            }),
            changed: Notify::new(),
        }
    }

    fn deadline(&self, limits: &Limits) -> (Instant, Expiry) {
        let s = self.state.lock().unwrap();
        if s.in_flight > 0 {
            // Woken by `changed` when the last request ends.
            return (Instant::now() + Duration::from_secs(24 * 3600), Expiry::None);
        }
        match s.head_since {
            Some(t) => (t + limits.header_read, Expiry::Head),
            None => (s.idle_since + limits.idle, Expiry::Idle),
        }
    }

    /// Bytes came in: between requests on HTTP/1 they start a head, and its clock.
    fn read(&self) {
        let mut s = self.state.lock().unwrap();
        if s.in_flight == 0 && !s.h2 && s.head_since.is_none() {
            s.head_since = Some(Instant::now());
            drop(s);
            self.changed.notify_one();
        }
    }
}

/// A request from its dispatch until its response body is sent (or dropped).
struct InFlight(Arc<Conn>);

impl InFlight {
    fn begin(conn: Arc<Conn>, h2: bool) -> InFlight {
        {
            let mut s = conn.state.lock().unwrap();
            s.in_flight += 1;
            s.head_since = None;
            s.h2 |= h2;
        }
        conn.changed.notify_one();
        InFlight(conn)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        {
            let mut s = self.0.state.lock().unwrap();
            s.in_flight -= 1;
            if s.in_flight == 0 {
                s.idle_since = Instant::now();
            }
        }
        self.0.changed.notify_one();
    }
}

/// A response body that keeps its request in flight until hyper is done with it.
struct Tracked {
    body: Body,
    _guard: InFlight,
}

impl hyper::body::Body for Tracked {
    type Data = <Body as hyper::body::Body>::Data;
    type Error = <Body as hyper::body::Body>::Error;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.get_mut().body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

/// The socket (plaintext, above TLS): reports reads to the watchdog and holds the connection's
/// permits for as long as it is open, upgraded or not.
struct Watched<S> {
    io: S,
    conn: Arc<Conn>,
    _permit: Held,
}

impl<S: AsyncRead + Unpin> AsyncRead for Watched<S> {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let me = self.get_mut();
        let before = buf.filled().len();
        let r = Pin::new(&mut me.io).poll_read(cx, buf);
        if matches!(r, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            me.conn.read();
        }
        r
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Watched<S> {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

/// How much of a refused request's body is read (and dropped) before the refusal is sent.
const DRAIN_BYTES: usize = 1 << 20;
const DRAIN_TIME: Duration = Duration::from_secs(2);

/// A refusal sent before the request's body was read (an upload to a missing sandbox, bad
/// metadata): a client still sending the body (HTTP/1, chunks) sees a connection closed under it
/// as a broken pipe and never reads the reason, so a small body is read first. A large or slow
/// one is not waited for.
pub async fn drained(body: axum::body::Body, refusal: axum::response::Response) -> axum::response::Response {
    let _ = tokio::time::timeout(DRAIN_TIME, axum::body::to_bytes(body, DRAIN_BYTES)).await;
    refusal
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::routing::get;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    const HEADER: Duration = Duration::from_millis(300);
    const IDLE: Duration = Duration::from_millis(800);

    async fn start(app: Router) -> std::net::SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let limits = Limits {
            header_read: HEADER,
            idle: IDLE,
            ping: IDLE,
            max_connections: 16,
            max_connections_per_client: 16,
        };
        tokio::spawn(serve(listener, app, None, limits));
        addr
    }

    /// Read until `needle` shows up; false if the connection ends first.
    async fn read_until(s: &mut tokio::net::TcpStream, needle: &str) -> bool {
        let mut seen = Vec::new();
        let mut buf = [0u8; 1024];
        while !String::from_utf8_lossy(&seen).contains(needle) {
            match tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf)).await {
                Ok(Ok(n)) if n > 0 => seen.extend_from_slice(&buf[..n]),
                _ => return false,
            }
        }
        true
    }

    fn app() -> Router {
        Router::new()
            .route("/", get(|| async { "ok" }))
            // A stream quiet for three idle periods between its events.
            .route(
                "/slow",
                get(|| async {
                    let events = futures_util::stream::unfold(0, |i| async move {
                        if i == 2 {
                            return None;
                        }
                        if i == 1 {
                            tokio::time::sleep(IDLE * 3).await;
                        }
                        Some((Ok::<_, Infallible>(format!("event{i}\n")), i + 1))
                    });
                    Body::from_stream(events)
                }),
            )
            // An upgrade to a byte echo.
            .route(
                "/echo",
                get(|mut req: axum::extract::Request| async move {
                    let upgrade = hyper::upgrade::on(&mut req);
                    tokio::spawn(async move {
                        let mut io = TokioIo::new(upgrade.await.unwrap());
                        let mut buf = [0u8; 64];
                        while let Ok(n) = io.read(&mut buf).await {
                            if n == 0 || io.write_all(&buf[..n]).await.is_err() {
                                break;
                            }
                        }
                    });
                    axum::response::Response::builder()
                        .status(101)
                        .header("connection", "upgrade")
                        .header("upgrade", "echo")
                        .body(Body::empty())
                        .unwrap()
                }),
            )
    }

    #[tokio::test]
    async fn a_quiet_stream_is_not_idle() {
        let addr = start(app()).await;
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(b"GET /slow HTTP/1.1\r\nhost: x\r\n\r\n").await.unwrap();
        assert!(read_until(&mut s, "event0").await);
        assert!(
            read_until(&mut s, "event1").await,
            "the stream outlives the idle timeout"
        );
    }

    #[tokio::test]
    async fn an_upgraded_connection_leaves_the_timers() {
        let addr = start(app()).await;
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(b"GET /echo HTTP/1.1\r\nhost: x\r\nconnection: upgrade\r\nupgrade: echo\r\n\r\n")
            .await
            .unwrap();
        assert!(read_until(&mut s, "\r\n\r\n").await);
        tokio::time::sleep(IDLE * 2).await;
        s.write_all(b"ping").await.unwrap();
        assert!(read_until(&mut s, "ping").await, "the upgraded socket is still open");
    }

    #[tokio::test]
    async fn between_requests_the_idle_timeout_applies_then_the_header_one() {
        let addr = start(app()).await;
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n").await.unwrap();
        assert!(read_until(&mut s, "ok").await);
        // Longer than the header timeout, shorter than the idle one: still open.
        tokio::time::sleep(HEADER * 2).await;
        s.write_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n").await.unwrap();
        assert!(
            read_until(&mut s, "ok").await,
            "a keep-alive connection waits the idle time"
        );
        // A head that starts and stalls is cut at the header timeout.
        s.write_all(b"GET / HTTP/1.1\r\n").await.unwrap();
        let t = Instant::now();
        assert!(!read_until(&mut s, "ok").await);
        let cut = t.elapsed();
        assert!(cut >= HEADER - Duration::from_millis(50) && cut < IDLE, "{cut:?}");
        // And an idle one is closed after the idle timeout.
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n").await.unwrap();
        assert!(read_until(&mut s, "ok").await);
        let t = Instant::now();
        assert!(!read_until(&mut s, "never").await);
        let closed = t.elapsed();
        assert!(closed >= IDLE - Duration::from_millis(50), "{closed:?}");
        assert!(closed < IDLE + HEADER * 2, "{closed:?}");
    }

    #[test]
    fn clients_are_counted_by_ipv4_address_or_ipv6_slash_64() {
        let key = |s: &str| client_key(s.parse().unwrap()).to_string();
        assert_eq!(key("192.0.2.7"), "192.0.2.7");
        assert_eq!(key("::ffff:192.0.2.7"), "192.0.2.7");
        assert_eq!(key("2001:db8:1:2:aaaa:bbbb:cccc:dddd"), "2001:db8:1:2::");
        assert_eq!(key("2001:db8:1:2::1"), key("2001:db8:1:2:ffff::9"));
        assert_ne!(key("2001:db8:1:2::1"), key("2001:db8:1:3::1"));
    }

    #[tokio::test]
    async fn a_silent_connection_is_closed_at_the_header_timeout() {
        let addr = start(app()).await;
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        let t = Instant::now();
        assert!(!read_until(&mut s, "never").await);
        let closed = t.elapsed();
        assert!(
            closed >= HEADER - Duration::from_millis(50) && closed < IDLE,
            "{closed:?}"
        );
    }
}
