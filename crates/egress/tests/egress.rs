//! The egress proxy and DNS responder against real sockets, in network namespaces built per test
//! (`airlock_testnet`): a "sandbox" namespace whose TCP is DNATed to the proxy, a "host"
//! namespace where the proxy and DNS responder run and dial from, and an "internet" namespace
//! with an authoritative test DNS server and web servers on TEST-NET addresses. Needs root, `ip`
//! and `nft`. Nothing is routed through the machine's own namespace.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpStream, UdpSocket};
use std::sync::Arc;
use std::time::Duration;

use airlock_egress::*;
use airlock_testnet::{TestDns, TestNet, TestWeb, GATEWAY, PROXY_PORT, UPLINK};
use hickory_proto::op::{Message, Query, ResponseCode};
use hickory_proto::rr::{Name, RData, RecordType};

/// Plain HTTP, request by request.
#[path = "egress/http.rs"]
mod http;

const ALLOWED: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 10);
const OTHER: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 20);
/// What `evil.test` resolves to (a name tenants deny).
const EVIL: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 30);
const DNS: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 53);
/// A resolver that takes queries and never answers.
const SILENT_DNS: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 54);

/// One test's world: namespaces, test DNS + web servers, and the proxy + DNS responder for one
/// sandbox running in the host namespace until drop.
struct World {
    sandbox: Arc<SandboxEgress>,
    web: TestWeb,
    dns: TestDns,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    runner: Option<std::thread::JoinHandle<()>>,
    net: TestNet,
}

impl Drop for World {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(r) = self.runner.take() {
            let _ = r.join();
        }
    }
}

fn zone() -> HashMap<String, Vec<Ipv4Addr>> {
    let mut z = HashMap::new();
    z.insert("allowed.test".to_string(), vec![ALLOWED]);
    z.insert("other.test".to_string(), vec![OTHER]);
    z.insert("evil.test".to_string(), vec![EVIL]);
    z.insert("rebind-lo.test".to_string(), vec![Ipv4Addr::new(127, 0, 0, 1)]);
    z.insert(
        "rebind-private.test".to_string(),
        vec![Ipv4Addr::new(10, 1, 2, 3), Ipv4Addr::new(169, 254, 169, 254)],
    );
    z.insert("mixed.test".to_string(), vec![Ipv4Addr::new(10, 0, 0, 1), ALLOWED]);
    z
}

fn world(profiles: &str, tenant: &str, selected: &[&str], limits: SandboxLimits) -> World {
    world_with_upstream(profiles, tenant, selected, limits, DNS, "sb-test")
}

/// `upstream`: the resolver the proxy and DNS responder use (a host in the internet namespace);
/// `id`: the sandbox's id (what its log lines carry).
fn world_with_upstream(
    profiles: &str,
    tenant: &str,
    selected: &[&str],
    limits: SandboxLimits,
    upstream: Ipv4Addr,
    id: &str,
) -> World {
    let net = TestNet::new(false).expect("test namespaces");
    for ip in [ALLOWED, OTHER, EVIL, DNS, SILENT_DNS] {
        net.add_internet_host(ip).unwrap();
    }
    let dns = TestDns::start(&net.internet, SocketAddr::new(DNS.into(), 53), zone()).unwrap();
    let web = TestWeb::start(&net.internet, &[80, 443, 8080]).unwrap();

    let config = EgressConfig::new(
        PlatformDenies::new([IpAddr::from(GATEWAY), IpAddr::from(UPLINK)]),
        Profiles::from_json(profiles).unwrap(),
    );
    let names = config.profiles.select(selected).unwrap();
    let policy = Policy::new(&config, TenantPolicy::from_json(tenant).unwrap(), &names).unwrap();
    let sandbox = SandboxEgress::new(id, policy, limits);

    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let sb = sandbox.clone();
    // The gateway's sockets, bound inside the host namespace by the same call the plumbing uses.
    let sockets = SandboxSockets::bind_in_netns(&net.host.path(), GATEWAY.into(), PROXY_PORT).unwrap();
    let runner = net.host.spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let resolver = Arc::new(Resolver::new(
                SocketAddr::new(upstream.into(), 53),
                Duration::from_secs(2),
            ));
            let dns = DnsServer::new(resolver.clone(), DnsConfig::default());
            let proxy = Proxy::new(
                resolver,
                ProxyConfig {
                    sniff_timeout: Duration::from_secs(2),
                    connect_timeout: Duration::from_secs(2),
                    ..ProxyConfig::default()
                },
            );
            let tasks = serve_sandbox(&dns, &proxy, sockets, sb).unwrap();
            ready_tx.send(()).unwrap();
            let _ = stopped.await;
            assert!(tasks.is_running(), "a listener failed");
        });
    });
    ready_rx.recv_timeout(Duration::from_secs(10)).expect("proxy up");
    World {
        sandbox,
        web,
        dns,
        stop: Some(stop),
        runner: Some(runner),
        net,
    }
}

impl World {
    /// From inside the sandbox: connect to `to`, send `bytes`, read everything until close.
    fn tcp(&self, to: (Ipv4Addr, u16), bytes: &[u8]) -> String {
        let bytes = bytes.to_vec();
        self.net
            .sandbox
            .spawn(move || {
                let Ok(mut s) = TcpStream::connect_timeout(&SocketAddr::new(to.0.into(), to.1), Duration::from_secs(5))
                else {
                    return String::new();
                };
                s.set_read_timeout(Some(Duration::from_secs(8))).unwrap();
                let _ = s.write_all(&bytes);
                let mut out = Vec::new();
                let _ = s.read_to_end(&mut out);
                String::from_utf8_lossy(&out).to_string()
            })
            .join()
            .unwrap()
    }

    fn http(&self, to: (Ipv4Addr, u16), host: &str) -> String {
        self.tcp(
            to,
            format!("GET / HTTP/1.1\r\nHost: {host}\r\nUser-Agent: test\r\n\r\n").as_bytes(),
        )
    }

    fn tls(&self, to: (Ipv4Addr, u16), sni: &str) -> String {
        self.tcp(to, &sniff::client_hello(Some(sni)))
    }

    /// From inside the sandbox: one query to the gateway's DNS.
    fn dns(&self, name: &str, ty: RecordType) -> (ResponseCode, Vec<Ipv4Addr>) {
        let name = name.to_string();
        self.net
            .sandbox
            .spawn(move || {
                let s = UdpSocket::bind("0.0.0.0:0").unwrap();
                s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
                let mut q = Message::query();
                q.metadata.recursion_desired = true;
                q.add_query(Query::query(Name::from_ascii(&name).unwrap(), ty));
                s.send_to(&q.to_vec().unwrap(), (GATEWAY, 53)).unwrap();
                let mut buf = [0u8; 2048];
                let n = s.recv(&mut buf).expect("dns answer");
                let r = Message::from_vec(&buf[..n]).unwrap();
                assert_eq!(r.metadata.id, q.metadata.id);
                let ips = r
                    .answers
                    .iter()
                    .filter_map(|a| match &a.data {
                        RData::A(a) => Some(a.0),
                        _ => None,
                    })
                    .collect();
                (r.metadata.response_code, ips)
            })
            .join()
            .unwrap()
    }

    /// `n` queries from inside the sandbox, one after another on one socket, alternating between
    /// `names`; the answers' codes, counted.
    fn dns_many(&self, n: usize, names: [&'static str; 2]) -> HashMap<ResponseCode, usize> {
        self.net
            .sandbox
            .spawn(move || {
                let s = UdpSocket::bind("0.0.0.0:0").unwrap();
                s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
                let mut codes = HashMap::new();
                let mut buf = [0u8; 2048];
                for i in 0..n {
                    let mut q = Message::query();
                    q.add_query(Query::query(Name::from_ascii(names[i % 2]).unwrap(), RecordType::A));
                    s.send_to(&q.to_vec().unwrap(), (GATEWAY, 53)).unwrap();
                    let n = s.recv(&mut buf).expect("dns answer");
                    let r = Message::from_vec(&buf[..n]).unwrap();
                    *codes.entry(r.metadata.response_code).or_default() += 1;
                }
                codes
            })
            .join()
            .unwrap()
    }

    /// The same over TCP (two queries on one connection).
    fn dns_tcp(&self, names: [&'static str; 2]) -> Vec<(ResponseCode, Vec<Ipv4Addr>)> {
        self.net
            .sandbox
            .spawn(move || {
                let mut s =
                    TcpStream::connect_timeout(&SocketAddr::new(GATEWAY.into(), 53), Duration::from_secs(5)).unwrap();
                s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
                names
                    .iter()
                    .map(|name| {
                        let mut q = Message::query();
                        q.add_query(Query::query(Name::from_ascii(name).unwrap(), RecordType::A));
                        let bytes = q.to_vec().unwrap();
                        s.write_all(&(bytes.len() as u16).to_be_bytes()).unwrap();
                        s.write_all(&bytes).unwrap();
                        let mut len = [0u8; 2];
                        s.read_exact(&mut len).unwrap();
                        let mut buf = vec![0u8; u16::from_be_bytes(len) as usize];
                        s.read_exact(&mut buf).unwrap();
                        let r = Message::from_vec(&buf).unwrap();
                        let ips = r
                            .answers
                            .iter()
                            .filter_map(|a| match &a.data {
                                RData::A(a) => Some(a.0),
                                _ => None,
                            })
                            .collect();
                        (r.metadata.response_code, ips)
                    })
                    .collect()
            })
            .join()
            .unwrap()
    }

    fn hits(&self) -> Vec<SocketAddr> {
        self.web.hits.lock().unwrap().clone()
    }

    fn no_hit_on(&self, ip: Ipv4Addr) -> bool {
        self.hits().iter().all(|a| a.ip() != IpAddr::from(ip))
    }
}

const WEB: &str = r#"{"web": {"domains": ["allowed.test"], "default": true}}"#;
const NO_TENANT: &str = "{}";

fn served_by(resp: &str, ip: Ipv4Addr, port: u16) -> bool {
    resp.starts_with("HTTP/1.1 200") && resp.contains(&format!("served-by {ip}:{port}"))
}

#[test]
fn allowed_name_by_host_reaches_the_allowed_site() {
    let w = world(WEB, NO_TENANT, &[], SandboxLimits::default());
    let r = w.http((ALLOWED, 80), "allowed.test");
    assert!(served_by(&r, ALLOWED, 80), "{r}");
    let snap = w.sandbox.snapshot();
    assert_eq!(snap.profiles, ["web"]);
    assert_eq!(snap.counters.tcp_allowed, 1);
    assert_eq!(snap.counters.by_rule["allow profile web domain allowed.test"], 1);
    // A bigger body comes through the splice whole.
    let r = w.tcp(
        (ALLOWED, 80),
        b"GET /bytes/8388608 HTTP/1.1\r\nHost: allowed.test\r\n\r\n",
    );
    let body = r.split_once("\r\n\r\n").map(|(_, b)| b).unwrap_or("");
    assert_eq!(body.len(), 8 << 20);
    assert!(body.bytes().all(|b| b == b'x'));
    // Both requests and both answers are counted as the relay passed them on.
    let c = w.sandbox.snapshot().counters;
    assert!(c.bytes_received >= (8 << 20) + 2 * 17, "{c:?}");
    assert!((2 * 35..200).contains(&c.bytes_sent), "{c:?}");
}

#[test]
fn spoofed_address_with_allowed_name_reaches_the_allowed_site_not_the_address() {
    // curl --resolve allowed.test:80:<other IP> / :443: the guest's chosen IP is ignored.
    let w = world(WEB, NO_TENANT, &[], SandboxLimits::default());
    let r = w.http((OTHER, 80), "allowed.test");
    assert!(served_by(&r, ALLOWED, 80), "{r}");
    let r = w.tls((OTHER, 443), "allowed.test");
    assert!(served_by(&r, ALLOWED, 443), "{r}");
    assert!(w.no_hit_on(OTHER), "{:?}", w.hits());
}

#[test]
fn sni_of_an_allowed_name_reaches_only_the_allowed_site() {
    let w = world(WEB, NO_TENANT, &[], SandboxLimits::default());
    // TLS: only the SNI counts; whatever follows it (here a Host for another site, as it would be
    // inside the encrypted stream) goes to the allowed site's address.
    let mut bytes = sniff::client_hello(Some("allowed.test"));
    bytes.extend_from_slice(b"GET / HTTP/1.1\r\nHost: other.test\r\n\r\n");
    let r = w.tcp((OTHER, 443), &bytes);
    assert!(served_by(&r, ALLOWED, 443), "{r}");
    // Spliced bytes are counted too: the hello and what followed it, and the answer.
    let c = w.sandbox.snapshot().counters;
    assert_eq!(c.bytes_sent, bytes.len() as u64, "{c:?}");
    assert_eq!(c.bytes_received, r.len() as u64, "{c:?}");
    // Plain HTTP to the allowed site's address with another Host: refused, nothing reached.
    let r = w.http((ALLOWED, 80), "other.test");
    assert!(
        r.starts_with("HTTP/1.1 403") && r.contains("other.test:80 (default deny)"),
        "{r}"
    );
    // A Host that disagrees with the absolute request target is refused outright.
    let r = w.tcp(
        (ALLOWED, 80),
        b"GET http://other.test/ HTTP/1.1\r\nHost: allowed.test\r\n\r\n",
    );
    assert!(r.starts_with("HTTP/1.1 403") && r.contains("ambiguous request"), "{r}");
    assert!(w.no_hit_on(OTHER), "{:?}", w.hits());
    assert_eq!(w.hits().len(), 1, "{:?}", w.hits());
}

#[test]
fn non_allowed_name_is_refused() {
    let w = world(WEB, NO_TENANT, &[], SandboxLimits::default());
    let r = w.http((OTHER, 80), "other.test");
    assert!(r.starts_with("HTTP/1.1 403"), "{r}");
    let r = w.tls((OTHER, 443), "other.test");
    assert_eq!(r, "");
    assert!(w.hits().is_empty(), "{:?}", w.hits());
    let snap = w.sandbox.snapshot();
    assert_eq!(snap.counters.tcp_denied, 2);
    let dests: Vec<_> = snap
        .recent_denials
        .iter()
        .map(|d| (d.destination.as_str(), d.rule.as_str()))
        .collect();
    assert_eq!(
        dests,
        [("other.test:80", "default deny"), ("other.test:443", "default deny")]
    );
}

#[test]
fn ip_literal_is_reached_only_through_an_ip_or_cidr_rule() {
    let w = world(WEB, NO_TENANT, &[], SandboxLimits::default());
    assert_eq!(w.tcp((OTHER, 8080), b"GET / HTTP/1.1\r\n\r\n"), "");
    let r = w.http((OTHER, 80), &OTHER.to_string());
    assert!(r.starts_with("HTTP/1.1 403"), "{r}");
    // No name at all on 80 and 443: judged by the address.
    assert_eq!(w.tcp((OTHER, 443), b"not tls"), "");
    assert!(w.hits().is_empty(), "{:?}", w.hits());
    drop(w);

    let w = world(
        WEB,
        r#"{"allow": {"ips": ["203.0.113.20"]}}"#,
        &[],
        SandboxLimits::default(),
    );
    let r = w.tcp((OTHER, 8080), b"GET / HTTP/1.1\r\n\r\n");
    assert!(served_by(&r, OTHER, 8080), "{r}");
    let r = w.http((OTHER, 80), &OTHER.to_string());
    assert!(served_by(&r, OTHER, 80), "{r}");
    assert_eq!(
        w.tcp((ALLOWED, 8080), b"GET / HTTP/1.1\r\n\r\n"),
        "",
        "only the listed address"
    );
    drop(w);

    let w = world(
        r#"{"net": {"cidrs": ["203.0.113.0/28"]}}"#,
        NO_TENANT,
        &["net"],
        SandboxLimits::default(),
    );
    let r = w.tcp((ALLOWED, 8080), b"GET / HTTP/1.1\r\n\r\n");
    assert!(served_by(&r, ALLOWED, 8080), "{r}");
    assert_eq!(w.tcp((OTHER, 8080), b"GET / HTTP/1.1\r\n\r\n"), "", "outside the CIDR");
    assert_eq!(
        w.sandbox.snapshot().counters.by_rule["allow profile net cidr 203.0.113.0/28"],
        1
    );
}

#[test]
fn rebinding_answers_are_refused() {
    let profiles = r#"{"rb": {"domains": ["rebind-lo.test", "rebind-private.test", "mixed.test"], "default": true}}"#;
    let w = world(profiles, NO_TENANT, &[], SandboxLimits::default());
    assert_eq!(w.dns("rebind-lo.test", RecordType::A), (ResponseCode::Refused, vec![]));
    assert_eq!(
        w.dns("rebind-private.test", RecordType::A),
        (ResponseCode::Refused, vec![])
    );
    // Only the public address of a mixed answer is given out.
    assert_eq!(
        w.dns("mixed.test", RecordType::A),
        (ResponseCode::NoError, vec![ALLOWED])
    );
    // The proxy resolves for itself and refuses the same answers.
    let r = w.http((OTHER, 80), "rebind-lo.test");
    assert!(
        r.starts_with("HTTP/1.1 403") && r.contains("answer platform deny 127.0.0.0/8 (loopback)"),
        "{r}"
    );
    let r = w.http((OTHER, 80), "rebind-private.test");
    assert!(
        r.starts_with("HTTP/1.1 403") && r.contains("answer platform deny 10.0.0.0/8"),
        "{r}"
    );
    assert!(w.hits().is_empty(), "{:?}", w.hits());
    let r = w.http((OTHER, 80), "mixed.test");
    assert!(served_by(&r, ALLOWED, 80), "{r}");
}

#[test]
fn dns_refuses_other_names_without_asking_upstream() {
    let w = world(WEB, NO_TENANT, &[], SandboxLimits::default());
    assert_eq!(w.dns("other.test", RecordType::A), (ResponseCode::Refused, vec![]));
    assert_eq!(
        w.dns("c2VjcmV0.exfil.test", RecordType::TXT),
        (ResponseCode::Refused, vec![])
    );
    assert_eq!(
        w.dns("sub.allowed.test", RecordType::A),
        (ResponseCode::Refused, vec![])
    );
    // Allowed name: AAAA and other types are empty, not forwarded.
    assert_eq!(w.dns("allowed.test", RecordType::AAAA), (ResponseCode::NoError, vec![]));
    assert_eq!(w.dns("allowed.test", RecordType::MX), (ResponseCode::NoError, vec![]));
    assert_eq!(
        w.dns("ALLOWED.test", RecordType::A),
        (ResponseCode::NoError, vec![ALLOWED])
    );
    // The upstream heard exactly one question.
    assert_eq!(w.dns.asked(), ["allowed.test A"]);
    let snap = w.sandbox.snapshot();
    assert_eq!(snap.counters.dns_denied, 3);
    assert_eq!(snap.counters.dns_allowed, 3);
}

#[test]
fn dns_over_tcp_follows_the_same_rules() {
    let w = world(WEB, NO_TENANT, &[], SandboxLimits::default());
    assert_eq!(
        w.dns_tcp(["other.test", "allowed.test"]),
        [(ResponseCode::Refused, vec![]), (ResponseCode::NoError, vec![ALLOWED])]
    );
    assert_eq!(w.dns.asked(), ["allowed.test A"]);
}

#[test]
fn platform_denies_beat_a_tenant_allow_all() {
    let w = world(
        WEB,
        r#"{"allow": {"cidrs": ["0.0.0.0/0"]}}"#,
        &[],
        SandboxLimits::default(),
    );
    // The always-denied ranges (and the host's own addresses) hold against an allow-everything.
    for (to, rule) in [
        ((Ipv4Addr::new(10, 0, 0, 1), 80), "platform deny 10.0.0.0/8 (private)"),
        (
            (Ipv4Addr::new(169, 254, 169, 254), 80),
            "platform deny 169.254.0.0/16 (link-local/metadata)",
        ),
        (
            (Ipv4Addr::new(100, 100, 100, 200), 80),
            "platform deny 100.64.0.0/10 (cgnat)",
        ),
        ((GATEWAY, 80), "platform deny host address"),
    ] {
        let r = w.tcp(to, b"GET / HTTP/1.1\r\n\r\n");
        assert!(r.starts_with("HTTP/1.1 403") && r.contains(rule), "{to:?}: {r}");
    }
    assert_eq!(w.tcp((UPLINK, 22), b"SSH-2.0-x\r\n"), "");
    // Anything else public is allowed by the CIDR, by address.
    let r = w.tcp((OTHER, 8080), b"GET / HTTP/1.1\r\n\r\n");
    assert!(served_by(&r, OTHER, 8080), "{r}");
    let denied: Vec<_> = w
        .sandbox
        .snapshot()
        .recent_denials
        .into_iter()
        .map(|d| d.rule)
        .collect();
    assert_eq!(denied.len(), 5, "{denied:?}");
}

#[test]
fn tenant_deny_beats_profile_allow() {
    let w = world(
        WEB,
        r#"{"deny": {"domains": ["allowed.test"]}}"#,
        &[],
        SandboxLimits::default(),
    );
    assert_eq!(w.dns("allowed.test", RecordType::A), (ResponseCode::Refused, vec![]));
    let r = w.http((ALLOWED, 80), "allowed.test");
    assert!(
        r.starts_with("HTTP/1.1 403") && r.contains("tenant deny domain allowed.test"),
        "{r}"
    );
    assert_eq!(w.tls((ALLOWED, 443), "allowed.test"), "");
    assert!(w.hits().is_empty(), "{:?}", w.hits());
    assert!(w.dns.asked().is_empty());
    drop(w);

    // A tenant's CIDR deny also holds against what an allowed name resolves to.
    let w = world(
        WEB,
        r#"{"deny": {"cidrs": ["203.0.113.0/28"]}}"#,
        &[],
        SandboxLimits::default(),
    );
    assert_eq!(w.dns("allowed.test", RecordType::A), (ResponseCode::Refused, vec![]));
    let r = w.http((OTHER, 80), "allowed.test");
    assert!(r.contains("answer tenant deny cidr 203.0.113.0/28"), "{r}");
    assert!(w.hits().is_empty(), "{:?}", w.hits());
}

#[test]
fn a_denied_name_stays_denied_at_its_address_under_a_cidr_allow() {
    // The tenant denies evil.test and allows the whole /24 evil.test's address is in.
    let w = world(
        WEB,
        r#"{"allow": {"cidrs": ["203.0.113.0/24"]}, "deny": {"domains": ["evil.test"]}}"#,
        &[],
        SandboxLimits::default(),
    );
    let rule = "tenant deny domain evil.test (an address it resolves to)";
    // No name at all (another port, a TLS hello without SNI), a name no rule mentions, an IP
    // literal as Host: each judged by address, and the address is evil.test's.
    assert_eq!(w.tcp((EVIL, 8080), b"GET / HTTP/1.1\r\n\r\n"), "");
    assert_eq!(w.tcp((EVIL, 443), &sniff::client_hello(None)), "");
    assert_eq!(w.tls((EVIL, 443), "unlisted.test"), "");
    let r = w.http((EVIL, 80), "unlisted.test");
    assert!(r.starts_with("HTTP/1.1 403") && r.contains(rule), "{r}");
    let r = w.http((EVIL, 80), &EVIL.to_string());
    assert!(r.starts_with("HTTP/1.1 403") && r.contains(rule), "{r}");
    // Naming it is denied whatever the address (as before).
    let r = w.http((OTHER, 80), "evil.test");
    assert!(
        r.starts_with("HTTP/1.1 403") && r.contains("tenant deny domain evil.test"),
        "{r}"
    );
    assert!(w.no_hit_on(EVIL), "{:?}", w.hits());
    let snap = w.sandbox.snapshot();
    assert_eq!(snap.counters.by_rule[&format!("deny {rule}")], 5, "{:?}", snap.counters);
    // The rest of the /24 is still open by address, and evil.test was looked up once (cached).
    let r = w.tcp((OTHER, 8080), b"GET / HTTP/1.1\r\n\r\n");
    assert!(served_by(&r, OTHER, 8080), "{r}");
    assert_eq!(w.dns.asked(), ["evil.test A"]);
}

#[test]
fn connection_cap_closes_connections_past_it() {
    let w = world(
        WEB,
        r#"{"allow": {"ips": ["203.0.113.20"]}}"#,
        &[],
        SandboxLimits {
            max_connections: 1,
            ..Default::default()
        },
    );
    // Hold one proxied connection open (the test server waits for a request head).
    let holder = w.net.sandbox.spawn(|| {
        let s = TcpStream::connect_timeout(&SocketAddr::new(OTHER.into(), 8080), Duration::from_secs(5)).unwrap();
        std::thread::sleep(Duration::from_millis(1500));
        drop(s);
    });
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(w.tcp((OTHER, 8080), b"GET / HTTP/1.1\r\n\r\n"), "");
    holder.join().unwrap();
    assert_eq!(w.sandbox.snapshot().counters.by_rule["deny connection cap"], 1);
    // Once the held connection is gone, its slot is free again.
    let mut r = String::new();
    for _ in 0..30 {
        r = w.tcp((OTHER, 8080), b"GET / HTTP/1.1\r\n\r\n");
        if served_by(&r, OTHER, 8080) {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(served_by(&r, OTHER, 8080), "the slot is free again: {r}");
}

#[test]
fn a_silent_upstream_or_client_costs_bounded_time() {
    let w = world_with_upstream(WEB, NO_TENANT, &[], SandboxLimits::default(), SILENT_DNS, "sb-test");
    // The upstream reads queries and never answers (the resolver's timeout here is 2 s).
    let sock = w
        .net
        .internet
        .spawn(|| std::net::UdpSocket::bind((SILENT_DNS, 53)).unwrap())
        .join()
        .unwrap();
    let started = std::time::Instant::now();
    assert_eq!(w.dns("allowed.test", RecordType::A), (ResponseCode::ServFail, vec![]));
    let r = w.http((ALLOWED, 80), "allowed.test");
    assert!(
        r.starts_with("HTTP/1.1 403") && r.contains("name does not resolve"),
        "{r}"
    );
    assert!(started.elapsed() < Duration::from_secs(10), "{:?}", started.elapsed());
    drop(sock);
    // A client that connects to port 80 and says nothing is judged by address after the sniff
    // timeout (2 s here): no rule allows it, so it is closed (before the client's own 8 s).
    let started = std::time::Instant::now();
    assert_eq!(w.tcp((ALLOWED, 80), b""), "");
    assert!(started.elapsed() < Duration::from_secs(7), "{:?}", started.elapsed());
    assert!(w.hits().is_empty(), "{:?}", w.hits());
}

#[test]
fn namespaces_are_removed_even_when_a_test_panics() {
    let (tx, rx) = std::sync::mpsc::channel();
    let failed = std::thread::spawn(move || {
        let net = TestNet::new(false).unwrap();
        tx.send([net.sandbox.name(), net.host.name(), net.internet.name()].map(String::from))
            .unwrap();
        panic!("a failing test");
    })
    .join();
    assert!(failed.is_err());
    for name in rx.recv().unwrap() {
        assert!(
            !std::path::Path::new("/run/netns").join(&name).exists(),
            "{name} left behind"
        );
    }
}

#[test]
fn wildcard_profile_entry_is_a_config_error_naming_it() {
    let e = Profiles::from_json(r#"{"web": {"domains": ["allowed.test", "*.cdn.test"]}}"#).unwrap_err();
    assert_eq!(
        e,
        ConfigError::Wildcard {
            place: "profile \"web\"".into(),
            entry: "*.cdn.test".into()
        }
    );
    assert!(
        e.to_string().contains("*.cdn.test") && e.to_string().contains("web"),
        "{e}"
    );
    let e = Profiles::from_json(r#"{"web": {"domains": [".cdn.test"]}}"#).unwrap_err();
    assert!(matches!(e, ConfigError::Wildcard { .. }), "{e}");
    let e = TenantPolicy::from_json(r#"{"deny": {"domains": ["*"]}}"#).unwrap_err();
    assert!(e.to_string().starts_with("tenant deny: wildcard domain \"*\""), "{e}");
    // The environment variable goes through the same parser.
    std::env::set_var(
        PROFILES_ENV,
        r#"{"p": {"domains": ["a.test"], "ips": ["203.0.113.300"]}}"#,
    );
    let e = Profiles::from_env().unwrap_err().to_string();
    std::env::remove_var(PROFILES_ENV);
    assert!(e.contains("203.0.113.300") && e.contains("profile \"p\""), "{e}");
}

#[test]
fn digest_is_stable_and_changes_with_the_configuration() {
    let digest = |json: &str| EgressConfig::new(PlatformDenies::new([]), Profiles::from_json(json).unwrap()).digest();
    let a =
        digest(r#"{"web": {"domains": ["a.test", "b.test"], "default": true}, "x": {"cidrs": ["203.0.113.0/24"]}}"#);
    assert_eq!(a.len(), 64);
    // Same configuration written differently: order, case, trailing dots, duplicates, host addresses.
    let same = EgressConfig::new(
        PlatformDenies::new(["192.0.2.1".parse().unwrap()]),
        Profiles::from_json(
            r#"{"x": {"cidrs": ["203.0.113.0/24"], "default": false},
                "web": {"default": true, "domains": ["B.test.", "a.test", "a.test"]}}"#,
        )
        .unwrap(),
    )
    .digest();
    assert_eq!(a, same);
    assert_ne!(
        a,
        digest(r#"{"web": {"domains": ["a.test", "b.test"]}, "x": {"cidrs": ["203.0.113.0/24"]}}"#)
    );
    assert_ne!(
        a,
        digest(r#"{"web": {"domains": ["a.test"], "default": true}, "x": {"cidrs": ["203.0.113.0/24"]}}"#)
    );
    assert_ne!(
        a,
        digest(r#"{"web2": {"domains": ["a.test", "b.test"], "default": true}, "x": {"cidrs": ["203.0.113.0/24"]}}"#)
    );
    assert_ne!(a, digest("{}"));
}

/// INFO lines by the `sandbox` field they carry, from every thread (a global subscriber, installed
/// once for this test binary; each test that counts uses its own sandbox id).
fn info_lines_of(sandbox: &str) -> usize {
    use std::sync::{Mutex, OnceLock};
    use tracing_subscriber::layer::SubscriberExt;

    struct Count(&'static Mutex<HashMap<String, usize>>);
    impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Count {
        fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
            struct Sandbox(Option<String>);
            impl tracing::field::Visit for Sandbox {
                fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
                    if field.name() == "sandbox" {
                        self.0 = Some(format!("{value:?}"));
                    }
                }
            }
            if *event.metadata().level() == tracing::Level::INFO {
                let mut s = Sandbox(None);
                event.record(&mut s);
                if let Some(id) = s.0 {
                    *self.0.lock().unwrap().entry(id).or_default() += 1;
                }
            }
        }
    }
    static COUNTS: OnceLock<&'static Mutex<HashMap<String, usize>>> = OnceLock::new();
    let counts = COUNTS.get_or_init(|| {
        let counts: &'static Mutex<HashMap<String, usize>> = Box::leak(Box::default());
        tracing::subscriber::set_global_default(tracing_subscriber::registry().with(Count(counts)))
            .expect("no other global subscriber in this test binary");
        counts
    });
    counts.lock().unwrap().get(sandbox).copied().unwrap_or(0)
}

#[test]
fn ten_thousand_dns_queries_write_a_bounded_log() {
    assert_eq!(info_lines_of("sb-dns-flood"), 0);
    let w = world_with_upstream(WEB, NO_TENANT, &[], SandboxLimits::default(), DNS, "sb-dns-flood");
    let started = std::time::Instant::now();
    let codes = w.dns_many(10_000, ["allowed.test", "other.test"]);
    let took = started.elapsed();
    assert_eq!(codes[&ResponseCode::NoError], 5_000);
    assert_eq!(codes[&ResponseCode::Refused], 5_000);
    let counters = w.sandbox.snapshot().counters;
    assert_eq!((counters.dns_allowed, counters.dns_denied), (5_000, 5_000));
    drop(w); // the sandbox's last summary line
    let lines = info_lines_of("sb-dns-flood");
    eprintln!("10000 DNS queries in {took:?}: {lines} INFO lines");
    // 10 lines and a summary per 10 s window.
    let windows = took.as_secs() as usize / 10 + 1;
    assert!(lines >= 11 && lines <= 11 * windows, "{lines} lines in {took:?}");
}
