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

mod events;
mod reaper;
pub use reaper::NODE_GRACE;
mod recover;
mod run;

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
        /// Where to place it next, in order, with each node's budgets, if its node refuses it
        /// by its own admission (a replica's view of a node is stale).
        fallbacks: Vec<(String, NodeBudget)>,
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
    /// place, vcpu and memory again, so it is admitted under `quota` and `budget` of
    /// `sandbox.node` like a create. A parked one (on no node) starts on `sandbox.node`, and
    /// if that node refuses it, on the next of `fallbacks` as a create would.
    Resume {
        sandbox: SandboxRecord,
        quota: Quota,
        budget: NodeBudget,
        fallbacks: Vec<(String, NodeBudget)>,
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
    /// The operations this process runs now, whose leases it renews (`store::LEASE_MS`); one
    /// whose task ended without finishing it lapses, and a replica takes it over.
    running: RunningOps,
    /// Sandboxes whose node did not take their latest deadline (`Engine::set_expiry`).
    deadlines_unsent: Arc<std::sync::Mutex<std::collections::HashSet<String>>>,
    /// Sandboxes of draining nodes this engine suspended already (`Engine::drain_sweep`).
    drain_tried: Arc<std::sync::Mutex<std::collections::HashSet<String>>>,
    /// How long a node must leave every replica unanswered before its running sandboxes are
    /// lost (`reaper::NODE_GRACE` unless configured).
    node_grace: Duration,
    /// VMs `reap_disowned` found on a node their live sandbox's record does not name (node, id,
    /// run), since when: removed once so for `node_grace`.
    disowned: Arc<std::sync::Mutex<std::collections::HashMap<reaper::Disowned, std::time::Instant>>>,
    /// Operation id -> the epoch of the lease this engine took it over with, until it ends.
    epochs: Arc<std::sync::Mutex<std::collections::HashMap<String, i64>>>,
    /// What this process counts (operations, creates, its recovery) for `GET /metrics`.
    telemetry: Arc<crate::telemetry::Telemetry>,
    /// The `seq` of the newest lifecycle event this process recorded (`events.rs`).
    events: Arc<tokio::sync::watch::Sender<i64>>,
}

/// Operation id -> how many tasks of this process carry it out now (a recovery hands a
/// delete on to its run).
type RunningOps = Arc<std::sync::Mutex<std::collections::HashMap<String, u32>>>;

/// An operation this engine runs, while it does: counted in [`Engine::running`].
struct Running {
    ops: RunningOps,
    id: String,
}

impl Drop for Running {
    fn drop(&mut self) {
        let mut ops = self.ops.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = ops.get_mut(&self.id) {
            *n -= 1;
            if *n == 0 {
                ops.remove(&self.id);
            }
        }
    }
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
            running: Default::default(),
            deadlines_unsent: Default::default(),
            drain_tried: Default::default(),
            node_grace: reaper::NODE_GRACE,
            disowned: Default::default(),
            epochs: Default::default(),
            telemetry: Default::default(),
            events: Arc::new(tokio::sync::watch::channel(0).0),
        }
    }

    /// What this process counts, for `GET /metrics`.
    pub fn telemetry(&self) -> &Arc<crate::telemetry::Telemetry> {
        &self.telemetry
    }

    /// The same engine, judging a node's running sandboxes lost after `grace` unanswered.
    pub fn with_node_grace(mut self, grace: Duration) -> Self {
        self.node_grace = grace;
        self
    }

    /// Run `work` (carrying out `op`) in the background, renewing `op`'s lease until it ends.
    fn start(&self, op: &Operation, work: impl std::future::Future<Output = ()> + Send + 'static) {
        let running = self.running(&op.id);
        tokio::spawn(crate::nodes::wire::OPERATION.scope(self.carried(&op.id), async move {
            work.await;
            drop(running);
        }));
    }

    /// Operation `id` as this engine's calls to nodes name it: with the epoch of its lease here
    /// (1 unless this engine took it over).
    pub(super) fn carried(&self, id: &str) -> crate::nodes::wire::Carried {
        let epoch = self.epochs.lock().unwrap_or_else(|e| e.into_inner()).get(id).copied();
        crate::nodes::wire::Carried {
            id: id.to_string(),
            epoch: epoch.unwrap_or(1),
        }
    }

    /// The operations of `claimed`, their epochs kept for [`Engine::carried`].
    pub(super) fn took(&self, claimed: Vec<crate::store::Claimed>) -> Vec<Operation> {
        let mut epochs = self.epochs.lock().unwrap_or_else(|e| e.into_inner());
        claimed
            .into_iter()
            .map(|c| {
                epochs.insert(c.op.id.clone(), c.epoch);
                c.op
            })
            .collect()
    }

    /// Count `id` as run here until the guard goes.
    fn running(&self, id: &str) -> Running {
        *self
            .running
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(id.to_string())
            .or_default() += 1;
        Running {
            ops: self.running.clone(),
            id: id.to_string(),
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
        if state.is_ended() {
            let _ = self.ended.send(id.to_string());
            self.publish(crate::store::News::SandboxEnded(id.to_string()));
        }
    }

    /// Tell the other replicas (off the caller's path: news is a hint, never a step).
    fn publish(&self, news: crate::store::News) {
        let store = self.store.clone();
        tokio::spawn(async move {
            if let Err(e) = store.publish(&news).await {
                tracing::debug!("cannot tell the other replicas {news:?}: {e}");
            }
        });
    }

    /// Hear the other replicas' news for as long as the process runs: an operation one of them
    /// finished wakes this one's waiters, a sandbox one of them ended is announced here too.
    pub fn spawn_news(&self) {
        let engine = self.clone();
        tokio::spawn(async move {
            use futures_util::StreamExt;
            let mut news = match engine.store.listen().await {
                Ok(Some(news)) => news,
                Ok(None) => return,
                Err(e) => {
                    tracing::warn!("cannot hear the other replicas (waiters and sweeps look for themselves): {e}");
                    return;
                }
            };
            while let Some(n) = news.next().await {
                match n {
                    crate::store::News::OperationFinished(_) => engine.finished.send_modify(|n| *n += 1),
                    crate::store::News::SandboxEnded(id) => {
                        let _ = engine.ended.send(id);
                    }
                }
            }
        });
    }

    /// Record `action` as an operation and start it.
    pub async fn submit(&self, action: Action) -> CoreResult<Submitted> {
        match action {
            Action::Create {
                sandbox,
                idempotency_key,
                quota,
                budget,
                fallbacks,
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
                        self.start(&op, async move { engine.run_create(run, sandbox, fallbacks).await });
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
                let lost = sandbox.state == SandboxState::Lost;
                self.start(&op, async move { engine.run_delete(run, lost).await });
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
                self.start(&op, async move { engine.run_snapshot(run, snapshot).await });
                Ok(Submitted {
                    operation: op,
                    new: true,
                })
            }
            Action::Resume {
                sandbox,
                quota,
                budget,
                fallbacks,
            } => {
                if sandbox.state == SandboxState::Suspended
                    && !self
                        .store
                        .admit_resume(&sandbox.id, &sandbox.node, &quota, &budget)
                        .await?
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
                    if let Some(parked) = self.store.sandbox_parked(&sandbox.id).await? {
                        let op = new_operation(OperationKind::Resume, &sandbox.id);
                        self.store.insert_operation(&sandbox.tenant_id, &op).await?;
                        let engine = self.clone();
                        let run = op.clone();
                        self.start(
                            &op,
                            async move { engine.run_unpark(run, sandbox, parked, fallbacks).await },
                        );
                        return Ok(Submitted {
                            operation: op,
                            new: true,
                        });
                    }
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
        self.start(&op, async move { engine.run_change(run).await });
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
        match self.store.finish_operation(&op.id, state, error.as_ref()).await {
            Ok(true) => {
                if let Some(took) = crate::telemetry::since_rfc3339(&op.created_at) {
                    self.telemetry.operation_ended(op.kind.as_str(), error.is_none(), took);
                }
                // Before waiters wake: whoever saw the operation end finds its event.
                self.record_end(op, error.as_ref()).await;
            }
            // This replica stalled past its lease and another took the operation over: its
            // end is the one recorded, not this late one.
            Ok(false) => tracing::warn!(op = %op.id, "another replica took the operation over; its end stands"),
            Err(e) => tracing::error!(op = %op.id, "cannot record the end of the operation: {e}"),
        }
        self.epochs.lock().unwrap_or_else(|e| e.into_inner()).remove(&op.id);
        self.finished.send_modify(|n| *n += 1);
        self.publish(crate::store::News::OperationFinished(op.id.clone()));
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
}
