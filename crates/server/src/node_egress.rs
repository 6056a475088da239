//! The node's egress side: the runtime's [`EgressHook`], serving every sandbox's DNS responder
//! and proxy on the host end of its link, under the policy the core decided for it.
//!
//! The hook must exist before the runtime opens (which re-attaches the VMs of the last run), and
//! the core is built on top of the runtime, so the core is handed in afterwards
//! ([`NodeEgress::bind_core`]); an `attach` that comes first waits for it.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use airlock_egress::{serve_sandbox, DnsConfig, DnsServer, EgressTasks, Proxy, ProxyConfig, Resolver, SandboxSockets};
use airlock_runtime::net::{EgressHook, EgressPorts, SandboxLink};
use async_trait::async_trait;
use tokio::sync::watch;

use crate::core::Core;

type HookError = Box<dyn std::error::Error + Send + Sync>;

/// How long an `attach` waits for the core to be handed in.
const CORE_WAIT: Duration = Duration::from_secs(60);

pub struct NodeEgress {
    dns: DnsServer,
    proxy: Proxy,
    core: watch::Sender<Option<Core>>,
    /// The tasks serving each wired sandbox, by id; dropping them closes its sockets and every
    /// connection it has open.
    served: Mutex<HashMap<String, EgressTasks>>,
}

impl NodeEgress {
    /// `resolver` and `proxy` carry the uplink (where lookups and dials leave from).
    pub fn new(resolver: Arc<Resolver>, proxy: ProxyConfig) -> Arc<Self> {
        Arc::new(NodeEgress {
            dns: DnsServer::new(resolver.clone(), DnsConfig::default()),
            proxy: Proxy::new(resolver, proxy),
            core: watch::channel(None).0,
            served: Mutex::new(HashMap::new()),
        })
    }

    /// The core whose policies this node serves (once, right after it is built).
    pub fn bind_core(&self, core: Core) {
        self.core.send_replace(Some(core));
    }

    async fn core(&self) -> Result<Core, HookError> {
        let mut rx = self.core.subscribe();
        let got = tokio::time::timeout(CORE_WAIT, rx.wait_for(|c| c.is_some()))
            .await
            .map_err(|_| "the server's core was not ready in time")?
            .map_err(|_| "the server is shutting down")?;
        Ok(got.clone().expect("waited for Some"))
    }

    fn served(&self) -> std::sync::MutexGuard<'_, HashMap<String, EgressTasks>> {
        self.served.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Sandboxes being served now (for `/v1/system` and tests).
    pub fn serving(&self) -> usize {
        self.served().len()
    }
}

/// DNS (UDP and TCP on one port) and the proxy on `addr`: at `ports` when they were wired
/// before (a re-attached sandbox's rules name them), else on free ports.
fn bind(addr: IpAddr, ports: EgressPorts) -> std::io::Result<(SandboxSockets, EgressPorts)> {
    let proxy = std::net::TcpListener::bind(SocketAddr::new(addr, ports.proxy.unwrap_or(0)))?;
    // UDP and TCP must share the DNS port: a free UDP port may be taken for TCP, so try a few.
    let mut last = None;
    for _ in 0..8 {
        let udp = std::net::UdpSocket::bind(SocketAddr::new(addr, ports.dns.unwrap_or(0)))?;
        let port = udp.local_addr()?.port();
        match std::net::TcpListener::bind(SocketAddr::new(addr, port)) {
            Ok(tcp) => {
                proxy.set_nonblocking(true)?;
                udp.set_nonblocking(true)?;
                tcp.set_nonblocking(true)?;
                let wired = EgressPorts {
                    dns: Some(port),
                    proxy: Some(proxy.local_addr()?.port()),
                };
                let sockets = SandboxSockets {
                    dns_udp: udp,
                    dns_tcp: tcp,
                    proxy,
                };
                return Ok((sockets, wired));
            }
            Err(e) if ports.dns.is_none() => last = Some(e),
            Err(e) => return Err(e),
        }
    }
    Err(last.expect("tried at least once"))
}

#[async_trait]
impl EgressHook for NodeEgress {
    async fn attach(&self, link: &SandboxLink) -> Result<EgressPorts, HookError> {
        let core = self.core().await?;
        let row = core
            .store()
            .sandbox_by_id(&link.id)
            .await?
            .ok_or_else(|| format!("sandbox {} is not in the store", link.id))?;
        let egress = core
            .egress_of(&row)
            .await
            .ok_or_else(|| format!("sandbox {} has ended", link.id))?;
        // A sealed sandbox is wired too: its lookups get a prompt REFUSED and its connections a
        // prompt close, each counted and shown in `GET .../egress`, rather than silent timeouts.
        let (sockets, ports) = bind(link.host_addr.into(), link.ports)?;
        let tasks = serve_sandbox(&self.dns, &self.proxy, sockets, egress)?;
        self.served().insert(link.id.clone(), tasks);
        tracing::debug!(sandbox = %link.id, ?ports, "egress wired");
        Ok(ports)
    }

    async fn detach(&self, link: &SandboxLink) {
        // Dropped outside the lock: aborting the tasks closes their sockets.
        let tasks = self.served().remove(&link.id);
        drop(tasks);
    }
}
