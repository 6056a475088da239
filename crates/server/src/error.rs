//! `CoreError`: everything the core (and the engine below it) can fail with, as conditions a
//! caller can act on. Each door turns it into its wire format in exactly one place
//! (`native::error::ApiError`, `e2b::E2bError`, `e2b::connect::RpcError`).

use crate::model::SandboxState;
use crate::nodes::NodeError;
use crate::store::StoreError;
use airlock_agent_client::AgentError;
use airlock_proto::ErrorCode;

/// What a `NotFound` or an agent error was about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Sandbox,
    Session,
    Operation,
    Template,
    /// A process inside a sandbox (E2B selects them by pid or tag).
    Process,
    /// A file or directory inside a sandbox.
    File,
    Watcher,
    Route,
    Tenant,
    /// An API key, by its id.
    Key,
    Snapshot,
    Volume,
    /// A scrape token of `GET /metrics`, by its id.
    ScrapeToken,
    Webhook,
}

impl Kind {
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Sandbox => "sandbox",
            Kind::Session => "session",
            Kind::Operation => "operation",
            Kind::Template => "template",
            Kind::Process => "process",
            Kind::File => "file",
            Kind::Watcher => "watcher",
            Kind::Route => "route",
            Kind::Tenant => "tenant",
            Kind::Key => "key",
            Kind::Snapshot => "snapshot",
            Kind::Volume => "volume",
            Kind::ScrapeToken => "scrape token",
            Kind::Webhook => "webhook",
        }
    }
}

impl std::fmt::Display for Kind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[derive(Debug, thiserror::Error)]
pub enum CoreError {
    /// Missing, or owned by another tenant: both answer the same.
    #[error("{kind} {id:?} not found{hint}")]
    NotFound { kind: Kind, id: String, hint: String },
    #[error("{field}: {reason}")]
    InvalidField { field: String, reason: String },
    #[error("invalid resources: {0}")]
    InvalidResources(String),
    #[error("sandbox {id} is {}; {need}", state.as_str())]
    InvalidState {
        id: String,
        state: SandboxState,
        need: String,
    },
    /// One of a tenant's quotas (`sandboxes`, `vcpu`, `memory_mib`, `disk_mib`) would be exceeded.
    #[error("{}", quota_message(tenant, quota, *used, *asked, *limit))]
    QuotaExceeded {
        tenant: String,
        quota: &'static str,
        used: u64,
        asked: u64,
        limit: u64,
    },
    /// The tenant's `creates_per_minute` is used up for now.
    #[error("tenant {tenant} may create {limit} sandboxes a minute and has; retry in {retry_after_s} s")]
    RateLimited {
        tenant: String,
        limit: u32,
        retry_after_s: u64,
    },
    /// Too many failed sign-ins to the console account lately, from this client's address or
    /// (`from`) all remote ones: no password is even checked until the window has room again.
    #[error("too many failed sign-ins {from} in the last {window_s} s; retry in {retry_after_s} s")]
    SignInThrottled {
        from: &'static str,
        window_s: u64,
        retry_after_s: u64,
    },
    /// A sandbox already runs as many sessions (processes started through either door) as the
    /// server allows at once.
    #[error("sandbox {sandbox} has {running} running sessions, its tenant's quota of {limit} (sessions_per_sandbox); wait for one to exit or kill one first")]
    SessionLimit { sandbox: String, running: u32, limit: u32 },
    /// A sandbox holds as many file watchers as its node keeps for one.
    #[error("sandbox {sandbox} holds {limit} watchers, the most allowed; remove one first")]
    WatcherLimit { sandbox: String, limit: usize },
    /// As many uploads as allowed are under way (`scope`: to this sandbox, for this tenant, on
    /// this server), and none ended while this one waited.
    #[error("{limit} uploads are under way {scope}, the most allowed; retry when one has ended")]
    TooManyUploads {
        scope: &'static str,
        limit: usize,
        retry_after_s: u64,
    },
    /// No node takes the sandbox: each node's reason (its budget, or why it takes none now).
    #[error("no node can take this sandbox: {0}")]
    NoNodeFits(String),
    /// This node has no room left for the sandbox in one of its budgets (`vcpu`, `memory`,
    /// `disk`), whoever holds the rest: it comes back as sandboxes are deleted.
    #[error("this node's {budget} budget is exhausted: the sandbox asks for {asked} {unit}, {left} {unit} of {total} {unit} are left{hint}")]
    NodeBudgetExceeded {
        budget: &'static str,
        unit: &'static str,
        asked: u64,
        left: u64,
        total: u64,
        /// What the operator can change (` (--vcpu-overcommit)`), or empty.
        hint: String,
    },
    /// An egress rule, profile name or network option that is refused (a wildcard, a malformed
    /// entry, an unknown profile); the message names the entry.
    #[error("egress: {0}")]
    Egress(#[from] airlock_egress::ConfigError),
    /// A create asked to allow what its tenant's policy does not (egress may only be narrowed).
    #[error(
        "{field}: \"{entry}\" is not allowed by the tenant's egress policy; a sandbox's egress can only be narrowed"
    )]
    EgressNotAllowed { field: String, entry: String },
    #[error("option `{option}` is not supported by airlock{reason}")]
    Unsupported { option: String, reason: String },
    #[error("{0}")]
    Unauthenticated(String),
    /// Authenticated, but this credential may not do this (a tenant key on an admin route).
    #[error("{0}")]
    Forbidden(String),
    /// The object exists already, or its state forbids the change: which, in `Conflict`.
    #[error(transparent)]
    Conflict(#[from] Conflict),
    /// A failure of the server itself that no caller can act on, with its cause.
    #[error(transparent)]
    Internal(#[from] InternalError),
    /// The guest agent answered with an error about `kind` (a file, a process).
    #[error("{source}")]
    Guest { kind: Kind, source: AgentError },
    /// The guest agent does not answer (VM gone, channel down, hostile agent), or the sandbox did
    /// not come back to answer; `reason` keeps the cause.
    #[error("sandbox {id} is unreachable: {reason}")]
    Unreachable {
        id: String,
        #[source]
        reason: Unreachable,
    },
    /// The node failed at what it was asked (see `NodeError` for what a caller can act on).
    #[error(transparent)]
    Node(NodeError),
    #[error("{0}")]
    Unavailable(String),
    #[error(transparent)]
    Store(StoreError),
}

pub type CoreResult<T> = Result<T, CoreError>;

/// Why a sandbox's agent can't be reached (502 `sandbox_unreachable` at both doors).
#[derive(Debug, thiserror::Error)]
pub enum Unreachable {
    /// The channel to the agent failed (not an answer of the agent's own).
    #[error("{0}")]
    Agent(#[source] AgentError),
    /// The node has no agent for it (its VM is gone or not running).
    #[error("{0}")]
    Node(#[source] NodeError),
    /// A held sandbox a request reached did not resume: the operation's error message.
    #[error("it did not resume: {0}")]
    NotResumed(String),
    /// A snapshot's save failed: the operation's error message.
    #[error("it could not be saved: {0}")]
    NotSaved(String),
}

/// Why a change conflicts with what exists (409 `conflict` at both doors).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Conflict {
    /// A snapshot's name is taken by another snapshot or a template.
    #[error("a snapshot or template named {0:?} exists")]
    NameTaken(String),
    #[error("tenant {0} exists")]
    TenantExists(String),
    /// `default` can't be deleted: it holds the server's bootstrap key.
    #[error("tenant default holds the server's bootstrap key; revoke its keys instead")]
    DefaultTenant,
    /// A volume is held by sandboxes in a way that refuses the change (the message names them).
    #[error("{0}")]
    VolumeBusy(String),
    #[error("a volume named {0:?} exists")]
    VolumeNameTaken(String),
}

/// A failure of the server itself (500 `internal`), keeping what caused it.
#[derive(Debug, thiserror::Error)]
pub enum InternalError {
    #[error("hashing the console password: {0}")]
    PasswordHash(#[source] argon2::password_hash::Error),
    /// The upload semaphores were closed (they never are while the core lives).
    #[error("upload slots closed")]
    UploadSlotsClosed(#[source] tokio::sync::AcquireError),
}

/// Stable snake_case code and the HTTP status class of an error; doors start from this.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Code {
    pub code: &'static str,
    pub status: u16,
}

impl CoreError {
    pub fn not_found(kind: Kind, id: impl Into<String>) -> Self {
        CoreError::NotFound {
            kind,
            id: id.into(),
            hint: String::new(),
        }
    }

    pub fn invalid(field: impl Into<String>, reason: impl Into<String>) -> Self {
        CoreError::InvalidField {
            field: field.into(),
            reason: reason.into(),
        }
    }

    /// `budget` is `vcpu`, `memory` or `disk` (as the store names them).
    pub fn node_budget(budget: &'static str, asked: u64, used: u64, total: u64) -> Self {
        let (unit, hint) = match budget {
            "vcpu" => ("vCPUs", " (the host's CPUs times --vcpu-overcommit)"),
            "memory" => ("MiB", " (the host's memory less --memory-reserve-mib)"),
            _ => (
                "MiB",
                " (the data dir's free space less --disk-reserve-mib, counting every sandbox's disk at its full size, and snapshots)",
            ),
        };
        CoreError::NodeBudgetExceeded {
            budget,
            unit,
            asked,
            left: total.saturating_sub(used),
            total,
            hint: hint.into(),
        }
    }

    pub fn unsupported(option: impl Into<String>, reason: impl Into<String>) -> Self {
        let reason = reason.into();
        CoreError::Unsupported {
            option: option.into(),
            reason: if reason.is_empty() {
                reason
            } else {
                format!(": {reason}")
            },
        }
    }

    /// A tenant's quota error names the tenant (the store knows only its id).
    pub fn for_tenant(self, name: &str) -> Self {
        match self {
            CoreError::QuotaExceeded {
                quota,
                used,
                asked,
                limit,
                ..
            } => CoreError::QuotaExceeded {
                tenant: name.into(),
                quota,
                used,
                asked,
                limit,
            },
            CoreError::RateLimited {
                limit, retry_after_s, ..
            } => CoreError::RateLimited {
                tenant: name.into(),
                limit,
                retry_after_s,
            },
            other => other,
        }
    }

    /// Seconds after which a refused request may succeed, for a `Retry-After` header.
    pub fn retry_after(&self) -> Option<u64> {
        match self {
            CoreError::RateLimited { retry_after_s, .. } | CoreError::SignInThrottled { retry_after_s, .. } => {
                Some(*retry_after_s)
            }
            CoreError::TooManyUploads { retry_after_s, .. } => Some(*retry_after_s),
            _ => None,
        }
    }

    /// Sandbox `sandbox_id`'s node could not carry a call about it out.
    pub fn node(sandbox_id: &str, e: crate::nodes::NodeError) -> Self {
        CoreError::Unreachable {
            id: sandbox_id.into(),
            reason: Unreachable::Node(e),
        }
    }

    /// An agent error while addressing `kind`; transport failures mean the sandbox is unreachable.
    pub fn agent(kind: Kind, sandbox_id: &str, e: AgentError) -> Self {
        match e {
            AgentError::Api { .. } => CoreError::Guest { kind, source: e },
            other => CoreError::Unreachable {
                id: sandbox_id.into(),
                reason: Unreachable::Agent(other),
            },
        }
    }

    /// The code and status every door starts from (the E2B door narrows statuses to what its
    /// SDKs know).
    pub fn code(&self) -> Code {
        let c = |code, status| Code { code, status };
        match self {
            CoreError::NotFound { kind, .. } => c(not_found_code(*kind), 404),
            CoreError::InvalidField { .. } => c("invalid_argument", 422),
            CoreError::InvalidResources(_) => c("invalid_resources", 422),
            CoreError::InvalidState { .. } => c("invalid_state", 409),
            CoreError::QuotaExceeded { .. } | CoreError::SessionLimit { .. } | CoreError::WatcherLimit { .. } => {
                c("quota_exceeded", 429)
            }
            CoreError::RateLimited { .. } | CoreError::SignInThrottled { .. } => c("rate_limited", 429),
            // At every scope: a busy server is a reason to slow down, not a failure of it.
            CoreError::TooManyUploads { .. } => c("too_many_uploads", 429),
            // 503, not 429: the caller is within its own quota; the node is full (for everyone)
            // until sandboxes go, and a client or balancer retries later or elsewhere.
            CoreError::NodeBudgetExceeded { .. } => c("node_budget_exceeded", 503),
            CoreError::NoNodeFits(_) => c("no_node_fits", 503),
            CoreError::Unsupported { .. } => c("unsupported", 422),
            CoreError::Egress(_) => c("invalid_egress", 400),
            CoreError::EgressNotAllowed { .. } => c("egress_not_allowed", 400),
            CoreError::Unauthenticated(_) => c("unauthorized", 401),
            CoreError::Forbidden(_) => c("forbidden", 403),
            CoreError::Conflict(_) => c("conflict", 409),
            CoreError::Internal(_) => c("internal", 500),
            CoreError::Guest { kind, source } => match source.code() {
                Some(ErrorCode::NotFound) => c(not_found_code(*kind), 404),
                Some(ErrorCode::AlreadyExists) => c("already_exists", 409),
                Some(ErrorCode::InvalidArgument) => c("invalid_argument", 400),
                Some(ErrorCode::NotADirectory) => c("not_a_directory", 400),
                Some(ErrorCode::IsADirectory) => c("is_a_directory", 400),
                Some(ErrorCode::PermissionDenied) => c("permission_denied", 403),
                Some(ErrorCode::Internal) | None => c("guest_error", 500),
            },
            CoreError::Unreachable { .. } => c("sandbox_unreachable", 502),
            CoreError::Node(e) => match e {
                NodeError::BootFailed(_) => c("boot_failed", 500),
                NodeError::SandboxIdTaken(_) => c("conflict", 409),
                NodeError::InvalidSandboxId(_) => c("invalid_argument", 422),
                NodeError::NotRunning(_) => c("invalid_state", 409),
                // Internal calls (a reaper's, a stalled replica's) that the node turned away;
                // named here so a new variant is placed deliberately.
                NodeError::StaleRun(_) | NodeError::Fenced(_) => c("conflict", 409),
                // The node has no room left: retry later or elsewhere, as for budgets.
                NodeError::Exhausted(_) => c("unavailable", 503),
                NodeError::Network(_) => c("network", 500),
                // Its VMs' fate is unknown: retry later (or elsewhere, once there are others).
                NodeError::Unreachable(_) => c("node_unreachable", 503),
                // Every node a create was offered to turned it away (see `nodes/admission.rs`).
                NodeError::Refused(..) => c("node_refused", 503),
                // Never a caller's request: the engine falls back (a suspend on its own disk).
                NodeError::Unsupported(_) => c("unavailable", 503),
                // `From<NodeError>` makes these `NotFound`/`InvalidResources`; named so that a
                // new variant must be placed here deliberately.
                NodeError::UnknownTemplate(_)
                | NodeError::UnknownSandbox(_)
                | NodeError::UnknownImage(_)
                | NodeError::InvalidResources(_)
                | NodeError::BadImage(_)
                | NodeError::InvalidVolume(_)
                | NodeError::UnknownVolume(_)
                | NodeError::VolumeBusy(_)
                | NodeError::Failed(_) => c("runtime", 500),
            },
            CoreError::Unavailable(_) => c("unavailable", 503),
            CoreError::Store(_) => c("internal", 500),
        }
    }
}

fn not_found_code(kind: Kind) -> &'static str {
    match kind {
        Kind::Sandbox => "sandbox_not_found",
        Kind::Session => "session_not_found",
        Kind::Operation => "operation_not_found",
        Kind::Template => "template_not_found",
        Kind::Process => "process_not_found",
        Kind::File => "file_not_found",
        Kind::Watcher => "watcher_not_found",
        Kind::Route => "route_not_found",
        Kind::Tenant => "tenant_not_found",
        Kind::Key => "key_not_found",
        Kind::Snapshot => "snapshot_not_found",
        Kind::Volume => "volume_not_found",
        Kind::ScrapeToken => "scrape_token_not_found",
        Kind::Webhook => "webhook_not_found",
    }
}

impl From<StoreError> for CoreError {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::QuotaExceeded {
                quota,
                used,
                asked,
                limit,
            } => CoreError::QuotaExceeded {
                tenant: String::new(),
                quota,
                used,
                asked,
                limit,
            },
            StoreError::RateLimited { limit, retry_after_s } => CoreError::RateLimited {
                tenant: String::new(),
                limit,
                retry_after_s,
            },
            StoreError::NodeBudgetExceeded {
                budget,
                asked,
                used,
                total,
            } => CoreError::node_budget(budget, asked, used, total),
            other => CoreError::Store(other),
        }
    }
}

/// Node conditions a caller can act on become their own variants; the rest stay `Node`.
impl From<NodeError> for CoreError {
    fn from(e: NodeError) -> Self {
        match e {
            NodeError::UnknownTemplate(name) => CoreError::NotFound {
                kind: Kind::Template,
                id: name,
                hint: "; `airlock template ls` lists the templates".into(),
            },
            NodeError::UnknownSandbox(id) => CoreError::not_found(Kind::Sandbox, id),
            NodeError::UnknownImage(id) => CoreError::not_found(Kind::Snapshot, id),
            NodeError::InvalidResources(m) => CoreError::InvalidResources(m),
            NodeError::BadImage(m) => CoreError::invalid("from", m),
            NodeError::InvalidVolume(m) => CoreError::invalid("volumes", m),
            NodeError::UnknownVolume(id) => CoreError::not_found(Kind::Volume, id),
            NodeError::VolumeBusy(m) => CoreError::Conflict(Conflict::VolumeBusy(m)),
            other => CoreError::Node(other),
        }
    }
}

fn quota_message(tenant: &str, quota: &str, used: u64, asked: u64, limit: u64) -> String {
    let how = "delete one first, or have the operator raise it (`airlock tenant quota set`)";
    if quota == "sandboxes" {
        return format!("tenant {tenant} has {used} live sandboxes, its quota of {limit} (sandboxes); {how}");
    }
    // Disk is also held by snapshots and saved memory (and asked for by saves and suspends).
    let holders = if quota == "disk_mib" {
        "live sandboxes and snapshots"
    } else {
        "live sandboxes"
    };
    format!(
        "tenant {tenant}'s {quota} quota is {limit}: its {holders} hold {used} and this one asks for {asked}; {how}"
    )
}
