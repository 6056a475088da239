//! The DNS responder on a sandbox's gateway. It answers only names the sandbox's policy allows,
//! resolving them through the upstream; everything else is REFUSED without any upstream query
//! (no exfiltration through DNS). Only A is ever resolved: AAAA and other types for an allowed
//! name get an empty answer (IPv6 is off; nothing else is forwarded). Answers whose addresses fall
//! in the always-denied ranges (or the tenant's IP denies) are dropped; if none is left the
//! answer is REFUSED (rebinding).
//!
//! The socket is the caller's: bind it to the gateway address inside the sandbox's namespace
//! (a socket keeps the namespace it was made in), then hand it to [`DnsServer::serve_udp`] /
//! [`DnsServer::serve_tcp`]. Upstream sockets are made by the runtime's threads, in the
//! process's own namespace.

use std::sync::Arc;
use std::time::Duration;

use hickory_proto::op::{Edns, Message, MessageType, OpCode, ResponseCode};
use hickory_proto::rr::rdata::A;
use hickory_proto::rr::{DNSClass, RData, Record, RecordType};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, UdpSocket};
use tokio::task::JoinSet;

use crate::error::ResolveError;
use crate::policy::Decision;
use crate::resolve::Resolver;
use crate::sandbox::{Path, SandboxEgress};

/// Largest query read from a guest (a query has one question: 512 is plenty; EDNS may pad).
const MAX_QUERY: usize = 1232;
/// TTL given to the guest, at most.
const MAX_TTL: u32 = 300;

#[derive(Debug, Clone)]
pub struct DnsConfig {
    /// Per TCP connection: the whole exchange (reading queries, answering) must fit in it.
    pub tcp_timeout: Duration,
    /// Queries answered on one TCP connection.
    pub tcp_max_queries: usize,
}

impl Default for DnsConfig {
    fn default() -> Self {
        DnsConfig {
            tcp_timeout: Duration::from_secs(10),
            tcp_max_queries: 16,
        }
    }
}

#[derive(Debug, Clone)]
pub struct DnsServer {
    resolver: Arc<Resolver>,
    config: DnsConfig,
}

impl DnsServer {
    pub fn new(resolver: Arc<Resolver>, config: DnsConfig) -> Self {
        DnsServer { resolver, config }
    }

    /// Answers queries on `socket` until it fails or the future is dropped (which also drops the
    /// queries in flight). Past the sandbox's in-flight cap, queries are dropped.
    pub async fn serve_udp(&self, socket: UdpSocket, sandbox: Arc<SandboxEgress>) -> std::io::Result<()> {
        let socket = Arc::new(socket);
        let mut tasks = JoinSet::new();
        let mut buf = vec![0u8; MAX_QUERY];
        loop {
            tokio::select! {
                Some(_) = tasks.join_next(), if !tasks.is_empty() => {}
                r = socket.recv_from(&mut buf) => {
                    let (n, peer) = match r {
                        Ok(v) => v,
                        // ICMP errors from earlier replies surface here on Linux; keep serving.
                        Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => continue,
                        Err(e) => return Err(e),
                    };
                    let Ok(permit) = sandbox.dns_in_flight.clone().try_acquire_owned() else { continue };
                    let query = buf[..n].to_vec();
                    let (this, socket, sandbox) = (self.clone(), socket.clone(), sandbox.clone());
                    tasks.spawn(async move {
                        if let Some(reply) = this.answer(&query, &sandbox, 512).await {
                            let _ = socket.send_to(&reply, peer).await;
                        }
                        drop(permit);
                    });
                }
            }
        }
    }

    /// DNS over TCP on `listener` (same rules; a guest falls back to it on truncation).
    pub async fn serve_tcp(&self, listener: TcpListener, sandbox: Arc<SandboxEgress>) -> std::io::Result<()> {
        let mut tasks = JoinSet::new();
        loop {
            tokio::select! {
                Some(_) = tasks.join_next(), if !tasks.is_empty() => {}
                r = listener.accept() => {
                    let (mut stream, _) = r?;
                    let Ok(permit) = sandbox.dns_in_flight.clone().try_acquire_owned() else { continue };
                    let (this, sandbox) = (self.clone(), sandbox.clone());
                    tasks.spawn(async move {
                        let session = async {
                            for _ in 0..this.config.tcp_max_queries {
                                let len = stream.read_u16().await? as usize;
                                if len == 0 || len > MAX_QUERY {
                                    break;
                                }
                                let mut q = vec![0u8; len];
                                stream.read_exact(&mut q).await?;
                                let Some(reply) = this.answer(&q, &sandbox, u16::MAX as usize).await else { break };
                                let mut framed = (reply.len() as u16).to_be_bytes().to_vec();
                                framed.extend_from_slice(&reply);
                                stream.write_all(&framed).await?;
                            }
                            Ok::<_, std::io::Error>(())
                        };
                        let _ = tokio::time::timeout(this.config.tcp_timeout, session).await;
                        drop(permit);
                    });
                }
            }
        }
    }

    /// The reply to one query message (None: not worth answering, e.g. not a query at all).
    /// `max_len` is the transport's limit (512 for UDP without EDNS).
    pub async fn answer(&self, query: &[u8], sandbox: &SandboxEgress, max_len: usize) -> Option<Vec<u8>> {
        let req = match Message::from_vec(query) {
            Ok(m) => m,
            Err(_) => {
                // Unparseable: a FORMERR if at least the id is there.
                if query.len() < 12 {
                    return None;
                }
                let id = u16::from_be_bytes([query[0], query[1]]);
                return Message::error_msg(id, OpCode::Query, ResponseCode::FormErr)
                    .to_vec()
                    .ok();
            }
        };
        if req.metadata.message_type != MessageType::Query {
            return None;
        }
        let mut resp = Message::response(req.metadata.id, req.metadata.op_code);
        resp.metadata.recursion_desired = req.metadata.recursion_desired;
        resp.metadata.recursion_available = true;
        resp.queries = req.queries.clone();
        let max_len = match &req.edns {
            Some(e) => {
                let mut edns = Edns::new();
                edns.set_max_payload(1232);
                resp.set_edns(edns);
                max_len.max(e.max_payload().min(1232) as usize)
            }
            None => max_len,
        };
        let rcode = self.resolve_into(&req, sandbox, &mut resp).await;
        resp.metadata.response_code = rcode;
        let mut bytes = resp.to_vec().ok()?;
        if bytes.len() > max_len {
            resp.answers.clear();
            resp.metadata.truncation = true;
            bytes = resp.to_vec().ok()?;
        }
        Some(bytes)
    }

    async fn resolve_into(&self, req: &Message, sandbox: &SandboxEgress, resp: &mut Message) -> ResponseCode {
        if req.metadata.op_code != OpCode::Query {
            return ResponseCode::NotImp;
        }
        let [q] = req.queries.as_slice() else {
            return ResponseCode::FormErr;
        };
        let name = q.name().to_ascii();
        let qtype = q.query_type();
        let destination = format!("{} {}", name.trim_end_matches('.'), qtype);
        if q.query_class() != DNSClass::IN {
            sandbox.record(Path::Dns, &destination, &Decision::deny("dns class not IN"));
            return ResponseCode::Refused;
        }
        let decision = sandbox.policy().decide_domain(&name);
        if !decision.allowed {
            sandbox.record(Path::Dns, &destination, &decision);
            return ResponseCode::Refused;
        }
        if qtype != RecordType::A {
            // Allowed name, but only A is ever resolved: an empty answer, nothing forwarded.
            sandbox.record(
                Path::Dns,
                &destination,
                &Decision::allow(format!("{} (empty: only A)", decision.rule)),
            );
            return ResponseCode::NoError;
        }
        let lookup_name = name.trim_end_matches('.').to_ascii_lowercase();
        match self.resolver.lookup_a(&lookup_name).await {
            Ok(lookup) => {
                let total = lookup.addrs.len();
                let mut first_deny = None;
                for ip in lookup.addrs {
                    match sandbox.policy().deny_for_address(ip.into()) {
                        Some(d) => {
                            first_deny.get_or_insert(d);
                        }
                        None => {
                            resp.add_answer(Record::from_rdata(
                                q.name().clone(),
                                lookup.ttl.min(MAX_TTL),
                                RData::A(A(ip)),
                            ));
                        }
                    };
                }
                if total > 0 && resp.answers.is_empty() {
                    let d = first_deny.expect("some address was denied");
                    sandbox.record(Path::Dns, &destination, &Decision::deny(format!("answer {}", d.rule)));
                    return ResponseCode::Refused;
                }
                sandbox.record(Path::Dns, &destination, &decision);
                ResponseCode::NoError
            }
            Err(ResolveError::NxDomain) => {
                sandbox.record(Path::Dns, &destination, &decision);
                ResponseCode::NXDomain
            }
            Err(e) => {
                sandbox.log_failure("upstream lookup", &destination, &e, true);
                ResponseCode::ServFail
            }
        }
    }
}
