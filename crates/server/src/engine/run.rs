//! Carrying out an `Operation` in the background: create (with the sessions a snapshot's sandbox
//! inherits), delete, snapshot, and the changes (pause, suspend, resume) through `Nodes`.

use super::*;

/// How long a create waits, at most, for a node busy with other starts (see `create_placed`).
const BUSY_WAIT: Duration = Duration::from_secs(30);

impl Engine {
    pub(super) async fn run_create(&self, op: Operation, row: SandboxRecord, fallbacks: Vec<(String, NodeBudget)>) {
        let _ = self.store.set_operation_state(&op.id, OperationState::Running).await;
        // A shared snapshot's image starts on any node of its machine, pulled where it lacks.
        let shared = match &row.image_id {
            Some(image) => match self.store.get_snapshot(&row.tenant_id, image).await {
                Ok(snapshot) => snapshot.and_then(|s| s.shared),
                Err(e) => {
                    tracing::warn!(sandbox = %row.id, %image, "cannot read its snapshot: {e}");
                    None
                }
            },
            None => None,
        };
        let vm = crate::nodes::VmRequest {
            id: row.id.clone(),
            template: row.template.clone(),
            resources: row.resources,
            image_id: row.image_id.clone(),
            env: row.env.clone(),
            egress: row.egress.clone(),
            node: row.node.clone(),
            keep_image: shared.is_some(),
            volumes: Vec::new(),
            moved_from: shared,
        };
        let created = async {
            let vm = crate::nodes::VmRequest {
                volumes: self.volume_mounts(&row).await?,
                ..vm
            };
            self.create_placed(vm, fallbacks).await
        };
        match created.await {
            Ok(booted) => {
                let _ = self.store.set_sandbox_boot(&row.id, &booted).await;
                if let Some(image) = &row.image_id {
                    self.inherit_sessions(&row, image).await;
                }
                // The lifetime asked for starts when the sandbox runs: a slow boot (a loaded
                // host, TCG) is not charged to it. Set while still `creating`, which the
                // reaper leaves alone.
                let lifetime = row.expires_at_ms - row.created_at_ms;
                let _ = self.set_expiry(&row, now_ms() + lifetime).await;
                if self
                    .transition(&row.id, &[SandboxState::Creating], SandboxState::Running)
                    .await
                {
                    tracing::info!(sandbox = %row.id, "created");
                    let took = Duration::from_millis((now_ms() - row.created_at_ms).max(0) as u64);
                    self.telemetry.create_ended(Some((&booted.start.from, took)));
                } else {
                    // A delete was submitted during the boot, and may have found no VM yet: the
                    // VM just booted is nobody's, so it goes (deleting twice is harmless).
                    tracing::info!(sandbox = %row.id, "deleted while it booted; stopping its VM");
                    if let Err(e) = self.nodes.delete(&row.id, crate::nodes::named_run(&booted.run)).await {
                        tracing::warn!(sandbox = %row.id, "cannot stop the VM of a deleted sandbox: {e}");
                    }
                }
                self.finish(&op, None).await;
            }
            Err(e) => {
                tracing::warn!(sandbox = %row.id, "create failed: {e}");
                self.telemetry.create_ended(None);
                self.transition(&row.id, &[SandboxState::Creating], SandboxState::Failed)
                    .await;
                self.finish(&op, Some((&e).into())).await;
            }
        }
    }

    /// The volumes sandbox `row` mounts, as its node mounts them: a fresh volume's root goes to
    /// the user its processes run as (its template's last USER, else `user`).
    async fn volume_mounts(&self, row: &SandboxRecord) -> Result<Vec<crate::nodes::VolumeMountSpec>, CoreError> {
        let mounts = self.store.sandbox_volumes(&row.id).await?;
        if mounts.is_empty() {
            return Ok(Vec::new());
        }
        let owner = self
            .nodes
            .template(&row.template)
            .and_then(|m| m.built)
            .map(|b| b.user)
            .unwrap_or_else(|| "user".into());
        Ok(mounts
            .into_iter()
            .map(|m| crate::nodes::VolumeMountSpec {
                volume: m.volume_id,
                path: m.path,
                read_only: m.read_only,
                owner: Some(owner.clone()),
            })
            .collect())
    }

    /// Record when sandbox `row` times out, and tell its node, which ends the VM itself if no
    /// replica does by then (`nodes/expiry.rs`); a node that cannot be told leaves it to the
    /// replicas' reaper, as before.
    pub(crate) async fn set_expiry(&self, row: &SandboxRecord, at_ms: i64) -> Result<(), crate::store::StoreError> {
        self.store.set_sandbox_expiry(&row.id, at_ms).await?;
        let deadline = crate::nodes::Deadline {
            at_ms,
            suspend: row.lifecycle.on_timeout == crate::model::OnTimeout::Suspend,
        };
        if let Err(e) = self.nodes.set_deadline(&row.id, Some(deadline)).await {
            // Its node would act on the old one: the reaper tells it again (`resend_deadlines`).
            tracing::warn!(sandbox = %row.id, "its node did not take its deadline: {e}");
            self.deadlines_unsent
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(row.id.clone());
        }
        Ok(())
    }

    /// Tell the nodes the deadlines they did not take when they changed (a node unreachable
    /// for a moment), as the store has them now.
    pub(super) async fn resend_deadlines(&self) {
        let ids: Vec<String> = std::mem::take(&mut *self.deadlines_unsent.lock().unwrap_or_else(|e| e.into_inner()))
            .into_iter()
            .collect();
        for id in ids {
            let Ok(Some(row)) = self.store.sandbox_by_id(&id).await else {
                continue;
            };
            if !matches!(row.state, SandboxState::Running | SandboxState::Paused) {
                continue;
            }
            let deadline = crate::nodes::Deadline {
                at_ms: row.expires_at_ms,
                suspend: row.lifecycle.on_timeout == crate::model::OnTimeout::Suspend,
            };
            if self.nodes.set_deadline(&id, Some(deadline)).await.is_err() {
                self.deadlines_unsent
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(id);
            }
        }
    }

    /// Create `vm` on its node; while a node refuses it by its own admission, move it to the
    /// next of `fallbacks` that the store's budgets admit, and try there. A node busy with as
    /// many starts as it takes at once (they end within seconds) is asked again, with a growing
    /// pause, for up to [`BUSY_WAIT`] once no other node is left: a burst queues rather than
    /// fails. Every node's last refusal is named in the error when none takes it.
    async fn create_placed(
        &self,
        mut vm: crate::nodes::VmRequest,
        fallbacks: Vec<(String, NodeBudget)>,
    ) -> Result<crate::model::Booted, CoreError> {
        let started = tokio::time::Instant::now();
        let mut pause = Duration::from_millis(100);
        let mut reasons: Vec<(String, String)> = Vec::new();
        let mut next = fallbacks.into_iter();
        loop {
            let (refusal, busy) = match self.nodes.create(&vm).await {
                Err(e @ crate::nodes::NodeError::Refused(reason, _)) => {
                    (CoreError::from(e), reason == crate::nodes::Refusal::Busy)
                }
                other => return other.map_err(CoreError::from),
            };
            tracing::info!(sandbox = %vm.id, node = %vm.node, "node refused the create: {refusal}");
            reasons.retain(|(node, _)| *node != vm.node);
            reasons.push((vm.node.clone(), refusal.to_string()));
            loop {
                let Some((node, budget)) = next.next() else {
                    if busy && started.elapsed() < BUSY_WAIT {
                        tokio::time::sleep(pause).await;
                        pause = (pause * 2).min(Duration::from_secs(1));
                        // Unless it was deleted meanwhile: then the refusal stands.
                        let starting = self
                            .store
                            .sandbox_by_id(&vm.id)
                            .await
                            .ok()
                            .flatten()
                            .is_some_and(|r| matches!(r.state, SandboxState::Creating | SandboxState::Resuming));
                        if !starting {
                            return Err(refusal);
                        }
                        break;
                    }
                    return Err(crate::core::placement::refused_everywhere(reasons, Some(refusal)));
                };
                match self.store.move_starting(&vm.id, &node, &budget).await {
                    Ok(true) => {
                        vm.node = node;
                        break;
                    }
                    // Deleted meanwhile: the refusal stands.
                    Ok(false) => return Err(refusal),
                    Err(e) => {
                        let e = CoreError::from(e);
                        if !crate::core::placement::node_refused(&e) {
                            return Err(e);
                        }
                        reasons.push((node, e.to_string()));
                    }
                }
            }
        }
    }

    /// A sandbox made from a snapshot runs the processes its source ran: their sessions (as
    /// the source has them now) become its own, so both doors find them by pid and tag.
    pub(super) async fn inherit_sessions(&self, row: &SandboxRecord, image: &str) {
        let copied = async {
            let Some(snapshot) = self.store.get_snapshot(&row.tenant_id, image).await? else {
                return Ok(());
            };
            for s in self.store.list_sessions(&snapshot.sandbox_id).await? {
                if s.exited {
                    continue;
                }
                let copy = crate::records::SessionRecord {
                    id: format!("ses_{}", airlock_runtime::datadir::random_hex(8)),
                    sandbox_id: row.id.clone(),
                    ..s
                };
                self.store.insert_session(&copy).await?;
            }
            Ok::<_, crate::store::StoreError>(())
        };
        if let Err(e) = copied.await {
            tracing::warn!(sandbox = %row.id, "cannot record the sessions it inherited: {e}");
        }
    }

    /// Stop the sandbox's VM and record it deleted. A `lost` one's node does not answer: it is
    /// recorded deleted at once, and its VM goes if that node comes back (`reap_disowned`).
    pub(super) async fn run_delete(&self, op: Operation, lost: bool) {
        let id = op.sandbox_id.clone();
        let _ = self.store.set_operation_state(&op.id, OperationState::Running).await;
        let stopped = match lost {
            true => Ok(()),
            false => self.nodes.delete(&id, None).await,
        };
        match stopped {
            Ok(()) => {
                self.set_state(&id, SandboxState::Deleted).await;
                let _ = self.store.set_paused_remaining(&id, None).await;
                tracing::info!(sandbox = %id, "deleted");
                if let Ok(Some(parked)) = self.store.sandbox_parked(&id).await {
                    self.delete_parked(&id, &parked.image).await;
                }
                self.finish(&op, None).await;
            }
            Err(e) => {
                tracing::warn!(sandbox = %id, "delete failed: {e}");
                self.set_state(&id, SandboxState::Failed).await;
                self.finish(&op, Some((&CoreError::from(e)).into())).await;
            }
        }
    }

    /// Remove the image sandbox `id` ended parked with from object storage, then its record of
    /// it; one that stays (no node could) is tried again by the reaper (`sweep_parked`).
    pub(super) async fn delete_parked(&self, id: &str, image: &str) {
        match self.nodes.delete_parked(image).await {
            Ok(()) => {
                tracing::info!(sandbox = %id, %image, "its parked image is deleted");
                let _ = self.store.set_sandbox_parked(id, None).await;
            }
            Err(e) => tracing::warn!(sandbox = %id, %image, "its parked image stays in object storage for now: {e}"),
        }
    }

    /// Save the image, digest it (snapshots, while the sandbox runs on; forks need none), then
    /// record its size: from then on it holds that instead of its reserve. A save that fails
    /// leaves neither image nor record; one whose record went meanwhile (its tenant was
    /// deleted) leaves no image.
    pub(super) async fn run_snapshot(&self, op: Operation, mut snapshot: crate::records::SnapshotRecord) {
        let _ = self.store.set_operation_state(&op.id, OperationState::Running).await;
        let saved = async {
            snapshot.bytes = self.nodes.save_image(&op.sandbox_id, &snapshot.id).await?;
            if snapshot.kind == crate::records::SnapshotKind::Snapshot {
                snapshot.digest = Some(self.nodes.digest_image(&snapshot.id).await?);
                // Into object storage too, where its node has one: it then outlives the node.
                snapshot.shared = match self.nodes.share_image(&snapshot.id).await {
                    Ok(shared) => Some(shared.fingerprint),
                    Err(crate::nodes::NodeError::Unsupported(_)) => None,
                    Err(e) => {
                        tracing::warn!(snapshot = %snapshot.id, "stays on its node alone: cannot put it in object storage: {e}");
                        None
                    }
                };
            }
            if !self.store.snapshot_saved(&snapshot).await? {
                return Err(CoreError::not_found(crate::error::Kind::Snapshot, &snapshot.id));
            }
            Ok::<_, CoreError>(())
        }
        .await;
        match saved {
            Ok(()) => self.finish(&op, None).await,
            Err(e) => {
                tracing::warn!(sandbox = %op.sandbox_id, "snapshot failed: {e}");
                let _ = self.store.delete_snapshot(&snapshot.tenant_id, &snapshot.id).await;
                let _ = self.nodes.delete_image(&snapshot.id).await;
                self.finish(&op, Some((&e).into())).await
            }
        }
    }

    /// Pause, suspend or resume (`op.kind`), then record what the VM is. A suspend on a
    /// draining node that can park it parks it in object storage instead, for another node to
    /// resume ([`Engine::run_unpark`]).
    pub(super) async fn run_change(&self, op: Operation) {
        let id = op.sandbox_id.clone();
        let _ = self.store.set_operation_state(&op.id, OperationState::Running).await;
        let result = match op.kind {
            OperationKind::Pause => self.nodes.pause(&id).await.map(|()| None),
            OperationKind::Suspend => match self.parking_on(&id).await {
                Some(parked) => self.park(&id, parked).await.map(|()| Some(VmState::Suspended)),
                None => self.nodes.suspend(&id).await.map(|_| None),
            },
            _ => self.nodes.resume(&id).await.map(|()| None),
        };
        match result {
            Ok(state) => {
                self.settle_held(&id, state.unwrap_or_else(|| self.nodes.vm_state(&id)))
                    .await;
                self.finish(&op, None).await;
            }
            Err(e) => {
                // A resume that did not start the VM leaves it suspended; a failed suspend
                // leaves it running (or, if its VM died, the reaper fails it).
                if let VmState::Suspended | VmState::Running | VmState::Paused = self.nodes.vm_state(&id) {
                    self.settle_held(&id, self.nodes.vm_state(&id)).await;
                }
                self.finish(&op, Some((&CoreError::from(e)).into())).await
            }
        }
    }

    /// Where sandbox `id` would be parked if its node drains and can park it: a new image
    /// id, the node's fingerprint, and whether it is to run again (it runs now).
    async fn parking_on(&self, id: &str) -> Option<crate::records::ParkedImage> {
        let row = self.store.sandbox_by_id(id).await.ok()??;
        let node = self
            .nodes
            .members()
            .into_iter()
            .find(|m| m.name == row.node && m.draining && m.parks)?;
        Some(crate::records::ParkedImage {
            image: format!("park-{}", airlock_runtime::datadir::random_hex(12)),
            fingerprint: node.fingerprint,
            resume: row.state == SandboxState::Running,
        })
    }

    /// Park sandbox `id` in object storage as `parked`, its VM ended. The image is recorded
    /// first, so a replica that takes the operation over and finds the VM gone knows where it
    /// went.
    async fn park(&self, id: &str, mut parked: crate::records::ParkedImage) -> Result<(), crate::nodes::NodeError> {
        let store_failed = |e: crate::store::StoreError| crate::nodes::NodeError::Failed(Box::new(e));
        self.store
            .set_sandbox_parked(id, Some(&parked))
            .await
            .map_err(store_failed)?;
        match self.nodes.park(id, &parked.image).await {
            Ok(p) => {
                tracing::info!(sandbox = %id, image = %parked.image, bytes = p.bytes, "parked in object storage");
                if p.fingerprint != parked.fingerprint {
                    parked.fingerprint = p.fingerprint;
                    self.store
                        .set_sandbox_parked(id, Some(&parked))
                        .await
                        .map_err(store_failed)?;
                }
                Ok(())
            }
            Err(e) => match self.nodes.vm_state_now(id).await {
                // The node ends the VM only once its image is pushed: parked, the answer lost.
                Some(VmState::Gone) => {
                    tracing::info!(sandbox = %id, image = %parked.image, "parked in object storage (its node's answer was lost: {e})");
                    Ok(())
                }
                // Not parked: its VM runs on where it was.
                Some(_) => {
                    let _ = self.store.set_sandbox_parked(id, None).await;
                    Err(e)
                }
                // Its node cannot say: the record stays, and the reaper settles it by whether
                // the node comes back with the VM (`lose_dead_nodes`, `recover_sandbox`).
                None => Err(e),
            },
        }
    }

    /// Resume a parked sandbox: its image started on `row.node` (admitted there already), or
    /// on the next of `fallbacks` while a node refuses it. One that starts nowhere stays
    /// suspended and parked.
    pub(super) async fn run_unpark(
        &self,
        op: Operation,
        row: SandboxRecord,
        parked: crate::records::ParkedImage,
        fallbacks: Vec<(String, NodeBudget)>,
    ) {
        let _ = self.store.set_operation_state(&op.id, OperationState::Running).await;
        let vm = crate::nodes::VmRequest {
            id: row.id.clone(),
            template: row.template.clone(),
            resources: row.resources,
            image_id: Some(parked.image.clone()),
            env: row.env.clone(),
            egress: row.egress.clone(),
            node: row.node.clone(),
            moved_from: Some(parked.fingerprint.clone()),
            keep_image: false,
            volumes: Vec::new(),
        };
        match self.create_placed(vm, fallbacks).await {
            Ok(booted) => {
                let _ = self.store.set_sandbox_boot(&row.id, &booted).await;
                let _ = self.store.set_sandbox_parked(&row.id, None).await;
                tracing::info!(sandbox = %row.id, image = %parked.image, "resumed from object storage");
                self.settle_held(&row.id, VmState::Running).await;
                self.finish(&op, None).await;
            }
            Err(e) => {
                tracing::warn!(sandbox = %row.id, "resume from object storage failed: {e}");
                self.transition(&row.id, &[SandboxState::Resuming], SandboxState::Suspended)
                    .await;
                self.finish(&op, Some((&e).into())).await;
            }
        }
    }

    /// Record the state a sandbox's VM is in now (running, paused, suspended), and stop (or
    /// restart) its clock: a held sandbox keeps the lifetime it had left, and expires only after
    /// `MAX_PAUSE` in memory or `MAX_SUSPEND` on disk. A sandbox being deleted stays so.
    pub(super) async fn settle_held(&self, id: &str, vm: VmState) {
        let live = [
            SandboxState::Running,
            SandboxState::Paused,
            SandboxState::Suspended,
            SandboxState::Resuming,
        ];
        let (to, hold_for) = match vm {
            VmState::Running => (SandboxState::Running, None),
            VmState::Paused => (SandboxState::Paused, Some(MAX_PAUSE)),
            VmState::Suspended => (SandboxState::Suspended, Some(MAX_SUSPEND)),
            VmState::Gone => return,
        };
        let Ok(Some(row)) = self.store.sandbox_by_id(id).await else {
            return;
        };
        if row.state == to || !self.transition(id, &live, to).await {
            return;
        }
        let now = now_ms();
        let result = async {
            if let Some(hold_for) = hold_for {
                // The lifetime left is kept from when it first stopped running.
                if self.store.paused_remaining(id).await?.is_none() {
                    let remaining = (row.expires_at_ms - now).max(0);
                    self.store.set_paused_remaining(id, Some(remaining)).await?;
                }
                self.set_expiry(&row, now + hold_for.as_millis() as i64).await?;
                Ok(())
            } else {
                if let Some(remaining) = self.store.paused_remaining(id).await? {
                    self.set_expiry(&row, now + remaining).await?;
                    self.store.set_paused_remaining(id, None).await?;
                }
                Ok::<_, crate::store::StoreError>(())
            }
        }
        .await;
        if let Err(e) = result {
            tracing::error!(sandbox = %id, "cannot record the pause clock: {e}");
        }
    }
}
