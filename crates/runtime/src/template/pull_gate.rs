//! Every connection an image pull makes, judged: `oci-client` dials the registry, then wherever
//! the registry sends it (a `WWW-Authenticate` realm, a redirect to blob storage), with a client
//! of its own that this code cannot configure. So each pull gets a forward proxy on loopback of
//! its own, the only way out its client has (`https_proxy` and `http_proxy` both), which allows:
//! - the registry (or mirror) the operator's policy chose, as configured, plain HTTP only if
//!   that one is;
//! - any other host over TLS (`CONNECT`), when every address it resolves to is outside the
//!   node's platform denies (loopback, private, link-local, metadata, the host's own...): a
//!   registry's token service and blob CDN live on the internet, the operator's network does not.
//!
//! The address checked is the one dialed (no second lookup to rebind). What it refused is told
//! in the pull's error by host only, nothing of what answered.

use ipnet::IpNet;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// The most of a request head the gate reads.
const MAX_HEAD: usize = 16 << 10;
/// A client that sends no head, or a host that does not resolve or answer, for this long is dropped.
const STEP_TIMEOUT: Duration = Duration::from_secs(15);

/// One pull's gate: listening until dropped.
pub struct PullGate {
    addr: SocketAddr,
    refused: Arc<Mutex<Vec<String>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for PullGate {
    fn drop(&mut self) {
        self.task.abort();
    }
}

struct Rules {
    /// `host:port` of the registry (or mirror) the policy chose, lowercase.
    target: String,
    /// Whether the target is spoken to in plain HTTP.
    target_plain: bool,
    denied: Vec<IpNet>,
}

impl PullGate {
    /// A gate for a pull from `target` (`host:port`), over plain HTTP when `plain`.
    pub async fn start(target: &str, plain: bool, denied: Vec<IpNet>) -> std::io::Result<PullGate> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let rules = Arc::new(Rules {
            target: target.to_ascii_lowercase(),
            target_plain: plain,
            denied,
        });
        let refused = Arc::new(Mutex::new(Vec::new()));
        let seen = refused.clone();
        let task = tokio::spawn(async move {
            while let Ok((conn, _)) = listener.accept().await {
                let (rules, seen) = (rules.clone(), seen.clone());
                tokio::spawn(async move {
                    if let Err(Some(host)) = serve(conn, &rules).await {
                        let mut s = seen.lock().unwrap();
                        if s.len() < 16 && !s.contains(&host) {
                            s.push(host);
                        }
                    }
                });
            }
        });
        Ok(PullGate { addr, refused, task })
    }

    /// The proxy URL to give the pull's client.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The hosts it refused so far.
    pub fn refused(&self) -> Vec<String> {
        self.refused.lock().unwrap().clone()
    }
}

/// One client connection: `Err(Some(host))` when it asked for a host the rules refuse.
async fn serve(mut conn: TcpStream, rules: &Rules) -> Result<(), Option<String>> {
    let head = tokio::time::timeout(STEP_TIMEOUT, read_head(&mut conn))
        .await
        .map_err(|_| None)?
        .map_err(|_| None)?;
    let text = String::from_utf8_lossy(&head).into_owned();
    let mut lines = text.split("\r\n");
    let first = lines.next().unwrap_or("");
    let mut parts = first.split(' ');
    let (method, uri) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    if method.eq_ignore_ascii_case("CONNECT") {
        let authority = uri.to_ascii_lowercase();
        let upstream = dial_or_refuse(&mut conn, &authority, 443, rules, true).await?;
        conn.write_all(b"HTTP/1.1 200 Connection Established\r\n\r\n")
            .await
            .map_err(|_| None)?;
        relay(conn, upstream, &[]).await;
        return Ok(());
    }
    // Plain HTTP: absolute-form, only to a plain target; one request per connection.
    let Some(rest) = uri.strip_prefix("http://") else {
        let _ = conn
            .write_all(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
            .await;
        return Err(None);
    };
    let (authority, path) = match rest.find('/') {
        Some(i) => (rest[..i].to_ascii_lowercase(), &rest[i..]),
        None => (rest.to_ascii_lowercase(), "/"),
    };
    let upstream = dial_or_refuse(&mut conn, &authority, 80, rules, false).await?;
    let mut out = format!("{method} {path} HTTP/1.1\r\n");
    for line in lines.take_while(|l| !l.is_empty()) {
        let name = line.split(':').next().unwrap_or("").trim().to_ascii_lowercase();
        if !matches!(
            name.as_str(),
            "connection" | "proxy-connection" | "proxy-authorization" | "keep-alive"
        ) {
            out.push_str(line);
            out.push_str("\r\n");
        }
    }
    out.push_str("Connection: close\r\n\r\n");
    let body_start = head
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map_or(head.len(), |i| i + 4);
    let mut first = out.into_bytes();
    first.extend_from_slice(&head[body_start..]);
    relay(conn, upstream, &first).await;
    Ok(())
}

/// [`dial`], or the client told 403 and the refused host named to the gate.
async fn dial_or_refuse(
    conn: &mut TcpStream,
    authority: &str,
    default_port: u16,
    rules: &Rules,
    tls: bool,
) -> Result<TcpStream, Option<String>> {
    match dial(authority, default_port, rules, tls).await {
        Ok(s) => Ok(s),
        Err(refused) => {
            let _ = conn
                .write_all(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\n\r\n")
                .await;
            Err(refused.then(|| host_part(authority).to_string()))
        }
    }
}

fn host_part(authority: &str) -> &str {
    match authority.rsplit_once(':') {
        Some((h, p)) if p.bytes().all(|b| b.is_ascii_digit()) => h,
        _ => authority,
    }
}

/// The connection to `authority` the rules allow; `Err(true)` refused by them, `Err(false)`
/// unreachable.
async fn dial(authority: &str, default_port: u16, rules: &Rules, tls: bool) -> Result<TcpStream, bool> {
    let with_port = if authority
        .rsplit_once(':')
        .is_some_and(|(_, p)| p.bytes().all(|b| b.is_ascii_digit()))
    {
        authority.to_string()
    } else {
        format!("{authority}:{default_port}")
    };
    let is_target = with_port == rules.target;
    if !is_target && !tls {
        return Err(true);
    }
    if is_target && tls == rules.target_plain {
        return Err(true);
    }
    let (host, port) = with_port.rsplit_once(':').ok_or(true)?;
    let port: u16 = port.parse().map_err(|_| true)?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let addrs: Vec<SocketAddr> = tokio::time::timeout(STEP_TIMEOUT, tokio::net::lookup_host((host, port)))
        .await
        .map_err(|_| false)?
        .map_err(|_| false)?
        .collect();
    if addrs.is_empty() {
        return Err(false);
    }
    if !is_target && addrs.iter().any(|a| rules.denied.iter().any(|n| n.contains(&a.ip()))) {
        return Err(true);
    }
    for a in addrs {
        if let Ok(Ok(s)) = tokio::time::timeout(STEP_TIMEOUT, TcpStream::connect(a)).await {
            return Ok(s);
        }
    }
    Err(false)
}

/// The request head (up to and with its blank line; what came after it too).
async fn read_head(conn: &mut TcpStream) -> std::io::Result<Vec<u8>> {
    let mut head = Vec::with_capacity(1024);
    let mut buf = [0u8; 2048];
    loop {
        let n = conn.read(&mut buf).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        head.extend_from_slice(&buf[..n]);
        if head.windows(4).any(|w| w == b"\r\n\r\n") {
            return Ok(head);
        }
        if head.len() > MAX_HEAD {
            return Err(std::io::Error::other("request head too large"));
        }
    }
}

/// Bytes both ways until either side ends; `first` goes upstream before the client's.
async fn relay(mut client: TcpStream, mut upstream: TcpStream, first: &[u8]) {
    if !first.is_empty() && upstream.write_all(first).await.is_err() {
        return;
    }
    let _ = tokio::io::copy_bidirectional(&mut client, &mut upstream).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A listener that counts its connections: what must never be reached.
    async fn canary() -> (SocketAddr, Arc<std::sync::atomic::AtomicUsize>) {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let hits = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let h = hits.clone();
        tokio::spawn(async move {
            while let Ok((mut c, _)) = l.accept().await {
                h.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let _ = c.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok").await;
            }
        });
        (addr, hits)
    }

    async fn ask(gate: &PullGate, request: String) -> String {
        let mut c = TcpStream::connect(gate.addr).await.unwrap();
        c.write_all(request.as_bytes()).await.unwrap();
        let mut out = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(5), c.read_to_end(&mut out)).await;
        String::from_utf8_lossy(&out).into_owned()
    }

    #[tokio::test]
    async fn only_the_target_and_public_tls_hosts_are_dialed() {
        let (registry, registry_hits) = canary().await;
        let (internal, internal_hits) = canary().await;
        let loopback: IpNet = "127.0.0.0/8".parse().unwrap();
        let gate = PullGate::start(&registry.to_string(), true, vec![loopback])
            .await
            .unwrap();
        // The target, in plain HTTP as configured: passed on, one request per connection.
        let answer = ask(
            &gate,
            format!("GET http://{registry}/v2/ HTTP/1.1\r\nHost: {registry}\r\n\r\n"),
        )
        .await;
        assert!(answer.ends_with("ok"), "{answer}");
        assert_eq!(registry_hits.load(std::sync::atomic::Ordering::SeqCst), 1);
        // Another host on a denied address: a realm or redirect into the operator's network.
        for request in [
            format!("GET http://{internal}/token HTTP/1.1\r\nHost: {internal}\r\n\r\n"),
            format!("CONNECT {internal} HTTP/1.1\r\nHost: {internal}\r\n\r\n"),
            format!("CONNECT localhost:{} HTTP/1.1\r\n\r\n", internal.port()),
            // The target over TLS when it is plain: not what the operator configured.
            format!("CONNECT {registry} HTTP/1.1\r\n\r\n"),
        ] {
            let answer = ask(&gate, request.clone()).await;
            assert!(answer.starts_with("HTTP/1.1 403"), "{request}: {answer}");
        }
        assert_eq!(internal_hits.load(std::sync::atomic::Ordering::SeqCst), 0);
        assert_eq!(registry_hits.load(std::sync::atomic::Ordering::SeqCst), 1);
        assert!(
            gate.refused().contains(&"127.0.0.1".to_string()),
            "{:?}",
            gate.refused()
        );
    }
}
