//! `Cluster`: `Nodes` over several named nodes (each usually a `RemoteNode`), for a replica that
//! places sandboxes on many hosts.
//!
//! Placement is the core's (it picks a [`Member`] by its budgets in the store and records the
//! name on the sandbox); the cluster only carries each call to the right node. A create goes to
//! the member its `VmRequest` names. Every other call about a VM or an image goes to the node
//! that has it: the one this cluster placed it on or claimed it from, else the one whose report
//! lists it (after a replica restart, or for what another replica placed), else the one that
//! says it has it when all are asked now (reports are up to a few seconds old). A node that
//! answers it no longer has the VM (another replica moved it) is passed over for the one that
//! has it now. A VM no node has is gone, as on one node.

use super::{Booted, Capacity, Member, NodeError, Nodes, PoolInfo, VmReport, VmRequest, VmState};
use airlock_agent_client::AgentClient;
use airlock_runtime::template::TemplateManifest;
use airlock_runtime::Resources;
use async_trait::async_trait;
use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use tokio::sync::broadcast;

/// The nodes by name, as one snapshot (calls clone it and never hold a lock across a call).
type Members = Arc<Vec<(String, Arc<dyn Nodes>)>>;

pub struct Cluster {
    members: Mutex<Members>,
    /// Members discovery no longer lists (not ready, going away): kept for the calls about
    /// their VMs, never chosen for new ones.
    unlisted: Mutex<BTreeSet<String>>,
    /// Members whose host is being drained (a cordoned Kubernetes node): they take no new
    /// sandbox, and their sandboxes are taken off them as from a draining node.
    cordoned: Mutex<BTreeSet<String>>,
    /// VMs, claimed pool VMs and images this cluster sent somewhere, by id: their member's name.
    placed: Mutex<HashMap<String, String>>,
    exits: broadcast::Sender<String>,
    /// Each member's exit forwarder, by name, ended with it or with the cluster.
    forwarders: Mutex<HashMap<String, tokio::task::AbortHandle>>,
    /// The warm pools every member keeps (template, resources, size), for members that join
    /// later.
    pools: Mutex<Vec<(String, Resources, usize)>>,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for t in lock(&self.forwarders).values() {
            t.abort();
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The error for a call about `id` that no member has.
fn unknown(id: &str) -> NodeError {
    NodeError::UnknownSandbox(id.to_string())
}

impl Cluster {
    /// The nodes by name (names are what sandbox records keep: keep them stable).
    pub fn new(members: Vec<(String, Arc<dyn Nodes>)>) -> Self {
        let cluster = Cluster {
            members: Mutex::new(Arc::new(Vec::new())),
            unlisted: Mutex::default(),
            cordoned: Mutex::default(),
            placed: Mutex::default(),
            exits: broadcast::channel(1024).0,
            forwarders: Mutex::default(),
            pools: Mutex::default(),
        };
        for (name, node) in members {
            cluster.upsert(name, node);
        }
        cluster
    }

    /// Add node `name`, or replace it (a node back at a new address): calls about its VMs go
    /// to `node` from now on, and it is listed again.
    pub fn upsert(&self, name: String, node: Arc<dyn Nodes>) {
        let forwarder = {
            let (mut rx, tx) = (node.exits(), self.exits.clone());
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
        };
        if let Some(old) = lock(&self.forwarders).insert(name.clone(), forwarder) {
            old.abort();
        }
        // It keeps the pools the others keep.
        let pools = lock(&self.pools).clone();
        if !pools.is_empty() {
            let (node, name) = (node.clone(), name.clone());
            tokio::spawn(async move {
                for (template, resources, size) in pools {
                    if let Err(e) = node.set_pool(&template, &resources, size).await {
                        tracing::warn!("node {name}: warm pool of {template}: {e}");
                    }
                }
            });
        }
        let mut members = lock(&self.members);
        let mut next: Vec<(String, Arc<dyn Nodes>)> = members.iter().filter(|(n, _)| *n != name).cloned().collect();
        next.push((name.clone(), node));
        *members = Arc::new(next);
        lock(&self.unlisted).remove(&name);
    }

    /// Which members discovery lists now; the others take no new sandbox.
    pub fn set_listed(&self, listed: &BTreeSet<String>) {
        let all = self.snapshot();
        *lock(&self.unlisted) = all
            .iter()
            .map(|(n, _)| n.clone())
            .filter(|n| !listed.contains(n))
            .collect();
    }

    /// Which members' hosts are being drained now (discovery's view of them).
    pub fn set_cordoned(&self, cordoned: BTreeSet<String>) {
        *lock(&self.cordoned) = cordoned;
    }

    /// The member names and the node each has now.
    pub fn snapshot(&self) -> Members {
        lock(&self.members).clone()
    }

    fn placed(&self) -> std::sync::MutexGuard<'_, HashMap<String, String>> {
        lock(&self.placed)
    }

    /// The member that has VM (or pool VM, or image) `id`: its name and node.
    fn find(&self, id: &str) -> Option<(String, Arc<dyn Nodes>)> {
        let members = self.snapshot();
        let placed = self.placed().get(id).cloned();
        if let Some(name) = placed {
            if let Some(m) = members.iter().find(|(n, _)| *n == name) {
                return Some(m.clone());
            }
        }
        let found = members
            .iter()
            .find(|(_, n)| n.vm_state(id) != VmState::Gone || n.image_ids().iter().any(|i| i == id))?
            .clone();
        self.placed().insert(id.to_string(), found.0.clone());
        Some(found)
    }

    /// [`Cluster::find`], else the member that says it has VM `id` when every member is asked
    /// now: another replica may have placed or moved it since the last reports.
    async fn locate(&self, id: &str) -> Option<(String, Arc<dyn Nodes>)> {
        match self.find(id) {
            Some(found) => Some(found),
            None => self.ask_all(id).await,
        }
    }

    /// The member whose VM `id` is, asked of every member now.
    async fn ask_all(&self, id: &str) -> Option<(String, Arc<dyn Nodes>)> {
        let members = self.snapshot();
        let answers = futures_util::future::join_all(members.iter().map(|(_, n)| n.vm_state_now(id))).await;
        let (found, _) = members
            .iter()
            .zip(answers)
            .find(|(_, state)| state.is_some_and(|s| s != VmState::Gone))?;
        self.placed().insert(id.to_string(), found.0.clone());
        Some(found.clone())
    }

    /// `call` on the node that has VM `id`; if that node no longer has it (another replica
    /// moved it), on the one that has it now.
    async fn on_holder<T, F, Fut>(&self, id: &str, call: F) -> Result<T, NodeError>
    where
        F: Fn(Arc<dyn Nodes>) -> Fut,
        Fut: std::future::Future<Output = Result<T, NodeError>>,
    {
        let (_, node) = self.locate(id).await.ok_or_else(|| unknown(id))?;
        match call(node).await {
            Err(NodeError::UnknownSandbox(_)) => {
                self.forget(id);
                let (_, node) = self.ask_all(id).await.ok_or_else(|| unknown(id))?;
                call(node).await
            }
            done => done,
        }
    }

    fn forget(&self, id: &str) {
        self.placed().remove(id);
    }
}

#[async_trait]
impl Nodes for Cluster {
    fn runtime_name(&self) -> String {
        self.snapshot()
            .first()
            .map(|(_, n)| n.runtime_name())
            .unwrap_or_default()
    }

    async fn accel(&self) -> String {
        let first = self.snapshot().first().map(|(_, n)| n.clone());
        match first {
            Some(n) => n.accel().await,
            None => String::new(),
        }
    }

    fn templates(&self) -> Vec<TemplateManifest> {
        let mut all: Vec<TemplateManifest> = Vec::new();
        for (_, n) in self.snapshot().iter() {
            for t in n.templates() {
                if !all.iter().any(|a| a.digest == t.digest && a.name == t.name) {
                    all.push(t);
                }
            }
        }
        all
    }

    fn template(&self, reference: &str) -> Option<TemplateManifest> {
        self.snapshot().iter().find_map(|(_, n)| n.template(reference))
    }

    async fn create(&self, vm: &VmRequest) -> Result<Booted, NodeError> {
        let members = self.snapshot();
        let Some((name, node)) = members.iter().find(|(name, _)| *name == vm.node) else {
            return Err(NodeError::Failed(Box::new(super::wire::RemoteFailure(format!(
                "no node named {:?} in this cluster",
                vm.node
            )))));
        };
        self.placed().insert(vm.id.clone(), name.clone());
        node.create(vm).await
    }

    /// With `run`, on the member that reported that run of `id` (a leftover on one node while
    /// the sandbox runs on another is ended there, not where the sandbox runs).
    async fn delete(&self, id: &str, run: Option<&str>) -> Result<(), NodeError> {
        let reported = run.and_then(|run| {
            let members = self.snapshot();
            members
                .iter()
                .find(|(_, n)| n.vm_run(id).as_deref() == Some(run))
                .cloned()
        });
        let Some((name, node)) = (match reported {
            Some(found) => Some(found),
            None => self.locate(id).await,
        }) else {
            return Ok(());
        };
        node.delete(id, run).await?;
        if self.placed().get(id) == Some(&name) {
            self.forget(id);
        }
        Ok(())
    }

    async fn pause(&self, id: &str) -> Result<(), NodeError> {
        self.on_holder(id, |n| async move { n.pause(id).await }).await
    }

    async fn suspend(&self, id: &str) -> Result<u64, NodeError> {
        self.on_holder(id, |n| async move { n.suspend(id).await }).await
    }

    async fn save_image(&self, id: &str, image_id: &str) -> Result<u64, NodeError> {
        let (name, node) = self.locate(id).await.ok_or_else(|| unknown(id))?;
        let bytes = node.save_image(id, image_id).await?;
        self.placed().insert(image_id.to_string(), name);
        Ok(bytes)
    }

    async fn capture_template(&self, id: &str, capture: &super::Capture) -> Result<TemplateManifest, NodeError> {
        let (_, node) = self.locate(id).await.ok_or_else(|| unknown(id))?;
        let manifest = node.capture_template(id, capture).await?;
        self.forget(id);
        Ok(manifest)
    }

    /// On the first member that answers; with object storage the others pull it at their
    /// first create of it.
    async fn import_image(&self, import: &super::ImageImport) -> Result<TemplateManifest, NodeError> {
        let mut last = NodeError::Unsupported("import images: no node".into());
        for (member, node) in self.snapshot().iter() {
            match node.import_image(import).await {
                Err(e @ NodeError::Unreachable(_)) => {
                    tracing::warn!(%member, "importing {} elsewhere: {e}", import.image);
                    last = e;
                }
                r => return r,
            }
        }
        Err(last)
    }

    /// On every member; one that does not answer keeps its copy (unused: no record names it).
    async fn remove_template(&self, name: &str) -> Result<(), NodeError> {
        for (member, node) in self.snapshot().iter() {
            if let Err(e) = node.remove_template(name).await {
                tracing::warn!(%member, template = name, "the template stays on this node for now: {e}");
            }
        }
        Ok(())
    }

    async fn park(&self, id: &str, image_id: &str) -> Result<super::Parked, NodeError> {
        let (_, node) = self.locate(id).await.ok_or_else(|| unknown(id))?;
        let parked = node.park(id, image_id).await?;
        self.forget(id);
        Ok(parked)
    }

    async fn share_image(&self, image_id: &str) -> Result<super::Parked, NodeError> {
        let (_, node) = self
            .find(image_id)
            .ok_or_else(|| NodeError::UnknownImage(image_id.into()))?;
        node.share_image(image_id).await
    }

    /// On every member that lists it (a shared snapshot's copies too), and on the one it is
    /// known on. A member that does not answer keeps its copy, which the replicas' sweep of
    /// unclaimed images removes once it is back.
    async fn delete_image(&self, image_id: &str) -> Result<(), NodeError> {
        let members = self.snapshot();
        let mut holders: Vec<Arc<dyn Nodes>> = members
            .iter()
            .filter(|(_, n)| n.image_ids().iter().any(|i| i == image_id))
            .map(|(_, n)| n.clone())
            .collect();
        if holders.is_empty() {
            holders.extend(self.find(image_id).map(|(_, n)| n));
        }
        for node in holders {
            match node.delete_image(image_id).await {
                Err(NodeError::Unreachable(e)) => {
                    tracing::warn!(
                        image = image_id,
                        "a node that does not answer keeps its copy for now: {e}"
                    )
                }
                done => done?,
            }
        }
        self.forget(image_id);
        Ok(())
    }

    /// On the first member with object storage that does it: any can, the image is on none.
    async fn delete_parked(&self, image_id: &str) -> Result<(), NodeError> {
        let mut failed = None;
        for (name, node) in self.snapshot().iter().filter(|(_, n)| n.parks()) {
            match node.delete_parked(image_id).await {
                Ok(()) => return Ok(()),
                Err(e) => {
                    tracing::debug!(node = %name, image = image_id, "cannot delete a parked image: {e}");
                    failed = Some(e);
                }
            }
        }
        Err(failed.unwrap_or_else(|| {
            NodeError::Unsupported(format!("delete parked image {image_id}: no node has object storage"))
        }))
    }

    async fn digest_image(&self, image_id: &str) -> Result<String, NodeError> {
        match self.find(image_id) {
            Some((_, node)) => node.digest_image(image_id).await,
            None => Err(NodeError::UnknownImage(image_id.to_string())),
        }
    }

    fn image_ids(&self) -> Vec<String> {
        self.snapshot().iter().flat_map(|(_, n)| n.image_ids()).collect()
    }

    /// A pool VM from the member with the most free memory that has one ready.
    async fn claim(&self, template: &str, resources: &Resources) -> Option<String> {
        let unlisted = lock(&self.unlisted).clone();
        let cordoned = lock(&self.cordoned).clone();
        let mut order: Vec<(String, Arc<dyn Nodes>)> = self
            .snapshot()
            .iter()
            .filter(|(n, _)| !unlisted.contains(n) && !cordoned.contains(n))
            .cloned()
            .collect();
        order.sort_by_key(|(_, n)| std::cmp::Reverse(n.capacity().memory_mib));
        for (name, node) in order {
            let ready = node
                .pools()
                .iter()
                .any(|p| p.template == template && p.resources == *resources && p.ready > 0);
            if !ready {
                continue;
            }
            if let Some(id) = node.claim(template, resources).await {
                self.placed().insert(id.clone(), name);
                return Some(id);
            }
        }
        None
    }

    fn unclaim(&self, id: &str) {
        if let Some((_, node)) = self.find(id) {
            node.unclaim(id);
            self.forget(id);
        }
    }

    /// Every member keeps the pool, and every member that joins later.
    async fn set_pool(&self, template: &str, resources: &Resources, size: usize) -> Result<(), NodeError> {
        {
            let mut pools = lock(&self.pools);
            pools.retain(|(t, r, _)| !(t == template && r == resources));
            if size > 0 {
                pools.push((template.to_string(), *resources, size));
            }
        }
        for (_, n) in self.snapshot().iter() {
            n.set_pool(template, resources, size).await?;
        }
        Ok(())
    }

    fn pools(&self) -> Vec<PoolInfo> {
        self.snapshot().iter().flat_map(|(_, n)| n.pools()).collect()
    }

    async fn resume(&self, id: &str) -> Result<(), NodeError> {
        self.on_holder(id, |n| async move { n.resume(id).await }).await
    }

    fn vm_state(&self, id: &str) -> VmState {
        match self.find(id) {
            Some((_, node)) => node.vm_state(id),
            None => VmState::Gone,
        }
    }

    /// Every member asked now: the state of the one that has it, `Gone` only when every member
    /// says so, None when one that might have it cannot say.
    async fn vm_state_now(&self, id: &str) -> Option<VmState> {
        let members = self.snapshot();
        let answers = futures_util::future::join_all(members.iter().map(|(_, n)| n.vm_state_now(id))).await;
        if let Some(held) = answers.iter().flatten().find(|s| **s != VmState::Gone) {
            return Some(*held);
        }
        answers.into_iter().collect::<Option<Vec<_>>>().map(|_| VmState::Gone)
    }

    /// Every member settles what it knows of `id` (a restarted node may not list it yet).
    async fn settled(&self, id: &str) {
        let members = self.snapshot();
        futures_util::future::join_all(members.iter().map(|(_, n)| n.settled(id))).await;
    }

    async fn settled_all(&self) {
        let members = self.snapshot();
        futures_util::future::join_all(members.iter().map(|(_, n)| n.settled_all())).await;
    }

    fn vm_ids(&self) -> Vec<String> {
        self.snapshot().iter().flat_map(|(_, n)| n.vm_ids()).collect()
    }

    fn vm_run(&self, id: &str) -> Option<String> {
        self.find(id).and_then(|(_, node)| node.vm_run(id))
    }

    fn vm_reports(&self) -> Vec<(String, VmReport)> {
        let members = self.snapshot();
        members
            .iter()
            .flat_map(|(name, n)| n.vm_reports().into_iter().map(|(_, vm)| (name.clone(), vm)))
            .collect()
    }

    async fn agent(&self, id: &str) -> Result<AgentClient, NodeError> {
        self.on_holder(id, |n| async move { n.agent(id).await }).await
    }

    async fn agent_of_run(&self, id: &str, node: &str, run: &str) -> Result<AgentClient, NodeError> {
        let members = self.snapshot();
        let recorded = members
            .iter()
            .find(|(name, n)| name == node && (run.is_empty() || n.vm_run(id).as_deref() == Some(run)));
        match recorded {
            Some((name, n)) => {
                self.placed().insert(id.to_string(), name.clone());
                match n.agent(id).await {
                    // Moved since its report: wherever it is now.
                    Err(NodeError::UnknownSandbox(_)) => self.agent(id).await,
                    done => done,
                }
            }
            None => self.agent(id).await,
        }
    }

    fn exits(&self) -> broadcast::Receiver<String> {
        self.exits.subscribe()
    }

    /// The members' together (what the tenants' default quotas share).
    fn capacity(&self) -> Capacity {
        let mut sum = Capacity::default();
        for (_, n) in self.snapshot().iter() {
            let c = n.capacity();
            sum.cpus += c.cpus;
            sum.memory_mib += c.memory_mib;
            sum.sandboxes_running += c.sandboxes_running;
            sum.disk_free_mib += c.disk_free_mib;
            sum.vcpu_held += c.vcpu_held;
            sum.memory_held_mib += c.memory_held_mib;
            sum.disk_held_mib += c.disk_held_mib;
        }
        sum
    }

    async fn egress(&self, id: &str) -> Option<airlock_egress::EgressSnapshot> {
        self.locate(id).await?.1.egress(id).await
    }

    async fn watch_start(&self, id: &str, spec: &super::WatchSpec) -> Result<super::WatchStart, NodeError> {
        self.on_holder(id, |n| async move { n.watch_start(id, spec).await })
            .await
    }

    async fn watch_take(&self, id: &str, watch: &str) -> Result<Option<super::watches::Taken>, NodeError> {
        self.on_holder(id, |n| async move { n.watch_take(id, watch).await })
            .await
    }

    async fn watch_stop(&self, id: &str, watch: &str) -> Result<bool, NodeError> {
        self.on_holder(id, |n| async move { n.watch_stop(id, watch).await })
            .await
    }

    async fn set_deadline(&self, id: &str, deadline: Option<super::Deadline>) -> Result<(), NodeError> {
        self.on_holder(id, |n| async move { n.set_deadline(id, deadline).await })
            .await
    }

    fn members(&self) -> Vec<Member> {
        let unlisted = lock(&self.unlisted).clone();
        let cordoned = lock(&self.cordoned).clone();
        self.snapshot()
            .iter()
            .map(|(name, n)| {
                let one = n.members().into_iter().next().unwrap_or_else(|| Member {
                    name: String::new(),
                    capacity: n.capacity(),
                    refuses: None,
                    draining: false,
                    fingerprint: String::new(),
                    parks: false,
                    answering: false,
                });
                let refuses = if unlisted.contains(name) {
                    Some("not listed by discovery (not ready, or going away)".to_string())
                } else if cordoned.contains(name) {
                    Some("cordoned: its host is being drained".to_string())
                } else {
                    one.refuses
                };
                Member {
                    name: name.clone(),
                    refuses,
                    draining: one.draining || cordoned.contains(name),
                    ..one
                }
            })
            .collect()
    }

    fn owner(&self, id: &str) -> Option<String> {
        self.find(id).map(|(name, _)| name)
    }
}
