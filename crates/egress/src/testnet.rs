//! A small "internet" in network namespaces, for this crate's tests and the egress bench (not for
//! production use). Only TEST-NET addresses, only in namespaces made here; nothing is routed
//! through the machine's own namespace.
//!
//! ```text
//!  sandbox ns                host ns ("the uplink": proxy + DNS responder run here)      internet ns
//!  eth0 192.0.2.2/26 <-veth-> gw0 192.0.2.1/26 (gateway)  up0 198.51.100.1/24 <-veth-> eth0 198.51.100.2/24
//!  default via .1            nft: tcp in on gw0 -> DNAT 192.0.2.1:PROXY_PORT              lo: 203.0.113.x/32
//!                            (except DNS over TCP to the gateway)
//!                            203.0.113.0/24 via 198.51.100.2
//!  direct ns (optional, for the bench's baseline): eth0 192.0.2.66/26 <-> dir0 192.0.2.65/26, forwarded
//! ```
//!
//! Namespaces are named `egt-<pid>-<n>-<role>` and deleted on drop (also when a test panics);
//! ones left by a dead process are deleted by the next [`TestNet::new`].

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::os::fd::AsRawFd;
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

pub const GATEWAY: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 1);
pub const GUEST: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 2);
pub const UPLINK: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 1);
pub const INTERNET_LINK: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 2);
pub const DIRECT_GATEWAY: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 65);
pub const DIRECT_GUEST: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 66);
pub const PROXY_PORT: u16 = 15001;

fn run(args: &[&str]) -> io::Result<()> {
    let out = Command::new(args[0]).args(&args[1..]).output()?;
    if !out.status.success() {
        return Err(io::Error::other(format!(
            "{}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(())
}

/// A network namespace made with `ip netns add`, deleted on drop.
pub struct Netns {
    name: String,
}

impl Netns {
    pub fn new(name: &str) -> io::Result<Self> {
        run(&["ip", "netns", "add", name])?;
        let ns = Netns { name: name.to_string() };
        ns.ip(&["link", "set", "lo", "up"])?;
        Ok(ns)
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn path(&self) -> std::path::PathBuf {
        std::path::PathBuf::from(format!("/run/netns/{}", self.name))
    }

    /// `ip -n <ns> ...`
    pub fn ip(&self, args: &[&str]) -> io::Result<()> {
        let mut a = vec!["ip", "-n", &self.name];
        a.extend_from_slice(args);
        run(&a)
    }

    /// Runs a command inside the namespace (`ip netns exec`).
    pub fn exec(&self, args: &[&str]) -> io::Result<()> {
        let mut a = vec!["ip", "netns", "exec", &self.name];
        a.extend_from_slice(args);
        run(&a)
    }

    /// Runs `f` on a new thread that has entered this namespace: sockets it (and threads it
    /// spawns, e.g. a tokio runtime built there) makes live in the namespace.
    pub fn spawn<T: Send + 'static>(&self, f: impl FnOnce() -> T + Send + 'static) -> JoinHandle<T> {
        let path = format!("/run/netns/{}", self.name);
        std::thread::spawn(move || {
            enter(&path).expect("enter network namespace");
            f()
        })
    }
}

/// Moves the calling thread into the namespace at `path`.
pub fn enter(path: &str) -> io::Result<()> {
    crate::netns::enter(std::path::Path::new(path))
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = run(&["ip", "netns", "del", &self.name]);
    }
}

/// Deletes `egt-<pid>-*` namespaces whose process is gone.
fn sweep_stale() {
    let Ok(dir) = std::fs::read_dir("/run/netns") else {
        return;
    };
    for e in dir.flatten() {
        let name = e.file_name().to_string_lossy().to_string();
        let Some(rest) = name.strip_prefix("egt-") else {
            continue;
        };
        let Some(pid) = rest.split('-').next() else { continue };
        if !std::path::Path::new(&format!("/proc/{pid}")).exists() {
            let _ = run(&["ip", "netns", "del", &name]);
        }
    }
}

static SEQ: AtomicUsize = AtomicUsize::new(0);

/// The three (or four) namespaces and their links. Drop removes them all.
pub struct TestNet {
    pub sandbox: Netns,
    pub host: Netns,
    pub internet: Netns,
    pub direct: Option<Netns>,
}

impl TestNet {
    pub fn new(with_direct: bool) -> io::Result<Self> {
        sweep_stale();
        let base = format!("egt-{}-{}", std::process::id(), SEQ.fetch_add(1, Ordering::Relaxed));
        let sandbox = Netns::new(&format!("{base}-s"))?;
        let host = Netns::new(&format!("{base}-h"))?;
        let internet = Netns::new(&format!("{base}-i"))?;
        let direct = if with_direct {
            Some(Netns::new(&format!("{base}-d"))?)
        } else {
            None
        };
        let net = TestNet {
            sandbox,
            host,
            internet,
            direct,
        };
        net.wire()?;
        Ok(net)
    }

    fn wire(&self) -> io::Result<()> {
        let (s, h, i) = (&self.sandbox, &self.host, &self.internet);
        h.ip(&[
            "link",
            "add",
            "gw0",
            "type",
            "veth",
            "peer",
            "name",
            "eth0",
            "netns",
            s.name(),
        ])?;
        h.ip(&["addr", "add", "192.0.2.1/26", "dev", "gw0"])?;
        h.ip(&["link", "set", "dev", "gw0", "up"])?;
        s.ip(&["addr", "add", "192.0.2.2/26", "dev", "eth0"])?;
        s.ip(&["link", "set", "dev", "eth0", "up"])?;
        s.ip(&["route", "add", "default", "via", "192.0.2.1"])?;

        h.ip(&[
            "link",
            "add",
            "up0",
            "type",
            "veth",
            "peer",
            "name",
            "eth0",
            "netns",
            i.name(),
        ])?;
        h.ip(&["addr", "add", "198.51.100.1/24", "dev", "up0"])?;
        h.ip(&["link", "set", "dev", "up0", "up"])?;
        h.ip(&["route", "add", "203.0.113.0/24", "via", "198.51.100.2"])?;
        i.ip(&["addr", "add", "198.51.100.2/24", "dev", "eth0"])?;
        i.ip(&["link", "set", "dev", "eth0", "up"])?;

        // Every TCP connection from the sandbox goes to the proxy, as the plumbing does it.
        let rules = format!(
            "table ip egress_test {{ chain pre {{ type nat hook prerouting priority dstnat; \
             iifname \"gw0\" ip daddr {GATEWAY} tcp dport 53 accept; \
             iifname \"gw0\" meta l4proto tcp dnat to {GATEWAY}:{PROXY_PORT}; }}; }}"
        );
        h.exec(&["nft", &rules])?;

        if let Some(d) = &self.direct {
            h.ip(&[
                "link",
                "add",
                "dir0",
                "type",
                "veth",
                "peer",
                "name",
                "eth0",
                "netns",
                d.name(),
            ])?;
            h.ip(&["addr", "add", "192.0.2.65/26", "dev", "dir0"])?;
            h.ip(&["link", "set", "dev", "dir0", "up"])?;
            d.ip(&["addr", "add", "192.0.2.66/26", "dev", "eth0"])?;
            d.ip(&["link", "set", "dev", "eth0", "up"])?;
            d.ip(&["route", "add", "default", "via", "192.0.2.65"])?;
            i.ip(&["route", "add", "192.0.2.64/26", "via", "198.51.100.1"])?;
            h.exec(&["sysctl", "-q", "-w", "net.ipv4.ip_forward=1"])?;
        }
        Ok(())
    }

    /// Gives the internet namespace another address (a test host), e.g. 203.0.113.10.
    pub fn add_internet_host(&self, ip: Ipv4Addr) -> io::Result<()> {
        self.internet.ip(&["addr", "add", &format!("{ip}/32"), "dev", "lo"])
    }
}

/// An authoritative test DNS server: fixed A records, every question it is asked recorded.
pub struct TestDns {
    pub asked: Arc<Mutex<Vec<String>>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl TestDns {
    /// Serves on `addr` (UDP) inside `ns`: names in `zone` get their A records (AAAA: empty),
    /// others NXDOMAIN.
    pub fn start(ns: &Netns, addr: SocketAddr, zone: HashMap<String, Vec<Ipv4Addr>>) -> io::Result<Self> {
        use hickory_proto::op::{Message, ResponseCode};
        use hickory_proto::rr::{rdata::A, RData, Record, RecordType};
        let asked = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let (tx, rx) = std::sync::mpsc::channel();
        let (a2, s2) = (asked.clone(), stop.clone());
        let thread = ns.spawn(move || {
            let sock = match UdpSocket::bind(addr) {
                Ok(s) => s,
                Err(e) => return tx.send(Err(e)).unwrap(),
            };
            sock.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
            tx.send(Ok(())).unwrap();
            let mut buf = [0u8; 2048];
            while !s2.load(Ordering::Relaxed) {
                let Ok((n, peer)) = sock.recv_from(&mut buf) else {
                    continue;
                };
                let Ok(q) = Message::from_vec(&buf[..n]) else { continue };
                let Some(question) = q.queries.first() else { continue };
                let name = question.name().to_ascii().trim_end_matches('.').to_ascii_lowercase();
                a2.lock().unwrap().push(format!("{name} {}", question.query_type()));
                let mut r = Message::response(q.metadata.id, q.metadata.op_code);
                r.metadata.authoritative = true;
                r.metadata.recursion_desired = q.metadata.recursion_desired;
                r.queries = q.queries.clone();
                match zone.get(&name) {
                    Some(ips) => {
                        if question.query_type() == RecordType::A {
                            for ip in ips {
                                r.add_answer(Record::from_rdata(question.name().clone(), 60, RData::A(A(*ip))));
                            }
                        }
                    }
                    None => r.metadata.response_code = ResponseCode::NXDomain,
                }
                let _ = sock.send_to(&r.to_vec().unwrap(), peer);
            }
        });
        rx.recv().map_err(io::Error::other)??;
        Ok(TestDns {
            asked,
            stop,
            thread: Some(thread),
        })
    }

    pub fn asked(&self) -> Vec<String> {
        self.asked.lock().unwrap().clone()
    }
}

impl Drop for TestDns {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Test web servers in the internet namespace, on 0.0.0.0 at the given ports. Each connection:
/// read the request head (or a ClientHello: whatever arrives within 200 ms of the first bytes),
/// answer `served-by <local ip>:<port>` (HTTP form), or, for `GET /bytes/N`, N bytes of body.
/// A request with `Connection: keep-alive` is answered in kind and the next one read (bodies by
/// Content-Length or chunked); one with `Upgrade: X` gets `101` and its connection then echoes.
pub struct TestWeb {
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
    /// Every local address a connection arrived on.
    pub hits: Arc<Mutex<Vec<SocketAddr>>>,
    /// Every HTTP request read, in order.
    pub requests: Arc<Mutex<Vec<Served>>>,
}

/// One request a [`TestWeb`] read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Served {
    pub local: SocketAddr,
    pub host: String,
    pub body: Vec<u8>,
}

impl TestWeb {
    pub fn start(ns: &Netns, ports: &[u16]) -> io::Result<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        let hits = Arc::new(Mutex::new(Vec::new()));
        let requests = Arc::new(Mutex::new(Vec::new()));
        let mut threads = Vec::new();
        for &port in ports {
            let (tx, rx) = std::sync::mpsc::channel();
            let (stop2, hits2, requests2) = (stop.clone(), hits.clone(), requests.clone());
            threads.push(ns.spawn(move || {
                let l = match TcpListener::bind(("0.0.0.0", port)) {
                    Ok(l) => l,
                    Err(e) => return tx.send(Err(e)).unwrap(),
                };
                tx.send(Ok(())).unwrap();
                while !stop2.load(Ordering::Relaxed) {
                    // Wait for a connection at most 50 ms, so a stop is seen soon.
                    let mut pfd = libc::pollfd {
                        fd: l.as_raw_fd(),
                        events: libc::POLLIN,
                        revents: 0,
                    };
                    // SAFETY: one valid pollfd.
                    if unsafe { libc::poll(&mut pfd, 1, 50) } <= 0 {
                        continue;
                    }
                    if let Ok((s, _)) = l.accept() {
                        let (hits3, requests3) = (hits2.clone(), requests2.clone());
                        std::thread::spawn(move || {
                            let _ = serve_one(s, &hits3, &requests3);
                        });
                    }
                }
            }));
            rx.recv().map_err(io::Error::other)??;
        }
        Ok(TestWeb {
            stop,
            threads,
            hits,
            requests,
        })
    }

    /// The Host of every request read so far.
    pub fn hosts(&self) -> Vec<String> {
        self.requests.lock().unwrap().iter().map(|r| r.host.clone()).collect()
    }
}

fn find(buf: &[u8], what: &[u8], from: usize) -> Option<usize> {
    buf.get(from..)?
        .windows(what.len())
        .position(|w| w == what)
        .map(|i| i + from)
}

/// Reads into `buf` until it holds `want` bytes (false: the peer closed first).
fn fill(s: &mut TcpStream, buf: &mut Vec<u8>, want: usize) -> io::Result<bool> {
    let mut chunk = [0u8; 4096];
    while buf.len() < want {
        let n = s.read(&mut chunk)?;
        if n == 0 {
            return Ok(false);
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    Ok(true)
}

/// Reads until `buf` has `what` at or after `from`; its position.
fn fill_until(s: &mut TcpStream, buf: &mut Vec<u8>, what: &[u8], from: usize) -> io::Result<Option<usize>> {
    loop {
        if let Some(i) = find(buf, what, from) {
            return Ok(Some(i));
        }
        let want = buf.len() + 1;
        if buf.len() > 1 << 20 || !fill(s, buf, want)? {
            return Ok(None);
        }
    }
}

/// A chunked body starting at `buf[at..]`: its data, and where the message ends.
fn read_chunked(s: &mut TcpStream, buf: &mut Vec<u8>, mut at: usize) -> io::Result<Option<(Vec<u8>, usize)>> {
    let mut body = Vec::new();
    loop {
        let Some(eol) = fill_until(s, buf, b"\r\n", at)? else {
            return Ok(None);
        };
        let line = String::from_utf8_lossy(&buf[at..eol]).to_string();
        let size = usize::from_str_radix(line.split(';').next().unwrap_or("").trim(), 16)
            .map_err(|_| io::Error::other("bad chunk size"))?;
        at = eol + 2;
        if size == 0 {
            // Trailer lines until an empty one.
            loop {
                let Some(eol) = fill_until(s, buf, b"\r\n", at)? else {
                    return Ok(None);
                };
                let empty = eol == at;
                at = eol + 2;
                if empty {
                    return Ok(Some((body, at)));
                }
            }
        }
        if !fill(s, buf, at + size + 2)? {
            return Ok(None);
        }
        body.extend_from_slice(&buf[at..at + size]);
        at += size + 2;
    }
}

fn serve_one(mut s: TcpStream, hits: &Mutex<Vec<SocketAddr>>, requests: &Mutex<Vec<Served>>) -> io::Result<()> {
    s.set_nodelay(true)?;
    let local = s.local_addr()?;
    hits.lock().unwrap().push(local);
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    while let Ok(n) = s.read(&mut chunk) {
        if n == 0 {
            if buf.is_empty() {
                return Ok(()); // nothing asked, nothing answered
            }
            break;
        }
        buf.extend_from_slice(&chunk[..n]);
        if find(&buf, b"\r\n\r\n", 0).is_some() || buf.len() > 64 * 1024 {
            break;
        }
        // A ClientHello (or anything not HTTP) is answered after a short pause for more bytes.
        s.set_read_timeout(Some(Duration::from_millis(200)))?;
    }
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    loop {
        let Some(head_end) = find(&buf, b"\r\n\r\n", 0) else {
            // Not HTTP (a ClientHello): one answer, then close.
            answer(&mut s, local, false)?;
            break;
        };
        let head = String::from_utf8_lossy(&buf[..head_end]).to_string();
        let header = |name: &str| {
            head.split("\r\n").skip(1).find_map(|l| {
                let (n, v) = l.split_once(':')?;
                n.trim().eq_ignore_ascii_case(name).then(|| v.trim().to_string())
            })
        };
        let mut end = head_end + 4;
        let body = if header("transfer-encoding").is_some_and(|v| v.eq_ignore_ascii_case("chunked")) {
            let Some((body, at)) = read_chunked(&mut s, &mut buf, end)? else {
                break;
            };
            end = at;
            body
        } else {
            let len: usize = header("content-length").and_then(|v| v.parse().ok()).unwrap_or(0);
            if !fill(&mut s, &mut buf, end + len)? {
                break;
            }
            end += len;
            buf[head_end + 4..end].to_vec()
        };
        requests.lock().unwrap().push(Served {
            local,
            host: header("host").unwrap_or_default(),
            body,
        });
        buf.drain(..end);
        if let Some(proto) = header("upgrade") {
            write!(
                s,
                "HTTP/1.1 101 Switching Protocols\r\nUpgrade: {proto}\r\nConnection: Upgrade\r\n\r\n"
            )?;
            // The other protocol: echo everything.
            s.write_all(&buf)?;
            while let Ok(n) = s.read(&mut chunk) {
                if n == 0 || s.write_all(&chunk[..n]).is_err() {
                    break;
                }
            }
            break;
        }
        let size = head
            .strip_prefix("GET /bytes/")
            .and_then(|r| r.split(' ').next())
            .and_then(|n| n.parse::<usize>().ok());
        if let Some(n) = size {
            write!(s, "HTTP/1.1 200 OK\r\nContent-Length: {n}\r\nConnection: close\r\n\r\n")?;
            let chunk = vec![b'x'; 256 * 1024];
            let mut left = n;
            while left > 0 {
                let k = left.min(chunk.len());
                s.write_all(&chunk[..k])?;
                left -= k;
            }
            break;
        }
        let keep_alive = header("connection").is_some_and(|v| v.eq_ignore_ascii_case("keep-alive"));
        answer(&mut s, local, keep_alive)?;
        if !keep_alive {
            break;
        }
        // The next request head (the client may have sent it already).
        if fill_until(&mut s, &mut buf, b"\r\n\r\n", 0).unwrap_or(None).is_none() {
            break;
        }
    }
    let _ = s.shutdown(std::net::Shutdown::Write);
    Ok(())
}

fn answer(s: &mut TcpStream, local: SocketAddr, keep_alive: bool) -> io::Result<()> {
    let body = format!("served-by {local}\n");
    let connection = if keep_alive { "keep-alive" } else { "close" };
    write!(
        s,
        "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: {connection}\r\n\r\n{body}",
        body.len()
    )
}

impl Drop for TestWeb {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}
