//! Per-sandbox networks: the kernel side of egress.
//!
//! Every sandbox gets a network namespace `airlock-<tag>-<id>` (`tag`: 4 hex digits of the data
//! dir's path, so two runtimes on one host never sweep each other's) holding
//!
//! - `tap0`, the VM's NIC (virtio-net). The runtime opens it in the namespace and hands QEMU the
//!   open fd, so the VMM needs neither the namespace nor the privilege. Its address is the
//!   gateway, `100.96.0.1/30`; the guest is `100.96.0.2` (`airlock_proto::net`): the same in
//!   every sandbox, since no two sandboxes share a namespace, so a snapshot restores anywhere.
//!   CGNAT space (RFC 6598): never a destination a policy may allow, so the link hides none.
//! - `up0`, one end of a veth pair whose other end, `al<tag><hash of id>`, is in the host's
//!   namespace. The pair is a /31 from the link pool (default `169.254.0.0/16`, skipping
//!   `169.254.169.0/24` where clouds keep their metadata service; `AIRLOCK_NET_POOL` sets
//!   another), unique per sandbox and recorded in `<sandbox dir>/net.json`: the host end (`H`)
//!   is where the egress side listens for this sandbox, the namespace end (`N`) the source the
//!   host sees (the namespace source-NATs the guest to it, since every guest has the same address).
//!
//! Two nftables tables, each loaded in one transaction (`nft -f`):
//!
//! - `inet airlock` in the namespace: IPv6 from the guest and any source but the guest's address
//!   dropped before conntrack; DNS (UDP and TCP 53) to the gateway passed to the DNS hook
//!   (`H:dns`), or, unwired, left to the empty namespace (no answer); with the proxy hook every
//!   guest TCP connection routed to the host end; all other UDP (no QUIC), ICMP and everything
//!   else dropped. Named counters (`spoofed`, `ipv6`, `dns`, `tcp`, `udp_dropped`, `dropped`)
//!   show what happened.
//! - `inet airlock-<tag>-<id>` in the host's namespace: every TCP connection arriving on the
//!   sandbox's veth is DNATed to `H:proxy`. The DNAT is here, not in the sandbox's namespace,
//!   because conntrack is per namespace: only here can the proxy read the guest's original
//!   destination with `SO_ORIGINAL_DST` on the socket it accepted. Input from the veth is limited
//!   to the hooks' ports on `H`, and nothing from or to the veth is ever forwarded (a sandbox is
//!   never routed to the host's uplink, whatever `ip_forward` says).
//!
//! Without an egress hook (or with one that returns no ports for a sandbox) the guest has its NIC
//! and nothing else: every sandbox starts with no egress.
//!
//! Everything is made with the sandbox and removed with it; at start-up the runtime sweeps
//! namespaces, host tables and host veths carrying its tag whose sandbox is not live.
//! `ip` and `nft` run as commands, each bounded by [`COMMAND_TIMEOUT`].

mod network;
mod pool;
mod rules;
mod sys;

pub use network::{names, Network, NetworkOptions};
pub use pool::LinkPool;
pub use rules::{host_ruleset, netns_ruleset};

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use std::net::{Ipv4Addr, SocketAddrV4};
use std::path::{Path, PathBuf};
use std::time::Duration;
use thiserror::Error;

/// Where `ip netns add` keeps named namespaces.
pub const NETNS_DIR: &str = "/run/netns";
/// Prefix of every name airlock gives a namespace or a host nftables table.
pub const NETNS_PREFIX: &str = "airlock-";
/// Prefix of the host end of every sandbox's veth.
pub const HOST_IF_PREFIX: &str = "al";
/// The VM's tap, inside the sandbox's namespace.
pub const TAP: &str = "tap0";
/// The namespace's end of the veth.
pub const UPLINK: &str = "up0";
/// The nftables table inside each sandbox's namespace.
pub const NETNS_TABLE: &str = "airlock";
/// DNS port the guest uses on the gateway.
pub const DNS_PORT: u16 = 53;
/// The longest any `ip` or `nft` command may take.
pub const COMMAND_TIMEOUT: Duration = Duration::from_secs(10);
/// The default link pool.
pub const DEFAULT_POOL: &str = "169.254.0.0/16";

#[derive(Debug, Error)]
pub enum NetError {
    #[error("`{program}` cannot be run ({source}); run scripts/install-host-deps as root")]
    ToolMissing {
        program: &'static str,
        source: std::io::Error,
    },
    #[error("`{command}` failed ({status}): {stderr}")]
    Command {
        command: String,
        status: String,
        stderr: String,
    },
    #[error("`{command}` did not finish within {}s", COMMAND_TIMEOUT.as_secs())]
    Timeout { command: String },
    #[error("no free address pair left in the sandbox link pool {0}")]
    PoolExhausted(String),
    #[error("invalid sandbox link pool {pool:?} (AIRLOCK_NET_POOL): {reason}")]
    InvalidPool { pool: String, reason: String },
    #[error("network namespace {netns}: {source}")]
    Netns { netns: String, source: std::io::Error },
    #[error("tap device {TAP} in {netns}: {source}")]
    Tap { netns: String, source: std::io::Error },
    #[error("sysctl {path}: {source}")]
    Sysctl { path: String, source: std::io::Error },
    #[error("the egress hook failed for sandbox {id}: {reason}")]
    Hook { id: String, reason: String },
}

type Result<T, E = NetError> = std::result::Result<T, E>;

/// The ports the egress side serves a sandbox on, on its host address `H`. `None` keeps that
/// door closed.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct EgressPorts {
    /// Gets the guest's DNS queries to the gateway (UDP and TCP 53, destination rewritten).
    pub dns: Option<u16>,
    /// Gets every TCP connection the guest opens; `SO_ORIGINAL_DST` on the accepted socket is
    /// where the guest aimed.
    pub proxy: Option<u16>,
}

/// One sandbox's link, as recorded in `<sandbox dir>/net.json`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct SandboxLink {
    pub id: String,
    /// Network namespace (`/run/netns/<netns>`); also the name of the host's nftables table.
    pub netns: String,
    /// The host end of the veth.
    pub host_if: String,
    /// `H`: the host end's address, where the egress side listens for this sandbox.
    pub host_addr: Ipv4Addr,
    /// `N`: the namespace end's address, the source of everything the sandbox sends the host.
    pub peer_addr: Ipv4Addr,
    /// Index of the pair in the pool.
    pub index: u32,
    /// The ports the rulesets were loaded with.
    pub ports: EgressPorts,
}

impl SandboxLink {
    /// Where the guest's TCP connections land, when wired.
    pub fn proxy_target(&self) -> Option<SocketAddrV4> {
        self.ports.proxy.map(|p| SocketAddrV4::new(self.host_addr, p))
    }
    pub fn record_path(dir: &Path) -> PathBuf {
        dir.join("net.json")
    }
    pub fn load(dir: &Path) -> Option<Self> {
        serde_json::from_slice(&std::fs::read(Self::record_path(dir)).ok()?).ok()
    }
}

/// What the egress side (DNS responder, proxy) plugs into, through
/// `RuntimeOptions::network.egress` (so it must exist before `Runtime::open`, which re-attaches).
///
/// A typical `attach`: bind a TCP listener and a UDP + TCP socket on `(link.host_addr, port)`
/// (plain `bind` in the host's namespace: the address is on the host end of the veth), remember
/// `link.id` for them, and return their ports. The proxy then reads where each accepted
/// connection was aimed with `getsockopt(SOL_IP, SO_ORIGINAL_DST)` (the DNAT happens in the
/// host's namespace, where the socket lives); every peer is `link.peer_addr`. The DNS responder
/// gets the queries the guest sent to the gateway's port 53, from `link.peer_addr`; over TCP
/// too, if it listens on TCP. Nothing reaches the host from a sandbox but these ports on its
/// own `H`. Policy lives only here: the kernel side only seals and redirects.
#[async_trait]
pub trait EgressHook: Send + Sync {
    /// The sandbox's link exists and `link.host_addr` is assigned on the host, so a listener can
    /// bind it (a peer from `link.peer_addr` is this sandbox). Answer which ports to wire;
    /// `link.ports` is what was wired before, for a sandbox re-attached after a restart. Called
    /// before the VM boots and for every sandbox re-attached at start-up. An error fails the
    /// create.
    async fn attach(&self, link: &SandboxLink) -> Result<EgressPorts, Box<dyn std::error::Error + Send + Sync>>;
    /// The sandbox is gone (deleted, exited, failed to boot, or its `attach` failed): stop
    /// serving it. May come for a link `attach` never accepted.
    async fn detach(&self, link: &SandboxLink);
}
