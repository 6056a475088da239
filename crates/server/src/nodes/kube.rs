//! Nodes found through the Kubernetes API (`serve --nodes-kube SELECTOR`): the node
//! DaemonSet's pods in the replica's namespace that match the label selector, are Ready and are
//! not being deleted, each at `<pod IP>:<port>`. A pod on a cordoned Kubernetes node
//! (`spec.unschedulable`, what `kubectl drain` sets first) is listed as cordoned: its airlock
//! node takes no new sandbox and the replicas take its sandboxes off it (`Engine::drain_sweep`)
//! before the pod is evicted. A failed listing is no evidence about any node
//! (`Discovery::follow` keeps the last answer).

use super::discovery::Listed;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, ListParams};
use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};

/// The node pods of one namespace, by label selector.
#[derive(Clone)]
pub struct KubeNodes {
    pods: Api<Pod>,
    nodes: Api<Node>,
    selector: String,
    port: u16,
}

impl KubeNodes {
    /// From the pod's service account (in a cluster) or the kubeconfig, in its namespace.
    pub async fn from_environment(selector: &str, port: u16) -> Result<Self, kube::Error> {
        let client = kube::Client::try_default().await?;
        Ok(Self::new(client.clone(), client.default_namespace(), selector, port))
    }

    /// Over `client`, the pods of `namespace` that match `selector`, their nodes at `port`.
    pub fn new(client: kube::Client, namespace: &str, selector: &str, port: u16) -> Self {
        KubeNodes {
            pods: Api::namespaced(client.clone(), namespace),
            nodes: Api::all(client),
            selector: selector.to_string(),
            port,
        }
    }

    /// The Ready node pods now, each with whether its Kubernetes node is cordoned.
    pub async fn list(&self) -> Result<Vec<Listed>, kube::Error> {
        let pods = self.pods.list(&ListParams::default().labels(&self.selector)).await?;
        let mut cordoned: HashMap<String, bool> = HashMap::new();
        let mut listed = Vec::new();
        for pod in pods.items {
            let Some(ip) = ready_address(&pod) else { continue };
            let host = pod.spec.as_ref().and_then(|s| s.node_name.clone()).unwrap_or_default();
            let off = match cordoned.get(&host) {
                Some(off) => *off,
                None => {
                    // A node that cannot be read is taken as schedulable: no evidence.
                    let off = match host.is_empty() {
                        true => false,
                        false => self
                            .nodes
                            .get_opt(&host)
                            .await?
                            .and_then(|n| n.spec?.unschedulable)
                            .unwrap_or(false),
                    };
                    cordoned.insert(host, off);
                    off
                }
            };
            listed.push(Listed {
                addr: SocketAddr::new(ip, self.port),
                cordoned: off,
            });
        }
        Ok(listed)
    }
}

/// A pod's IP if it is Ready and not being deleted.
fn ready_address(pod: &Pod) -> Option<IpAddr> {
    if pod.metadata.deletion_timestamp.is_some() {
        return None;
    }
    let status = pod.status.as_ref()?;
    let ready = status
        .conditions
        .iter()
        .flatten()
        .any(|c| c.type_ == "Ready" && c.status == "True");
    match ready {
        true => status.pod_ip.as_deref()?.parse().ok(),
        false => None,
    }
}
