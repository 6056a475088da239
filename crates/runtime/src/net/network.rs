//! `Network`: a runtime's sandbox networks, made, re-attached, removed and swept; the names
//! of each sandbox's namespace and veth. Uses the pool, the rulesets and the kernel calls.

use super::sys::{host_addresses, in_netns, open_tap, run, write_sysctl};
use super::*;
use airlock_proto::net as guest;
use sha2::{Digest, Sha256};
use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::net::Ipv4Addr;
use std::os::fd::OwnedFd;
use std::path::Path;
use std::sync::{Arc, Mutex};

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

pub(super) fn runtime_tag(data_root: &Path) -> String {
    let path = std::fs::canonicalize(data_root).unwrap_or_else(|_| data_root.to_path_buf());
    hex::encode(Sha256::digest(path.as_os_str().as_encoded_bytes()))[..4].to_string()
}

pub(super) fn netns_name(tag: &str, id: &str) -> String {
    format!("{NETNS_PREFIX}{tag}-{id}")
}

/// `al` + tag (4) + 9 hex digits of the id's hash: 15 bytes, the most an interface name holds.
pub(super) fn host_if_name(tag: &str, id: &str) -> String {
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

    pub(super) async fn make(&self, id: &str, egress: bool) -> Result<(SandboxLink, OwnedFd)> {
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

    pub(super) async fn build(&self, link: &mut SandboxLink, egress: bool) -> Result<OwnedFd> {
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
    pub(super) async fn load_rules(&self, link: &SandboxLink) -> Result<()> {
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

    pub(super) async fn remove_names(&self, netns: &str, host_if: &str) {
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
    pub(super) async fn allocate(&self) -> Result<(u32, Ipv4Addr, Ipv4Addr)> {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_fit_the_kernel_limits() {
        let ifname = host_if_name("1a2b", &"z".repeat(40));
        assert_eq!(ifname.len(), 15);
        assert!(ifname.starts_with("al1a2b"));
        assert_ne!(host_if_name("1a2b", "aaaaaaaa"), host_if_name("1a2b", "aaaaaaab"));
        assert_eq!(netns_name("1a2b", "abc"), "airlock-1a2b-abc");
    }
}
