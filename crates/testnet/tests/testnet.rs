//! The test internet itself, seen from its host namespace (where the egress proxy would dial
//! from): its name server answers from its zone and records the questions, its web servers answer
//! on every internet host's address, and its namespaces are gone after drop. Needs root, `ip` and
//! `nft`.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream, UdpSocket};
use std::time::Duration;

use airlock_testnet::{TestDns, TestNet, TestWeb};
use hickory_proto::op::{Message, Query, ResponseCode};
use hickory_proto::rr::{Name, RData, RecordType};

const WEB: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 10);
const DNS: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 53);

fn ask(name: &str) -> Message {
    let sock = UdpSocket::bind("0.0.0.0:0").unwrap();
    sock.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut q = Message::query();
    q.add_query(Query::query(Name::from_ascii(name).unwrap(), RecordType::A));
    sock.send_to(&q.to_vec().unwrap(), (DNS, 53)).unwrap();
    let mut buf = [0u8; 2048];
    let n = sock.recv(&mut buf).unwrap();
    Message::from_vec(&buf[..n]).unwrap()
}

#[test]
fn the_internet_answers_names_and_web_requests_and_is_removed_on_drop() {
    let net = TestNet::new(false).expect("test namespaces (root, ip, nft)");
    net.add_internet_host(WEB).unwrap();
    net.add_internet_host(DNS).unwrap();
    let zone = HashMap::from([("allowed.test".to_string(), vec![WEB])]);
    let dns = TestDns::start(&net.internet, SocketAddr::new(DNS.into(), 53), zone).unwrap();
    let web = TestWeb::start(&net.internet, &[80]).unwrap();

    let (answer, missing, reply) = net
        .host
        .spawn(|| {
            let mut s = TcpStream::connect((WEB, 80)).unwrap();
            s.write_all(b"GET / HTTP/1.1\r\nHost: allowed.test\r\n\r\n").unwrap();
            let mut reply = String::new();
            s.read_to_string(&mut reply).unwrap();
            (ask("allowed.test."), ask("missing.test."), reply)
        })
        .join()
        .unwrap();

    let ips: Vec<Ipv4Addr> = answer
        .answers
        .iter()
        .filter_map(|r| match &r.data {
            RData::A(a) => Some(a.0),
            _ => None,
        })
        .collect();
    assert_eq!(ips, vec![WEB]);
    assert_eq!(missing.metadata.response_code, ResponseCode::NXDomain);
    assert_eq!(dns.asked(), vec!["allowed.test A", "missing.test A"]);
    assert!(reply.ends_with("served-by 203.0.113.10:80\n"), "{reply}");
    assert_eq!(web.hosts(), vec!["allowed.test"]);

    let names = [net.sandbox.name(), net.host.name(), net.internet.name()].map(str::to_string);
    drop((dns, web, net));
    for name in names {
        assert!(
            !std::path::Path::new("/run/netns").join(&name).exists(),
            "{name} left behind"
        );
    }
}
