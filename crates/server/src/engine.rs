//! The operation engine: every lifecycle change (create, delete, pause, suspend, resume) is submitted
//! here as an `Action`, recorded as an `Operation`, and carried out in the background; callers
//! `wait` for it when their door answers synchronously. On start, `recover` makes the store
//! agree with the VMs that really exist; the reaper deletes expired sandboxes and marks those
//! whose VM exited on its own as failed.

use crate::error::{CoreError, CoreResult};
use crate::model::ErrorBody;
use crate::model::{Operation, OperationKind, OperationState, Quota, SandboxState};
use crate::nodes::{Nodes, VmState};
use crate::records::{now_ms, rfc3339, SandboxRecord};
use crate::store::{CreateRecorded, NodeBudget, Store};
use std::sync::Arc;
use std::time::Duration;

/// How long a sandbox may stay paused in memory before it is deleted like an expired one.
pub const MAX_PAUSE: Duration = Duration::from_secs(24 * 3600);
/// How long a sandbox may stay suspended (on disk) before it is deleted like an expired one.
pub const MAX_SUSPEND: Duration = Duration::from_secs(30 * 24 * 3600);
/// How often the reaper looks for expired sandboxes.
const REAP_EVERY: Duration = Duration::from_millis(500);
/// How often it also sweeps for VMs that vanished without an exit notice (missed while busy).
const SWEEP_EVERY_TICKS: u32 = 4;
/// The longest a caller waits for an operation (a boot under TCG takes seconds; a stuck one
/// must not hold a request forever).
pub const WAIT_LIMIT: Duration = Duration::from_secs(300);

/// A lifecycle change to carry out.
#[derive(Debug, Clone)]
pub enum Action {
    /// Record a new sandbox (if the tenant stays within its `quota` and the node's live
    /// sandboxes plus this one fit in `budget`) and boot it.
    Create {
        sandbox: SandboxRecord,
        idempotency_key: Option<String>,
        quota: Quota,
        budget: NodeBudget,
    },
    Delete {
        sandbox: SandboxRecord,
    },
    Pause {
        sandbox: SandboxRecord,
    },
    /// Save the sandbox to disk and end its VM.
    Suspend {
        sandbox: SandboxRecord,
    },
    /// Save a running sandbox as `snapshot` while it runs on. Recorded at once as being saved
    /// if `reserve_mib` fits the tenant's disk `quota` and the node's disk `budget` (like a
    /// create's admission; it holds that much until the save ends, then its size).
    Snapshot {
        sandbox: SandboxRecord,
        snapshot: crate::records::SnapshotRecord,
        reserve_mib: u64,
        quota: Quota,
        budget: NodeBudget,
    },
    /// Run a paused sandbox again, or start a suspended one from its saved state: that needs its
    /// place, vcpu and memory again, so it is admitted under `quota` and `budget` like a create.
    Resume {
        sandbox: SandboxRecord,
        quota: Quota,
        budget: NodeBudget,
    },
}

#[derive(Debug, Clone)]
pub struct Submitted {
    pub operation: Operation,
    /// False when an earlier operation answered instead (idempotent create, delete under way).
    pub new: bool,
}

/// Sandboxes recovered at once after a restart.
const RECOVER_AT_ONCE: usize = 8;
/// The longest a request waits for its sandbox's recovery after a restart before it is
/// answered `unavailable` (a node re-attaches a VM within its agent's 10 s connect timeout).
pub const RECOVERY_WAIT: Duration = Duration::from_secs(20);

/// What a restart still has to settle: the sandboxes whose record and VM are not yet checked
/// against each other. Requests about one of them wait for it (see [`Engine::recovered`]).
struct Recovery {
    /// How long a request waits for its sandbox (`RECOVERY_WAIT` unless a test says otherwise).
    wait: Duration,
    /// Sandbox id -> its tenant's id.
    pending: std::sync::Mutex<std::collections::HashMap<String, String>>,
    /// Whether anything is left at all (the VMs no record claims are swept last).
    under_way: std::sync::atomic::AtomicBool,
}

#[derive(Clone)]
pub struct Engine {
    store: Arc<dyn Store>,
    nodes: Arc<dyn Nodes>,
    recovery: Arc<Recovery>,
    /// Bumped whenever a sandbox's recovery (or the whole recovery) finishes.
    recovered: Arc<tokio::sync::watch::Sender<u64>>,
    /// Bumped whenever an operation finishes, to wake `wait`ers.
    finished: Arc<tokio::sync::watch::Sender<u64>>,
    /// The id of every sandbox that reached `deleted` or `failed`, for state kept elsewhere
    /// about a sandbox (a door's watchers) to go with it. See [`Engine::ended`].
    ended: tokio::sync::broadcast::Sender<String>,
    /// When this engine was made: images recorded before it and still unfinished were cut
    /// short by a restart.
    started_ms: i64,
}

fn new_operation(kind: OperationKind, sandbox_id: &str) -> Operation {
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

impl From<&CoreError> for ErrorBody {
    fn from(e: &CoreError) -> Self {
        ErrorBody {
            code: e.code().code.into(),
            message: e.to_string(),
        }
    }
}

fn interrupted() -> ErrorBody {
    ErrorBody {
        code: "interrupted".into(),
        message: "the server stopped while this operation ran; nothing of it is left running".into(),
    }
}

impl Engine {
    pub fn new(store: Arc<dyn Store>, nodes: Arc<dyn Nodes>) -> Self {
        Self {
            store,
            nodes,
            recovery: Arc::new(Recovery {
                wait: RECOVERY_WAIT,
                pending: Default::default(),
                under_way: Default::default(),
            }),
            recovered: Arc::new(tokio::sync::watch::channel(0).0),
            finished: Arc::new(tokio::sync::watch::channel(0).0),
            ended: tokio::sync::broadcast::channel(256).0,
            started_ms: now_ms(),
        }
    }

    /// The same engine, whose requests wait at most `wait` for a sandbox's recovery (before
    /// any clone is taken).
    pub fn with_recovery_wait(mut self, wait: Duration) -> Self {
        if let Some(r) = Arc::get_mut(&mut self.recovery) {
            r.wait = wait;
        }
        self
    }

    /// Sandboxes as they end (deleted or failed). A receiver that lags misses ids: it should
    /// then check what it holds against the store.
    pub fn ended(&self) -> tokio::sync::broadcast::Receiver<String> {
        self.ended.subscribe()
    }

    /// For as long as `owner` lives (state a door or the core keeps per sandbox): `on_end` for
    /// each sandbox that ends, and `sweep` every `period` (the first after `first`) and whenever
    /// announcements were missed (the channel lagged). One task; it ends with `owner`.
    pub fn follow_ended<T, F>(
        &self,
        owner: std::sync::Weak<T>,
        first: Duration,
        period: Duration,
        on_end: impl Fn(&T, &str) + Send + 'static,
        sweep: impl Fn(Arc<T>) -> F + Send + 'static,
    ) where
        T: Send + Sync + 'static,
        F: std::future::Future<Output = ()> + Send + 'static,
    {
        use tokio::sync::broadcast::error::RecvError;
        let mut ended = self.ended();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + first, period);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                let news = tokio::select! {
                    r = ended.recv() => Some(r),
                    _ = tick.tick() => None,
                };
                let Some(owner) = owner.upgrade() else { return };
                match news {
                    Some(Ok(id)) => on_end(&owner, &id),
                    Some(Err(RecvError::Closed)) => return,
                    Some(Err(RecvError::Lagged(_))) | None => sweep(owner).await,
                }
            }
        });
    }

    fn announce(&self, id: &str, state: SandboxState) {
        if matches!(state, SandboxState::Deleted | SandboxState::Failed) {
            let _ = self.ended.send(id.to_string());
        }
    }

    /// Record `action` as an operation and start it.
    pub async fn submit(&self, action: Action) -> CoreResult<Submitted> {
        match action {
            Action::Create {
                sandbox,
                idempotency_key,
                quota,
                budget,
            } => {
                let op = new_operation(OperationKind::Create, &sandbox.id);
                match self
                    .store
                    .insert_create_within(&sandbox, &op, idempotency_key.as_deref(), &quota, &budget)
                    .await?
                {
                    CreateRecorded::Existing(prior) => Ok(Submitted {
                        operation: prior,
                        new: false,
                    }),
                    CreateRecorded::New(op) => {
                        let engine = self.clone();
                        let run = op.clone();
                        tokio::spawn(async move { engine.run_create(run, sandbox).await });
                        Ok(Submitted {
                            operation: op,
                            new: true,
                        })
                    }
                }
            }
            Action::Delete { sandbox } => {
                if let Some(open) = self
                    .store
                    .open_delete_operation(&sandbox.id)
                    .await?
                    .filter(|o| !o.state.is_final())
                {
                    return Ok(Submitted {
                        operation: open,
                        new: false,
                    });
                }
                let op = new_operation(OperationKind::Delete, &sandbox.id);
                self.store.insert_operation(&sandbox.tenant_id, &op).await?;
                self.store
                    .set_sandbox_state(&sandbox.id, SandboxState::Deleting)
                    .await?;
                let engine = self.clone();
                let run = op.clone();
                tokio::spawn(async move { engine.run_delete(run).await });
                Ok(Submitted {
                    operation: op,
                    new: true,
                })
            }
            Action::Pause { sandbox } => self.submit_change(sandbox, OperationKind::Pause).await,
            Action::Suspend { sandbox } => self.submit_change(sandbox, OperationKind::Suspend).await,
            Action::Snapshot {
                sandbox,
                snapshot,
                reserve_mib,
                quota,
                budget,
            } => {
                use crate::store::SnapshotAdmission;
                match self
                    .store
                    .admit_snapshot(&snapshot, reserve_mib, &quota, &budget)
                    .await?
                {
                    SnapshotAdmission::Admitted => {}
                    SnapshotAdmission::NameTaken => {
                        return Err(crate::error::Conflict::NameTaken(snapshot.name.clone().unwrap_or_default()).into())
                    }
                    SnapshotAdmission::NoTenant => {
                        return Err(CoreError::not_found(crate::error::Kind::Tenant, &snapshot.tenant_id))
                    }
                }
                let op = new_operation(OperationKind::Snapshot, &sandbox.id);
                if let Err(e) = self.store.insert_operation(&sandbox.tenant_id, &op).await {
                    let _ = self.store.delete_snapshot(&snapshot.tenant_id, &snapshot.id).await;
                    return Err(e.into());
                }
                let engine = self.clone();
                let run = op.clone();
                tokio::spawn(async move { engine.run_snapshot(run, snapshot).await });
                Ok(Submitted {
                    operation: op,
                    new: true,
                })
            }
            Action::Resume { sandbox, quota, budget } => {
                if sandbox.state == SandboxState::Suspended
                    && !self.store.admit_resume(&sandbox.id, &quota, &budget).await?
                {
                    return Err(CoreError::InvalidState {
                        id: sandbox.id.clone(),
                        state: self
                            .store
                            .sandbox_by_id(&sandbox.id)
                            .await?
                            .map_or(SandboxState::Deleted, |r| r.state),
                        need: "only a suspended or paused sandbox can be resumed".into(),
                    });
                }
                if sandbox.state == SandboxState::Suspended {
                    self.announce(&sandbox.id, SandboxState::Resuming);
                }
                self.submit_change(sandbox, OperationKind::Resume).await
            }
        }
    }

    async fn submit_change(&self, sandbox: SandboxRecord, kind: OperationKind) -> CoreResult<Submitted> {
        let op = new_operation(kind, &sandbox.id);
        self.store.insert_operation(&sandbox.tenant_id, &op).await?;
        let engine = self.clone();
        let run = op.clone();
        tokio::spawn(async move { engine.run_change(run).await });
        Ok(Submitted {
            operation: op,
            new: true,
        })
    }

    /// Wait until `op` has finished (at most `WAIT_LIMIT`); returns its final record.
    pub async fn wait(&self, op: &Operation) -> CoreResult<Operation> {
        let mut finished = self.finished.subscribe();
        let deadline = tokio::time::Instant::now() + WAIT_LIMIT;
        loop {
            if tokio::time::Instant::now() >= deadline {
                return Err(CoreError::Unavailable(format!(
                    "operation {} is still running after {}; poll GET /v1/operations/{}",
                    op.id,
                    humantime::format_duration(WAIT_LIMIT),
                    op.id
                )));
            }
            if let Some(o) = self.store.operation_by_id(&op.id).await? {
                if o.state.is_final() {
                    return Ok(o);
                }
            }
            // Woken by any finish; the timeout covers operations another process finishes.
            let _ = tokio::time::timeout(Duration::from_secs(1), finished.changed()).await;
        }
    }

    async fn finish(&self, op: &Operation, error: Option<ErrorBody>) {
        let state = if error.is_none() {
            OperationState::Succeeded
        } else {
            OperationState::Failed
        };
        if let Err(e) = self.store.finish_operation(&op.id, state, error.as_ref()).await {
            tracing::error!(op = %op.id, "cannot record the end of the operation: {e}");
        }
        self.finished.send_modify(|n| *n += 1);
    }

    async fn set_state(&self, id: &str, state: SandboxState) {
        if let Err(e) = self.store.set_sandbox_state(id, state).await {
            tracing::error!(sandbox = %id, "cannot record state {}: {e}", state.as_str());
        }
        self.announce(id, state);
    }

    /// Move a sandbox on only from the states a change may leave; false when something else
    /// (a delete) got there first.
    async fn transition(&self, id: &str, from: &[SandboxState], to: SandboxState) -> bool {
        match self.store.transition_sandbox(id, from, to).await {
            Ok(moved) => {
                if moved {
                    self.announce(id, to);
                }
                moved
            }
            Err(e) => {
                tracing::error!(sandbox = %id, "cannot record state {}: {e}", to.as_str());
                false
            }
        }
    }

    async fn run_create(&self, op: Operation, row: SandboxRecord) {
        let _ = self.store.set_operation_state(&op.id, OperationState::Running).await;
        match self.nodes.create(&row).await {
            Ok(booted) => {
                let _ = self.store.set_sandbox_boot(&row.id, &booted).await;
                if let Some(image) = &row.image_id {
                    self.inherit_sessions(&row, image).await;
                }
                // The lifetime asked for starts when the sandbox runs: a slow boot (a loaded
                // host, TCG) is not charged to it. Set while still `creating`, which the
                // reaper leaves alone.
                let lifetime = row.expires_at_ms - row.created_at_ms;
                let _ = self.store.set_sandbox_expiry(&row.id, now_ms() + lifetime).await;
                if self
                    .transition(&row.id, &[SandboxState::Creating], SandboxState::Running)
                    .await
                {
                    tracing::info!(sandbox = %row.id, "created");
                } else {
                    // A delete was submitted during the boot, and may have found no VM yet: the
                    // VM just booted is nobody's, so it goes (deleting twice is harmless).
                    tracing::info!(sandbox = %row.id, "deleted while it booted; stopping its VM");
                    if let Err(e) = self.nodes.delete(&row.id).await {
                        tracing::warn!(sandbox = %row.id, "cannot stop the VM of a deleted sandbox: {e}");
                    }
                }
                self.finish(&op, None).await;
            }
            Err(e) => {
                tracing::warn!(sandbox = %row.id, "create failed: {e}");
                self.transition(&row.id, &[SandboxState::Creating], SandboxState::Failed)
                    .await;
                self.finish(&op, Some((&CoreError::from(e)).into())).await;
            }
        }
    }

    /// A sandbox made from a snapshot runs the processes its source ran: their sessions (as
    /// the source has them now) become its own, so both doors find them by pid and tag.
    async fn inherit_sessions(&self, row: &SandboxRecord, image: &str) {
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

    async fn run_delete(&self, op: Operation) {
        let id = op.sandbox_id.clone();
        let _ = self.store.set_operation_state(&op.id, OperationState::Running).await;
        match self.nodes.delete(&id).await {
            Ok(()) => {
                self.set_state(&id, SandboxState::Deleted).await;
                let _ = self.store.set_paused_remaining(&id, None).await;
                tracing::info!(sandbox = %id, "deleted");
                self.finish(&op, None).await;
            }
            Err(e) => {
                tracing::warn!(sandbox = %id, "delete failed: {e}");
                self.set_state(&id, SandboxState::Failed).await;
                self.finish(&op, Some((&CoreError::from(e)).into())).await;
            }
        }
    }

    /// Save the image, digest it (snapshots, while the sandbox runs on; forks need none), then
    /// record its size: from then on it holds that instead of its reserve. A save that fails
    /// leaves neither image nor record; one whose record went meanwhile (its tenant was
    /// deleted) leaves no image.
    async fn run_snapshot(&self, op: Operation, mut snapshot: crate::records::SnapshotRecord) {
        let _ = self.store.set_operation_state(&op.id, OperationState::Running).await;
        let saved = async {
            snapshot.bytes = self.nodes.save_image(&op.sandbox_id, &snapshot.id).await?;
            if snapshot.kind == crate::records::SnapshotKind::Snapshot {
                snapshot.digest = Some(self.nodes.digest_image(&snapshot.id).await?);
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

    /// Pause, suspend or resume (`op.kind`), then record what the VM is.
    async fn run_change(&self, op: Operation) {
        let id = op.sandbox_id.clone();
        let _ = self.store.set_operation_state(&op.id, OperationState::Running).await;
        let result = match op.kind {
            OperationKind::Pause => self.nodes.pause(&id).await,
            OperationKind::Suspend => self.nodes.suspend(&id).await.map(drop),
            _ => self.nodes.resume(&id).await,
        };
        match result {
            Ok(()) => {
                self.settle_held(&id, self.nodes.vm_state(&id)).await;
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

    /// Record the state a sandbox's VM is in now (running, paused, suspended), and stop (or
    /// restart) its clock: a held sandbox keeps the lifetime it had left, and expires only after
    /// `MAX_PAUSE` in memory or `MAX_SUSPEND` on disk. A sandbox being deleted stays so.
    async fn settle_held(&self, id: &str, vm: VmState) {
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
                self.store
                    .set_sandbox_expiry(id, now + hold_for.as_millis() as i64)
                    .await?;
                Ok(())
            } else {
                if let Some(remaining) = self.store.paused_remaining(id).await? {
                    self.store.set_sandbox_expiry(id, now + remaining).await?;
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
        let mut ops: std::collections::HashMap<String, Vec<Operation>> = Default::default();
        for op in self.store.unfinished_operations().await? {
            ops.entry(op.sandbox_id.clone()).or_default().push(op);
        }
        let mut pending = std::collections::HashMap::new();
        for row in self.store.live_sandboxes().await? {
            pending.insert(row.id.clone(), row.tenant_id.clone());
        }
        for id in ops.keys() {
            if !pending.contains_key(id) {
                if let Some(row) = self.store.sandbox_by_id(id).await? {
                    pending.insert(id.clone(), row.tenant_id);
                }
            }
        }
        let ids: Vec<String> = pending.keys().cloned().collect();
        self.recovery.pending.lock().unwrap().extend(pending);
        self.recovery.under_way.store(true, std::sync::atomic::Ordering::SeqCst);
        let engine = self.clone();
        tokio::spawn(async move {
            use futures_util::StreamExt;
            futures_util::stream::iter(ids)
                .for_each_concurrent(RECOVER_AT_ONCE, |id| {
                    let engine = engine.clone();
                    let ops = ops.remove(&id).unwrap_or_default();
                    async move {
                        engine.nodes.settled(&id).await;
                        if let Err(e) = engine.recover_sandbox(&id, ops).await {
                            tracing::error!(sandbox = %id, "cannot recover: {e}");
                        }
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
            tracing::info!("recovery after the restart finished");
        });
        Ok(())
    }

    /// Whether sandbox `id` is still being recovered after a restart.
    pub fn recovering(&self, id: &str) -> bool {
        self.recovery.pending.lock().unwrap().contains_key(id)
    }

    /// Wait (at most [`RECOVERY_WAIT`], or what `Config::recovery_wait` says) until the restart's recovery has settled every sandbox
    /// `which` selects (by id and tenant id); `unavailable` if it has not by then. Immediate
    /// when none is pending, which is always so once the recovery is over.
    async fn await_recovered(&self, which: impl Fn(&str, &str) -> bool, what: &str) -> CoreResult<()> {
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
    /// operations finished or failed by what the VM is, and the sandbox failed if its VM is gone.
    async fn recover_sandbox(&self, id: &str, ops: Vec<Operation>) -> CoreResult<()> {
        for op in ops {
            let vm = self.nodes.vm_state(id);
            match (op.kind, vm) {
                (OperationKind::Delete, _) => {
                    let engine = self.clone();
                    tokio::spawn(async move { engine.run_delete(op).await });
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
                match self.nodes.vm_state(id) {
                    VmState::Gone => {
                        tracing::warn!(sandbox = %id, "its VM is gone; marking it failed");
                        self.set_state(id, SandboxState::Failed).await;
                    }
                    vm => self.settle_held(id, vm).await,
                }
            }
        }
        Ok(())
    }

    /// VMs that no live record claims (left by a crash) are deleted.
    async fn sweep_unclaimed_vms(&self) -> CoreResult<()> {
        for id in self.nodes.vm_ids() {
            let live = self
                .store
                .sandbox_by_id(&id)
                .await?
                .is_some_and(|r| !matches!(r.state, SandboxState::Deleted | SandboxState::Failed));
            if !live {
                tracing::warn!(sandbox = %id, "VM without a live record; deleting it");
                let _ = self.nodes.delete(&id).await;
            }
        }
        Ok(())
    }

    /// Images no snapshot record claims, saves the restart cut short, and forks' images (the
    /// restart cut the fork short; its children that started hold their own links). Only what
    /// was recorded before this engine started: saves and forks since then are under way.
    async fn sweep_images(&self) -> CoreResult<()> {
        for image in self.store.interrupted_images(self.started_ms).await? {
            tracing::info!(image = %image.id, "removing an image a restart interrupted (a fork's or a save's)");
            self.store.delete_snapshot(&image.tenant_id, &image.id).await?;
            let _ = self.nodes.delete_image(&image.id).await;
        }
        let claimed: std::collections::HashSet<String> = self.store.snapshot_ids().await?.into_iter().collect();
        for id in self.nodes.image_ids() {
            if !claimed.contains(&id) {
                tracing::warn!(image = %id, "image without a snapshot record; removing it");
                let _ = self.nodes.delete_image(&id).await;
            }
        }
        Ok(())
    }

    /// A sandbox whose VM exited on its own is failed (its quota slot is free again).
    async fn vm_exited(&self, id: &str) {
        let live = [SandboxState::Running, SandboxState::Paused];
        if self.transition(id, &live, SandboxState::Failed).await {
            tracing::warn!(sandbox = %id, "its VM exited on its own; marking it failed");
            let _ = self.store.set_paused_remaining(id, None).await;
        }
    }

    /// Sandboxes the store thinks run, whose VM is gone, with no operation under way.
    async fn sweep(&self) -> CoreResult<()> {
        let busy: std::collections::HashSet<String> = self
            .store
            .unfinished_operations()
            .await?
            .into_iter()
            .map(|o| o.sandbox_id)
            .collect();
        for row in self.store.live_sandboxes().await? {
            if matches!(row.state, SandboxState::Running | SandboxState::Paused)
                && !busy.contains(&row.id)
                && !self.recovering(&row.id)
                && self.nodes.vm_state(&row.id) == VmState::Gone
            {
                self.vm_exited(&row.id).await;
            }
        }
        Ok(())
    }

    /// A sandbox whose timeout passed: suspended if it asked for that (`on_timeout: suspend`,
    /// E2B's autoPause) and runs, else deleted. A suspend that fails deletes it after all.
    async fn timed_out(&self, row: SandboxRecord) {
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
            self.store
                .set_sandbox_expiry(&row.id, now_ms() + MAX_SUSPEND.as_millis() as i64)
                .await?;
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

    /// Delete sandboxes whose timeout passed; fail those whose VM exited on its own.
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
                if let Ok(expired) = engine.store.expired_sandboxes(now_ms()).await {
                    // A sandbox the restart's recovery has yet to settle waits for it.
                    for row in expired.into_iter().filter(|r| !engine.recovering(&r.id)) {
                        engine.timed_out(row).await;
                    }
                }
                if tick.is_multiple_of(SWEEP_EVERY_TICKS) {
                    let _ = engine.sweep().await;
                }
            }
        });
    }
}
