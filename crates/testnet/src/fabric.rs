//! A "fabric" for a cluster's hosts on one machine: a bridge in the machine's namespace with
//! the address [`FABRIC_GATEWAY`], and one namespace per host on it (`eth0` 198.18.0.11, .12,
//! ...: RFC 2544's benchmarking range, unused here), so each host's processes have their own
//! network and a host's link can be cut (`ip link set ... down`) as a cable is pulled. Hosts
//! reach each other and the machine's side (an API replica, an S3 server bound to the gateway);
//! nothing is routed beyond the bridge.
//!
//! Named `alf<pid>` (the bridge), `alf<pid>h<n>` (a host's link) and `alf-<pid>-<n>` (its
//! namespace); removed on drop, and ones of a dead process by the next [`Fabric::new`].

use super::{run, veth_to, Netns};
use std::io;
use std::net::Ipv4Addr;

/// The bridge's own address: what hosts reach the machine's side at.
pub const FABRIC_GATEWAY: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 1);

/// The bridge and its hosts. Processes still in a host's namespace keep it alive past the
/// drop: end them first.
pub struct Fabric {
    bridge: String,
    hosts: Vec<Netns>,
}

impl Fabric {
    /// A bridge with `hosts` namespaces on it, each link up.
    pub fn new(hosts: usize) -> io::Result<Fabric> {
        sweep_stale();
        let pid = std::process::id();
        let mut fabric = Fabric {
            bridge: format!("alf{pid}"),
            hosts: Vec::new(),
        };
        run(&["ip", "link", "add", &fabric.bridge, "type", "bridge"])?;
        run(&[
            "ip",
            "addr",
            "add",
            &format!("{FABRIC_GATEWAY}/24"),
            "dev",
            &fabric.bridge,
        ])?;
        run(&["ip", "link", "set", &fabric.bridge, "up"])?;
        for n in 0..hosts {
            let ns = Netns::new(&format!("alf-{pid}-{n}"))?;
            let link = fabric.link(n);
            veth_to(None, &link, &ns)?;
            run(&["ip", "link", "set", &link, "master", &fabric.bridge, "up"])?;
            ns.ip(&["addr", "add", &format!("{}/24", Self::addr(n)), "dev", "eth0"])?;
            ns.ip(&["link", "set", "eth0", "up"])?;
            fabric.hosts.push(ns);
        }
        Ok(fabric)
    }

    /// Host `n`'s address.
    pub fn addr(n: usize) -> Ipv4Addr {
        Ipv4Addr::new(198, 18, 0, 11 + n as u8)
    }

    /// Host `n`'s namespace.
    pub fn host(&self, n: usize) -> &Netns {
        &self.hosts[n]
    }

    /// Host `n`'s link, on the bridge's side.
    fn link(&self, n: usize) -> String {
        format!("{}h{n}", self.bridge)
    }

    /// Pull host `n`'s cable: nothing reaches it or leaves it until [`Fabric::mend`].
    pub fn cut(&self, n: usize) -> io::Result<()> {
        run(&["ip", "link", "set", &self.link(n), "down"])
    }

    pub fn mend(&self, n: usize) -> io::Result<()> {
        run(&["ip", "link", "set", &self.link(n), "up"])
    }
}

impl Drop for Fabric {
    fn drop(&mut self) {
        // The namespaces go with `hosts` (and their links with them); the bridge here.
        let _ = run(&["ip", "link", "del", &self.bridge]);
    }
}

/// Removes the bridges and namespaces of fabrics whose process is gone.
fn sweep_stale() {
    let dead = |pid: &str| !pid.is_empty() && !std::path::Path::new(&format!("/proc/{pid}")).exists();
    if let Ok(dir) = std::fs::read_dir("/run/netns") {
        for e in dir.flatten() {
            let name = e.file_name().to_string_lossy().to_string();
            if let Some(pid) = name.strip_prefix("alf-").and_then(|r| r.split('-').next()) {
                if dead(pid) {
                    let _ = run(&["ip", "netns", "del", &name]);
                }
            }
        }
    }
    if let Ok(dir) = std::fs::read_dir("/sys/class/net") {
        for e in dir.flatten() {
            let name = e.file_name().to_string_lossy().to_string();
            if let Some(pid) = name
                .strip_prefix("alf")
                .filter(|r| r.bytes().all(|b| b.is_ascii_digit()))
            {
                if dead(pid) {
                    let _ = run(&["ip", "link", "del", &name]);
                }
            }
        }
    }
}
