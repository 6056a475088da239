//! The egress proxy: every TCP connection a guest opens is redirected here (the plumbing DNATs
//! it to a per-sandbox listener; [`OriginalDst::Netfilter`] reads where the guest meant to go
//! with `SO_ORIGINAL_DST`, or [`OriginalDst::LocalAddr`] under TPROXY).
//!
//! - Port 80: the HTTP/1 request head's Host; 443: the TLS ClientHello's SNI (read within
//!   [`ProxyConfig::sniff_timeout`] and [`ProxyConfig::sniff_max`], never decrypted). On port
//!   80 every later request head on the connection is judged too (`relay`): one naming another
//!   host than the connection was dialed for is refused, and what can't be framed safely closes
//!   the connection.
//! - A name a domain rule allows is resolved here, through the upstream resolver, and the proxy
//!   dials what it resolved, after checking every address against the always-denied ranges and
//!   the tenant's IP denies (dial by name: the address the guest chose is ignored). The bytes
//!   already read are replayed, then both directions are spliced (plain HTTP: request by
//!   request).
//! - No name (other ports, or no Host/SNI): only IP/CIDR rules, against the original destination.
//!   A name no rule mentions also falls back to those (an allowed address is allowed whatever
//!   the bytes say); a name the tenant denies is refused, and so is an address a denied name
//!   resolves to (looked up here, `denied`), whatever IP/CIDR rule covers it.
//! - Connects, the first read, and idle splices are bounded in time; open connections per
//!   sandbox are capped.
//!
//! Dials are made by the runtime's threads, in the process's own network namespace (the uplink),
//! optionally from a given source address.

use std::net::{IpAddr, SocketAddr};
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;
use tokio::time::{timeout, Instant};

use crate::policy::{normalize_domain, Decision, Policy};
use crate::relay::{self, HttpRelay};
use crate::resolve::Resolver;
use crate::sandbox::{Path, SandboxEgress};
use crate::sniff::{self, Sniffed};
use crate::uplink::Uplink;

/// How the proxy learns where a redirected connection was going.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OriginalDst {
    /// `SO_ORIGINAL_DST` (nftables/iptables DNAT or `redirect`): conntrack of the namespace the
    /// listener was made in, so the DNAT must happen in that same namespace.
    Netfilter,
    /// The accepted socket's local address (TPROXY keeps the original destination there).
    LocalAddr,
}

#[derive(Debug, Clone)]
pub struct ProxyConfig {
    pub original_dst: OriginalDst,
    /// Reading the request head / ClientHello.
    pub sniff_timeout: Duration,
    /// Most bytes read looking for a name; also the largest later request head on port 80.
    pub sniff_max: usize,
    /// Each outbound connect.
    pub connect_timeout: Duration,
    /// A spliced connection with no byte in either direction for this long is closed.
    pub idle_timeout: Duration,
    /// The namespace dials leave from.
    pub uplink: Uplink,
    /// Source address for dials (None: the kernel picks, in the uplink's namespace).
    pub uplink_bind: Option<IpAddr>,
}

impl Default for ProxyConfig {
    fn default() -> Self {
        ProxyConfig {
            original_dst: OriginalDst::Netfilter,
            sniff_timeout: Duration::from_secs(5),
            sniff_max: 16 * 1024,
            connect_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(300),
            uplink: Uplink::host(),
            uplink_bind: None,
        }
    }
}

#[derive(Debug, Clone)]
pub struct Proxy {
    resolver: Arc<Resolver>,
    config: Arc<ProxyConfig>,
}

/// Where a connection will go, once decided.
enum Target {
    /// Dial these (already checked, what the name resolved to), in order, on `port`.
    Resolved(String, Vec<IpAddr>, u16),
    Direct(SocketAddr),
}

impl Proxy {
    pub fn new(resolver: Arc<Resolver>, config: ProxyConfig) -> Self {
        Proxy {
            resolver,
            config: Arc::new(config),
        }
    }

    /// Serves the sandbox's redirected connections from `listener` until the future is dropped,
    /// which also closes every connection it opened (they live in its task set).
    pub async fn serve(&self, listener: TcpListener, sandbox: Arc<SandboxEgress>) -> std::io::Result<()> {
        let mut tasks = JoinSet::new();
        loop {
            tokio::select! {
                Some(_) = tasks.join_next(), if !tasks.is_empty() => {}
                r = listener.accept() => match r {
                    Ok((stream, _)) => {
                        let Some(permit) = sandbox.try_connection() else {
                            sandbox.record(Path::Tcp, "(any)", &Decision::deny("connection cap"));
                            drop(stream);
                            continue;
                        };
                        let (this, sandbox) = (self.clone(), sandbox.clone());
                        tasks.spawn(async move {
                            this.handle(stream, &sandbox).await;
                            drop(permit);
                        });
                    }
                    Err(e) => {
                        // EMFILE and friends: back off rather than spin or give up.
                        tracing::warn!(sandbox = %sandbox.id(), error = %e, "egress proxy accept failed");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                }
            }
        }
    }

    async fn handle(&self, mut client: TcpStream, sandbox: &SandboxEgress) {
        let _ = client.set_nodelay(true);
        let original = match self.original_destination(&client) {
            Ok(a) => a,
            Err(e) => {
                sandbox.record(Path::Tcp, "(unknown)", &Decision::deny("no original destination"));
                tracing::debug!(sandbox = %sandbox.id(), error = %e, "no original destination");
                return;
            }
        };
        if client.local_addr().ok() == Some(original) && self.config.original_dst == OriginalDst::Netfilter {
            sandbox.record(Path::Tcp, &original.to_string(), &Decision::deny("not redirected"));
            return;
        }
        let port = original.port();
        let (head, sniffed) = match port {
            80 => self.sniff(&mut client, sniff::http_host).await,
            443 => self.sniff(&mut client, sniff::tls_sni).await,
            _ => (Vec::new(), Sniffed::NoName),
        };
        let is_http_head = port == 80 && !matches!(sniffed, Sniffed::Invalid(_) | Sniffed::NeedMore);
        // Port 80 is relayed request by request unless its first bytes can't be HTTP (then it
        // is judged by address and passed on as bytes, like any other port).
        let is_http = port == 80 && !sniff::not_http(&head);
        let (destination, decision, target) = self.decide(sandbox, original, sniffed).await;
        sandbox.record(Path::Tcp, &destination, &decision);
        let Some(target) = target.filter(|_| decision.allowed) else {
            if is_http_head {
                let reply = relay::denied_reply(&destination, &decision.rule);
                let _ = timeout(Duration::from_secs(2), client.write_all(&reply)).await;
            }
            return;
        };
        let upstream = match self.dial(&target).await {
            Ok(s) => s,
            Err(e) => {
                sandbox.log_failure("dial", &destination, &e, false);
                return;
            }
        };
        let _ = upstream.set_nodelay(true);
        if !is_http {
            return relay::splice(client, upstream, head, self.config.idle_timeout, sandbox.bytes()).await;
        }
        let bound = match &target {
            Target::Resolved(name, ..) => Some(name.as_str()),
            Target::Direct(_) => None,
        };
        let policy = sandbox.policy();
        let judge = |sniffed: &Sniffed| judge_request(policy, bound, &destination, port, sniffed);
        let relay = HttpRelay {
            sandbox,
            destination: &destination,
            judge: &judge,
            max_head: self.config.sniff_max,
            idle: self.config.idle_timeout,
        };
        relay::http(client, upstream, head, relay).await;
    }

    fn original_destination(&self, s: &TcpStream) -> std::io::Result<SocketAddr> {
        match self.config.original_dst {
            OriginalDst::LocalAddr => s.local_addr(),
            OriginalDst::Netfilter => so_original_dst(s),
        }
    }

    /// Reads until `parse` finds an answer, the limit, EOF, or the timeout.
    async fn sniff(&self, client: &mut TcpStream, parse: fn(&[u8]) -> Sniffed) -> (Vec<u8>, Sniffed) {
        let deadline = Instant::now() + self.config.sniff_timeout;
        let mut buf = Vec::with_capacity(2048);
        let mut chunk = [0u8; 4096];
        loop {
            let want = chunk.len().min(self.config.sniff_max - buf.len());
            match tokio::time::timeout_at(deadline, client.read(&mut chunk[..want])).await {
                Ok(Ok(n)) if n > 0 => {
                    buf.extend_from_slice(&chunk[..n]);
                    match parse(&buf) {
                        Sniffed::NeedMore if buf.len() < self.config.sniff_max => continue,
                        Sniffed::NeedMore => return (buf, Sniffed::Invalid("no name within the read limit")),
                        other => return (buf, other),
                    }
                }
                // EOF, error or timeout: judge what there is (no name).
                _ => return (buf, Sniffed::NeedMore),
            }
        }
    }

    async fn decide(
        &self,
        sandbox: &SandboxEgress,
        original: SocketAddr,
        sniffed: Sniffed,
    ) -> (String, Decision, Option<Target>) {
        let policy = sandbox.policy();
        let port = original.port();
        let by_ip = || async {
            let d = self.decide_address(sandbox, original.ip()).await;
            (original.to_string(), d, Some(Target::Direct(original)))
        };
        let name = match sniffed {
            Sniffed::Name(n) => n,
            Sniffed::Ambiguous(why) => {
                return (
                    original.to_string(),
                    Decision::deny(format!("ambiguous request: {why}")),
                    None,
                );
            }
            Sniffed::NoName | Sniffed::NeedMore | Sniffed::Invalid(_) => return by_ip().await,
        };
        let bare = name.trim_start_matches('[').trim_end_matches(']');
        if bare.parse::<IpAddr>().is_ok() {
            // An IP literal as Host: the connection is judged by where it really goes.
            return by_ip().await;
        }
        let Ok(normalized) = crate::policy::normalize_domain(&name) else {
            return (original.to_string(), Decision::deny("malformed name"), None);
        };
        let destination = format!("{normalized}:{port}");
        let d = policy.decide_domain(&normalized);
        if !d.allowed {
            if d.rule.starts_with("tenant deny") {
                return (destination, d, None);
            }
            // No rule names it: an IP/CIDR rule for the real destination may still allow it.
            let (addr, ip_d, target) = by_ip().await;
            if ip_d.allowed || ip_d.rule.starts_with("tenant deny domain") {
                return (addr, ip_d, target);
            }
            return (destination, d, None);
        }
        match self.resolver.lookup_a(&normalized).await {
            Ok(lookup) => {
                let mut ok = Vec::new();
                let mut first_deny = None;
                for ip in lookup.addrs {
                    match policy.deny_for_address(ip.into()) {
                        Some(deny) => {
                            first_deny.get_or_insert(deny);
                        }
                        None => ok.push(IpAddr::from(ip)),
                    }
                }
                if ok.is_empty() {
                    let rule = match first_deny {
                        Some(deny) => format!("answer {}", deny.rule),
                        None => "name has no address".into(),
                    };
                    return (destination, Decision::deny(rule), None);
                }
                (destination, d, Some(Target::Resolved(normalized, ok, port)))
            }
            Err(e) => {
                tracing::debug!(sandbox = %sandbox.id(), destination, error = %e, "egress lookup failed");
                (destination, Decision::deny("name does not resolve"), None)
            }
        }
    }

    /// [`crate::Policy::decide_address`] with the denied names' addresses as they resolve now.
    async fn decide_address(&self, sandbox: &SandboxEgress, ip: IpAddr) -> Decision {
        let policy = sandbox.policy();
        let d = policy.decide_ip(ip);
        if !d.allowed || policy.denied_domains().is_empty() {
            return d;
        }
        let denied = sandbox
            .denied_names
            .current(policy.denied_domains(), &self.resolver)
            .await;
        policy.decide_address(ip, &denied)
    }

    async fn dial(&self, target: &Target) -> std::io::Result<TcpStream> {
        let addrs: Vec<SocketAddr> = match target {
            Target::Resolved(_, ips, port) => ips.iter().map(|ip| SocketAddr::new(*ip, *port)).collect(),
            Target::Direct(a) => vec![*a],
        };
        let mut last = std::io::Error::new(std::io::ErrorKind::NotFound, "no address");
        for addr in addrs {
            let socket = self.config.uplink.tcp_socket(addr.is_ipv6())?;
            if let Some(src) = self.config.uplink_bind {
                socket.bind(SocketAddr::new(src, 0))?;
            }
            match timeout(self.config.connect_timeout, socket.connect(addr)).await {
                Ok(Ok(s)) => return Ok(s),
                Ok(Err(e)) => last = e,
                Err(_) => {
                    last = std::io::Error::new(std::io::ErrorKind::TimedOut, format!("connect to {addr} timed out"))
                }
            }
        }
        Err(last)
    }
}

const SO_ORIGINAL_DST: libc::c_int = 80; // linux/netfilter_ipv4.h
const IP6T_SO_ORIGINAL_DST: libc::c_int = 80; // linux/netfilter_ipv6/ip6_tables.h

/// A request head on a plain-HTTP connection already decided (each one, the first again
/// included), against what the decision covered: `bound` is the name the connection was dialed
/// for (`None`: it was judged by address). `Err`: the denial to record and answer.
fn judge_request(
    policy: &Policy,
    bound: Option<&str>,
    destination: &str,
    port: u16,
    sniffed: &Sniffed,
) -> Result<(), (String, Decision)> {
    let deny = |to: String, rule: String| Err((to, Decision::deny(rule)));
    let name = match sniffed {
        Sniffed::Name(n) => n,
        Sniffed::NoName if bound.is_none() => return Ok(()),
        Sniffed::NoName => {
            return deny(
                destination.into(),
                "request without a Host on a connection to a name".into(),
            )
        }
        Sniffed::Ambiguous(why) => return deny(destination.into(), format!("ambiguous request: {why}")),
        Sniffed::Invalid(why) => return deny(destination.into(), format!("malformed request: {why}")),
        Sniffed::NeedMore => return deny(destination.into(), "malformed request".into()),
    };
    let another = "request names another host than its connection";
    if name
        .trim_start_matches('[')
        .trim_end_matches(']')
        .parse::<IpAddr>()
        .is_ok()
    {
        // An IP literal: judged by where the connection goes, as a first request would be.
        return match bound {
            None => Ok(()),
            Some(_) => deny(format!("{name}:{port}"), another.into()),
        };
    }
    let Ok(name) = normalize_domain(name) else {
        return deny(destination.into(), "malformed name".into());
    };
    let d = policy.decide_domain(&name);
    match bound {
        Some(b) if b == name => Ok(()),
        // Even an allowed name: the connection goes where the first one resolved to.
        Some(_) if d.allowed => deny(format!("{name}:{port}"), another.into()),
        Some(_) => Err((format!("{name}:{port}"), d)),
        // By address: an allowed address is allowed whatever the name, unless the tenant denies it.
        None if !d.allowed && d.rule.starts_with("tenant deny") => Err((format!("{name}:{port}"), d)),
        None => Ok(()),
    }
}

fn so_original_dst(s: &TcpStream) -> std::io::Result<SocketAddr> {
    let fd = s.as_raw_fd();
    if s.local_addr()?.is_ipv4() {
        let mut addr: libc::sockaddr_in = unsafe { std::mem::zeroed() };
        let mut len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
        // SAFETY: fd is a live socket; addr/len describe a writable sockaddr_in.
        let rc = unsafe {
            libc::getsockopt(
                fd,
                libc::SOL_IP,
                SO_ORIGINAL_DST,
                (&mut addr as *mut libc::sockaddr_in).cast(),
                &mut len,
            )
        };
        if rc != 0 {
            return Err(std::io::Error::last_os_error());
        }
        let ip = std::net::Ipv4Addr::from(u32::from_be(addr.sin_addr.s_addr));
        Ok(SocketAddr::new(ip.into(), u16::from_be(addr.sin_port)))
    } else {
        let mut addr: libc::sockaddr_in6 = unsafe { std::mem::zeroed() };
        let mut len = std::mem::size_of::<libc::sockaddr_in6>() as libc::socklen_t;
        // SAFETY: as above, for sockaddr_in6.
        let rc = unsafe {
            libc::getsockopt(
                fd,
                libc::SOL_IPV6,
                IP6T_SO_ORIGINAL_DST,
                (&mut addr as *mut libc::sockaddr_in6).cast(),
                &mut len,
            )
        };
        if rc != 0 {
            return Err(std::io::Error::last_os_error());
        }
        let ip = std::net::Ipv6Addr::from(addr.sin6_addr.s6_addr);
        Ok(SocketAddr::new(ip.into(), u16::from_be(addr.sin6_port)))
    }
}
