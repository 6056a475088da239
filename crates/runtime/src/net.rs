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

use airlock_proto::net as guest;
use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::net::{Ipv4Addr, SocketAddrV4};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
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

/// The pool of /31 host-side pairs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LinkPool {
    base: Ipv4Addr,
    prefix_len: u8,
}

impl std::fmt::Display for LinkPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.base, self.prefix_len)
    }
}

impl Default for LinkPool {
    fn default() -> Self {
        DEFAULT_POOL.parse().expect("default pool")
    }
}

impl std::str::FromStr for LinkPool {
    type Err = NetError;
    fn from_str(s: &str) -> Result<Self> {
        let bad = |reason: &str| NetError::InvalidPool {
            pool: s.into(),
            reason: reason.into(),
        };
        let (addr, len) = s.split_once('/').ok_or_else(|| bad("expected a.b.c.d/len"))?;
        let base: Ipv4Addr = addr.parse().map_err(|_| bad("not an IPv4 address"))?;
        let prefix_len: u8 = len.parse().map_err(|_| bad("not a prefix length"))?;
        if !(8..=30).contains(&prefix_len) {
            return Err(bad("the prefix length must be between 8 and 30"));
        }
        let mask = u32::MAX << (32 - prefix_len);
        if u32::from(base) & !mask != 0 {
            return Err(bad("host bits are set"));
        }
        let pool = Self { base, prefix_len };
        let guest_net = u32::from(Ipv4Addr::from(guest::GATEWAY)) & (u32::MAX << (32 - guest::PREFIX_LEN));
        if pool.contains(guest_net) || pool.contains(guest_net + 3) {
            return Err(bad("it overlaps the guest link 100.96.0.0/30"));
        }
        Ok(pool)
    }
}

impl LinkPool {
    fn contains(&self, a: u32) -> bool {
        let mask = u32::MAX << (32 - self.prefix_len);
        a & mask == u32::from(self.base)
    }
    fn pairs(&self) -> u32 {
        1 << (31 - self.prefix_len)
    }
    /// `(H, N)` of pair `index`, unless the pair is one never to use.
    fn pair(&self, index: u32) -> Option<(Ipv4Addr, Ipv4Addr)> {
        let h = u32::from(self.base) + 2 * index;
        // Clouds answer their metadata service at 169.254.169.254: leave its /24 alone.
        if h & 0xffff_ff00 == u32::from(Ipv4Addr::new(169, 254, 169, 0)) {
            return None;
        }
        Some((Ipv4Addr::from(h), Ipv4Addr::from(h + 1)))
    }
}

/// Network settings of a runtime.
#[derive(Clone, Default)]
pub struct NetworkOptions {
    /// The pool of host-side pairs; `None`: `AIRLOCK_NET_POOL`, else [`DEFAULT_POOL`].
    pub pool: Option<LinkPool>,
    /// The egress side; `None`: sandboxes get their NIC and no egress.
    pub egress: Option<Arc<dyn EgressHook>>,
}

/// A runtime's sandbox networks.
pub struct Network {
    tag: String,
    pool: LinkPool,
    egress: Option<Arc<dyn EgressHook>>,
    /// Pool indices of live links (and of links being made).
    reserved: Mutex<BTreeSet<u32>>,
}

/// The names of sandbox `id`'s namespace (= host table) and host veth end, for the runtime whose
/// data dir is `data_root`.
pub fn names(data_root: &Path, id: &str) -> (String, String) {
    let tag = runtime_tag(data_root);
    (netns_name(&tag, id), host_if_name(&tag, id))
}

fn runtime_tag(data_root: &Path) -> String {
    let path = std::fs::canonicalize(data_root).unwrap_or_else(|_| data_root.to_path_buf());
    hex::encode(Sha256::digest(path.as_os_str().as_encoded_bytes()))[..4].to_string()
}

fn netns_name(tag: &str, id: &str) -> String {
    format!("{NETNS_PREFIX}{tag}-{id}")
}

/// `al` + tag (4) + 9 hex digits of the id's hash: 15 bytes, the most an interface name holds.
fn host_if_name(tag: &str, id: &str) -> String {
    let h = hex::encode(Sha256::digest(id.as_bytes()));
    format!("{HOST_IF_PREFIX}{tag}{}", &h[..9])
}

impl Network {
    pub fn new(data_root: &Path, opts: NetworkOptions) -> Result<Self> {
        let pool = match (opts.pool, std::env::var("AIRLOCK_NET_POOL")) {
            (Some(pool), _) => pool,
            (None, Ok(p)) if !p.is_empty() => p.parse()?,
            (None, _) => LinkPool::default(),
        };
        Ok(Self {
            tag: runtime_tag(data_root),
            pool,
            egress: opts.egress,
            reserved: Mutex::new(BTreeSet::new()),
        })
    }

    /// Fail early, with the fix, when `ip` or `nft` is missing.
    pub async fn check_tools(&self) -> Result<()> {
        run("ip", &["-V"], None, None).await?;
        run("nft", &["--version"], None, None).await?;
        Ok(())
    }

    pub fn netns_name(&self, id: &str) -> String {
        netns_name(&self.tag, id)
    }

    pub fn host_if_name(&self, id: &str) -> String {
        host_if_name(&self.tag, id)
    }

    /// Make sandbox `id`'s network; returns its link and the tap, open (the VMM's NIC). On any
    /// failure everything made so far is removed.
    pub async fn create(&self, id: &str) -> Result<(SandboxLink, OwnedFd)> {
        self.make(id, true).await
    }

    /// A network the egress side never hears of: the NIC and nothing else (a base snapshot's
    /// builder, which needs the device but never a packet out).
    pub async fn create_sealed(&self, id: &str) -> Result<(SandboxLink, OwnedFd)> {
        self.make(id, false).await
    }

    async fn make(&self, id: &str, egress: bool) -> Result<(SandboxLink, OwnedFd)> {
        let (index, host_addr, peer_addr) = self.allocate().await?;
        let mut link = SandboxLink {
            id: id.into(),
            netns: self.netns_name(id),
            host_if: self.host_if_name(id),
            host_addr,
            peer_addr,
            index,
            ports: EgressPorts::default(),
        };
        let started = std::time::Instant::now();
        match self.build(&mut link, egress).await {
            Ok(tap) => {
                tracing::debug!(
                    id,
                    netns = %link.netns,
                    "network made in {} ms",
                    started.elapsed().as_millis()
                );
                Ok((link, tap))
            }
            Err(e) => {
                self.remove(&link).await;
                Err(e)
            }
        }
    }

    async fn build(&self, link: &mut SandboxLink, egress: bool) -> Result<OwnedFd> {
        run("ip", &["netns", "add", &link.netns], None, None).await?;
        let ns_path = Path::new(NETNS_DIR).join(&link.netns);
        run(
            "ip",
            &[
                "link",
                "add",
                &link.host_if,
                "type",
                "veth",
                "peer",
                "name",
                UPLINK,
                "netns",
                &link.netns,
            ],
            None,
            None,
        )
        .await?;
        // Host end: no IPv6 (no link-local address, nothing to route), then its /31.
        write_sysctl(&format!("/proc/sys/net/ipv6/conf/{}/disable_ipv6", link.host_if), "1")?;
        run(
            "ip",
            &["-batch", "-"],
            None,
            Some(format!(
                "addr add {}/31 dev {}\nlink set {} up\n",
                link.host_addr, link.host_if, link.host_if
            )),
        )
        .await?;
        // In the namespace: sysctls and the tap, from a thread that enters it.
        let tap = {
            let ns_path = ns_path.clone();
            let netns = link.netns.clone();
            in_netns(ns_path, move || {
                for (path, value) in [
                    ("/proc/sys/net/ipv6/conf/all/disable_ipv6", "1"),
                    ("/proc/sys/net/ipv6/conf/default/disable_ipv6", "1"),
                    ("/proc/sys/net/ipv4/ip_forward", "1"),
                ] {
                    write_sysctl(path, value)?;
                }
                open_tap(TAP).map_err(|source| NetError::Tap { netns, source })
            })
            .await
            .map_err(|source| NetError::Netns {
                netns: link.netns.clone(),
                source,
            })??
        };
        if let Some(hook) = self.egress.as_ref().filter(|_| egress) {
            link.ports = hook.attach(link).await.map_err(|e| NetError::Hook {
                id: link.id.clone(),
                reason: e.to_string(),
            })?;
        }
        // The rules before the links carry anything.
        self.load_rules(link).await?;
        let gw = Ipv4Addr::from(guest::GATEWAY);
        let guest_addr = Ipv4Addr::from(guest::GUEST_ADDR);
        run(
            "ip",
            &["-batch", "-"],
            Some(&ns_path),
            Some(format!(
                "link set lo up\n\
                 addr add {peer}/31 dev {UPLINK}\n\
                 link set {UPLINK} up\n\
                 route add default via {host} dev {UPLINK}\n\
                 link set {TAP} address {gw_mac}\n\
                 addr add {gw}/{len} dev {TAP}\n\
                 link set {TAP} up\n\
                 neigh replace {guest_addr} lladdr {guest_mac} dev {TAP} nud permanent\n",
                peer = link.peer_addr,
                host = link.host_addr,
                gw_mac = guest::GATEWAY_MAC,
                len = guest::PREFIX_LEN,
                guest_mac = guest::GUEST_MAC,
            )),
        )
        .await?;
        Ok(tap)
    }

    /// Load both tables for `link.ports` (each atomically: a table is replaced in one transaction).
    async fn load_rules(&self, link: &SandboxLink) -> Result<()> {
        let ns_path = Path::new(NETNS_DIR).join(&link.netns);
        run("nft", &["-f", "-"], Some(&ns_path), Some(netns_ruleset(link))).await?;
        run("nft", &["-f", "-"], None, Some(host_ruleset(link))).await?;
        Ok(())
    }

    /// A sandbox found running after a restart: keep its pair, let the egress side serve it again,
    /// and reload the rules for the ports it answers now.
    pub async fn reattach(&self, link: &mut SandboxLink) -> Result<()> {
        self.reserved.lock().unwrap().insert(link.index);
        if let Some(hook) = &self.egress {
            link.ports = hook.attach(link).await.map_err(|e| NetError::Hook {
                id: link.id.clone(),
                reason: e.to_string(),
            })?;
        } else {
            link.ports = EgressPorts::default();
        }
        self.load_rules(link).await
    }

    /// Remove everything `link` names (the egress side told first). Never fails: what cannot be
    /// removed is logged, and the next start-up's sweep tries again.
    pub async fn remove(&self, link: &SandboxLink) {
        if let Some(hook) = &self.egress {
            hook.detach(link).await;
        }
        self.remove_names(&link.netns, &link.host_if).await;
        self.reserved.lock().unwrap().remove(&link.index);
    }

    async fn remove_names(&self, netns: &str, host_if: &str) {
        let steps: [(&'static str, Vec<&str>, &[&str]); 3] = [
            ("nft", vec!["delete", "table", "inet", netns], &["No such file"]),
            ("ip", vec!["netns", "delete", netns], &["No such file"]),
            // Gone with the namespace (a veth pair dies together); left if the peer never moved.
            ("ip", vec!["link", "delete", host_if], &["Cannot find device"]),
        ];
        for (program, args, absent) in steps {
            match run(program, &args, None, None).await {
                Ok(_) => {}
                Err(NetError::Command { stderr, .. }) if absent.iter().any(|a| stderr.contains(a)) => {}
                Err(e) => tracing::warn!("removing sandbox network {netns}: {e}"),
            }
        }
    }

    /// Remove namespaces, host tables and host veth ends carrying this runtime's tag whose
    /// sandbox is not in `live` (a crash left them). Returns the namespaces/tables/links removed.
    pub async fn sweep(&self, live: &HashSet<String>) -> Vec<String> {
        let ns_prefix = format!("{NETNS_PREFIX}{}-", self.tag);
        let mut ids = BTreeSet::new();
        for entry in std::fs::read_dir(NETNS_DIR).into_iter().flatten().flatten() {
            let name = entry.file_name().to_string_lossy().to_string();
            if let Some(id) = name.strip_prefix(&ns_prefix) {
                ids.insert(id.to_string());
            }
        }
        match run("nft", &["list", "tables"], None, None).await {
            Ok(out) => {
                for line in out.lines() {
                    if let Some(id) = line
                        .trim()
                        .strip_prefix("table inet ")
                        .and_then(|t| t.strip_prefix(&ns_prefix))
                    {
                        ids.insert(id.to_string());
                    }
                }
            }
            Err(e) => tracing::warn!("listing the host's nftables tables: {e}"),
        }
        let mut removed = Vec::new();
        for id in ids.iter().filter(|id| !live.contains(*id)) {
            let (netns, host_if) = (self.netns_name(id), self.host_if_name(id));
            tracing::info!("removing leftover network {netns} (no live sandbox {id})");
            self.remove_names(&netns, &host_if).await;
            removed.push(netns);
        }
        // Host veth ends whose namespace is already gone (a crash between the two steps).
        let if_prefix = format!("{HOST_IF_PREFIX}{}", self.tag);
        let live_ifs: HashSet<String> = live.iter().map(|id| self.host_if_name(id)).collect();
        for entry in std::fs::read_dir("/sys/class/net").into_iter().flatten().flatten() {
            let name = entry.file_name().to_string_lossy().to_string();
            if name.len() == 15 && name.starts_with(&if_prefix) && !live_ifs.contains(&name) {
                tracing::info!("removing leftover link {name}");
                if let Err(e) = run("ip", &["link", "delete", &name], None, None).await {
                    tracing::warn!("removing leftover link {name}: {e}");
                }
                removed.push(name);
            }
        }
        removed
    }

    /// The next free pair: not reserved by a live link, and neither address already on the host.
    async fn allocate(&self) -> Result<(u32, Ipv4Addr, Ipv4Addr)> {
        let on_host = host_addresses().await?;
        let mut reserved = self.reserved.lock().unwrap();
        for index in 0..self.pool.pairs() {
            let Some((h, n)) = self.pool.pair(index) else { continue };
            if reserved.contains(&index) || on_host.contains(&h) || on_host.contains(&n) {
                continue;
            }
            reserved.insert(index);
            return Ok((index, h, n));
        }
        Err(NetError::PoolExhausted(self.pool.to_string()))
    }

    /// The named counters of a sandbox's namespace table (packets), e.g. `spoofed`, `dropped`.
    pub async fn counters(&self, link: &SandboxLink) -> Result<BTreeMap<String, u64>> {
        let ns_path = Path::new(NETNS_DIR).join(&link.netns);
        let out = run(
            "nft",
            &["-j", "list", "counters", "table", "inet", NETNS_TABLE],
            Some(&ns_path),
            None,
        )
        .await?;
        let v: serde_json::Value = serde_json::from_str(&out).map_err(|e| NetError::Command {
            command: "nft -j list counters".into(),
            status: "unreadable output".into(),
            stderr: e.to_string(),
        })?;
        Ok(v["nftables"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|o| {
                let c = o.get("counter")?;
                Some((c["name"].as_str()?.to_string(), c["packets"].as_u64()?))
            })
            .collect())
    }
}

/// The sandbox namespace's table (see the module doc).
pub fn netns_ruleset(link: &SandboxLink) -> String {
    let gw = Ipv4Addr::from(guest::GATEWAY);
    let guest_addr = Ipv4Addr::from(guest::GUEST_ADDR);
    let (h, n) = (link.host_addr, link.peer_addr);
    let dns_to_gateway = format!("iifname \"{TAP}\" ip daddr {gw} meta l4proto {{ tcp, udp }} th dport {DNS_PORT}");
    let mut dnat = String::new();
    let mut input = String::new();
    let mut forward = String::new();
    match link.ports.dns {
        Some(port) => {
            dnat.push_str(&format!("\t\t{dns_to_gateway} dnat ip to {h}:{port}\n"));
            forward.push_str(&format!(
                "\t\tiifname \"{TAP}\" oifname \"{UPLINK}\" ct status dnat ip daddr {h} meta l4proto {{ tcp, udp }} th dport {port} counter name \"dns_queries\" accept\n"
            ));
        }
        // Unwired: the query reaches the namespace, where nothing listens (no answer).
        None => input.push_str(&format!("\t\t{dns_to_gateway} counter name \"dns_queries\" accept\n")),
    }
    if link.ports.proxy.is_some() {
        forward.push_str(&format!(
            "\t\tiifname \"{TAP}\" oifname \"{UPLINK}\" meta l4proto tcp counter name \"tcp_out\" accept\n"
        ));
    }
    format!(
        "table inet {NETNS_TABLE}
delete table inet {NETNS_TABLE}
table inet {NETNS_TABLE} {{
	counter spoofed {{ }}
	counter ipv6_dropped {{ }}
	counter dns_queries {{ }}
	counter tcp_out {{ }}
	counter udp_dropped {{ }}
	counter dropped {{ }}

	chain guard {{
		type filter hook prerouting priority raw; policy accept;
		iifname \"{TAP}\" meta nfproto ipv6 counter name \"ipv6_dropped\" drop
		iifname \"{TAP}\" ip saddr != {guest_addr} counter name \"spoofed\" drop
		iifname \"{TAP}\" ether saddr != {guest_mac} counter name \"spoofed\" drop
		iifname != \"{TAP}\" meta nfproto ipv6 counter name \"ipv6_dropped\" drop
	}}

	chain nat_pre {{
		type nat hook prerouting priority dstnat; policy accept;
{dnat}	}}

	chain input {{
		type filter hook input priority filter; policy drop;
		iifname \"lo\" accept
{input}		meta l4proto udp counter name \"udp_dropped\" drop
		counter name \"dropped\" drop
	}}

	chain forward {{
		type filter hook forward priority filter; policy drop;
		ct state established,related accept
{forward}		meta l4proto udp counter name \"udp_dropped\" drop
		counter name \"dropped\" drop
	}}

	chain nat_post {{
		type nat hook postrouting priority srcnat; policy accept;
		oifname \"{UPLINK}\" ip saddr {guest_addr} snat ip to {n}
	}}
}}
",
        guest_mac = guest::GUEST_MAC,
    )
}

/// The host's table for one sandbox (see the module doc).
pub fn host_ruleset(link: &SandboxLink) -> String {
    let table = &link.netns;
    let (ifname, h, n) = (&link.host_if, link.host_addr, link.peer_addr);
    let mut dnat = String::new();
    let mut input = String::new();
    if let Some(port) = link.ports.dns {
        dnat.push_str(&format!(
            "\t\tiifname \"{ifname}\" ip daddr {h} tcp dport {port} accept\n"
        ));
        input.push_str(&format!(
            "\t\tiifname \"{ifname}\" ip saddr {n} ip daddr {h} meta l4proto {{ tcp, udp }} th dport {port} accept\n"
        ));
    }
    if let Some(port) = link.ports.proxy {
        dnat.push_str(&format!(
            "\t\tiifname \"{ifname}\" meta l4proto tcp dnat ip to {h}:{port}\n"
        ));
        input.push_str(&format!(
            "\t\tiifname \"{ifname}\" ip saddr {n} ip daddr {h} tcp dport {port} accept\n"
        ));
    }
    format!(
        "table inet {table}
delete table inet {table}
table inet {table} {{
	chain nat_pre {{
		type nat hook prerouting priority dstnat; policy accept;
{dnat}	}}

	chain input {{
		type filter hook input priority filter; policy accept;
		iifname \"{ifname}\" ct state established,related accept
{input}		iifname \"{ifname}\" counter drop
	}}

	chain forward {{
		type filter hook forward priority filter; policy accept;
		iifname \"{ifname}\" counter drop
		oifname \"{ifname}\" counter drop
	}}
}}
"
    )
}

/// IPv4 addresses on the host's interfaces.
async fn host_addresses() -> Result<HashSet<Ipv4Addr>> {
    let out = run("ip", &["-j", "-4", "addr", "show"], None, None).await?;
    let v: serde_json::Value = serde_json::from_str(&out).unwrap_or_default();
    Ok(v.as_array()
        .into_iter()
        .flatten()
        .flat_map(|link| link["addr_info"].as_array().cloned().unwrap_or_default())
        .filter_map(|a| a["local"].as_str()?.parse().ok())
        .collect())
}

fn write_sysctl(path: &str, value: &str) -> Result<()> {
    std::fs::write(path, value).map_err(|source| NetError::Sysctl {
        path: path.into(),
        source,
    })
}

/// Run `f` on a new thread that has entered the namespace at `ns_path` (the thread ends with
/// it, so no pooled thread is ever left in a sandbox's namespace).
async fn in_netns<T: Send + 'static>(ns_path: PathBuf, f: impl FnOnce() -> T + Send + 'static) -> std::io::Result<T> {
    tokio::task::spawn_blocking(move || {
        std::thread::spawn(move || {
            let ns = std::fs::File::open(&ns_path)?;
            if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(f())
        })
        .join()
        .map_err(|_| std::io::Error::other("the namespace thread panicked"))?
    })
    .await
    .map_err(std::io::Error::other)?
}

/// Create tap `name` in this thread's namespace and return it open (not persistent: it goes
/// when the last holder, the VMM, closes it). With a virtio-net header, so QEMU can offload.
fn open_tap(name: &str) -> std::io::Result<OwnedFd> {
    let fd = unsafe { libc::open(c"/dev/net/tun".as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, src) in req.ifr_name.iter_mut().zip(name.bytes().take(libc::IFNAMSIZ - 1)) {
        *dst = src as libc::c_char;
    }
    req.ifr_ifru.ifru_flags = (libc::IFF_TAP | libc::IFF_NO_PI | libc::IFF_VNET_HDR) as libc::c_short;
    if unsafe { libc::ioctl(fd.as_raw_fd(), libc::TUNSETIFF as _, &mut req) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(fd)
}

/// Run `program args` (in the namespace at `netns`, if given) with `input` on stdin, bounded by
/// [`COMMAND_TIMEOUT`]; its stdout, or a typed error naming the command and what it said.
async fn run(program: &'static str, args: &[&str], netns: Option<&Path>, input: Option<String>) -> Result<String> {
    use tokio::io::AsyncWriteExt;
    let command = {
        let mut c = format!("{program} {}", args.join(" "));
        if let Some(ns) = netns {
            c = format!("{c} (in {})", ns.display());
        }
        c
    };
    let mut cmd = tokio::process::Command::new(program);
    cmd.args(args)
        .stdin(if input.is_some() {
            std::process::Stdio::piped()
        } else {
            std::process::Stdio::null()
        })
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true);
    // Held until the spawn: the child enters the namespace before it execs (the fd is
    // close-on-exec, so the program never sees it).
    let ns_file = match netns {
        Some(p) => Some(std::fs::File::open(p).map_err(|source| NetError::Netns {
            netns: p.display().to_string(),
            source,
        })?),
        None => None,
    };
    if let Some(f) = &ns_file {
        let fd = f.as_raw_fd();
        unsafe {
            cmd.pre_exec(move || {
                if libc::setns(fd, libc::CLONE_NEWNET) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    }
    let work = async {
        let mut child = cmd
            .spawn()
            .map_err(|source| NetError::ToolMissing { program, source })?;
        drop(ns_file);
        if let (Some(text), Some(mut stdin)) = (input, child.stdin.take()) {
            // A program that exits early closes its stdin: its stderr says why.
            let _ = stdin.write_all(text.as_bytes()).await;
        }
        child
            .wait_with_output()
            .await
            .map_err(|source| NetError::ToolMissing { program, source })
    };
    let out = tokio::time::timeout(COMMAND_TIMEOUT, work)
        .await
        .map_err(|_| NetError::Timeout {
            command: command.clone(),
        })??;
    if !out.status.success() {
        return Err(NetError::Command {
            command,
            status: out.status.to_string(),
            stderr: String::from_utf8_lossy(&out.stderr).trim().chars().take(2000).collect(),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn link(ports: EgressPorts) -> SandboxLink {
        SandboxLink {
            id: "abcdef0123".into(),
            netns: "airlock-1a2b-abcdef0123".into(),
            host_if: host_if_name("1a2b", "abcdef0123"),
            host_addr: Ipv4Addr::new(169, 254, 0, 4),
            peer_addr: Ipv4Addr::new(169, 254, 0, 5),
            index: 2,
            ports,
        }
    }

    #[test]
    fn pool_parses_and_hands_out_pairs() {
        let p = LinkPool::default();
        assert_eq!(p.pairs(), 32768);
        assert_eq!(
            p.pair(0),
            Some((Ipv4Addr::new(169, 254, 0, 0), Ipv4Addr::new(169, 254, 0, 1)))
        );
        assert_eq!(
            p.pair(130),
            Some((Ipv4Addr::new(169, 254, 1, 4), Ipv4Addr::new(169, 254, 1, 5)))
        );
        // 169.254.169.0/24 (the metadata service's) is never handed out.
        assert_eq!(p.pair(169 * 128 + 127), None);
        let q: LinkPool = "10.123.0.0/20".parse().unwrap();
        assert_eq!(q.pairs(), 2048);
        for bad in [
            "10.0.0.1/16",
            "10.0.0.0",
            "10.0.0.0/31",
            "100.96.0.0/16",
            "x/16",
            "10.0.0.0/4",
        ] {
            assert!(bad.parse::<LinkPool>().is_err(), "{bad}");
        }
    }

    #[test]
    fn names_fit_the_kernel_limits() {
        let ifname = host_if_name("1a2b", &"z".repeat(40));
        assert_eq!(ifname.len(), 15);
        assert!(ifname.starts_with("al1a2b"));
        assert_ne!(host_if_name("1a2b", "aaaaaaaa"), host_if_name("1a2b", "aaaaaaab"));
        assert_eq!(netns_name("1a2b", "abc"), "airlock-1a2b-abc");
    }

    #[test]
    fn unwired_sandbox_rules_allow_only_dns_to_the_gateway() {
        let r = netns_ruleset(&link(EgressPorts::default()));
        assert!(!r.contains("dnat ip to"), "{r}");
        assert!(!r.contains("counter name \"tcp_out\" accept"), "{r}");
        assert!(
            r.contains("ip daddr 100.96.0.1 meta l4proto { tcp, udp } th dport 53 counter name \"dns_queries\" accept")
        );
        assert!(r.contains("ip saddr != 100.96.0.2 counter name \"spoofed\" drop"));
        assert!(r.contains("snat ip to 169.254.0.5"));
        let h = host_ruleset(&link(EgressPorts::default()));
        assert!(!h.contains("dnat ip to"), "{h}");
        assert!(h.contains(&format!(
            "iifname \"{}\" counter drop",
            link(EgressPorts::default()).host_if
        )));
    }

    #[test]
    fn wired_sandbox_rules_send_dns_and_tcp_to_the_hooks() {
        let l = link(EgressPorts {
            dns: Some(5353),
            proxy: Some(15001),
        });
        let r = netns_ruleset(&l);
        assert!(r.contains("th dport 53 dnat ip to 169.254.0.4:5353"), "{r}");
        assert!(r.contains("meta l4proto tcp counter name \"tcp_out\" accept"), "{r}");
        let h = host_ruleset(&l);
        assert!(h.contains("meta l4proto tcp dnat ip to 169.254.0.4:15001"), "{h}");
        assert!(h.contains("ip daddr 169.254.0.4 tcp dport 5353 accept"), "{h}");
    }

    /// Both tables, wired and not, as nft itself parses them (`-c`: checked, never loaded).
    #[tokio::test]
    async fn rulesets_pass_nfts_check() {
        if run("nft", &["--version"], None, None).await.is_err() || !nix::unistd::geteuid().is_root() {
            eprintln!("skipped: needs nft and root");
            return;
        }
        for ports in [
            EgressPorts::default(),
            EgressPorts {
                dns: Some(5353),
                proxy: Some(15001),
            },
        ] {
            for text in [netns_ruleset(&link(ports)), host_ruleset(&link(ports))] {
                if let Err(e) = run("nft", &["-c", "-f", "-"], None, Some(text.clone())).await {
                    panic!("{e}\n{text}");
                }
            }
        }
    }
}
