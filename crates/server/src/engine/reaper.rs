//! The reaper: expired sandboxes deleted (or suspended, `on_timeout: suspend`), VMs that exited on
//! their own failed, every tick, by one replica at a time; operations whose lease lapsed taken
//! over and leases renewed by every replica.

use super::*;

/// The duty ([`crate::store::OperationStore::lead`]) of reaping expired sandboxes and sweeping
/// for gone VMs and draining nodes.
const REAPER_DUTY: &str = "reaper";

impl Engine {
    /// A sandbox whose VM exited on its own is failed (its quota slot is free again).
    pub(super) async fn vm_exited(&self, id: &str) {
        let live = [SandboxState::Running, SandboxState::Paused];
        if self.transition(id, &live, SandboxState::Failed).await {
            tracing::warn!(sandbox = %id, "its VM exited on its own; marking it failed");
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

    /// A sandbox whose timeout passed: suspended if it asked for that (`on_timeout: suspend`,
    /// E2B's autoPause) and runs, else deleted. A suspend that fails deletes it after all.
    pub(super) async fn timed_out(&self, row: SandboxRecord) {
        let suspend = row.lifecycle.on_timeout == crate::model::OnTimeout::Suspend
            && matches!(row.state, SandboxState::Running | SandboxState::Paused);
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
                    if leads {
                        let _ = engine.sweep().await;
                        if let Err(e) = engine.drain_sweep().await {
                            tracing::warn!("cannot take sandboxes off draining nodes: {e}");
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
