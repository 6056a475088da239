//! Sandboxes: admission (template, resources, timeout, env, metadata, idempotency, quota) and
//! lifecycle requests, which the operation engine carries out.

use super::egress::EgressRequest;
use super::{Core, Principal};
use crate::engine::{Action, Submitted};
use crate::error::{CoreError, CoreResult, Kind};
use crate::model::{Operation, SandboxState};
use crate::nodes::NodeError;
use crate::records::{now_ms, SandboxRecord, Tenant};
use crate::store::{parse_page_token, SandboxFilter};
use airlock_agent_client::AgentClient;
use airlock_runtime::template::TemplateManifest;
use std::collections::BTreeMap;
use std::time::Duration;

/// A sandbox's lifetime when the caller names none.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);
/// The longest lifetime a sandbox may ask for (and the longest command timeout).
pub const MAX_TIMEOUT: Duration = Duration::from_secs(24 * 3600);
/// Longest `Idempotency-Key`.
const MAX_IDEMPOTENCY_KEY: usize = 200;

/// A request to create a sandbox, from either door.
#[derive(Debug, Clone, Default)]
pub struct CreateSandbox {
    /// Template name, alias (`base`) or digest (`sha256:...`).
    pub template: String,
    /// VMM; `None` is this node's.
    pub runtime: Option<String>,
    pub vcpu: Option<u32>,
    pub memory_mib: Option<u32>,
    pub disk_mib: Option<u32>,
    /// `None` is `DEFAULT_TIMEOUT`.
    pub timeout: Option<Duration>,
    /// Environment of every process started in the sandbox.
    pub env: BTreeMap<String, String>,
    pub metadata: BTreeMap<String, String>,
    /// A retried create with the same key returns the first operation.
    pub idempotency_key: Option<String>,
    /// What the sandbox may reach (see `core::egress`).
    pub egress: EgressRequest,
    pub lifecycle: crate::model::Lifecycle,
    /// A fork's child: its parent's egress, exactly (`egress` is then unused).
    pub inherit_egress: Option<crate::records::EgressSpec>,
    /// Start from this saved image (a build's cached step) as from a snapshot: its template
    /// and resources; `template` is then unused.
    pub from_saved: Option<crate::records::SnapshotRecord>,
    /// A template the core resolved itself (a build's parent made of an OCI image), started
    /// as it is; `template` is then unused.
    pub parent: Option<TemplateManifest>,
    /// The tenant's volumes to mount (see `core::volumes`): the sandbox goes to their node.
    pub volumes: Vec<super::volumes::MountRequest>,
}

#[derive(Debug, Clone)]
pub struct Created {
    pub operation: Operation,
    pub sandbox_id: String,
}

/// A page of sandboxes.
#[derive(Debug, Clone, Default)]
pub struct ListSandboxes {
    /// Only these states; empty means the live ones (creating, running, paused, deleting).
    pub states: Vec<SandboxState>,
    pub metadata: BTreeMap<String, String>,
    pub page_token: Option<String>,
    pub limit: u32,
    /// Newest first (E2B's order) instead of oldest first.
    pub newest_first: bool,
    /// Only sandboxes created at or after / before these times (ms since the epoch).
    pub created_from_ms: Option<i64>,
    pub created_before_ms: Option<i64>,
    /// Only sandboxes of this template, named as a create would name it (an alias included).
    pub template: Option<String>,
}

pub struct Page {
    pub sandboxes: Vec<SandboxRecord>,
    pub next_page_token: Option<String>,
}

/// A sandbox's lifetime or a command's timeout: 1 s to `MAX_TIMEOUT`.
pub fn check_timeout(field: &str, d: Duration) -> CoreResult<Duration> {
    if d < Duration::from_secs(1) || d > MAX_TIMEOUT {
        return Err(CoreError::invalid(
            field,
            format!(
                "must be between 1s and {}, got {}",
                humantime::format_duration(MAX_TIMEOUT),
                humantime::format_duration(d)
            ),
        ));
    }
    Ok(d)
}

/// Environment variable names a process can be given: not empty, no `=` or NUL, not starting
/// with a digit; values without NUL.
pub fn check_env(env: &BTreeMap<String, String>) -> CoreResult<()> {
    for (k, v) in env {
        let ok = !k.is_empty()
            && !k.contains('=')
            && !k.contains('\0')
            && !k.chars().next().is_some_and(|c| c.is_ascii_digit());
        if !ok {
            return Err(CoreError::invalid(
                "env",
                format!("environment variable name {k:?} is invalid (it must be non-empty, not start with a digit, and contain no '=' or NUL)"),
            ));
        }
        if v.contains('\0') {
            return Err(CoreError::invalid(
                "env",
                format!("the value of {k:?} contains a NUL byte"),
            ));
        }
    }
    Ok(())
}

fn check_metadata(m: &BTreeMap<String, String>) -> CoreResult<()> {
    if let Some(k) = m.keys().find(|k| k.is_empty() || k.len() > 256) {
        return Err(CoreError::invalid(
            "metadata",
            format!("key {k:?} must be 1 to 256 bytes"),
        ));
    }
    Ok(())
}

impl Core {
    /// Admit a sandbox and submit its create; with a known idempotency key, the earlier one.
    pub(super) async fn create_sandbox_unaudited(
        &self,
        principal: &Principal,
        tenant: &Tenant,
        req: CreateSandbox,
    ) -> CoreResult<Created> {
        let runtime = self.nodes.runtime_name();
        match req.runtime.as_deref() {
            None => {}
            Some(r) if r == runtime => {}
            Some("fc") => {
                return Err(CoreError::invalid(
                    "runtime",
                    "runtime \"fc\" (Firecracker) is not available on this node",
                ))
            }
            Some(other) => {
                return Err(CoreError::invalid(
                    "runtime",
                    format!("unknown runtime {other:?}; use \"{runtime}\""),
                ))
            }
        }
        if let Some(k) = &req.idempotency_key {
            if k.is_empty() || k.len() > MAX_IDEMPOTENCY_KEY {
                return Err(CoreError::invalid(
                    "Idempotency-Key",
                    format!("must be 1 to {MAX_IDEMPOTENCY_KEY} characters"),
                ));
            }
            // A retry answers with what the first request started, whatever else changed.
            if let Some(prior) = self.store.operation_by_idempotency_key(&tenant.id, k).await? {
                return Ok(Created {
                    sandbox_id: prior.sandbox_id.clone(),
                    operation: prior,
                });
            }
        }
        // One of the tenant's snapshots (by id or name) before a template of that name.
        let snapshot = match (req.from_saved.clone(), &req.parent) {
            (Some(saved), _) => Some(saved),
            (None, Some(_)) => None,
            (None, None) => self.store.get_snapshot(&tenant.id, &req.template).await?,
        };
        let template = match (&snapshot, &req.parent) {
            (Some(s), _) => self.resolve_template(&s.template).ok(),
            (None, Some(parent)) => Some(parent.clone()),
            (None, None) => Some(self.resolve_template_for(tenant, &req.template).await?),
        };
        // A built template's ENV, under what the create asks.
        let mut req = req;
        if let Some(built) = template.as_ref().and_then(|t| t.built.as_ref()) {
            for (k, v) in &built.env {
                req.env.entry(k.clone()).or_insert_with(|| v.clone());
            }
        }
        let defaults = template
            .as_ref()
            .map_or_else(Default::default, airlock_runtime::Resources::for_template);
        let resources = airlock_runtime::Resources {
            vcpu: req.vcpu.unwrap_or(defaults.vcpu),
            memory_mib: req.memory_mib.unwrap_or(defaults.memory_mib),
            disk_mib: req.disk_mib.unwrap_or(defaults.disk_mib),
        };
        let resources = match &snapshot {
            Some(s) => {
                let fixed = s.resources;
                let asked = [
                    (req.vcpu, fixed.vcpu),
                    (req.memory_mib, fixed.memory_mib),
                    (req.disk_mib, fixed.disk_mib),
                ];
                if asked.iter().any(|(asked, has)| asked.is_some_and(|a| a != *has)) {
                    return Err(CoreError::InvalidResources(format!(
                        "a sandbox made from snapshot {} has its resources ({} vcpu, {} MiB memory, {} MiB disk); leave them out",
                        s.id, fixed.vcpu, fixed.memory_mib, fixed.disk_mib
                    )));
                }
                fixed
            }
            None => resources,
        };
        if let Some(template) = &template {
            resources.validate(template).map_err(NodeError::from)?;
        }
        let budget = self.largest_budget();
        for (field, asked, total, what) in [
            (
                "vcpu",
                resources.vcpu as u64,
                budget.vcpu,
                "the host's CPUs times --vcpu-overcommit",
            ),
            (
                "memory_mib",
                resources.memory_mib as u64,
                budget.memory_mib,
                "the host's memory less --memory-reserve-mib",
            ),
        ] {
            // More than the whole budget never fits, however many sandboxes go: a bad request.
            if asked > total {
                return Err(CoreError::InvalidResources(format!(
                    "{field} must be at most {total} on this node ({what}), got {asked}"
                )));
            }
        }
        let timeout = check_timeout("timeout", req.timeout.unwrap_or(DEFAULT_TIMEOUT))?;
        check_env(&req.env)?;
        check_metadata(&req.metadata)?;
        // The quota and the node's budgets count live sandboxes: not before the restart's
        // recovery has failed those whose VM is gone.
        self.engine.all_recovered().await?;
        let (mounts, volume_node) = self.resolve_mounts(tenant, &req.volumes).await?;
        let egress = match req.inherit_egress {
            Some(parents) => parents,
            None => self.egress_for_create(principal, tenant, &req.egress).await?,
        };
        let now = now_ms();
        let row = SandboxRecord {
            id: airlock_runtime::datadir::random_hex(10),
            tenant_id: tenant.id.clone(),
            state: SandboxState::Creating,
            template: match (&snapshot, &template) {
                (Some(s), _) => s.template.clone(),
                (None, Some(t)) => t.name.clone(),
                (None, None) => unreachable!("a create without a snapshot resolved its template"),
            },
            template_digest: template.as_ref().map(|t| t.digest.clone()).unwrap_or_default(),
            runtime,
            accel: self.nodes.accel().await,
            resources,
            env: req.env,
            metadata: req.metadata,
            created_at_ms: now,
            expires_at_ms: now + timeout.as_millis() as i64,
            egress,
            start: None,
            lifecycle: req.lifecycle,
            timeout_ms: timeout.as_millis() as i64,
            image_id: snapshot.as_ref().map(|s| s.id.clone()),
            node: String::new(),
            run: String::new(),
        };
        // A warm pool's VM, where one is ready for this template and shape: its id is the
        // sandbox's. A create that does not go ahead gives it back.
        let mut row = row;
        let mut pooled = match row.image_id {
            None => self.nodes.claim(&row.template, &row.resources).await,
            Some(_) => None,
        };
        // A pool VM elsewhere than the volumes' node is no use: it goes back.
        if let (Some(id), Some(node)) = (&pooled, &volume_node) {
            if self.nodes.owner(id).is_some_and(|o| o != *node) {
                self.nodes.unclaim(id);
                pooled = None;
            }
        }
        if let Some(id) = &pooled {
            row.id = id.clone();
        }
        let quota = self.quota(tenant).await?;
        // Where its pool VM or its snapshot's image is, it must go; else the best node that
        // admits it. A shared snapshot starts on any node of its machine, best on one that has
        // its image already.
        let pinned = match (&pooled, &row.image_id) {
            (Some(id), _) | (None, Some(id)) => self.nodes.owner(id),
            (None, None) => None,
        };
        // Its volumes' node, if it has any: nowhere else has their disks.
        let pinned = match (volume_node, pinned) {
            (Some(node), Some(other)) if node != other => {
                return Err(CoreError::invalid(
                    "volumes",
                    format!("its volumes are on node {node:?}, its snapshot's image on {other:?}"),
                ))
            }
            (Some(node), _) => Some(node),
            (None, pinned) => pinned,
        };
        if !mounts.is_empty() {
            self.store.put_sandbox_volumes(&row.id, &mounts).await?;
        }
        let candidates = match snapshot.as_ref().and_then(|s| s.shared.as_deref()) {
            Some(machine) if pooled.is_none() => {
                let (mut open, refused) = self.candidates_matching(machine);
                if let Some(at) = open.iter().position(|m| pinned.as_deref() == Some(m.name.as_str())) {
                    let holder = open.remove(at);
                    open.insert(0, holder);
                }
                (open, refused)
            }
            _ => self.candidates(pinned.as_deref()),
        };
        let submitted = self
            .offer(candidates, |node, budget, fallbacks| {
                let sandbox = SandboxRecord { node, ..row.clone() };
                let action = Action::Create {
                    sandbox,
                    idempotency_key: req.idempotency_key.clone(),
                    quota,
                    budget,
                    fallbacks,
                };
                async { self.engine.submit(action).await.map_err(|e| e.for_tenant(&tenant.name)) }
            })
            .await;
        let unclaim = || {
            if let Some(id) = &pooled {
                self.nodes.unclaim(id);
            }
        };
        let Submitted { operation, new } = submitted.inspect_err(|_| unclaim())?;
        if !new {
            // An earlier create answered: this row was never recorded.
            unclaim();
        }
        Ok(Created {
            sandbox_id: operation.sandbox_id.clone(),
            operation,
        })
    }

    /// A tenant's sandbox in any state; another tenant's answers like a missing one.
    pub async fn sandbox(&self, tenant: &Tenant, id: &str) -> CoreResult<SandboxRecord> {
        let row = self
            .store
            .get_sandbox(&tenant.id, id)
            .await?
            .ok_or_else(|| CoreError::not_found(Kind::Sandbox, id))?;
        self.current(row).await
    }

    /// `row` as it is once the restart's recovery has settled it (at once when it is not
    /// pending): a record the recovery has yet to check against its VM may say `running` for a
    /// VM that is gone. Call only for a caller that proved its right to the sandbox (the wait,
    /// or its `unavailable`, would tell others that it exists).
    pub async fn current(&self, row: SandboxRecord) -> CoreResult<SandboxRecord> {
        if !self.engine.recovering(&row.id) {
            return Ok(row);
        }
        self.engine.recovered(&row.id).await?;
        self.store
            .sandbox_by_id(&row.id)
            .await?
            .ok_or_else(|| CoreError::not_found(Kind::Sandbox, &row.id))
    }

    /// Whether a restart's recovery has yet to settle `id` (its record may not be true yet).
    pub fn settling(&self, id: &str) -> bool {
        self.engine.recovering(id)
    }

    /// Whether `id` is a sandbox that is running, paused or suspended, of whichever tenant; for
    /// state a door keeps per sandbox, dropped once this is false.
    pub async fn sandbox_is_live(&self, id: &str) -> CoreResult<bool> {
        Ok(self
            .store
            .sandbox_by_id(id)
            .await?
            .is_some_and(|r| r.state.is_held_or_running()))
    }

    /// Wait until `op` has finished (succeeded or failed); `unavailable` past the engine's limit.
    pub async fn wait_operation(&self, op: &Operation) -> CoreResult<Operation> {
        self.engine.wait(op).await
    }

    /// Per-sandbox state a door keeps: `on_end` as each sandbox ends, `sweep` every `period`
    /// (after `first`), for as long as `owner` lives (see [`crate::engine::Engine::follow_ended`]).
    pub fn follow_ended<T, F>(
        &self,
        owner: std::sync::Weak<T>,
        first: Duration,
        period: Duration,
        on_end: impl Fn(&T, &str) + Send + 'static,
        sweep: impl Fn(std::sync::Arc<T>) -> F + Send + 'static,
    ) where
        T: Send + Sync + 'static,
        F: std::future::Future<Output = ()> + Send + 'static,
    {
        self.engine.follow_ended(owner, first, period, on_end, sweep)
    }

    /// An operation of the tenant's, as it is once the restart's recovery has settled its
    /// sandbox (an operation the restart interrupted is still open in the record until then).
    pub async fn operation(&self, tenant: &Tenant, id: &str) -> CoreResult<Operation> {
        let missing = || CoreError::not_found(Kind::Operation, id);
        let op = self.store.get_operation(&tenant.id, id).await?.ok_or_else(missing)?;
        if !self.engine.recovering(&op.sandbox_id) {
            return Ok(op);
        }
        self.engine.recovered(&op.sandbox_id).await?;
        self.store.get_operation(&tenant.id, id).await?.ok_or_else(missing)
    }

    /// A sandbox that is running, paused or suspended (what E2B calls a sandbox); others are
    /// missing.
    pub async fn live_sandbox(&self, tenant: &Tenant, id: &str) -> CoreResult<SandboxRecord> {
        match self.sandbox(tenant, id).await? {
            row if row.state.is_held_or_running() => Ok(row),
            _ => Err(CoreError::not_found(Kind::Sandbox, id)),
        }
    }

    pub async fn list_sandboxes(&self, tenant: &Tenant, q: ListSandboxes) -> CoreResult<Page> {
        if !(1..=100).contains(&q.limit) {
            return Err(CoreError::invalid(
                "limit",
                format!("must be between 1 and 100, got {}", q.limit),
            ));
        }
        let after = match &q.page_token {
            None => None,
            Some(t) => Some(
                parse_page_token(t)
                    .ok_or_else(|| CoreError::invalid("page_token", "not a token this server issued"))?,
            ),
        };
        let states = if q.states.is_empty() {
            vec![
                SandboxState::Creating,
                SandboxState::Running,
                SandboxState::Paused,
                SandboxState::Suspended,
                SandboxState::Resuming,
                SandboxState::Deleting,
            ]
        } else {
            q.states
        };
        // A sandbox records the template its create resolved to: the filter resolves the same way
        // (an alias, a digest); a name nothing resolves matches nothing.
        let templates = match &q.template {
            None => Vec::new(),
            Some(t) => match self.resolve_template(t) {
                Ok(found) => vec![found.name],
                Err(_) => vec![t.clone()],
            },
        };
        let filter = SandboxFilter {
            states,
            metadata: q.metadata,
            after,
            limit: q.limit,
            newest_first: q.newest_first,
            created_from_ms: q.created_from_ms,
            created_before_ms: q.created_before_ms,
            templates,
        };
        // States the restart's recovery has yet to check are not listed as if they were true.
        self.engine.tenant_recovered(&tenant.id).await?;
        let mut rows = self.store.list_sandboxes(&tenant.id, &filter).await?;
        let next_page_token = crate::store::next_page_token(&rows, q.limit);
        rows.truncate(q.limit as usize);
        Ok(Page {
            sandboxes: rows,
            next_page_token,
        })
    }

    /// Submit a delete (or return the one under way).
    async fn delete_sandbox_unaudited(&self, tenant: &Tenant, id: &str) -> CoreResult<Operation> {
        let row = self.sandbox(tenant, id).await?;
        if row.state == SandboxState::Deleted {
            return Err(CoreError::NotFound {
                kind: Kind::Sandbox,
                id: id.into(),
                hint: " (it was deleted)".into(),
            });
        }
        Ok(self.engine.submit(Action::Delete { sandbox: row }).await?.operation)
    }

    /// Pause, suspend or resume; returns the finished operation.
    async fn change_sandbox_unaudited(&self, tenant: &Tenant, id: &str, change: Change) -> CoreResult<Operation> {
        let row = self.sandbox(tenant, id).await?;
        let (from, need): (&[SandboxState], &str) = match change {
            Change::Pause => (&[SandboxState::Running], "only a running sandbox can be paused"),
            Change::Suspend => (
                &[SandboxState::Running, SandboxState::Paused],
                "only a running or paused sandbox can be suspended",
            ),
            Change::Resume => (
                &[SandboxState::Paused, SandboxState::Suspended],
                "only a paused or suspended sandbox can be resumed",
            ),
        };
        if !from.contains(&row.state) {
            return Err(CoreError::InvalidState {
                id: id.into(),
                state: row.state,
                need: need.into(),
            });
        }
        let action = match change {
            Change::Pause => Action::Pause { sandbox: row },
            Change::Suspend => {
                self.admit_suspend(&row).await.map_err(|e| e.for_tenant(&tenant.name))?;
                Action::Suspend { sandbox: row }
            }
            Change::Resume => {
                let op = self
                    .submit_resume(row)
                    .await
                    .map_err(|e| e.for_tenant(&tenant.name))?
                    .operation;
                return self.engine.wait(&op).await;
            }
        };
        let op = self
            .engine
            .submit(action)
            .await
            .map_err(|e| e.for_tenant(&tenant.name))?
            .operation;
        self.engine.wait(&op).await
    }

    /// Set the lifetime left to `timeout` from now. A paused sandbox's clock is stopped: it is
    /// what the sandbox will have once resumed.
    pub async fn set_sandbox_timeout(&self, row: &SandboxRecord, timeout: Duration) -> CoreResult<()> {
        let timeout = check_timeout("timeout", timeout)?;
        let ms = timeout.as_millis() as i64;
        if matches!(
            row.state,
            SandboxState::Paused | SandboxState::Suspended | SandboxState::Resuming
        ) {
            self.store.set_paused_remaining(&row.id, Some(ms)).await?;
        } else {
            self.engine.set_expiry(row, now_ms() + ms).await?;
        }
        self.engine
            .record_event(
                &row.id,
                crate::model::EventKind::Updated,
                serde_json::json!({ "timeout_ms": ms }),
            )
            .await;
        Ok(())
    }

    /// Make the sandbox live at least `timeout` from now (never shortens it).
    pub async fn extend_sandbox_timeout(&self, row: &SandboxRecord, timeout: Duration) -> CoreResult<()> {
        let timeout = check_timeout("timeout", timeout)?;
        let want = now_ms() + timeout.as_millis() as i64;
        if want > row.expires_at_ms {
            self.engine.set_expiry(row, want).await?;
        }
        Ok(())
    }

    /// A suspend writes the sandbox's memory to the data dir: that place is charged to its
    /// tenant's disk quota and the node's disk budget before it starts (once: a sandbox whose
    /// timeout suspends it holds it from its create).
    async fn admit_suspend(&self, row: &SandboxRecord) -> CoreResult<()> {
        let quota = self.quota_of(&row.tenant_id).await?;
        let budget = self.budget_of(&row.node);
        if !self.store.admit_suspend(&row.id, &quota, &budget).await? {
            let now = self.store.sandbox_by_id(&row.id).await?;
            return Err(CoreError::InvalidState {
                id: row.id.clone(),
                state: now.map_or(SandboxState::Deleted, |r| r.state),
                need: "only a running or paused sandbox can be suspended".into(),
            });
        }
        Ok(())
    }

    /// Resume `row`, admitted (from suspended) under its tenant's quota and the node's budgets
    /// as they are now: on its own node, or, parked in object storage, placed like a create
    /// on the nodes whose machine matches the one it was saved on.
    pub(super) async fn submit_resume(&self, row: SandboxRecord) -> CoreResult<crate::engine::Submitted> {
        let quota = self.quota_of(&row.tenant_id).await?;
        let parked = match row.state {
            SandboxState::Suspended => self.store.sandbox_parked(&row.id).await?,
            _ => None,
        };
        let Some(parked) = parked else {
            let budget = self.budget_of(&row.node);
            return self
                .engine
                .submit(Action::Resume {
                    sandbox: row,
                    quota,
                    budget,
                    fallbacks: Vec::new(),
                })
                .await;
        };
        let candidates = self.candidates_matching(&parked.fingerprint);
        self.offer(candidates, |node, budget, fallbacks| {
            let action = Action::Resume {
                sandbox: SandboxRecord { node, ..row.clone() },
                quota,
                budget,
                fallbacks,
            };
            self.engine.submit(action)
        })
        .await
    }

    /// Resume a held sandbox that asked for it (`auto_resume`) because a request reached it;
    /// requests arriving together share one resume. Returns once it runs.
    async fn wake(&self, id: &str) -> CoreResult<()> {
        let deadline = tokio::time::Instant::now() + crate::engine::WAIT_LIMIT;
        loop {
            let row = self
                .store
                .sandbox_by_id(id)
                .await?
                .ok_or_else(|| CoreError::not_found(Kind::Sandbox, id))?;
            match row.state {
                SandboxState::Running => return Ok(()),
                SandboxState::Paused | SandboxState::Suspended => {
                    match self.submit_resume(row).await {
                        Ok(submitted) => {
                            let op = self.engine.wait(&submitted.operation).await?;
                            let outcome = if op.error.is_none() { "ok" } else { "failed" };
                            self.audit("auto-resume", None, "sandbox.resume", Some(id), outcome)
                                .await;
                            if let Some(e) = op.error {
                                return Err(CoreError::Unreachable {
                                    id: id.into(),
                                    reason: crate::error::Unreachable::NotResumed(e.message),
                                });
                            }
                        }
                        // Another request's resume got there first.
                        Err(CoreError::InvalidState { .. }) => {}
                        Err(e) => return Err(e),
                    }
                }
                SandboxState::Resuming => tokio::time::sleep(std::time::Duration::from_millis(50)).await,
                state => {
                    return Err(CoreError::InvalidState {
                        id: id.into(),
                        state,
                        need: "it must be running".into(),
                    })
                }
            }
            if tokio::time::Instant::now() > deadline {
                return Err(CoreError::Unavailable(format!("sandbox {id} is still resuming; retry")));
            }
        }
    }

    /// The guest agent of a running sandbox (resumed first if it is held and asked for that).
    pub async fn agent_for(&self, row: &SandboxRecord) -> CoreResult<AgentClient> {
        let held = matches!(
            row.state,
            SandboxState::Paused | SandboxState::Suspended | SandboxState::Resuming
        );
        if held && row.lifecycle.auto_resume {
            self.wake(&row.id).await?;
        } else if row.state != SandboxState::Running {
            return Err(CoreError::InvalidState {
                id: row.id.clone(),
                state: row.state,
                need: match row.state {
                    SandboxState::Paused | SandboxState::Suspended => "it must be running; resume it first".into(),
                    _ => "it must be running".into(),
                },
            });
        }
        self.nodes
            .agent_of_run(&row.id, &row.node, &row.run)
            .await
            .map_err(|e| CoreError::node(&row.id, e))
    }
}

/// Every lifecycle request leaves an audit row (who, tenant, action, object, result).
impl Core {
    /// Create as `principal` (a signed-in one may pick egress profiles).
    pub async fn create_sandbox(&self, principal: &Principal, req: CreateSandbox) -> CoreResult<Created> {
        let tenant = acting_tenant(principal)?;
        let r = self.create_sandbox_unaudited(principal, tenant, req).await;
        let object = r.as_ref().ok().map(|c| c.sandbox_id.clone());
        self.audit(
            &principal.actor(),
            Some(&tenant.name),
            "sandbox.create",
            object.as_deref(),
            Self::outcome(&r),
        )
        .await;
        r
    }

    pub async fn delete_sandbox(&self, principal: &Principal, id: &str) -> CoreResult<Operation> {
        self.delete_sandbox_by(&principal.actor(), acting_tenant(principal)?, id)
            .await
    }

    /// A delete on behalf of `actor` (a principal's, or the platform account's).
    pub(crate) async fn delete_sandbox_by(&self, actor: &str, tenant: &Tenant, id: &str) -> CoreResult<Operation> {
        let r = self.delete_sandbox_unaudited(tenant, id).await;
        self.audit(actor, Some(&tenant.name), "sandbox.delete", Some(id), Self::outcome(&r))
            .await;
        r
    }

    pub async fn change_sandbox(&self, principal: &Principal, id: &str, change: Change) -> CoreResult<Operation> {
        let tenant = acting_tenant(principal)?;
        let r = self.change_sandbox_unaudited(tenant, id, change).await;
        let action = match change {
            Change::Pause => "sandbox.pause",
            Change::Suspend => "sandbox.suspend",
            Change::Resume => "sandbox.resume",
        };
        self.audit(
            &principal.actor(),
            Some(&tenant.name),
            action,
            Some(id),
            Self::outcome(&r),
        )
        .await;
        r
    }
}

/// A lifecycle change of a live sandbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Change {
    /// Freeze it in memory.
    Pause,
    /// Save it to disk and end its VM.
    Suspend,
    /// Run a paused or suspended one again.
    Resume,
}

/// The tenant a lifecycle request acts for: a sandbox's own token never manages sandboxes.
pub(crate) fn acting_tenant(principal: &Principal) -> CoreResult<&Tenant> {
    principal
        .tenant()
        .ok_or_else(|| CoreError::Forbidden("a sandbox's token can't manage sandboxes".into()))
}
