//! After a restart: settle every sandbox by what its VM really is, several at a time, while the
//! listener already serves (`start_recovery`; a request waits in `recovered`); remove VMs and
//! images no record claims.

use super::*;

impl Engine {
    /// After a (possibly unclean) restart: finish or fail every open operation by what the VMs
    /// really are, fail sandboxes whose VM is gone, and delete VMs no live record claims. Returns
    /// when all of it is done; see [`Engine::start_recovery`] for a server that listens first.
    pub async fn recover(&self) -> CoreResult<()> {
        self.start_recovery().await?;
        let mut news = self.recovered.subscribe();
        while self.recovery.under_way.load(std::sync::atomic::Ordering::SeqCst) {
            if news.changed().await.is_err() {
                break;
            }
        }
        Ok(())
    }

    /// Start the recovery (see [`Engine::recover`]) and return once every sandbox it must settle
    /// is recorded as pending: requests about those wait for theirs ([`Engine::recovered`]),
    /// others are served at once. Sandboxes are recovered several at a time, each as soon as the
    /// node has re-attached (or lost) its VM; the VMs no live record claims go last.
    pub async fn start_recovery(&self) -> CoreResult<()> {
        let began = std::time::Instant::now();
        // The operations of this server's earlier life and of replicas whose leases lapsed;
        // a sandbox another replica is changing now is that replica's to settle.
        let claimed = self.took(self.store.claim_operations(true).await?);
        let ours: std::collections::HashSet<&str> = claimed.iter().map(|o| o.id.as_str()).collect();
        let busy: std::collections::HashSet<String> = self
            .store
            .unfinished_operations()
            .await?
            .into_iter()
            .filter(|o| !ours.contains(o.id.as_str()))
            .map(|o| o.sandbox_id)
            .collect();
        let mut ops: std::collections::HashMap<String, Vec<Operation>> = Default::default();
        let mut running: std::collections::HashMap<String, Vec<Running>> = Default::default();
        for op in claimed {
            running
                .entry(op.sandbox_id.clone())
                .or_default()
                .push(self.running(&op.id));
            ops.entry(op.sandbox_id.clone()).or_default().push(op);
        }
        let mut pending = std::collections::HashMap::new();
        for row in self.store.live_sandboxes().await? {
            if !busy.contains(&row.id) {
                pending.insert(row.id.clone(), row.tenant_id.clone());
            }
        }
        for id in ops.keys() {
            if !pending.contains_key(id) {
                if let Some(row) = self.store.sandbox_by_id(id).await? {
                    pending.insert(id.clone(), row.tenant_id);
                }
            }
        }
        let ids: Vec<String> = pending.keys().cloned().collect();
        let settling = ids.len();
        self.recovery.pending.lock().unwrap().extend(pending);
        self.recovery.under_way.store(true, std::sync::atomic::Ordering::SeqCst);
        let engine = self.clone();
        tokio::spawn(async move {
            use futures_util::StreamExt;
            futures_util::stream::iter(ids)
                .for_each_concurrent(RECOVER_AT_ONCE, |id| {
                    let engine = engine.clone();
                    let ops = ops.remove(&id).unwrap_or_default();
                    let running = running.remove(&id);
                    async move {
                        engine.settle_claimed(&id, ops, running.unwrap_or_default()).await;
                        engine.recovery.pending.lock().unwrap().remove(&id);
                        engine.recovered.send_modify(|n| *n += 1);
                    }
                })
                .await;
            engine.nodes.settled_all().await;
            if let Err(e) = engine.sweep_unclaimed_vms().await {
                tracing::error!("cannot sweep VMs without a record: {e}");
            }
            if let Err(e) = engine.sweep_images().await {
                tracing::error!("cannot sweep images: {e}");
            }
            engine
                .recovery
                .under_way
                .store(false, std::sync::atomic::Ordering::SeqCst);
            engine.recovered.send_modify(|n| *n += 1);
            engine.telemetry.recovered(began.elapsed(), settling);
            tracing::info!("recovery after the restart finished in {:?}", began.elapsed());
        });
        Ok(())
    }

    /// Take over the operations whose lease lapsed (their replica died, or their task ended
    /// without finishing them): each settled by what its VM is now, as after a restart.
    pub(super) async fn take_over(&self) -> CoreResult<()> {
        let mut ops: std::collections::HashMap<String, Vec<Operation>> = Default::default();
        for op in self.took(self.store.claim_operations(false).await?) {
            tracing::warn!(op = %op.id, sandbox = %op.sandbox_id, "its lease lapsed; taking it over");
            ops.entry(op.sandbox_id.clone()).or_default().push(op);
        }
        for (id, ops) in ops {
            let running: Vec<Running> = ops.iter().map(|o| self.running(&o.id)).collect();
            let engine = self.clone();
            tokio::spawn(async move { engine.settle_claimed(&id, ops, running).await });
        }
        Ok(())
    }

    /// Sandbox `id` with the operations this engine claimed of it (counted as run here by
    /// `running` until it is done), once its node knows whether its VM is there.
    async fn settle_claimed(&self, id: &str, ops: Vec<Operation>, running: Vec<Running>) {
        // The node's calls name the operation taken over (the first, when there are several).
        let op = ops.first().map_or_else(|| self.carried(""), |o| self.carried(&o.id));
        crate::nodes::wire::OPERATION
            .scope(op, async {
                self.nodes.settled(id).await;
                if let Err(e) = self.recover_sandbox(id, ops).await {
                    tracing::error!(sandbox = %id, "cannot recover: {e}");
                }
            })
            .await;
        drop(running);
    }

    /// Whether sandbox `id` is still being recovered after a restart.
    pub fn recovering(&self, id: &str) -> bool {
        self.recovery.pending.lock().unwrap().contains_key(id)
    }

    /// Wait (at most [`RECOVERY_WAIT`], or what `Config::recovery_wait` says) until the restart's recovery has settled every sandbox
    /// `which` selects (by id and tenant id); `unavailable` if it has not by then. Immediate
    /// when none is pending, which is always so once the recovery is over.
    pub(super) async fn await_recovered(&self, which: impl Fn(&str, &str) -> bool, what: &str) -> CoreResult<()> {
        let mut news = self.recovered.subscribe();
        let deadline = tokio::time::Instant::now() + self.recovery.wait;
        loop {
            let left = self
                .recovery
                .pending
                .lock()
                .unwrap()
                .iter()
                .any(|(id, tenant)| which(id, tenant));
            if !left {
                return Ok(());
            }
            match tokio::time::timeout_at(deadline, news.changed()).await {
                Ok(Ok(())) => {}
                Ok(Err(_)) => return Ok(()),
                Err(_) => {
                    return Err(CoreError::Unavailable(format!(
                        "{what} is still being recovered after a server restart; retry in a few seconds"
                    )))
                }
            }
        }
    }

    /// Wait for sandbox `id`'s recovery (see [`Engine::await_recovered`]).
    pub async fn recovered(&self, id: &str) -> CoreResult<()> {
        if !self.recovering(id) {
            return Ok(());
        }
        self.await_recovered(|s, _| s == id, &format!("sandbox {id}")).await
    }

    /// Wait for the recovery of every sandbox of `tenant_id`.
    pub async fn tenant_recovered(&self, tenant_id: &str) -> CoreResult<()> {
        self.await_recovered(|_, t| t == tenant_id, "a sandbox of this tenant")
            .await
    }

    /// Wait for the recovery of every sandbox (node-wide budgets count them all).
    pub async fn all_recovered(&self) -> CoreResult<()> {
        self.await_recovered(|_, _| true, "a sandbox on this node").await
    }

    /// One sandbox after a restart, once its node knows whether its VM is there: its open
    /// operations finished or failed by what the VM is, and the sandbox failed if its VM is gone
    /// (unless it is parked in object storage: then it waits there, suspended).
    pub(super) async fn recover_sandbox(&self, id: &str, ops: Vec<Operation>) -> CoreResult<()> {
        let parked = self.store.sandbox_parked(id).await?.is_some();
        for op in ops {
            // Asked now: a view from an earlier report may predate what another replica did.
            let Some(vm) = self.nodes.vm_state_now(id).await else {
                // Its lease lapses and a later take-over asks again.
                tracing::warn!(op = %op.id, "its node cannot say what the VM is; left for later");
                continue;
            };
            match (op.kind, vm) {
                (OperationKind::Delete, _) => {
                    let engine = self.clone();
                    let run = op.clone();
                    self.start(&op, async move { engine.run_delete(run, false).await });
                    continue;
                }
                (OperationKind::Create, VmState::Running | VmState::Paused | VmState::Suspended) => {
                    self.transition(id, &[SandboxState::Creating], SandboxState::Running)
                        .await;
                    self.settle_held(id, vm).await;
                    self.finish(&op, None).await;
                    tracing::info!(op = %op.id, "create finished before the restart: succeeded");
                }
                (OperationKind::Pause, VmState::Paused)
                | (OperationKind::Suspend, VmState::Suspended)
                | (OperationKind::Resume, VmState::Running) => {
                    self.settle_held(id, vm).await;
                    self.finish(&op, None).await;
                    tracing::info!(op = %op.id, "finished before the restart: succeeded");
                }
                (OperationKind::Snapshot, _) => {
                    // Saved or not, it is not recorded as saved: its record and image (if any)
                    // go with the sweep.
                    self.finish(&op, Some(interrupted())).await;
                    tracing::warn!(op = %op.id, "snapshot interrupted by a restart");
                }
                (
                    OperationKind::Pause | OperationKind::Suspend | OperationKind::Resume,
                    VmState::Running | VmState::Paused | VmState::Suspended,
                ) => {
                    // It did not happen: the sandbox stays as its VM is.
                    self.settle_held(id, vm).await;
                    self.finish(&op, Some(interrupted())).await;
                    tracing::warn!(op = %op.id, "interrupted by a restart before it took effect");
                }
                // Its park went through (the image is recorded before the node is asked).
                (OperationKind::Suspend, VmState::Gone) if parked => {
                    self.settle_held(id, VmState::Suspended).await;
                    self.finish(&op, None).await;
                    tracing::info!(op = %op.id, "parked before the restart: succeeded");
                }
                // Its move to another node did not happen: it is still parked.
                (OperationKind::Resume, VmState::Gone) if parked => {
                    self.transition(id, &[SandboxState::Resuming], SandboxState::Suspended)
                        .await;
                    self.finish(&op, Some(interrupted())).await;
                    tracing::warn!(op = %op.id, "interrupted by a restart before it took effect");
                }
                (_, VmState::Gone) => {
                    self.set_state(id, SandboxState::Failed).await;
                    self.finish(&op, Some(interrupted())).await;
                    tracing::warn!(op = %op.id, "interrupted by a restart: failed");
                }
            }
        }
        if let Some(row) = self.store.sandbox_by_id(id).await? {
            let held = [
                SandboxState::Running,
                SandboxState::Paused,
                SandboxState::Suspended,
                SandboxState::Resuming,
            ];
            if held.contains(&row.state) {
                let Some(vm) = self.nodes.vm_state_now(id).await else {
                    return Ok(());
                };
                let parked = self.store.sandbox_parked(id).await?.is_some();
                match vm {
                    // Parked in object storage: suspended, on no node.
                    VmState::Gone if parked => self.settle_held(id, VmState::Suspended).await,
                    // Its timeout passed while no replica ran: its node ended it (`nodes/expiry.rs`).
                    VmState::Gone if row.expires_at_ms <= now_ms() => {
                        tracing::info!(sandbox = %id, "its timeout passed and its VM is gone; deleted");
                        self.set_state(id, SandboxState::Deleted).await;
                    }
                    VmState::Gone => {
                        tracing::warn!(sandbox = %id, "its VM is gone; marking it failed");
                        self.set_state(id, SandboxState::Failed).await;
                    }
                    vm => {
                        // A park or a move that did not finish: the VM is where it runs.
                        if parked {
                            self.store.set_sandbox_parked(id, None).await?;
                        }
                        self.settle_held(id, vm).await
                    }
                }
            }
        }
        Ok(())
    }

    /// VMs that no live record claims (left by a crash) are deleted.
    pub(super) async fn sweep_unclaimed_vms(&self) -> CoreResult<()> {
        for (_, vm) in self.nodes.vm_reports() {
            let live = self
                .store
                .sandbox_by_id(&vm.id)
                .await?
                .is_some_and(|r| !r.state.is_ended());
            if !live {
                tracing::warn!(sandbox = %vm.id, "VM without a live record; deleting it");
                // Only the run seen here: one started since (by another replica) stays.
                let _ = self.nodes.delete(&vm.id, crate::nodes::named_run(&vm.run)).await;
            }
        }
        Ok(())
    }

    /// Images no record claims (a snapshot's, or a parked sandbox's on its way to or from object
    /// storage), and [`Engine::sweep_interrupted_images`] of what was recorded before this
    /// engine started: saves and forks since then are under way.
    pub(super) async fn sweep_images(&self) -> CoreResult<()> {
        self.sweep_interrupted_images(self.started_ms).await?;
        self.sweep_unclaimed_images().await
    }

    /// Images on the nodes that no record claims. Every image is recorded before it is made (a
    /// save's, a fork's, a park's), so one unclaimed is left over: by a crash, or on a node that
    /// did not answer when its record went (a shared snapshot's copy).
    pub(super) async fn sweep_unclaimed_images(&self) -> CoreResult<()> {
        // The images first, then the claims: an image listed was recorded before it was made,
        // so a claim read after the list has it (unless it went since, and the image with it).
        let images = self.nodes.image_ids();
        let mut claimed: std::collections::HashSet<String> = self.store.snapshot_ids().await?.into_iter().collect();
        claimed.extend(self.store.parked_images().await?);
        claimed.extend(self.store.cached_step_images().await?);
        for id in images {
            if !claimed.contains(&id) {
                tracing::warn!(image = %id, "image without a record; removing it");
                let _ = self.nodes.delete_image(&id).await;
            }
        }
        Ok(())
    }

    /// Saves and forks' images recorded before `before_ms` that no operation is still at: a
    /// save a restart cut short, a fork whose replica died before removing its image (its
    /// children that started hold their own links).
    pub(super) async fn sweep_interrupted_images(&self, before_ms: i64) -> CoreResult<()> {
        // A save another replica runs now is its own (its sandbox has an operation leased).
        let unfinished = self.store.unfinished_operations().await?;
        let others: Vec<Operation> = {
            let running = self.running.lock().unwrap_or_else(|e| e.into_inner());
            unfinished
                .into_iter()
                .filter(|o| !running.contains_key(&o.id))
                .collect()
        };
        let busy: std::collections::HashSet<&str> = others.iter().map(|o| o.sandbox_id.as_str()).collect();
        // A fork's image is in use until its children have started from it: their creates
        // (another replica's, or one to take over) start from it.
        let mut starts_from = std::collections::HashSet::new();
        for o in others.iter().filter(|o| o.kind == OperationKind::Create) {
            if let Some(image) = self.store.sandbox_by_id(&o.sandbox_id).await?.and_then(|c| c.image_id) {
                starts_from.insert(image);
            }
        }
        for image in self.store.interrupted_images(before_ms).await? {
            if busy.contains(image.sandbox_id.as_str()) || starts_from.contains(&image.id) {
                continue;
            }
            tracing::info!(image = %image.id, "removing an image a restart interrupted (a fork's or a save's)");
            self.store.delete_snapshot(&image.tenant_id, &image.id).await?;
            let _ = self.nodes.delete_image(&image.id).await;
        }
        Ok(())
    }
}
