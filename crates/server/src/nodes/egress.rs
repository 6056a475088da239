//! The node's egress side: the runtime's [`EgressHook`], serving every sandbox's DNS responder
//! and proxy on the host end of its link, under the policy its create carried.
//!
//! The node decides alone: a create hands it the sandbox's [`EgressSpec`] (decided by the core
//! from the tenant's policy and the request), which the node keeps beside its VMs
//! (`<data dir>/egress/<id>.json`, written before the VM starts) and applies under its own
//! egress configuration (platform denies with this host's addresses, profiles). So a VM
//! re-attached after a restart is served again without asking anyone, and a node on another
//! host never reads the control plane's store. The counters and recent denials live here too,
//! for as long as the node has the VM (across pause, suspend and resume).

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use airlock_egress::{
    serve_sandbox, DnsConfig, DnsServer, EgressConfig, EgressSnapshot, EgressTasks, Proxy, ProxyConfig, Resolver,
    SandboxEgress, SandboxLimits, SandboxSockets,
};
use airlock_runtime::net::{EgressHook, EgressPorts, SandboxLink};
use async_trait::async_trait;

use crate::records::EgressSpec;

type HookError = Box<dyn std::error::Error + Send + Sync>;

/// Largest spec file read back (a tenant policy is bounded by the API's limits well below it).
const SPEC_MAX: u64 = 4 << 20;

pub struct NodeEgress {
    dns: DnsServer,
    proxy: Proxy,
    config: EgressConfig,
    /// Where each VM's spec is kept.
    dir: PathBuf,
    /// Each VM's egress state (policy, counters, denials), by sandbox id.
    sandboxes: Mutex<HashMap<String, Arc<SandboxEgress>>>,
    /// The tasks serving each wired sandbox, by id; dropping them closes its sockets and every
    /// connection it has open.
    served: Mutex<HashMap<String, EgressTasks>>,
}

impl NodeEgress {
    /// `resolver` and `proxy` carry the uplink (where lookups and dials leave from); `config`
    /// is this node's (its platform denies hold the host's addresses); specs are kept in `dir`.
    pub fn new(
        resolver: Arc<Resolver>,
        proxy: ProxyConfig,
        config: EgressConfig,
        dir: PathBuf,
    ) -> std::io::Result<Arc<Self>> {
        std::fs::create_dir_all(&dir)?;
        Ok(Arc::new(NodeEgress {
            dns: DnsServer::new(resolver.clone(), DnsConfig::default()),
            proxy: Proxy::new(resolver, proxy),
            config,
            dir,
            sandboxes: Mutex::new(HashMap::new()),
            served: Mutex::new(HashMap::new()),
        }))
    }

    /// This node's platform denies, as networks (an image pull's dials are held to them).
    pub fn denied_networks(&self) -> Vec<ipnet::IpNet> {
        self.config.platform.networks()
    }

    fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
        m.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn spec_path(&self, id: &str) -> PathBuf {
        self.dir.join(format!("{id}.json"))
    }

    /// Keep `spec` for VM `id` (before it starts: its network's `attach` applies it). A spec
    /// given again replaces the last (counters start over).
    pub fn prepare(&self, id: &str, spec: &EgressSpec) -> std::io::Result<()> {
        let bytes = serde_json::to_vec(spec).expect("serializable");
        airlock_runtime::datadir::write_atomic(&self.spec_path(id), &bytes).map_err(std::io::Error::other)?;
        let egress = self.build(id, spec);
        Self::lock(&self.sandboxes).insert(id.to_string(), egress);
        Ok(())
    }

    /// VM `id` is gone for good: its spec and counters go too.
    pub fn forget(&self, id: &str) {
        Self::lock(&self.sandboxes).remove(id);
        match std::fs::remove_file(self.spec_path(id)) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                tracing::warn!(sandbox = %id, "cannot remove its egress spec: {e}")
            }
            _ => {}
        }
    }

    /// Remove the specs of VMs this node no longer has, written before `before` (a create
    /// under way writes its spec after the node started, so it is never taken for a leftover).
    pub fn sweep(&self, live: &[String], before: std::time::SystemTime) {
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            let Some(id) = path.file_stem().and_then(|s| s.to_str()) else {
                continue;
            };
            let old = entry.metadata().and_then(|m| m.modified()).is_ok_and(|t| t < before);
            if old && !live.iter().any(|l| l == id) {
                tracing::info!(sandbox = %id, "removing the egress spec of a VM this node no longer has");
                self.forget(id);
            }
        }
    }

    /// The counters and recent denials of VM `id`, if this node has it.
    pub fn report(&self, id: &str) -> Option<EgressSnapshot> {
        Self::lock(&self.sandboxes).get(id).map(|e| e.snapshot())
    }

    /// VMs whose egress this node holds (served or not: paused, suspended, booting).
    pub fn held(&self) -> usize {
        Self::lock(&self.sandboxes).len()
    }

    /// Sandboxes being served now.
    pub fn serving(&self) -> usize {
        Self::lock(&self.served).len()
    }

    /// The state `spec` gives VM `id` under this node's configuration.
    fn build(&self, id: &str, spec: &EgressSpec) -> Arc<SandboxEgress> {
        let (policy, missing) = spec.policy(&self.config);
        if !missing.is_empty() {
            tracing::warn!(sandbox = %id, "egress profiles {missing:?} are not configured on this node; left out");
        }
        SandboxEgress::new(id.to_string(), policy, SandboxLimits::default())
    }

    /// VM `id`'s state: kept since its create, else (after a restart) from its spec file. A VM
    /// without a readable spec is sealed: it reaches less, never more.
    fn egress_of(&self, id: &str) -> Arc<SandboxEgress> {
        if let Some(e) = Self::lock(&self.sandboxes).get(id) {
            return e.clone();
        }
        let spec = match read_spec(&self.spec_path(id)) {
            Ok(spec) => spec,
            Err(e) => {
                tracing::warn!(sandbox = %id, "no egress spec for it ({e}); it runs sealed");
                EgressSpec::default()
            }
        };
        let egress = self.build(id, &spec);
        Self::lock(&self.sandboxes)
            .entry(id.to_string())
            .or_insert(egress)
            .clone()
    }
}

fn read_spec(path: &Path) -> Result<EgressSpec, HookError> {
    use std::io::Read;
    let mut bytes = Vec::new();
    std::fs::File::open(path)?.take(SPEC_MAX).read_to_end(&mut bytes)?;
    Ok(serde_json::from_slice(&bytes)?)
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
        let egress = self.egress_of(&link.id);
        // A sealed sandbox is wired too: its lookups get a prompt REFUSED and its connections a
        // prompt close, each counted and shown in `GET .../egress`, rather than silent timeouts.
        let (sockets, ports) = bind(link.host_addr.into(), link.ports)?;
        let tasks = serve_sandbox(&self.dns, &self.proxy, sockets, egress)?;
        Self::lock(&self.served).insert(link.id.clone(), tasks);
        tracing::debug!(sandbox = %link.id, ?ports, "egress wired");
        Ok(ports)
    }

    async fn detach(&self, link: &SandboxLink) {
        // Dropped outside the lock: aborting the tasks closes their sockets.
        let tasks = Self::lock(&self.served).remove(&link.id);
        drop(tasks);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use airlock_egress::{PlatformDenies, Profiles, TenantPolicy};

    fn node(dir: &Path, profiles: &str) -> Arc<NodeEgress> {
        let config = EgressConfig::new(PlatformDenies::new(Vec::new()), Profiles::from_json(profiles).unwrap());
        let resolver = Arc::new(Resolver::new(
            "127.0.0.1:53".parse().unwrap(),
            std::time::Duration::from_secs(1),
        ));
        NodeEgress::new(resolver, ProxyConfig::default(), config, dir.join("egress")).unwrap()
    }

    fn spec(profiles: &[&str], allow: &str) -> EgressSpec {
        EgressSpec {
            profiles: profiles.iter().map(|p| p.to_string()).collect(),
            sealed: false,
            tenant: TenantPolicy::from_json(&format!(r#"{{"allow": {{"domains": ["{allow}"]}}}}"#)).unwrap(),
        }
    }

    #[test]
    fn a_spec_is_kept_across_a_restart_and_applied_under_the_nodes_profiles() {
        let tmp = tempfile::tempdir().unwrap();
        let profiles = r#"{"pypi": {"domains": ["pypi.org"]}}"#;
        node(tmp.path(), profiles)
            .prepare("sb1", &spec(&["pypi", "gone"], "tenant.test"))
            .unwrap();
        // A new process: the spec is read back from the file.
        let again = node(tmp.path(), profiles);
        let e = again.egress_of("sb1");
        assert!(e.policy().decide_domain("pypi.org").allowed);
        assert!(e.policy().decide_domain("tenant.test").allowed);
        assert!(!e.policy().decide_domain("example.com").allowed);
        assert_eq!(
            again.report("sb1").unwrap().profiles,
            vec!["pypi".to_string()],
            "an unknown profile is left out"
        );
        again.forget("sb1");
        assert!(again.report("sb1").is_none());
        assert!(!tmp.path().join("egress/sb1.json").exists());
    }

    #[test]
    fn a_vm_without_a_readable_spec_runs_sealed() {
        let tmp = tempfile::tempdir().unwrap();
        let n = node(tmp.path(), "{}");
        std::fs::write(
            tmp.path().join("egress/sb2.json"),
            br#"{"profiles": [], "sealed": false, "tenant": {"allow": {"domains": ["*.test"]}}}"#,
        )
        .unwrap();
        assert!(
            !n.egress_of("sb2").policy().decide_domain("a.test").allowed,
            "a wildcard is refused on reading back"
        );
        assert!(!n.egress_of("sb3").policy().decide_domain("a.test").allowed);
    }

    #[test]
    fn the_sweep_removes_only_old_specs_of_vms_the_node_lacks() {
        let tmp = tempfile::tempdir().unwrap();
        let n = node(tmp.path(), "{}");
        for id in ["live", "left"] {
            n.prepare(id, &spec(&[], "a.test")).unwrap();
        }
        let start = std::time::SystemTime::now() + std::time::Duration::from_secs(1);
        n.sweep(&["live".to_string()], start);
        assert!(tmp.path().join("egress/live.json").exists());
        assert!(!tmp.path().join("egress/left.json").exists());
        n.prepare("new", &spec(&[], "a.test")).unwrap();
        n.sweep(&[], std::time::SystemTime::now() - std::time::Duration::from_secs(60));
        assert!(
            tmp.path().join("egress/new.json").exists(),
            "written after the node started"
        );
    }
}
