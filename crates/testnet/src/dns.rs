//! The internet's name server: an authoritative UDP DNS server with fixed A records that records
//! every question it is asked. Runs on a thread in a [`Netns`]; uses hickory-proto for the wire
//! format.

use std::collections::HashMap;
use std::io;
use std::net::{Ipv4Addr, SocketAddr, UdpSocket};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::Netns;

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
