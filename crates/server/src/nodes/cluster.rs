//! `Cluster`: `Nodes` over several named nodes (each usually a `RemoteNode`), for a replica that
//! places sandboxes on many hosts.
//!
//! Placement is the core's (it picks a [`Member`] by its budgets in the store and records the
//! name on the sandbox); the cluster only carries each call to the right node. A create goes to
//! the member its `VmRequest` names. Every other call about a VM or an image goes to the node
//! that has it: the one this cluster placed it on or claimed it from, else the one whose report
//! lists it (after a replica restart, or for what another replica placed). A VM no node lists
//! is gone, as on one node.

use super::{Booted, Capacity, Member, NodeError, Nodes, PoolInfo, VmRequest, VmState};
use airlock_agent_client::AgentClient;
use airlock_runtime::template::TemplateManifest;
use airlock_runtime::Resources;
use async_trait::async_trait;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use tokio::sync::broadcast;

pub struct Cluster {
    members: Vec<(String, Arc<dyn Nodes>)>,
    /// VMs, claimed pool VMs and images this cluster sent somewhere, by id: their member's index.
    placed: Mutex<HashMap<String, usize>>,
    exits: broadcast::Sender<String>,
    /// The exit forwarders, ended with the cluster.
    tasks: Vec<tokio::task::AbortHandle>,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// The error for a call about `id` that no member has.
fn unknown(id: &str) -> NodeError {
    NodeError::UnknownSandbox(id.to_string())
}

impl Cluster {
    /// The nodes by name (names are what sandbox records keep: keep them stable).
    pub fn new(members: Vec<(String, Arc<dyn Nodes>)>) -> Self {
        let exits = broadcast::channel(1024).0;
        let tasks = members
            .iter()
            .map(|(_, node)| {
                let (mut rx, tx) = (node.exits(), exits.clone());
                tokio::spawn(async move {
                    loop {
                        match rx.recv().await {
                            Ok(id) => {
                                let _ = tx.send(id);
                            }
                            Err(broadcast::error::RecvError::Lagged(_)) => continue,
                            Err(broadcast::error::RecvError::Closed) => return,
                        }
                    }
                })
                .abort_handle()
            })
            .collect();
        Cluster {
            members,
            placed: Mutex::default(),
            exits,
            tasks,
        }
    }

    fn placed(&self) -> std::sync::MutexGuard<'_, HashMap<String, usize>> {
        self.placed.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The index of the member that has VM (or pool VM, or image) `id`.
    fn index_of(&self, id: &str) -> Option<usize> {
        if let Some(i) = self.placed().get(id) {
            return Some(*i);
        }
        let found = self
            .members
            .iter()
            .position(|(_, n)| n.vm_state(id) != VmState::Gone || n.image_ids().iter().any(|i| i == id))?;
        self.placed().insert(id.to_string(), found);
        Some(found)
    }

    fn route(&self, id: &str) -> Result<&Arc<dyn Nodes>, NodeError> {
        self.index_of(id).map(|i| &self.members[i].1).ok_or_else(|| unknown(id))
    }

    fn forget(&self, id: &str) {
        self.placed().remove(id);
    }
}

#[async_trait]
impl Nodes for Cluster {
    fn runtime_name(&self) -> String {
        self.members.first().map(|(_, n)| n.runtime_name()).unwrap_or_default()
    }

    async fn accel(&self) -> String {
        match self.members.first() {
            Some((_, n)) => n.accel().await,
            None => String::new(),
        }
    }

    fn templates(&self) -> Vec<TemplateManifest> {
        let mut all: Vec<TemplateManifest> = Vec::new();
        for (_, n) in &self.members {
            for t in n.templates() {
                if !all.iter().any(|a| a.digest == t.digest && a.name == t.name) {
                    all.push(t);
                }
            }
        }
        all
    }

    fn template(&self, reference: &str) -> Option<TemplateManifest> {
        self.members.iter().find_map(|(_, n)| n.template(reference))
    }

    async fn create(&self, vm: &VmRequest) -> Result<Booted, NodeError> {
        let Some(i) = self.members.iter().position(|(name, _)| *name == vm.node) else {
            return Err(NodeError::Failed(Box::new(super::wire::RemoteFailure(format!(
                "no node named {:?} in this cluster",
                vm.node
            )))));
        };
        self.placed().insert(vm.id.clone(), i);
        self.members[i].1.create(vm).await
    }

    async fn delete(&self, id: &str) -> Result<(), NodeError> {
        let Some(i) = self.index_of(id) else {
            return Ok(());
        };
        self.members[i].1.delete(id).await?;
        self.forget(id);
        Ok(())
    }

    async fn pause(&self, id: &str) -> Result<(), NodeError> {
        self.route(id)?.pause(id).await
    }

    async fn suspend(&self, id: &str) -> Result<u64, NodeError> {
        self.route(id)?.suspend(id).await
    }

    async fn save_image(&self, id: &str, image_id: &str) -> Result<u64, NodeError> {
        let i = self.index_of(id).ok_or_else(|| unknown(id))?;
        let bytes = self.members[i].1.save_image(id, image_id).await?;
        self.placed().insert(image_id.to_string(), i);
        Ok(bytes)
    }

    async fn delete_image(&self, image_id: &str) -> Result<(), NodeError> {
        let Some(i) = self.index_of(image_id) else {
            return Ok(());
        };
        self.members[i].1.delete_image(image_id).await?;
        self.forget(image_id);
        Ok(())
    }

    async fn digest_image(&self, image_id: &str) -> Result<String, NodeError> {
        match self.index_of(image_id) {
            Some(i) => self.members[i].1.digest_image(image_id).await,
            None => Err(NodeError::UnknownImage(image_id.to_string())),
        }
    }

    fn image_ids(&self) -> Vec<String> {
        self.members.iter().flat_map(|(_, n)| n.image_ids()).collect()
    }

    /// A pool VM from the member with the most free memory that has one ready.
    async fn claim(&self, template: &str, resources: &Resources) -> Option<String> {
        let mut order: Vec<usize> = (0..self.members.len()).collect();
        order.sort_by_key(|i| std::cmp::Reverse(self.members[*i].1.capacity().memory_mib));
        for i in order {
            let (_, node) = &self.members[i];
            let ready = node
                .pools()
                .iter()
                .any(|p| p.template == template && p.resources == *resources && p.ready > 0);
            if !ready {
                continue;
            }
            if let Some(id) = node.claim(template, resources).await {
                self.placed().insert(id.clone(), i);
                return Some(id);
            }
        }
        None
    }

    fn unclaim(&self, id: &str) {
        if let Some(i) = self.index_of(id) {
            self.members[i].1.unclaim(id);
            self.forget(id);
        }
    }

    /// Every member keeps the pool.
    async fn set_pool(&self, template: &str, resources: &Resources, size: usize) -> Result<(), NodeError> {
        for (_, n) in &self.members {
            n.set_pool(template, resources, size).await?;
        }
        Ok(())
    }

    fn pools(&self) -> Vec<PoolInfo> {
        self.members.iter().flat_map(|(_, n)| n.pools()).collect()
    }

    async fn resume(&self, id: &str) -> Result<(), NodeError> {
        self.route(id)?.resume(id).await
    }

    fn vm_state(&self, id: &str) -> VmState {
        match self.index_of(id) {
            Some(i) => self.members[i].1.vm_state(id),
            None => VmState::Gone,
        }
    }

    /// Every member settles what it knows of `id` (a restarted node may not list it yet).
    async fn settled(&self, id: &str) {
        futures_util::future::join_all(self.members.iter().map(|(_, n)| n.settled(id))).await;
    }

    async fn settled_all(&self) {
        futures_util::future::join_all(self.members.iter().map(|(_, n)| n.settled_all())).await;
    }

    fn vm_ids(&self) -> Vec<String> {
        self.members.iter().flat_map(|(_, n)| n.vm_ids()).collect()
    }

    async fn agent(&self, id: &str) -> Result<AgentClient, NodeError> {
        self.route(id)?.agent(id).await
    }

    fn exits(&self) -> broadcast::Receiver<String> {
        self.exits.subscribe()
    }

    /// The members' together (what the tenants' default quotas share).
    fn capacity(&self) -> Capacity {
        let mut sum = Capacity {
            cpus: 0,
            memory_mib: 0,
            sandboxes_running: 0,
            disk_free_mib: 0,
            disk_held_mib: 0,
        };
        for (_, n) in &self.members {
            let c = n.capacity();
            sum.cpus += c.cpus;
            sum.memory_mib += c.memory_mib;
            sum.sandboxes_running += c.sandboxes_running;
            sum.disk_free_mib += c.disk_free_mib;
            sum.disk_held_mib += c.disk_held_mib;
        }
        sum
    }

    async fn egress(&self, id: &str) -> Option<airlock_egress::EgressSnapshot> {
        self.route(id).ok()?.egress(id).await
    }

    fn members(&self) -> Vec<Member> {
        self.members
            .iter()
            .map(|(name, n)| {
                let one = n.members().into_iter().next();
                Member {
                    name: name.clone(),
                    capacity: n.capacity(),
                    refuses: one.and_then(|m| m.refuses),
                }
            })
            .collect()
    }

    fn owner(&self, id: &str) -> Option<String> {
        self.index_of(id).map(|i| self.members[i].0.clone())
    }
}
