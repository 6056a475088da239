//! The upstream resolver the DNS responder and the proxy both use: one A query, over UDP (TCP when
//! the answer is truncated), bounded in time and size. Sockets are made by the calling thread, so
//! they live in the process's own network namespace (the uplink), never in a sandbox's.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Duration;

use hickory_proto::op::{Edns, Message, MessageType, OpCode, Query, ResponseCode};
use hickory_proto::rr::{Name, RData, RecordType};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::time::{timeout, Instant};

use crate::error::{ResolvConfError, ResolveError};
use crate::uplink::Uplink;

/// Largest answer read from the upstream (UDP with EDNS, or one TCP message).
const MAX_UPSTREAM_MESSAGE: usize = 16 * 1024;
/// CNAMEs followed within one answer.
const MAX_CNAME_CHAIN: usize = 8;
/// Addresses kept from one answer.
const MAX_ADDRESSES: usize = 16;

#[derive(Debug, Clone)]
pub struct Resolver {
    upstream: SocketAddr,
    timeout: Duration,
    uplink: Uplink,
}

/// An upstream answer: the name's IPv4 addresses (after CNAMEs) and the smallest TTL seen.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lookup {
    pub addrs: Vec<Ipv4Addr>,
    pub ttl: u32,
}

impl Resolver {
    /// `timeout` bounds a whole lookup (UDP tries and the TCP fallback together).
    pub fn new(upstream: SocketAddr, timeout: Duration) -> Self {
        Resolver {
            upstream,
            timeout,
            uplink: Uplink::host(),
        }
    }

    /// Ask the upstream from `uplink`'s namespace instead of the process's own.
    pub fn with_uplink(mut self, uplink: Uplink) -> Self {
        self.uplink = uplink;
        self
    }

    /// The first `nameserver` in a resolv.conf (port 53), e.g. `/etc/resolv.conf`.
    pub fn from_resolv_conf(path: &str, timeout: Duration) -> Result<Self, ResolvConfError> {
        let text = std::fs::read_to_string(path).map_err(|source| ResolvConfError::Read {
            path: path.to_string(),
            source,
        })?;
        let ns = text
            .lines()
            .filter_map(|l| {
                let mut words = l.split_whitespace();
                (words.next() == Some("nameserver")).then(|| words.next()).flatten()
            })
            .find_map(|w| w.split('%').next().and_then(|a| a.parse::<IpAddr>().ok()))
            .ok_or_else(|| ResolvConfError::NoNameserver { path: path.to_string() })?;
        Ok(Resolver::new(SocketAddr::new(ns, 53), timeout))
    }

    /// The host's resolver: `/etc/resolv.conf`, 5 s per lookup.
    pub fn system() -> Result<Self, ResolvConfError> {
        Self::from_resolv_conf("/etc/resolv.conf", Duration::from_secs(5))
    }

    pub fn upstream(&self) -> SocketAddr {
        self.upstream
    }

    /// The A records of `name` (a normalized host name).
    pub async fn lookup_a(&self, name: &str) -> Result<Lookup, ResolveError> {
        let qname = Name::from_ascii(name).map_err(|e| ResolveError::Malformed(e.to_string()))?;
        let mut qname = qname;
        qname.set_fqdn(true);
        let deadline = Instant::now() + self.timeout;
        let mut query = Message::query();
        query.metadata.recursion_desired = true;
        query.add_query(Query::query(qname.clone(), RecordType::A));
        let mut edns = Edns::new();
        edns.set_max_payload(1232);
        query.set_edns(edns);
        let bytes = query.to_vec().map_err(|e| ResolveError::Malformed(e.to_string()))?;

        let fut = async {
            let mut answer = self.udp(&bytes, query.metadata.id, deadline).await?;
            if answer.metadata.truncation {
                answer = self.tcp(&bytes, query.metadata.id).await?;
            }
            Ok::<_, ResolveError>(answer)
        };
        let answer = timeout(self.timeout, fut)
            .await
            .map_err(|_| ResolveError::Timeout(self.timeout))??;
        check_question(&answer, &qname)?;
        match answer.metadata.response_code {
            ResponseCode::NoError => {}
            ResponseCode::NXDomain => return Err(ResolveError::NxDomain),
            other => return Err(ResolveError::Upstream(other.to_string())),
        }
        Ok(collect_a(&answer, &qname))
    }

    async fn udp(&self, query: &[u8], id: u16, deadline: Instant) -> Result<Message, ResolveError> {
        let bind: SocketAddr = if self.upstream.is_ipv4() {
            "0.0.0.0:0".parse().unwrap()
        } else {
            "[::]:0".parse().unwrap()
        };
        let sock = self.uplink.udp_socket(bind)?;
        sock.connect(self.upstream).await?;
        let mut buf = vec![0u8; MAX_UPSTREAM_MESSAGE];
        // Two sends: one lost datagram shouldn't cost the whole timeout.
        let per_try = self.timeout / 2;
        loop {
            sock.send(query).await?;
            let try_end = (Instant::now() + per_try).min(deadline);
            loop {
                match tokio::time::timeout_at(try_end, sock.recv(&mut buf)).await {
                    Err(_) => break,
                    Ok(Err(e)) => return Err(e.into()),
                    Ok(Ok(n)) => {
                        // A connected socket only hears the upstream; still, the id must match.
                        if let Ok(m) = Message::from_vec(&buf[..n]) {
                            if m.metadata.id == id && m.metadata.message_type == MessageType::Response {
                                return Ok(m);
                            }
                        }
                    }
                }
            }
            if Instant::now() >= deadline {
                return Err(ResolveError::Timeout(self.timeout));
            }
        }
    }

    async fn tcp(&self, query: &[u8], id: u16) -> Result<Message, ResolveError> {
        let mut s = self
            .uplink
            .tcp_socket(self.upstream.is_ipv6())?
            .connect(self.upstream)
            .await?;
        let mut framed = (query.len() as u16).to_be_bytes().to_vec();
        framed.extend_from_slice(query);
        s.write_all(&framed).await?;
        let len = s.read_u16().await? as usize;
        if len > MAX_UPSTREAM_MESSAGE {
            return Err(ResolveError::Malformed(format!("{len}-byte TCP answer")));
        }
        let mut buf = vec![0u8; len];
        s.read_exact(&mut buf).await?;
        let m = Message::from_vec(&buf).map_err(|e| ResolveError::Malformed(e.to_string()))?;
        if m.metadata.id != id {
            return Err(ResolveError::Malformed("answer id does not match".into()));
        }
        Ok(m)
    }
}

fn check_question(answer: &Message, qname: &Name) -> Result<(), ResolveError> {
    if answer.metadata.op_code != OpCode::Query {
        return Err(ResolveError::Malformed("not a query answer".into()));
    }
    match answer.queries.as_slice() {
        [q] if q.name().to_lowercase() == qname.to_lowercase() => {
            if q.query_type() == RecordType::A {
                Ok(())
            } else {
                Err(ResolveError::Malformed("answer is for another type".into()))
            }
        }
        _ => Err(ResolveError::Malformed("answer is for another question".into())),
    }
}

/// Follows CNAMEs from `qname` through the answer section and keeps the A records of the last name.
fn collect_a(answer: &Message, qname: &Name) -> Lookup {
    let mut owner = qname.to_lowercase();
    let mut ttl = u32::MAX;
    for _ in 0..MAX_CNAME_CHAIN {
        let next = answer.answers.iter().find_map(|r| match &r.data {
            RData::CNAME(c) if r.name.to_lowercase() == owner => Some((c.0.to_lowercase(), r.ttl)),
            _ => None,
        });
        match next {
            Some((target, t)) => {
                ttl = ttl.min(t);
                owner = target;
            }
            None => break,
        }
    }
    let mut addrs = Vec::new();
    for r in &answer.answers {
        if let RData::A(a) = &r.data {
            if r.name.to_lowercase() == owner && !addrs.contains(&a.0) && addrs.len() < MAX_ADDRESSES {
                addrs.push(a.0);
                ttl = ttl.min(r.ttl);
            }
        }
    }
    Lookup {
        addrs,
        ttl: if ttl == u32::MAX { 0 } else { ttl },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resolv_conf_first_nameserver() {
        let dir = std::env::temp_dir().join(format!("egress-resolv-{}", std::process::id()));
        std::fs::write(&dir, "# x\nsearch a\nnameserver fe80::1%eth0\nnameserver 192.0.2.53\n").unwrap();
        let r = Resolver::from_resolv_conf(dir.to_str().unwrap(), Duration::from_secs(1)).unwrap();
        assert_eq!(r.upstream(), "[fe80::1]:53".parse().unwrap());
        std::fs::write(&dir, "search a\n").unwrap();
        assert!(Resolver::from_resolv_conf(dir.to_str().unwrap(), Duration::from_secs(1)).is_err());
        std::fs::remove_file(&dir).unwrap();
    }
}
