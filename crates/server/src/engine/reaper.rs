//! The reaper: expired sandboxes deleted (or suspended, `on_timeout: suspend`), VMs that exited on
//! their own failed, every tick, by one replica at a time; operations whose lease lapsed taken
//! over and leases renewed by every replica.

use super::*;

/// The duty ([`crate::store::OperationStore::lead`]) of reaping expired sandboxes and sweeping
/// for gone VMs and draining nodes.
const REAPER_DUTY: &str = "reaper";

/// How long every replica must have had no answer from a node before its running sandboxes
/// are judged lost (`Config::node_grace`, `serve --node-grace-seconds`): a node back within it
/// keeps them.
pub const NODE_GRACE: Duration = Duration::from_secs(60);
/// A replica's view of a node counts while it asked the node this recently (it asks every
/// sweep): one that stopped asking (it died) is no witness.
const WITNESS_WITHIN_MS: i64 = 10_000;
/// Saves' and forks' images older than this with no operation at them are left over (see
/// [`Engine::sweep_interrupted_images`]).
const FORK_IMAGES_KEPT_MS: i64 = 600_000;
/// Views of nodes older than this are forgotten (their replica or node is long gone).
const FORGET_VIEWS_AFTER_MS: i64 = 3_600_000;

/// A VM on a node its sandbox's record does not name: (node, sandbox id, run).
pub(super) type Disowned = (String, String, String);

/// The nodes that every replica asking lately has had no answer from for at least `grace_ms`:
/// at least one witness, and none that saw the node answer meanwhile.
pub(crate) fn unanswering(
    seen: &[crate::store::NodeSeen],
    now_ms: i64,
    grace_ms: i64,
) -> std::collections::BTreeSet<String> {
    let mut verdict: std::collections::BTreeMap<&str, bool> = Default::default();
    for s in seen {
        let silent = s.unanswered_since_ms.is_some_and(|since| since <= now_ms - grace_ms);
        *verdict.entry(&s.node).or_insert(true) &= silent;
    }
    verdict
        .into_iter()
        .filter(|(_, dead)| *dead)
        .map(|(node, _)| node.to_string())
        .collect()
}

impl Engine {
    /// A sandbox whose VM exited on its own is failed (its quota slot is free again).
    pub(super) async fn vm_exited(&self, id: &str) {
        let live = [SandboxState::Running, SandboxState::Paused];
        if self.transition(id, &live, SandboxState::Failed).await {
            tracing::warn!(sandbox = %id, "its VM exited on its own; marking it failed");
            let data = serde_json::json!({ "error": { "code": "vm_exited", "message": "its VM exited on its own" } });
            self.record_event(id, crate::model::EventKind::Failed, data).await;
            let _ = self.store.set_paused_remaining(id, None).await;
        }
    }

    /// Sandboxes with an operation under way (here or on another replica).
    async fn busy_sandboxes(&self) -> CoreResult<std::collections::HashSet<String>> {
        let ops = self.store.unfinished_operations().await?;
        Ok(ops.into_iter().map(|o| o.sandbox_id).collect())
    }

    /// Sandboxes the store thinks run, whose VM is gone, with no operation under way.
    pub(super) async fn sweep(&self) -> CoreResult<()> {
        let busy = self.busy_sandboxes().await?;
        for row in self.store.live_sandboxes().await? {
            if matches!(row.state, SandboxState::Running | SandboxState::Paused)
                && !busy.contains(&row.id)
                && !self.recovering(&row.id)
                && self.nodes.vm_state(&row.id) == VmState::Gone
                && self.nodes.vm_gone(&row.id).await
            {
                self.vm_exited(&row.id).await;
            }
        }
        Ok(())
    }

    /// The images of sandboxes that ended parked, left in object storage when no node could
    /// remove them at the time.
    pub(super) async fn sweep_parked(&self) -> CoreResult<()> {
        for (id, image) in self.store.parked_of_ended().await? {
            self.delete_parked(&id, &image).await;
        }
        Ok(())
    }

    /// Sandboxes running on a node that drains are suspended (on its disk: resumed when it is
    /// back), so it can stop. Moving them through object storage to another node is to come.
    pub(super) async fn drain_sweep(&self) -> CoreResult<()> {
        let draining: std::collections::HashSet<String> = self
            .nodes
            .members()
            .into_iter()
            .filter(|m| m.draining)
            .map(|m| m.name)
            .collect();
        let tried = std::mem::take(&mut *self.drain_tried.lock().unwrap_or_else(|e| e.into_inner()));
        if draining.is_empty() {
            return Ok(());
        }
        let busy = self.busy_sandboxes().await?;
        // One suspend per sandbox for as long as its node drains: one that failed is left to
        // the node's own at the end of its drain budget.
        let mut kept = std::collections::HashSet::new();
        for row in self.store.live_sandboxes().await? {
            if !draining.contains(&row.node) {
                continue;
            }
            if tried.contains(&row.id) {
                kept.insert(row.id.clone());
                continue;
            }
            if matches!(row.state, SandboxState::Running | SandboxState::Paused) && !busy.contains(&row.id) {
                tracing::info!(sandbox = %row.id, node = %row.node, "its node drains; suspending it");
                kept.insert(row.id.clone());
                self.submit(Action::Suspend { sandbox: row }).await?;
            }
        }
        *self.drain_tried.lock().unwrap_or_else(|e| e.into_inner()) = kept;
        Ok(())
    }

    /// Record what this replica sees of each node now (whether it answered its last report).
    pub(super) async fn observe_nodes(&self) {
        let now = now_ms();
        for m in self.nodes.members().into_iter().filter(|m| !m.name.is_empty()) {
            if let Err(e) = self.store.observe_node(&m.name, m.answering, now).await {
                tracing::warn!(node = %m.name, "cannot record what this replica sees of it: {e}");
                return;
            }
        }
    }

    /// The running and paused sandboxes of nodes every replica has had no answer from for the
    /// grace are lost: their VMs went with the node (a host that died) or are cut off from
    /// every replica. Suspended ones stay: their state is on that node's disk, and they resume
    /// once it is back. The node's VMs of lost sandboxes go if it comes back (`reap_disowned`).
    pub(super) async fn lose_dead_nodes(&self) -> CoreResult<()> {
        let now = now_ms();
        let seen = self.store.node_observations(now - WITNESS_WITHIN_MS).await?;
        let dead = unanswering(&seen, now, self.node_grace.as_millis() as i64);
        if dead.is_empty() {
            return Ok(());
        }
        let busy = self.busy_sandboxes().await?;
        for row in self.store.live_sandboxes().await? {
            if !dead.contains(&row.node)
                || !matches!(row.state, SandboxState::Running | SandboxState::Paused)
                || busy.contains(&row.id)
            {
                continue;
            }
            // A park whose answer was lost with its node: the image is what is left of it.
            if self.store.sandbox_parked(&row.id).await?.is_some() {
                tracing::warn!(sandbox = %row.id, node = %row.node, "its node went while parking it; suspended, parked");
                self.settle_held(&row.id, VmState::Suspended).await;
                continue;
            }
            let from = [SandboxState::Running, SandboxState::Paused];
            if self.transition(&row.id, &from, SandboxState::Lost).await {
                tracing::warn!(sandbox = %row.id, node = %row.node, "its node has not answered any replica for {:?}; lost", self.node_grace);
                let _ = self.store.set_paused_remaining(&row.id, None).await;
            }
        }
        Ok(())
    }

    /// VMs the store has disowned, on nodes that answer, with no operation under way at their
    /// sandbox: its sandbox ended (lost, deleted, failed: a node back after its sandboxes were
    /// judged lost) or runs elsewhere (another node, another run of the id), the latter only once
    /// seen so for the node grace. Each delete names the run the report showed, so a VM started
    /// since is left. Never on missing evidence: a VM without any record is left to a replica's
    /// start.
    pub(super) async fn reap_disowned(&self) -> CoreResult<()> {
        let busy = self.busy_sandboxes().await?;
        let answering: std::collections::HashSet<String> = self
            .nodes
            .members()
            .into_iter()
            .filter(|m| m.answering)
            .map(|m| m.name)
            .collect();
        let mut still_disowned = std::collections::HashMap::new();
        for (node, vm) in self.nodes.vm_reports() {
            if busy.contains(&vm.id) || !answering.contains(&node) {
                continue;
            }
            let Some(row) = self.store.sandbox_by_id(&vm.id).await? else {
                continue;
            };
            let why = if row.state.is_ended() {
                format!("its sandbox is {}", row.state.as_str())
            } else if row.node != node {
                format!("its sandbox is on node {:?}", row.node)
            } else if !row.run.is_empty() && !vm.run.is_empty() && row.run != vm.run {
                format!("its sandbox is run {}", row.run)
            } else {
                continue;
            };
            if !row.state.is_ended() {
                let key = (node.clone(), vm.id.clone(), vm.run.clone());
                let first = self.disowned_since(&key);
                still_disowned.insert(key, first);
                if first.elapsed() < self.node_grace {
                    continue;
                }
            }
            tracing::warn!(sandbox = %vm.id, %node, run = %vm.run, "{why}, yet this node has a VM of it; removing that VM");
            match self.nodes.delete(&vm.id, crate::nodes::named_run(&vm.run)).await {
                Ok(()) => {}
                Err(crate::nodes::NodeError::StaleRun(_)) => {
                    tracing::info!(sandbox = %vm.id, %node, "the VM is a newer run than the report showed; left")
                }
                Err(e) => tracing::warn!(sandbox = %vm.id, %node, "cannot remove the VM: {e}"),
            }
        }
        *self.disowned.lock().unwrap_or_else(|e| e.into_inner()) = still_disowned;
        Ok(())
    }

    /// Since when this replica has seen VM `key` (node, id, run) disowned.
    fn disowned_since(&self, key: &Disowned) -> std::time::Instant {
        let seen = self.disowned.lock().unwrap_or_else(|e| e.into_inner());
        seen.get(key).copied().unwrap_or_else(std::time::Instant::now)
    }

    /// A sandbox whose timeout passed: suspended if it asked for that (`on_timeout: suspend`,
    /// E2B's autoPause) and runs, else deleted. A suspend that fails deletes it after all.
    pub(super) async fn timed_out(&self, row: SandboxRecord) {
        let suspend = row.lifecycle.on_timeout == crate::model::OnTimeout::Suspend
            && matches!(row.state, SandboxState::Running | SandboxState::Paused);
        let action = if suspend { "suspend" } else { "delete" };
        self.record_event(
            &row.id,
            crate::model::EventKind::TimedOut,
            serde_json::json!({ "action": action }),
        )
        .await;
        if !suspend {
            tracing::info!(sandbox = %row.id, "timeout passed; deleting");
            let _ = self.submit(Action::Delete { sandbox: row }).await;
            return;
        }
        tracing::info!(sandbox = %row.id, "timeout passed; suspending");
        // Not picked again while it suspends; resumed, it gets its whole timeout again.
        let held = async {
            self.set_expiry(&row, now_ms() + MAX_SUSPEND.as_millis() as i64).await?;
            self.store.set_paused_remaining(&row.id, Some(row.timeout_ms)).await
        };
        if let Err(e) = held.await {
            tracing::error!(sandbox = %row.id, "cannot record the suspend clock: {e}");
        }
        let engine = self.clone();
        tokio::spawn(async move {
            let done = match engine.submit(Action::Suspend { sandbox: row.clone() }).await {
                Ok(s) => engine.wait(&s.operation).await.ok().filter(|op| op.error.is_none()),
                Err(_) => None,
            };
            if done.is_none() {
                tracing::warn!(sandbox = %row.id, "suspend at timeout failed; deleting");
                let _ = engine.store.set_paused_remaining(&row.id, None).await;
                if let Ok(Some(now)) = engine.store.sandbox_by_id(&row.id).await {
                    let _ = engine.submit(Action::Delete { sandbox: now }).await;
                }
            }
        });
    }

    /// Delete sandboxes whose timeout passed; fail those whose VM exited on its own; take over
    /// operations whose lease lapsed and renew the leases of those this process runs.
    pub fn spawn_reaper(&self) {
        let engine = self.clone();
        let mut exits = self.nodes.exits();
        tokio::spawn(async move {
            loop {
                match exits.recv().await {
                    Ok(id) => engine.vm_exited(&id).await,
                    Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {
                        let _ = engine.sweep().await;
                    }
                    Err(tokio::sync::broadcast::error::RecvError::Closed) => break,
                }
            }
        });
        let engine = self.clone();
        tokio::spawn(async move {
            let mut tick = 0u32;
            loop {
                tokio::time::sleep(REAP_EVERY).await;
                tick = tick.wrapping_add(1);
                // One replica at a time reaps and sweeps (the others would only submit the same
                // deletes and suspends again); another takes the duty over once its lease lapses.
                let leads = match engine.store.lead(REAPER_DUTY).await {
                    Ok(leads) => leads,
                    Err(e) => {
                        tracing::warn!("cannot take the reaper's duty: {e}");
                        false
                    }
                };
                if leads {
                    if let Ok(expired) = engine.store.expired_sandboxes(now_ms()).await {
                        // A sandbox the restart's recovery has yet to settle waits for it.
                        for row in expired.into_iter().filter(|r| !engine.recovering(&r.id)) {
                            engine.timed_out(row).await;
                        }
                    }
                }
                if tick.is_multiple_of(SWEEP_EVERY_TICKS) {
                    engine.observe_nodes().await;
                    if leads {
                        let _ = engine.sweep().await;
                        if let Err(e) = engine.lose_dead_nodes().await {
                            tracing::warn!("cannot judge the nodes that do not answer: {e}");
                        }
                        if let Err(e) = engine.reap_disowned().await {
                            tracing::warn!("cannot remove disowned VMs: {e}");
                        }
                        if let Err(e) = engine.drain_sweep().await {
                            tracing::warn!("cannot take sandboxes off draining nodes: {e}");
                        }
                        if let Err(e) = engine.sweep_parked().await {
                            tracing::warn!("cannot look for the parked images of ended sandboxes: {e}");
                        }
                        let _ = engine
                            .store
                            .forget_node_observations(now_ms() - FORGET_VIEWS_AFTER_MS)
                            .await;
                        // A fork whose replica died leaves its image; one older than any fork
                        // takes, with no create still starting from it, goes.
                        if let Err(e) = engine.sweep_interrupted_images(now_ms() - FORK_IMAGES_KEPT_MS).await {
                            tracing::warn!("cannot sweep the images of interrupted forks and saves: {e}");
                        }
                        if let Err(e) = engine.sweep_unclaimed_images().await {
                            tracing::warn!("cannot sweep the images no record claims: {e}");
                        }
                    }
                    engine.resend_deadlines().await;
                    if !engine.recovery.under_way.load(std::sync::atomic::Ordering::SeqCst) {
                        if let Err(e) = engine.take_over().await {
                            tracing::warn!("cannot look for operations to take over: {e}");
                        }
                    }
                }
            }
        });
        // The leases of what this process runs, renewed well before they lapse.
        let engine = self.clone();
        tokio::spawn(async move {
            let every = Duration::from_millis(engine.store.lease().ms.max(3) as u64 / 3);
            loop {
                tokio::time::sleep(every).await;
                let ids: Vec<String> = engine
                    .running
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .keys()
                    .cloned()
                    .collect();
                if let Err(e) = engine.store.renew_leases(&ids).await {
                    tracing::warn!("cannot renew the leases of {} operations: {e}", ids.len());
                }
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::NodeSeen;

    fn seen(node: &str, replica: &str, since: Option<i64>) -> NodeSeen {
        NodeSeen {
            node: node.into(),
            replica: replica.into(),
            unanswered_since_ms: since,
        }
    }

    #[test]
    fn a_node_is_dead_only_when_every_witness_lost_it_for_the_whole_grace() {
        let (now, grace) = (100_000, 30_000);
        let judged = |s: &[NodeSeen]| unanswering(s, now, grace).into_iter().collect::<Vec<_>>();
        // Both replicas have had no answer for 40 s and 31 s.
        assert_eq!(
            judged(&[seen("n1", "r1", Some(60_000)), seen("n1", "r2", Some(69_000))]),
            ["n1"]
        );
        // One still sees it answer (a cut between the other replica and the node).
        assert!(judged(&[seen("n1", "r1", Some(60_000)), seen("n1", "r2", None)]).is_empty());
        // Silent for less than the grace to one of them.
        assert!(judged(&[seen("n1", "r1", Some(60_000)), seen("n1", "r2", Some(80_000))]).is_empty());
        // Nodes are judged each on their own evidence.
        assert_eq!(
            judged(&[
                seen("n1", "r1", None),
                seen("n2", "r1", Some(1)),
                seen("n3", "r1", Some(99_000))
            ]),
            ["n2"]
        );
        assert!(judged(&[]).is_empty(), "no witness, no verdict");
    }
}
