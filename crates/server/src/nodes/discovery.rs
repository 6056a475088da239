//! Finding a cluster's nodes while it runs: every [`ROUND`] a source lists the nodes' addresses
//! (a DNS name such as a Kubernetes headless Service, whose answer holds the Ready pods); each
//! new address's node joins the [`Cluster`] under the name it reports (`airlock node --name`:
//! its identity, kept across restarts and new addresses), a name seen at a new address replaces
//! its old one, and a node no longer listed takes no new sandbox but keeps serving the ones it
//! has (a node is judged gone by its own silence, never by a missing DNS answer).

use super::{Cluster, Nodes, RemoteNode};
use std::collections::{BTreeSet, HashMap};
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

/// How often the source is asked.
pub const ROUND: Duration = Duration::from_secs(5);

/// The addresses `target` (`host:port`) resolves to now.
pub async fn resolve(target: &str) -> Result<Vec<Listed>, String> {
    match tokio::net::lookup_host(target).await {
        Ok(addrs) => Ok(addrs.map(Listed::serving).collect()),
        Err(e) => Err(format!("{target}: {e}")),
    }
}

/// A node a source lists: where it answers, and whether its host is being drained (a
/// cordoned Kubernetes node; a DNS answer never says so).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Listed {
    pub addr: SocketAddr,
    pub cordoned: bool,
}

impl Listed {
    /// An address a DNS answer holds.
    pub fn serving(addr: SocketAddr) -> Self {
        Listed { addr, cordoned: false }
    }
}

/// Where a cluster's nodes are listed: a DNS name (`serve --nodes-dns`), or the Kubernetes
/// API (`serve --nodes-kube`).
#[derive(Clone)]
pub enum Source {
    Dns(String),
    Kube(Box<super::kube::KubeNodes>),
}

impl Source {
    /// The nodes listed now.
    pub async fn list(&self) -> Result<Vec<Listed>, String> {
        match self {
            Source::Dns(target) => resolve(target).await,
            Source::Kube(kube) => kube.list().await.map_err(|e| format!("the Kubernetes API: {e}")),
        }
    }
}

/// What discovery knows between rounds: each address seen and the name its node reported.
#[derive(Default)]
pub struct Discovery {
    known: HashMap<SocketAddr, String>,
}

impl Discovery {
    /// One round: `listed` is what the source answered now.
    pub async fn round(&mut self, cluster: &Cluster, listed: Vec<Listed>, link: &super::NodeLink) {
        let addrs: Vec<SocketAddr> = listed.iter().map(|l| l.addr).collect();
        self.known.retain(|addr, _| addrs.contains(addr));
        for addr in &addrs {
            if self.known.contains_key(addr) {
                continue;
            }
            let node = RemoteNode::open(*addr, link).await;
            if let Some(why) = node.members().into_iter().next().and_then(|m| m.refuses) {
                // Asked again next round.
                tracing::debug!("discovery: node at {addr}: {why}");
                continue;
            }
            let name = match node.reported_name() {
                n if n.is_empty() => addr.to_string(),
                n => n,
            };
            tracing::info!("discovery: node {name} at {addr}");
            cluster.upsert(name.clone(), Arc::new(node));
            self.known.insert(*addr, name);
        }
        let names: BTreeSet<String> = self.known.values().cloned().collect();
        cluster.set_listed(&names);
        let cordoned = listed
            .iter()
            .filter(|l| l.cordoned)
            .filter_map(|l| self.known.get(&l.addr).cloned())
            .collect();
        cluster.set_cordoned(cordoned);
    }

    /// Rounds every [`ROUND`] for as long as `cluster` lives, the addresses from `source`.
    pub async fn follow<F, Fut>(mut self, cluster: std::sync::Weak<Cluster>, link: super::NodeLink, source: F)
    where
        F: Fn() -> Fut,
        Fut: Future<Output = Result<Vec<Listed>, String>>,
    {
        loop {
            tokio::time::sleep(ROUND).await;
            let Some(cluster) = cluster.upgrade() else { return };
            match source().await {
                Ok(listed) => self.round(&cluster, listed, &link).await,
                // The last answer stands: a failed lookup is no evidence about any node.
                Err(e) => tracing::warn!("discovery: {e}"),
            }
        }
    }
}
