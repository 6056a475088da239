//! The operation engine: every slow lifecycle change runs here, never in a request handler.
//! Handlers record an operation and return it; the engine carries it out and records the end.
//! On start it reconciles the store with what really runs and finishes or fails every
//! operation a previous process left open.

use crate::error::{ApiError, ErrorBody};
use crate::model::{Operation, OperationKind, OperationState, SandboxState};
use crate::store::{now_ms, rfc3339, SandboxRow, Store};
use airlock_runtime::{CreateSandbox, Resources, Runtime, RuntimeError};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How long a sandbox may stay paused in memory before it is deleted like an expired one.
pub const MAX_PAUSE: Duration = Duration::from_secs(24 * 3600);

#[derive(Clone)]
pub struct Engine {
    store: Arc<dyn Store>,
    runtime: Runtime,
    /// One lifecycle change at a time per sandbox (a delete waits for its create).
    locks: Arc<Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>>,
}

pub fn new_operation(kind: OperationKind, sandbox_id: &str) -> Operation {
    Operation {
        id: format!("op_{}", airlock_runtime::datadir::random_hex(10)),
        kind,
        state: OperationState::Pending,
        sandbox_id: sandbox_id.into(),
        error: None,
        created_at: rfc3339(now_ms()),
        finished_at: None,
    }
}

impl Engine {
    pub fn new(store: Arc<dyn Store>, runtime: Runtime) -> Self {
        Self {
            store,
            runtime,
            locks: Arc::default(),
        }
    }

    fn lock_for(&self, id: &str) -> Arc<tokio::sync::Mutex<()>> {
        self.locks.lock().unwrap().entry(id.to_string()).or_default().clone()
    }

    /// Carry out a recorded create; the handle lets a synchronous door (E2B) wait for it.
    pub fn start_create(&self, op: Operation, row: SandboxRow) -> tokio::task::JoinHandle<()> {
        let engine = self.clone();
        tokio::spawn(async move { engine.run_create(op, row).await })
    }

    async fn run_create(&self, op: Operation, row: SandboxRow) {
        let lock = self.lock_for(&row.id);
        let _guard = lock.lock().await;
        let _ = self.store.set_operation_state(&op.id, OperationState::Running).await;
        let req = CreateSandbox {
            id: Some(row.id.clone()),
            template: row.template.clone(),
            resources: Resources {
                vcpu: row.resources.vcpu,
                memory_mib: row.resources.memory_mib,
                disk_mib: row.resources.disk_mib,
            },
        };
        match self.runtime.create(req).await {
            Ok(sb) => {
                let _ = self
                    .store
                    .set_sandbox_boot(&row.id, &sb.record.template_digest, &sb.record.accel.to_string())
                    .await;
                let _ = self.store.set_sandbox_state(&row.id, SandboxState::Running).await;
                let _ = self
                    .store
                    .finish_operation(&op.id, OperationState::Succeeded, None)
                    .await;
                tracing::info!(sandbox = %row.id, "created");
            }
            Err(e) => {
                tracing::warn!(sandbox = %row.id, "create failed: {e}");
                let body = ApiError::from(e).body();
                let _ = self.store.set_sandbox_state(&row.id, SandboxState::Failed).await;
                let _ = self
                    .store
                    .finish_operation(&op.id, OperationState::Failed, Some(&body))
                    .await;
            }
        }
    }

    /// Record a delete (or return the one already under way) and carry it out.
    pub async fn request_delete(&self, row: &SandboxRow) -> Result<Operation, ApiError> {
        if let Some(open) = self
            .store
            .open_delete_operation(&row.id)
            .await?
            .filter(|o| !o.state.is_final())
        {
            return Ok(open);
        }
        let op = new_operation(OperationKind::Delete, &row.id);
        self.store.insert_operation(&row.tenant_id, &op).await?;
        self.store.set_sandbox_state(&row.id, SandboxState::Deleting).await?;
        let engine = self.clone();
        let (op2, id) = (op.clone(), row.id.clone());
        tokio::spawn(async move { engine.run_delete(op2, id).await });
        Ok(op)
    }

    /// Pause (freeze in memory) or resume a sandbox; waits for the change, as both are quick.
    pub async fn pause_or_resume(&self, row: &SandboxRow, pause: bool) -> Result<Operation, ApiError> {
        let kind = if pause {
            OperationKind::Pause
        } else {
            OperationKind::Resume
        };
        let op = new_operation(kind, &row.id);
        self.store.insert_operation(&row.tenant_id, &op).await?;
        let engine = self.clone();
        let (op2, id) = (op.clone(), row.id.clone());
        let done = tokio::spawn(async move {
            let lock = engine.lock_for(&id);
            let _guard = lock.lock().await;
            let _ = engine.store.set_operation_state(&op2.id, OperationState::Running).await;
            let result = if pause {
                engine.runtime.pause(&id).await
            } else {
                engine.runtime.resume(&id).await
            };
            match result {
                Ok(()) => {
                    let state = if pause {
                        SandboxState::Paused
                    } else {
                        SandboxState::Running
                    };
                    let _ = engine.store.set_sandbox_state(&id, state).await;
                    let _ = engine.stop_or_restart_clock(&id, pause).await;
                    let _ = engine
                        .store
                        .finish_operation(&op2.id, OperationState::Succeeded, None)
                        .await;
                }
                Err(e) => {
                    let body = ApiError::from(e).body();
                    let _ = engine
                        .store
                        .finish_operation(&op2.id, OperationState::Failed, Some(&body))
                        .await;
                }
            }
        });
        let _ = done.await;
        Ok(self.store.get_operation(&row.tenant_id, &op.id).await?.unwrap_or(op))
    }

    /// A paused sandbox does not spend its timeout: pausing keeps what is left and sets the
    /// expiry to the pause limit (an in-memory pause holds the VM's RAM, so it cannot last
    /// forever); resuming restores what was left.
    async fn stop_or_restart_clock(&self, id: &str, pause: bool) -> Result<(), crate::store::StoreError> {
        let now = now_ms();
        if pause {
            let Some(row) = self.store.sandbox_by_id(id).await? else {
                return Ok(());
            };
            let remaining = (row.expires_at_ms - now).max(0);
            self.store.set_paused_remaining(id, Some(remaining)).await?;
            self.store
                .set_sandbox_expiry(id, now + MAX_PAUSE.as_millis() as i64)
                .await
        } else if let Some(remaining) = self.store.paused_remaining(id).await? {
            self.store.set_sandbox_expiry(id, now + remaining).await?;
            self.store.set_paused_remaining(id, None).await
        } else {
            Ok(())
        }
    }

    /// Delete and wait until it is done (the E2B door answers kill synchronously).
    pub async fn delete_and_wait(&self, row: &SandboxRow) -> Result<(), ApiError> {
        let op = self.request_delete(row).await?;
        let lock = self.lock_for(&row.id);
        loop {
            // The delete holds the sandbox's lock while it runs; taking it means it has finished.
            drop(lock.lock().await);
            match self.store.get_operation(&row.tenant_id, &op.id).await? {
                Some(o) if o.state.is_final() => return Ok(()),
                _ => tokio::time::sleep(Duration::from_millis(20)).await,
            }
        }
    }

    async fn run_delete(&self, op: Operation, id: String) {
        let lock = self.lock_for(&id);
        let _guard = lock.lock().await;
        let _ = self.store.set_operation_state(&op.id, OperationState::Running).await;
        let result = match self.runtime.delete(&id).await {
            Ok(()) | Err(RuntimeError::UnknownSandbox(_)) => Ok(()),
            Err(e) => Err(e),
        };
        // The VM and its disk are gone either way unless stop itself failed.
        match result {
            Ok(()) => {
                let _ = self.store.set_sandbox_state(&id, SandboxState::Deleted).await;
                let _ = self
                    .store
                    .finish_operation(&op.id, OperationState::Succeeded, None)
                    .await;
                tracing::info!(sandbox = %id, "deleted");
            }
            Err(e) => {
                let body = ApiError::from(e).body();
                let _ = self.store.set_sandbox_state(&id, SandboxState::Failed).await;
                let _ = self
                    .store
                    .finish_operation(&op.id, OperationState::Failed, Some(&body))
                    .await;
            }
        }
        self.locks.lock().unwrap().remove(&id);
    }

    /// After a (possibly unclean) restart: make the store agree with the VMs that exist.
    pub async fn recover(&self) -> Result<(), ApiError> {
        for op in self.store.unfinished_operations().await? {
            match op.kind {
                OperationKind::Create if self.runtime.get(&op.sandbox_id).is_ok() => {
                    let sb = self.runtime.get(&op.sandbox_id)?;
                    self.store
                        .set_sandbox_boot(&op.sandbox_id, &sb.record.template_digest, &sb.record.accel.to_string())
                        .await?;
                    self.store
                        .set_sandbox_state(&op.sandbox_id, SandboxState::Running)
                        .await?;
                    self.store
                        .finish_operation(&op.id, OperationState::Succeeded, None)
                        .await?;
                    tracing::info!(op = %op.id, "create finished before the restart: succeeded");
                }
                OperationKind::Delete => {
                    let engine = self.clone();
                    tokio::spawn(async move { engine.run_delete(op.clone(), op.sandbox_id.clone()).await });
                }
                _ => {
                    let body = ErrorBody {
                        code: "interrupted".into(),
                        message: "the server stopped while this operation ran; nothing of it is left running".into(),
                    };
                    self.store
                        .set_sandbox_state(&op.sandbox_id, SandboxState::Failed)
                        .await?;
                    self.store
                        .finish_operation(&op.id, OperationState::Failed, Some(&body))
                        .await?;
                    tracing::warn!(op = %op.id, "interrupted by a restart: failed");
                }
            }
        }
        let live = self.store.live_sandboxes().await?;
        for row in &live {
            if matches!(row.state, SandboxState::Running | SandboxState::Paused) && self.runtime.get(&row.id).is_err() {
                tracing::warn!(sandbox = %row.id, "its VM is gone; marking it failed");
                self.store.set_sandbox_state(&row.id, SandboxState::Failed).await?;
            }
        }
        // VMs the store does not know as live are not anyone's: remove them.
        for sb in self.runtime.list() {
            let known = self.store.sandbox_by_id(sb.id()).await?;
            if !known.is_some_and(|r| {
                matches!(
                    r.state,
                    SandboxState::Running | SandboxState::Paused | SandboxState::Creating | SandboxState::Deleting
                )
            }) {
                tracing::warn!(sandbox = %sb.id(), "VM without a live record; deleting it");
                let _ = self.runtime.delete(sb.id()).await;
            }
        }
        Ok(())
    }

    /// Delete sandboxes whose timeout passed; also notice VMs that died on their own.
    pub fn spawn_reaper(&self) {
        let engine = self.clone();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_millis(500)).await;
                if let Ok(expired) = engine.store.expired_sandboxes(now_ms()).await {
                    for row in expired {
                        tracing::info!(sandbox = %row.id, "timeout passed; deleting");
                        let _ = engine.request_delete(&row).await;
                    }
                }
                if let Ok(live) = engine.store.live_sandboxes().await {
                    for row in live
                        .iter()
                        .filter(|r| matches!(r.state, SandboxState::Running | SandboxState::Paused))
                    {
                        let locked = engine.locks.lock().unwrap().contains_key(&row.id);
                        if !locked && engine.runtime.get(&row.id).is_err() {
                            tracing::warn!(sandbox = %row.id, "VM exited on its own; marking it failed");
                            let _ = engine.store.set_sandbox_state(&row.id, SandboxState::Failed).await;
                        }
                    }
                }
            }
        });
    }
}
