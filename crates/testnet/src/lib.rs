//! A small "internet" in network namespaces, for the egress tests and the egress bench (test
//! scaffolding, never linked into production). Only TEST-NET addresses, only in namespaces made
//! here; nothing is routed through the machine's own namespace. This file owns the namespaces and
//! their links ([`Netns`], [`TestNet`]); the hosts in the internet namespace are [`TestDns`]
//! (`dns.rs`) and [`TestWeb`] (`web.rs`). Uses `ip`, `nft` and `sysctl` (needs root) and
//! `airlock_egress::netns` to enter a namespace.
//!
//! ```text
//!  sandbox ns                host ns ("the uplink": proxy + DNS responder run here)      internet ns
//!  eth0 192.0.2.2/26 <-veth-> gw0 192.0.2.1/26 (gateway)  up0 198.51.100.1/24 <-veth-> eth0 198.51.100.2/24
//!  default via .1            nft: tcp in on gw0 -> DNAT 192.0.2.1:PROXY_PORT              lo: 203.0.113.x/32
//!                            (except DNS over TCP to the gateway)
//!                            203.0.113.0/24 via 198.51.100.2
//!  direct ns (optional, for the bench's baseline): eth0 192.0.2.66/26 <-> dir0 192.0.2.65/26, forwarded
//! ```
//!
//! Beside it, test scaffolding of the same kind: [`Fabric`] (a cluster's hosts in namespaces on
//! a bridge, `fabric.rs`), [`s3::Moto`] (an S3 server, `s3.rs`), [`registry::Registry`] (a
//! container registry on loopback, `registry.rs`; hostile images for it, `hostile.rs`) and [`end_vmm_of`] (a VM a
//! stopped test server left, `leftovers.rs`).
//!
//! Namespaces are named `egt-<pid>-<n>-<role>` and deleted on drop (also when a test panics);
//! ones left by a dead process are deleted by the next [`TestNet::new`].

use std::io;
use std::net::Ipv4Addr;
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::thread::JoinHandle;

mod dns;
mod fabric;
pub mod hostile;
mod leftovers;
pub mod registry;
pub mod s3;
mod web;

pub use dns::TestDns;
pub use fabric::{Fabric, FABRIC_GATEWAY};
pub use leftovers::end_vmm_of;
pub use web::{Served, TestWeb};

pub const GATEWAY: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 1);
pub const GUEST: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 2);
pub const UPLINK: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 1);
pub const INTERNET_LINK: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 2);
pub const DIRECT_GATEWAY: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 65);
pub const DIRECT_GUEST: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 66);
pub const PROXY_PORT: u16 = 15001;

fn run(args: &[&str]) -> io::Result<()> {
    let out = Command::new(args[0]).args(&args[1..]).output()?;
    if !out.status.success() {
        return Err(io::Error::other(format!(
            "{}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(())
}

/// A network namespace made with `ip netns add`, deleted on drop.
pub struct Netns {
    name: String,
}

impl Netns {
    pub fn new(name: &str) -> io::Result<Self> {
        run(&["ip", "netns", "add", name])?;
        let ns = Netns { name: name.to_string() };
        ns.ip(&["link", "set", "lo", "up"])?;
        Ok(ns)
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn path(&self) -> std::path::PathBuf {
        std::path::PathBuf::from(format!("/run/netns/{}", self.name))
    }

    /// `ip -n <ns> ...`
    pub fn ip(&self, args: &[&str]) -> io::Result<()> {
        let mut a = vec!["ip", "-n", &self.name];
        a.extend_from_slice(args);
        run(&a)
    }

    /// Runs a command inside the namespace (`ip netns exec`).
    pub fn exec(&self, args: &[&str]) -> io::Result<()> {
        let mut a = vec!["ip", "netns", "exec", &self.name];
        a.extend_from_slice(args);
        run(&a)
    }

    /// Runs `f` on a new thread that has entered this namespace: sockets it (and threads it
    /// spawns, e.g. a tokio runtime built there) makes live in the namespace.
    pub fn spawn<T: Send + 'static>(&self, f: impl FnOnce() -> T + Send + 'static) -> JoinHandle<T> {
        let path = self.path();
        std::thread::spawn(move || {
            airlock_egress::netns::enter(&path).expect("enter network namespace");
            f()
        })
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = run(&["ip", "netns", "del", &self.name]);
    }
}

/// Deletes `egt-<pid>-*` namespaces whose process is gone.
fn sweep_stale() {
    let Ok(dir) = std::fs::read_dir("/run/netns") else {
        return;
    };
    for e in dir.flatten() {
        let name = e.file_name().to_string_lossy().to_string();
        let Some(rest) = name.strip_prefix("egt-") else {
            continue;
        };
        let Some(pid) = rest.split('-').next() else { continue };
        if !std::path::Path::new(&format!("/proc/{pid}")).exists() {
            let _ = run(&["ip", "netns", "del", &name]);
        }
    }
}

/// A veth pair from `host` (the machine's own namespace with None), its end there named
/// `host_end`, to `eth0` in `peer`; both ends down.
fn veth_to(host: Option<&Netns>, host_end: &str, peer: &Netns) -> io::Result<()> {
    let mut args = vec!["ip"];
    if let Some(h) = host {
        args.extend(["-n", h.name()]);
    }
    args.extend([
        "link",
        "add",
        host_end,
        "type",
        "veth",
        "peer",
        "name",
        "eth0",
        "netns",
        peer.name(),
    ]);
    run(&args)
}

/// A veth pair from `host` (end `host_end`, address `host_addr`) to `eth0` in `peer` (address
/// `peer_addr`), both ends up.
fn veth(host: &Netns, host_end: &str, host_addr: &str, peer: &Netns, peer_addr: &str) -> io::Result<()> {
    veth_to(Some(host), host_end, peer)?;
    host.ip(&["addr", "add", host_addr, "dev", host_end])?;
    host.ip(&["link", "set", "dev", host_end, "up"])?;
    peer.ip(&["addr", "add", peer_addr, "dev", "eth0"])?;
    peer.ip(&["link", "set", "dev", "eth0", "up"])
}

static SEQ: AtomicUsize = AtomicUsize::new(0);

/// The three (or four) namespaces and their links. Drop removes them all.
pub struct TestNet {
    pub sandbox: Netns,
    pub host: Netns,
    pub internet: Netns,
    pub direct: Option<Netns>,
}

impl TestNet {
    pub fn new(with_direct: bool) -> io::Result<Self> {
        sweep_stale();
        let base = format!("egt-{}-{}", std::process::id(), SEQ.fetch_add(1, Ordering::Relaxed));
        let sandbox = Netns::new(&format!("{base}-s"))?;
        let host = Netns::new(&format!("{base}-h"))?;
        let internet = Netns::new(&format!("{base}-i"))?;
        let direct = if with_direct {
            Some(Netns::new(&format!("{base}-d"))?)
        } else {
            None
        };
        let net = TestNet {
            sandbox,
            host,
            internet,
            direct,
        };
        net.wire()?;
        Ok(net)
    }

    fn wire(&self) -> io::Result<()> {
        let (s, h, i) = (&self.sandbox, &self.host, &self.internet);
        veth(h, "gw0", "192.0.2.1/26", s, "192.0.2.2/26")?;
        s.ip(&["route", "add", "default", "via", "192.0.2.1"])?;

        veth(h, "up0", "198.51.100.1/24", i, "198.51.100.2/24")?;
        h.ip(&["route", "add", "203.0.113.0/24", "via", "198.51.100.2"])?;

        // Every TCP connection from the sandbox goes to the proxy, as the plumbing does it.
        let rules = format!(
            "table ip egress_test {{ chain pre {{ type nat hook prerouting priority dstnat; \
             iifname \"gw0\" ip daddr {GATEWAY} tcp dport 53 accept; \
             iifname \"gw0\" meta l4proto tcp dnat to {GATEWAY}:{PROXY_PORT}; }}; }}"
        );
        h.exec(&["nft", &rules])?;

        if let Some(d) = &self.direct {
            veth(h, "dir0", "192.0.2.65/26", d, "192.0.2.66/26")?;
            d.ip(&["route", "add", "default", "via", "192.0.2.65"])?;
            i.ip(&["route", "add", "192.0.2.64/26", "via", "198.51.100.1"])?;
            h.exec(&["sysctl", "-q", "-w", "net.ipv4.ip_forward=1"])?;
        }
        Ok(())
    }

    /// Gives the internet namespace another address (a test host), e.g. 203.0.113.10.
    pub fn add_internet_host(&self, ip: Ipv4Addr) -> io::Result<()> {
        self.internet.ip(&["addr", "add", &format!("{ip}/32"), "dev", "lo"])
    }
}
