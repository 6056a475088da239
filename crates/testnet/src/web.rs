//! The internet's web servers: plain blocking TCP servers on a [`Netns`] that answer HTTP/1
//! (keep-alive, chunked and sized bodies, upgrades that then echo, `/bytes/N` downloads) and
//! anything else (a ClientHello) with one answer naming the address it arrived on.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::Netns;

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
