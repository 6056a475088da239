//! Wiring one sandbox: its sockets, bound inside its network namespace, and the tasks serving
//! them. A socket keeps the namespace it was made in, so the listeners are made by a short-lived
//! thread that has entered the namespace, and served by the caller's runtime (whose lookups and
//! dials then leave from the process's own namespace: the uplink).

use std::io;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use tokio::task::JoinHandle;

use crate::dns::DnsServer;
use crate::netns;
use crate::proxy::Proxy;
use crate::sandbox::SandboxEgress;

/// A sandbox's three listeners: DNS (UDP and TCP, port 53) on the gateway address, and the port
/// its TCP is redirected to.
#[derive(Debug)]
pub struct SandboxSockets {
    pub dns_udp: std::net::UdpSocket,
    pub dns_tcp: std::net::TcpListener,
    pub proxy: std::net::TcpListener,
}

impl SandboxSockets {
    /// Binds `gateway:53` (UDP and TCP) and `gateway:proxy_port` inside the namespace at
    /// `netns` (e.g. `/run/netns/<name>`). Non-blocking, ready for [`serve_sandbox`].
    pub fn bind_in_netns(netns: &Path, gateway: IpAddr, proxy_port: u16) -> io::Result<Self> {
        let path: PathBuf = netns.to_path_buf();
        std::thread::spawn(move || {
            netns::enter(&path)?;
            let dns_udp = std::net::UdpSocket::bind(SocketAddr::new(gateway, 53))?;
            let dns_tcp = std::net::TcpListener::bind(SocketAddr::new(gateway, 53))?;
            let proxy = std::net::TcpListener::bind(SocketAddr::new(gateway, proxy_port))?;
            dns_udp.set_nonblocking(true)?;
            dns_tcp.set_nonblocking(true)?;
            proxy.set_nonblocking(true)?;
            Ok(SandboxSockets {
                dns_udp,
                dns_tcp,
                proxy,
            })
        })
        .join()
        .map_err(|_| io::Error::other("binding thread panicked"))?
    }
}

/// The tasks serving one sandbox. Dropping it (or [`EgressTasks::stop`]) aborts them, which
/// closes every connection and query they had open.
#[derive(Debug)]
pub struct EgressTasks {
    tasks: Vec<JoinHandle<()>>,
}

impl EgressTasks {
    pub fn stop(self) {}

    /// True while every task still runs (a listener that failed ends its task).
    pub fn is_running(&self) -> bool {
        self.tasks.iter().all(|t| !t.is_finished())
    }
}

impl Drop for EgressTasks {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// Spawns the DNS responder (UDP and TCP) and the proxy for `sandbox` on the current tokio
/// runtime (call from within one).
pub fn serve_sandbox(
    dns: &DnsServer,
    proxy: &Proxy,
    sockets: SandboxSockets,
    sandbox: Arc<SandboxEgress>,
) -> io::Result<EgressTasks> {
    let udp = tokio::net::UdpSocket::from_std(sockets.dns_udp)?;
    let dns_tcp = tokio::net::TcpListener::from_std(sockets.dns_tcp)?;
    let listener = tokio::net::TcpListener::from_std(sockets.proxy)?;
    let log = |what: &'static str, id: String| {
        move |r: io::Result<()>| {
            if let Err(e) = r {
                tracing::error!(sandbox = %id, error = %e, "egress {what} stopped");
            }
        }
    };
    let (d1, d2, p) = (dns.clone(), dns.clone(), proxy.clone());
    let (s1, s2, s3) = (sandbox.clone(), sandbox.clone(), sandbox.clone());
    let id = sandbox.id().to_string();
    let (l1, l2, l3) = (
        log("dns", id.clone()),
        log("dns over tcp", id.clone()),
        log("proxy", id),
    );
    Ok(EgressTasks {
        tasks: vec![
            tokio::spawn(async move { l1(d1.serve_udp(udp, s1).await) }),
            tokio::spawn(async move { l2(d2.serve_tcp(dns_tcp, s2).await) }),
            tokio::spawn(async move { l3(p.serve(listener, s3).await) }),
        ],
    })
}
