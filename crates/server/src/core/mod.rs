//! The door-neutral core: typed requests in, typed results out, `CoreError` for every failure.
//! Both doors (native `/v1`, E2B) call these services and only translate wire formats; a rule
//! (auth, admission, timeouts, env names, signals, quotas) lives here once.
//!
//! - `accounts`: `root@local`, admin sign-in, tenants, keys, the audit log
//! - `audit`: refusals' audit rows, coalesced (a count per kind per minute)
//! - `sign_in`: the sign-in throttle (per client address, a ceiling for remote ones)
//! - `principal`: who is calling (API key, sandbox access token, signed URL)
//! - `sandboxes`: admission and lifecycle (through the operation engine)
//! - `sessions`: every process started through either door, with an id
//! - `files`: file operations inside a running sandbox (envd's semantics: user metadata,
//!   symlinks resolved)
//! - `uploads`: how many uploads may be under way (per sandbox, per tenant, on the server)
//! - `metrics`: each sandbox's sampled metrics history, for windows of it
//! - `templates`: template names and aliases
//! - `tenants`: a tenant's quotas (its own over the server's defaults) and usage
//! - `placement`: which node a new sandbox goes to, and each node's budgets
//! - `egress`: a new sandbox's egress (profiles, the tenant policy, narrowing), carried to its
//!   node with the create; the report

pub mod accounts;
pub mod audit;
pub mod builds;
pub mod egress;
pub mod events;
pub mod federation;
pub mod files;
pub mod metrics;
pub(crate) mod placement;
pub mod principal;
pub mod sandboxes;
pub mod scrape;
pub mod sessions;
pub mod sign_in;
pub mod snapshots;
pub mod templates;
pub mod tenants;
pub mod uploads;
pub mod volumes;
pub mod webhooks;

pub use crate::error::{Conflict, CoreError, CoreResult, InternalError, Kind, Unreachable};
pub use crate::nodes::watches::Taken as WatchTaken;
pub use crate::nodes::{NodeError, WatchSpec};
/// What a sandbox id looks like and the code interpreter's port, as the node defines them: the
/// ingress routes by them without knowing the runtime.
pub use airlock_runtime::sandbox::valid_sandbox_id;
pub use airlock_runtime::template::CODE_INTERPRETER_PORT;
pub use principal::{Accept, Credentials, Principal, SandboxTokens, Via, CREDENTIAL_HEADERS};

use crate::engine::Engine;
use crate::nodes::{Capacity, Nodes};
use crate::store::{NodeBudget, Store};
use std::path::Path;
use std::sync::Arc;

/// Limits the operator sets at start-up.
#[derive(Debug, Clone)]
pub struct Config {
    /// Live sandboxes (creating, running, paused, deleting) one tenant may have at once.
    pub max_sandboxes_per_tenant: u32,
    /// vCPUs, memory and disk (MiB) one tenant's sandboxes (and snapshots) may hold together
    /// where the operator set no quota of the tenant's own; `None`: `tenant_share` of the
    /// node's budget.
    pub max_vcpu_per_tenant: Option<u64>,
    pub max_memory_mib_per_tenant: Option<u64>,
    pub max_disk_mib_per_tenant: Option<u64>,
    /// The part of each node budget a tenant gets by default (where the limit above is `None`);
    /// 1: no limit of the tenant's, the node's budgets alone.
    pub tenant_share: f64,
    /// Creates one tenant may make in any 60 seconds, where it has no quota of its own.
    pub max_creates_per_minute: u32,
    /// The node's vCPU budget is its CPUs times this (idle sandboxes use little CPU).
    pub vcpu_overcommit: f64,
    /// Memory kept for the host: the sandboxes' memory sums to at most the rest (no overcommit:
    /// a guest touching all its RAM must not push the host into the OOM killer).
    pub memory_reserve_mib: u64,
    /// Disk space kept free on the data dir's filesystem; no create is admitted below it.
    pub disk_reserve_mib: u64,
    /// Sessions (processes started through either door) one sandbox may run at once; the next
    /// start is refused (`quota_exceeded`) until one exits.
    pub max_sessions_per_sandbox: u32,
    /// Exited sessions the store keeps per sandbox (for their exit status); the oldest go first.
    pub max_finished_sessions_per_sandbox: u32,
    /// After a restart, how long a request about a sandbox the recovery has not yet settled
    /// waits for it before it is answered `unavailable` (503).
    pub recovery_wait: std::time::Duration,
    /// Many hosts: how long every replica must have had no answer from a node before its
    /// running sandboxes are lost.
    pub node_grace: std::time::Duration,
    /// The platform's always-denied ranges and the egress profiles (`AIRLOCK_EGRESS_PROFILES`).
    pub egress: airlock_egress::EgressConfig,
    /// Issuers whose JWTs sign callers in (`--jwt-issuers`); none by default.
    pub federation: federation::Federation,
    /// Uploads under way at once, per sandbox, per tenant and on the whole server.
    pub uploads: uploads::UploadLimits,
    /// Where uploaded build contexts are kept (per tenant); None: builds cannot COPY.
    pub build_contexts: Option<std::path::PathBuf>,
    /// Where builds from OCI images pull them (mirrors, the registries allowed).
    pub registries: airlock_runtime::template::Registries,
    /// Webhooks may point at the platform's denied ranges (loopback, private, link-local,
    /// metadata), documentation ranges and this host's addresses: off unless the operator says
    /// so (`serve --webhook-allow-private`; the tests' receivers).
    pub webhook_allow_private: bool,
    /// This host's own addresses (its interfaces' and its listeners'): webhooks never go there.
    /// A replica of a cluster needs them said: its sandboxes' egress denies (a node's) name the
    /// node's host, not the replica's.
    pub webhook_host_addrs: Vec<std::net::IpAddr>,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            max_sandboxes_per_tenant: 20,
            max_vcpu_per_tenant: None,
            max_memory_mib_per_tenant: None,
            max_disk_mib_per_tenant: None,
            tenant_share: DEFAULT_TENANT_SHARE,
            max_creates_per_minute: DEFAULT_MAX_CREATES_PER_MINUTE,
            vcpu_overcommit: DEFAULT_VCPU_OVERCOMMIT,
            memory_reserve_mib: DEFAULT_MEMORY_RESERVE_MIB,
            disk_reserve_mib: DEFAULT_DISK_RESERVE_MIB,
            max_sessions_per_sandbox: DEFAULT_MAX_SESSIONS_PER_SANDBOX,
            max_finished_sessions_per_sandbox: DEFAULT_MAX_FINISHED_SESSIONS_PER_SANDBOX,
            recovery_wait: crate::engine::RECOVERY_WAIT,
            node_grace: crate::engine::NODE_GRACE,
            egress: airlock_egress::EgressConfig::new(
                airlock_egress::PlatformDenies::new(Vec::new()),
                airlock_egress::Profiles::default(),
            ),
            federation: Default::default(),
            uploads: Default::default(),
            build_contexts: None,
            registries: Default::default(),
            webhook_allow_private: false,
            webhook_host_addrs: Vec::new(),
        }
    }
}

/// Concurrent sessions per sandbox by default (the guest agent keeps up to 32 MiB of output for
/// each running process).
pub const DEFAULT_MAX_SESSIONS_PER_SANDBOX: u32 = 64;
/// Exited sessions kept per sandbox by default (as many as the guest agent remembers).
pub const DEFAULT_MAX_FINISHED_SESSIONS_PER_SANDBOX: u32 = 256;

/// A tenant gets at most half of each of the node's budgets by default: whatever the host's
/// size, no one tenant takes the whole node (a single-tenant operator raises it with
/// `--tenant-share 1` or a quota of the tenant's own).
pub const DEFAULT_TENANT_SHARE: f64 = 0.5;
/// One create a second, sustained: a loop of creates and deletes can't keep the node's CPUs
/// busy restoring VMs for one tenant; bursts (the E2B suite, a fork of 20) stay well within.
pub const DEFAULT_MAX_CREATES_PER_MINUTE: u32 = 60;

/// vCPUs are shared in time and idle sandboxes barely use theirs, so the vCPU budget is
/// generous (a 2-core host holds 32 one-vCPU sandboxes); memory and disk are the hard budgets.
pub const DEFAULT_VCPU_OVERCOMMIT: f64 = 16.0;
pub const DEFAULT_MEMORY_RESERVE_MIB: u64 = 1024;
pub const DEFAULT_DISK_RESERVE_MIB: u64 = 2048;

impl Config {
    /// The limits a tenant has where the operator set none of its own, on a node with `budget`.
    pub fn default_quota(&self, budget: &NodeBudget) -> crate::model::Quota {
        // At least 1: a zero would lock the tenant out (a node with nothing left refuses anyway).
        // The whole node is no limit of the tenant's: a full node says so (503), not a quota.
        let share =
            |total: u64| (self.tenant_share < 1.0).then(|| ((total as f64 * self.tenant_share).floor() as u64).max(1));
        crate::model::Quota {
            sandboxes: Some(self.max_sandboxes_per_tenant),
            vcpu: self.max_vcpu_per_tenant.or_else(|| share(budget.vcpu)),
            memory_mib: self.max_memory_mib_per_tenant.or_else(|| share(budget.memory_mib)),
            disk_mib: self.max_disk_mib_per_tenant.or_else(|| share(budget.disk_mib)),
            sessions_per_sandbox: Some(self.max_sessions_per_sandbox),
            creates_per_minute: Some(self.max_creates_per_minute),
            // Volumes are held on disk like sandboxes' disks: the same share of the node's.
            volume_mib: share(budget.disk_mib),
        }
    }

    /// The node's budgets for its live sandboxes together: vCPUs are `cpus x vcpu_overcommit`;
    /// memory is the host's less the reserve; disk (every sandbox's disk counted at its full
    /// size) is what the sandboxes already hold plus what is free, less the reserve, and none at
    /// all once free space is below the reserve.
    pub fn budget(&self, c: &Capacity) -> NodeBudget {
        let disk_mib = if c.disk_free_mib < self.disk_reserve_mib {
            0
        } else {
            c.disk_free_mib - self.disk_reserve_mib + c.disk_held_mib
        };
        NodeBudget {
            vcpu: (c.cpus as f64 * self.vcpu_overcommit).floor().max(0.0) as u64,
            memory_mib: c.memory_mib.saturating_sub(self.memory_reserve_mib),
            disk_mib,
        }
    }
}

/// The core's handle: cheap to clone, shared by every door.
#[derive(Clone)]
pub struct Core {
    /// The store, the node seam and the engine are the core's own: the doors reach them only
    /// through the core's methods (the accessors below are for the server's assembly and
    /// white-box tests).
    store: Arc<dyn Store>,
    nodes: Arc<dyn Nodes>,
    engine: Engine,
    pub config: Arc<Config>,
    /// Derives sandbox access tokens (see `principal`).
    secret: Arc<[u8]>,
    /// Refusals' audit rows still counting repeats (see `audit`).
    audits: Arc<audit::AuditCoalescer>,
    /// Every live sandbox's recent metrics (see `metrics`).
    pub metrics: Arc<metrics::MetricsHistory>,
    /// The uploads under way (see `uploads`).
    uploads: Arc<uploads::Uploads>,
}

impl Core {
    /// The store, for the server's assembly and white-box tests.
    pub fn store(&self) -> &Arc<dyn Store> {
        &self.store
    }

    /// The node seam, for the server's assembly and white-box tests.
    pub fn nodes(&self) -> &Arc<dyn Nodes> {
        &self.nodes
    }

    /// The operation engine, for the server's assembly (recovery, the reaper) and white-box tests.
    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    pub fn new(store: Arc<dyn Store>, nodes: Arc<dyn Nodes>, config: Config, secret: Vec<u8>) -> Self {
        let engine = Engine::new(store.clone(), nodes.clone())
            .with_recovery_wait(config.recovery_wait)
            .with_node_grace(config.node_grace);
        let uploads = Arc::new(uploads::Uploads::new(config.uploads.clone()));
        Self {
            store,
            nodes,
            engine,
            config: Arc::new(config),
            secret: secret.into(),
            audits: Default::default(),
            metrics: Default::default(),
            uploads,
        }
    }
}

/// A fresh random id: `prefix`, then `bytes` random bytes in hex.
pub fn random_id(prefix: &str, bytes: usize) -> String {
    format!("{prefix}{}", airlock_runtime::datadir::random_hex(bytes))
}

/// `<data-dir>/server.secret` (0600, 32 random bytes), made on first start.
pub fn load_or_create_secret(data_dir: &Path) -> std::io::Result<Vec<u8>> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let path = data_dir.join("server.secret");
    match std::fs::read(&path) {
        Ok(s) if s.len() >= 32 => return Ok(s),
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    let mut secret = vec![0u8; 32];
    std::fs::File::open("/dev/urandom").and_then(|mut f| std::io::Read::read_exact(&mut f, &mut secret))?;
    // Written under a temporary name and renamed: a crash never leaves half a secret.
    let tmp = data_dir.join(".server.secret.tmp");
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(true)
        .write(true)
        .mode(0o600)
        .open(&tmp)?;
    f.write_all(&secret)?;
    f.sync_all()?;
    std::fs::rename(&tmp, &path)?;
    Ok(secret)
}

/// How long readiness waits for the store.
const READY_WITHIN: std::time::Duration = std::time::Duration::from_secs(2);

/// What a ready replica answers: how many nodes take sandboxes now (none is still ready: a
/// create then says why with `no_node_fits`, which beats a connection refused).
#[derive(Debug, serde::Serialize)]
pub struct Readiness {
    pub nodes_ready: usize,
    pub nodes: usize,
}

impl Core {
    /// Whether this replica can serve: its store answers within `READY_WITHIN` (2 s).
    pub async fn readiness(&self) -> CoreResult<Readiness> {
        match tokio::time::timeout(READY_WITHIN, self.store.needs_bootstrap()).await {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => return Err(CoreError::Unavailable(format!("the store does not answer: {e}"))),
            Err(_) => {
                return Err(CoreError::Unavailable(format!(
                    "the store does not answer within {READY_WITHIN:?}"
                )))
            }
        }
        let members = self.nodes.members();
        Ok(Readiness {
            nodes_ready: members.iter().filter(|m| m.refuses.is_none()).count(),
            nodes: members.len(),
        })
    }

    /// What the server tells a caller about itself: version, accelerator, runtimes, egress
    /// configuration; with `node_wide` (the platform account only) also the node's counts and
    /// warm pools, every tenant's business together.
    pub async fn system_info(&self, node_wide: bool) -> crate::model::SystemInfo {
        let capacity = self.nodes.capacity();
        crate::model::SystemInfo {
            version: env!("CARGO_PKG_VERSION").into(),
            accel: self.nodes.accel().await,
            runtimes: vec![self.nodes.runtime_name()],
            capacity: node_wide.then_some(crate::model::Capacity {
                cpus: capacity.cpus,
                memory_mib: capacity.memory_mib,
                sandboxes_running: capacity.sandboxes_running,
            }),
            egress: self.egress_info(),
            pools: node_wide.then(|| self.pools()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn capacity(cpus: u32, memory_mib: u64, disk_free_mib: u64, disk_held_mib: u64) -> Capacity {
        Capacity {
            cpus,
            memory_mib,
            disk_free_mib,
            disk_held_mib,
            ..Capacity::default()
        }
    }

    #[test]
    fn budgets_come_from_capacity_overcommit_and_reserves() {
        let config = Config::default();
        let b = config.budget(&capacity(8, 16384, 100_000, 0));
        assert_eq!(b.vcpu, 128, "16x the CPUs by default");
        assert_eq!(b.memory_mib, 16384 - 1024);
        assert_eq!(b.disk_mib, 100_000 - 2048);

        let config = Config {
            vcpu_overcommit: 1.5,
            memory_reserve_mib: 0,
            ..Config::default()
        };
        let b = config.budget(&capacity(3, 512, 100_000, 0));
        assert_eq!((b.vcpu, b.memory_mib), (4, 512));
        // A reserve larger than the host leaves nothing, without wrapping.
        let b = Config::default().budget(&capacity(1, 512, 0, 0));
        assert_eq!((b.memory_mib, b.disk_mib), (0, 0));
    }

    #[test]
    fn default_quotas_are_a_share_of_the_node_unless_set() {
        let budget = NodeBudget {
            vcpu: 32,
            memory_mib: 23 * 1024,
            disk_mib: 68_000,
        };
        let q = Config::default().default_quota(&budget);
        assert_eq!(
            (q.vcpu, q.memory_mib, q.disk_mib),
            (Some(16), Some(23 * 512), Some(34_000))
        );
        assert_eq!((q.sandboxes, q.creates_per_minute), (Some(20), Some(60)));
        let config = Config {
            max_vcpu_per_tenant: Some(4),
            tenant_share: 1.0,
            ..Config::default()
        };
        let q = config.default_quota(&budget);
        assert_eq!((q.vcpu, q.memory_mib, q.disk_mib), (Some(4), None, None));
        // Never 0, which would lock the tenant out without saying why.
        let none = NodeBudget {
            vcpu: 1,
            memory_mib: 0,
            disk_mib: 0,
        };
        let q = Config::default().default_quota(&none);
        assert_eq!((q.vcpu, q.memory_mib, q.disk_mib), (Some(1), Some(1), Some(1)));
    }

    #[test]
    fn disk_budget_counts_what_sandboxes_hold_and_none_below_the_reserve() {
        let config = Config::default();
        // Sandboxes already wrote 3000 MiB: that is theirs to keep, on top of what is free.
        assert_eq!(
            config.budget(&capacity(1, 0, 10_000, 3000)).disk_mib,
            10_000 - 2048 + 3000
        );
        // Below the reserve nothing is admitted, whatever sandboxes hold.
        assert_eq!(config.budget(&capacity(1, 0, 2047, 50_000)).disk_mib, 0);
        assert_eq!(config.budget(&capacity(1, 0, 2048, 10)).disk_mib, 10);
    }
}
