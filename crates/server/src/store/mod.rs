//! The control-plane store.
//!
//! The traits split it by concern: [`TenantStore`] (tenants and API keys), [`SandboxStore`]
//! (sandboxes, their access tokens and exec sessions), [`OperationStore`] (long-running
//! operations) and [`E2bStore`] (state only the E2B door has). [`Store`] is all four, which is
//! what the server holds (`Arc<dyn Store>`). No signature names a database type: [`SqliteStore`]
//! (the embedded default) and [`PgStore`] implement them alike.
//!
//! Secrets are never stored: API keys and sandbox access tokens are kept as [`token_hash`]es.
//! The schema is versioned by the SQL files in `crates/server/migrations`, embedded at build
//! time and applied by [`SqliteStore::open`]; [`PgStore`] (a Postgres database) has
//! its own, `crates/server/migrations-postgres`, to the same end state.

mod admit;
pub mod builds;
pub mod events;
mod postgres;
pub mod scrape_tokens;
mod sqlite;
pub mod volumes;

pub use builds::BuildStore;
pub use events::{EventFilter, EventStore};
pub use postgres::{redact_url, PgOpenError, PgStore};
pub use scrape_tokens::ScrapeTokenStore;
pub use sqlite::SqliteStore;
pub use volumes::VolumeStore;

use crate::model::ErrorBody;
use crate::model::{Operation, OperationState, Quota, SandboxState, TenantUsage};
pub use crate::records::AuditFilter;
use crate::records::{AuditRecord, KeyRecord, ParkedImage, SandboxRecord, SessionRecord, SnapshotRecord, Tenant};
use async_trait::async_trait;
use std::collections::BTreeMap;

/// An API key's public id: `key_` + the first 16 hex of its hash (reveals nothing of the key).
pub fn key_id_of(key: &str) -> String {
    format!("key_{}", &token_hash(key)[..16])
}

/// The sha256 hex of a secret (an API key or a sandbox access token): what the store keeps.
/// A sandbox's two tokens: envd's (`X-Access-Token`: processes, files, signed URLs) and the
/// traffic token (`E2B-Traffic-Access-Token`: its ports only). They are derived apart, so
/// holding one says nothing of the other.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenKind {
    Envd,
    Traffic,
}

/// The hashes of a sandbox's issued tokens; `traffic` is `None` for a sandbox whose tokens were
/// issued before traffic tokens existed (until they are handed out again).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AccessHashes {
    pub envd: String,
    pub traffic: Option<String>,
}

impl AccessHashes {
    pub fn get(&self, kind: TokenKind) -> Option<&str> {
        match kind {
            TokenKind::Envd => Some(&self.envd),
            TokenKind::Traffic => self.traffic.as_deref(),
        }
    }
}

pub fn token_hash(secret: &str) -> String {
    use sha2::Digest;
    hex::encode(sha2::Sha256::digest(secret.as_bytes()))
}

/// Opaque cursor of a sandbox list page: `<created_at_ms>.<id>` of the last row shown.
pub fn parse_page_token(token: &str) -> Option<(i64, String)> {
    let (ms, id) = token.split_once('.')?;
    Some((ms.parse().ok()?, id.to_string()))
}

/// The token for the page after `rows` (fetched with one row more than `limit`), if any.
pub fn next_page_token(rows: &[SandboxRecord], limit: u32) -> Option<String> {
    (rows.len() > limit as usize).then(|| {
        let last = &rows[limit as usize - 1];
        format!("{}.{}", last.created_at_ms, last.id)
    })
}

#[derive(Debug, Clone, Default)]
pub struct SandboxFilter {
    /// Only these states; empty means every state but `deleted`.
    pub states: Vec<SandboxState>,
    pub metadata: BTreeMap<String, String>,
    /// Return rows after this (created_at_ms, id) cursor, in the list's order.
    pub after: Option<(i64, String)>,
    pub limit: u32,
    /// Newest first (the cursor then walks back in time).
    pub newest_first: bool,
    /// Only sandboxes created at or after / before these times (ms).
    pub created_from_ms: Option<i64>,
    pub created_before_ms: Option<i64>,
    /// Only sandboxes of one of these templates (a name and its aliases).
    pub templates: Vec<String>,
}

impl SandboxFilter {
    /// Whether `s` passes the filters a store applies after its cursor query (states,
    /// metadata, creation times, templates): one definition for every store.
    pub fn matches(&self, s: &SandboxRecord) -> bool {
        (self.states.is_empty() || self.states.contains(&s.state))
            && self.metadata.iter().all(|(k, v)| s.metadata.get(k) == Some(v))
            && self.created_from_ms.is_none_or(|t| s.created_at_ms >= t)
            && self.created_before_ms.is_none_or(|t| s.created_at_ms < t)
            && (self.templates.is_empty() || self.templates.contains(&s.template))
    }
}

/// How a minted key is spelled; both are 160 random bits and work on both doors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyFormat {
    /// `ak_<40 hex>`.
    Airlock,
    /// `e2b_<40 hex>`: E2B's own shape, which e2b SDKs 2.26 to 2.5x insist on client-side
    /// (`Invalid API key format: expected "e2b_" followed by hex characters`).
    E2b,
}

pub fn new_key(format: KeyFormat) -> String {
    let prefix = match format {
        KeyFormat::Airlock => "ak_",
        KeyFormat::E2b => "e2b_",
    };
    format!("{prefix}{}", airlock_runtime::datadir::random_hex(20))
}

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// One of the tenant's quotas (`sandboxes`, `vcpu`, `memory_mib`, `disk_mib`) would be
    /// exceeded: its live sandboxes hold `used`, the create asks for `asked` more, the limit is
    /// `limit` (checked atomically with the insert).
    #[error("tenant {quota} quota: {used} used, {asked} asked, the limit is {limit}")]
    QuotaExceeded {
        quota: &'static str,
        used: u64,
        asked: u64,
        limit: u64,
    },
    /// The tenant was admitted `limit` creates in the last 60 seconds; the oldest of them leaves
    /// the window in `retry_after_s`.
    #[error("tenant made {limit} creates in the last minute")]
    RateLimited { limit: u32, retry_after_s: u64 },
    /// The node's `budget` (`vcpu`, `memory`, `disk`) has `total`, live sandboxes hold `used`
    /// of it, and the create asked for `asked` more (checked atomically with the insert).
    #[error("node {budget} budget: asked {asked}, {} left of {total}", total.saturating_sub(*used))]
    NodeBudgetExceeded {
        budget: &'static str,
        asked: u64,
        used: u64,
        total: u64,
    },
    /// The database failed; nothing a caller can act on but report it.
    #[error("store: {0}")]
    Backend(#[source] Box<dyn std::error::Error + Send + Sync>),
}

impl StoreError {
    pub fn backend(e: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Self {
        Self::Backend(e.into())
    }
}

/// What one node can give its live sandboxes in total: the sums of their `vcpu`, `memory_mib`
/// and `disk_mib` (counted at their maximum size) must stay within these.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NodeBudget {
    pub vcpu: u64,
    pub memory_mib: u64,
    pub disk_mib: u64,
}

impl NodeBudget {
    pub const UNLIMITED: NodeBudget = NodeBudget {
        vcpu: u64::MAX,
        memory_mib: u64::MAX,
        disk_mib: u64::MAX,
    };
}

/// What [`SandboxStore::insert_create`] recorded.
#[derive(Debug, Clone)]
pub enum CreateRecorded {
    /// The sandbox and its create operation are new: the caller starts the work.
    New(Operation),
    /// The tenant used this idempotency key before: its earlier operation, nothing inserted.
    Existing(Operation),
}

#[async_trait]
pub trait TenantStore: Send + Sync {
    /// Whether tenant `default` has no key yet (a new store).
    async fn needs_bootstrap(&self) -> Result<bool, StoreError>;
    /// If tenant `default` has no key yet, create it with `key` as its admin key (only the hash
    /// is kept) and return true; otherwise change nothing and return false. The caller writes the
    /// key where its user finds it *before* this commits it (`crate::bootstrap_admin_key`).
    async fn bootstrap(&self, key: &str) -> Result<bool, StoreError>;
    /// Mint a key for `tenant` (created if new); only its hash is kept.
    async fn create_key(&self, tenant: &str, format: KeyFormat) -> Result<String, StoreError>;
    /// The tenant whose key this is (looked up by `token_hash(key)`).
    async fn tenant_by_key(&self, key: &str) -> Result<Option<Tenant>, StoreError>;
    async fn tenant_by_name(&self, name: &str) -> Result<Option<Tenant>, StoreError>;
    /// The tenant's base egress policy; a tenant that has set none allows nothing.
    async fn egress_policy(&self, tenant_id: &str) -> Result<airlock_egress::TenantPolicy, StoreError>;
    /// The limits set for the tenant (`None`: the server's default).
    async fn quota(&self, tenant_id: &str) -> Result<Quota, StoreError>;
    /// Replace the limits set for the tenant.
    async fn set_quota(&self, tenant_id: &str, quota: &Quota) -> Result<(), StoreError>;
    /// Replace the tenant's base egress policy (already validated: it is a parsed policy).
    async fn set_egress_policy(&self, tenant_id: &str, policy: &airlock_egress::TenantPolicy)
        -> Result<(), StoreError>;
}

#[async_trait]
pub trait SandboxStore: Send + Sync {
    /// Record a new sandbox and its create operation in one atomic step that also checks the
    /// tenant has fewer than `max_live` live sandboxes ([`LIVE_STATES`]). With an idempotency key
    /// this tenant used before, nothing is inserted and the earlier operation comes back as
    /// [`CreateRecorded::Existing`] (before any quota check). Concurrent calls are serialized:
    /// each gets `New`, `Existing` or [`StoreError::QuotaExceeded`].
    async fn insert_create(
        &self,
        sb: &SandboxRecord,
        op: &Operation,
        idempotency_key: Option<&str>,
        max_live: u32,
    ) -> Result<CreateRecorded, StoreError> {
        let quota = Quota {
            sandboxes: Some(max_live),
            ..Quota::default()
        };
        self.insert_create_within(sb, op, idempotency_key, &quota, &NodeBudget::UNLIMITED)
            .await
    }
    /// [`SandboxStore::insert_create`] under the tenant's whole `quota` (the effective one: its
    /// own limits over the server's defaults; live sandboxes, their vcpu, memory and disk, creates
    /// in the last 60 seconds), that also checks, in the same atomic step, that the live
    /// sandboxes of every tenant plus this one fit in the node's `budget` (one node per store
    /// today). Past a quota, [`StoreError::QuotaExceeded`] or [`StoreError::RateLimited`]; past
    /// a budget, [`StoreError::NodeBudgetExceeded`] names the first budget exceeded.
    async fn insert_create_within(
        &self,
        sb: &SandboxRecord,
        op: &Operation,
        idempotency_key: Option<&str>,
        quota: &Quota,
        budget: &NodeBudget,
    ) -> Result<CreateRecorded, StoreError>;
    /// What the tenant's live sandboxes hold, and its creates since `now_ms - 60 s`.
    async fn tenant_usage(&self, tenant_id: &str, now_ms: i64) -> Result<TenantUsage, StoreError>;
    async fn get_sandbox(&self, tenant_id: &str, id: &str) -> Result<Option<SandboxRecord>, StoreError>;
    async fn sandbox_by_id(&self, id: &str) -> Result<Option<SandboxRecord>, StoreError>;
    /// One page (`limit + 1` rows, see [`next_page_token`]) of the tenant's sandboxes.
    async fn list_sandboxes(&self, tenant_id: &str, filter: &SandboxFilter) -> Result<Vec<SandboxRecord>, StoreError>;
    /// Every tenant's sandboxes in a [`LIVE_STATES`] state.
    async fn live_sandboxes(&self) -> Result<Vec<SandboxRecord>, StoreError>;
    async fn count_live_sandboxes(&self, tenant_id: &str) -> Result<u32, StoreError>;
    /// Sessions recorded as running, per live sandbox that has any (the metrics' gauge).
    async fn running_sessions(&self) -> Result<Vec<(String, u64)>, StoreError>;
    /// Place a sandbox still `creating` or `resuming` on `node` instead (its first node
    /// refused it) if it fits that node's `budget` next to what every sandbox and snapshot there
    /// holds. False when it is no longer starting (a delete came first); the tenant's quota
    /// counts it already.
    async fn move_starting(&self, id: &str, node: &str, budget: &NodeBudget) -> Result<bool, StoreError>;
    /// Move a suspended sandbox to `resuming` on `node` (its own, or any for a parked one) if
    /// it fits the tenant's `quota` and that node's `budget` again (its place, vcpu and memory;
    /// its disk it holds already), atomically like a create's admission. False when it is not
    /// suspended.
    async fn admit_resume(&self, id: &str, node: &str, quota: &Quota, budget: &NodeBudget) -> Result<bool, StoreError>;
    /// Record sandbox `id` as parked in object storage (on no node since), or no longer.
    async fn set_sandbox_parked(&self, id: &str, parked: Option<&ParkedImage>) -> Result<(), StoreError>;
    /// Where sandbox `id` is parked, if it is.
    async fn sandbox_parked(&self, id: &str) -> Result<Option<ParkedImage>, StoreError>;
    /// Suspended sandboxes parked with `resume` set: to start again on another node.
    async fn parked_to_resume(&self) -> Result<Vec<SandboxRecord>, StoreError>;
    /// Sandboxes that ended (deleted, failed) while parked: (id, image) of each image still to
    /// remove from object storage.
    async fn parked_of_ended(&self) -> Result<Vec<(String, String)>, StoreError>;
    /// Every image a sandbox is parked as (or is being parked or unparked as).
    async fn parked_images(&self) -> Result<Vec<String>, StoreError>;
    /// Before a running or paused sandbox is suspended: charge the memory its suspend saves
    /// (its `memory_mib`) to the tenant's disk quota and the node's disk budget, atomically like
    /// a create's admission, unless it holds that place already (its timeout suspends it, or an
    /// earlier suspend was admitted). False when it is neither running nor paused.
    async fn admit_suspend(&self, id: &str, quota: &Quota, budget: &NodeBudget) -> Result<bool, StoreError>;
    async fn set_sandbox_state(&self, id: &str, state: SandboxState) -> Result<(), StoreError>;
    /// Move a sandbox to `to` only if it is in one of `from` (compare-and-set); returns whether it
    /// moved. Concurrent lifecycle changes use it so a late writer never undoes a delete.
    async fn transition_sandbox(&self, id: &str, from: &[SandboxState], to: SandboxState) -> Result<bool, StoreError>;
    /// What the node reports once the VM runs: the template digest it resolved, the accelerator
    /// and how the VM started.
    async fn set_sandbox_boot(&self, id: &str, booted: &crate::model::Booted) -> Result<(), StoreError>;
    /// Running, paused or suspended sandboxes whose expiry is at or before `now_ms`.
    async fn expired_sandboxes(&self, now_ms: i64) -> Result<Vec<SandboxRecord>, StoreError>;
    async fn set_sandbox_expiry(&self, id: &str, expires_at_ms: i64) -> Result<(), StoreError>;
    /// The lifetime a paused sandbox has left: its clock stops while paused and resume restores it.
    async fn set_paused_remaining(&self, id: &str, remaining_ms: Option<i64>) -> Result<(), StoreError>;
    async fn paused_remaining(&self, id: &str) -> Result<Option<i64>, StoreError>;

    /// Set (or replace) the sandbox's tokens, given as their [`token_hash`]es.
    async fn set_access_hashes(&self, sandbox_id: &str, hashes: &AccessHashes) -> Result<(), StoreError>;
    async fn access_hashes(&self, sandbox_id: &str) -> Result<Option<AccessHashes>, StoreError>;
    /// The sandbox that was issued a token of `kind` with this hash.
    async fn sandbox_by_access_hash(
        &self,
        kind: TokenKind,
        token_hash: &str,
    ) -> Result<Option<SandboxRecord>, StoreError>;

    async fn insert_session(&self, s: &SessionRecord) -> Result<(), StoreError>;
    async fn get_session(&self, sandbox_id: &str, id: &str) -> Result<Option<SessionRecord>, StoreError>;
    async fn list_sessions(&self, sandbox_id: &str) -> Result<Vec<SessionRecord>, StoreError>;
    /// Record how the session's process ended (exit code, signal, timed out, end time).
    async fn finish_session(&self, s: &SessionRecord) -> Result<(), StoreError>;
    /// The session of the agent process `process_id` (the latest, should the agent reuse ids).
    async fn session_by_process(&self, sandbox_id: &str, process_id: u64) -> Result<Option<SessionRecord>, StoreError>;
    /// Forget the sandbox's exited sessions but the `keep` that ended last; how many went.
    async fn prune_finished_sessions(&self, sandbox_id: &str, keep: u32) -> Result<u64, StoreError>;
    /// Reserve one more session of a sandbox (`core/sessions.rs`): unless its running sessions
    /// and the starts reserved before reach `start.limit` (then `Err` with how many they are).
    /// One step per sandbox on either store, so starts through any number of replicas never pass
    /// the limit.
    async fn reserve_session_start(&self, start: &SessionStart<'_>) -> Result<Result<(), u32>, StoreError>;
    /// The start is over: its session recorded, or it failed.
    async fn end_session_start(&self, id: &str) -> Result<(), StoreError>;
}

#[async_trait]
pub trait OperationStore: Send + Sync {
    async fn insert_operation(&self, tenant_id: &str, op: &Operation) -> Result<(), StoreError>;
    async fn get_operation(&self, tenant_id: &str, id: &str) -> Result<Option<Operation>, StoreError>;
    /// Any tenant's operation: for the engine, which has no tenant in hand.
    async fn operation_by_id(&self, id: &str) -> Result<Option<Operation>, StoreError>;
    async fn operation_by_idempotency_key(&self, tenant_id: &str, key: &str) -> Result<Option<Operation>, StoreError>;
    /// Record how an operation ended, if this store's [`Lease::holder`] still holds it: false
    /// when another replica took it over (this one stalled past its lease), whose end stands.
    async fn finish_operation(
        &self,
        id: &str,
        state: OperationState,
        error: Option<&ErrorBody>,
    ) -> Result<bool, StoreError>;
    async fn set_operation_state(&self, id: &str, state: OperationState) -> Result<(), StoreError>;
    /// Pending or running operations, oldest first: what a restart must settle.
    async fn unfinished_operations(&self) -> Result<Vec<Operation>, StoreError>;
    /// The sandbox's latest delete operation, whatever its state.
    async fn open_delete_operation(&self, sandbox_id: &str) -> Result<Option<Operation>, StoreError>;
    /// Take the lease of every unfinished operation whose lease lapsed (and, with `own_too`, of
    /// those this store's [`Lease::holder`] held in an earlier life: a restarted single-host
    /// server), for [`LEASE_MS`]; returns them, oldest first. Each is taken by one caller only
    /// (Postgres: `FOR UPDATE SKIP LOCKED`), its lease's epoch raised by one.
    async fn claim_operations(&self, own_too: bool) -> Result<Vec<Claimed>, StoreError>;
    /// Extend the leases this holder has of `ids` by [`LEASE_MS`] from now (a lease another
    /// holder took meanwhile stays its own).
    async fn renew_leases(&self, ids: &[String]) -> Result<(), StoreError>;
    /// Whose leases this store takes, and for how long.
    fn lease(&self) -> &Lease;
    /// Take or keep `duty` (work one replica does at a time) for this store's lease: true when
    /// this holder has it now, for [`Lease::ms`] from now; false while another holds it.
    async fn lead(&self, duty: &str) -> Result<bool, StoreError>;
    /// Record that this store's lease holder (a replica) asked `node` at `now_ms`, and whether
    /// it answered.
    async fn observe_node(&self, node: &str, answered: bool, now_ms: i64) -> Result<(), StoreError>;
    /// What every replica saw of every node, of those that asked at or after `since_ms`.
    async fn node_observations(&self, since_ms: i64) -> Result<Vec<NodeSeen>, StoreError>;
    /// Forget what replicas that last asked before `before_ms` saw (gone replicas, gone
    /// nodes); how many views went.
    async fn forget_node_observations(&self, before_ms: i64) -> Result<u64, StoreError>;
    /// Tell the other replicas sharing this store `news` (Postgres: NOTIFY). SQLite has no
    /// other replica to tell.
    async fn publish(&self, _news: &News) -> Result<(), StoreError> {
        Ok(())
    }
    /// The other replicas' news as it comes (Postgres: LISTEN), None on SQLite. News sent
    /// while the connection is down is lost: what waits on it also looks for itself now and then.
    async fn listen(&self) -> Result<Option<futures_util::stream::BoxStream<'static, News>>, StoreError> {
        Ok(None)
    }
}

/// What one replica tells the others sharing its store ([`OperationStore::publish`]), so they
/// learn it at once instead of at their next look.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum News {
    /// An operation reached its final state: whoever waits for it may read it now.
    OperationFinished(String),
    /// A sandbox ended (deleted, failed, lost): what a replica keeps of it can go.
    SandboxEnded(String),
}

/// The Postgres channel news goes on.
const NEWS_CHANNEL: &str = "airlock_news";

impl News {
    /// `<sender> <kind> <id>`: a replica skips its own.
    fn encode(&self, sender: &str) -> String {
        match self {
            News::OperationFinished(id) => format!("{sender} finished {id}"),
            News::SandboxEnded(id) => format!("{sender} ended {id}"),
        }
    }

    /// News from another sender than `me`; None for its own or what it cannot read.
    fn decode(payload: &str, me: &str) -> Option<News> {
        let mut parts = payload.splitn(3, ' ');
        let (sender, kind, id) = (parts.next()?, parts.next()?, parts.next()?);
        if sender == me || id.is_empty() {
            return None;
        }
        match kind {
            "finished" => Some(News::OperationFinished(id.to_string())),
            "ended" => Some(News::SandboxEnded(id.to_string())),
            _ => None,
        }
    }
}

/// One replica's view of one node ([`OperationStore::observe_node`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeSeen {
    pub node: String,
    pub replica: String,
    /// Since when it has not answered this replica; None: it answered the last time.
    pub unanswered_since_ms: Option<i64>,
}

/// [`OperationStore::observe_node`], one statement both stores run: an answer clears the
/// silence, a silence keeps the time it began.
const OBSERVE_NODE: &str = "INSERT INTO node_seen (node, replica, asked_ms, unanswered_since_ms) \
     VALUES ($1, $2, $3, $4) ON CONFLICT (node, replica) DO UPDATE SET asked_ms = excluded.asked_ms, \
     unanswered_since_ms = CASE WHEN excluded.unanswered_since_ms IS NULL THEN NULL \
     ELSE COALESCE(node_seen.unanswered_since_ms, excluded.unanswered_since_ms) END";
/// [`OperationStore::forget_node_observations`].
const FORGET_NODE_SEEN: &str = "DELETE FROM node_seen WHERE asked_ms < $1";
/// [`OperationStore::node_observations`].
const NODE_OBSERVATIONS: &str = "SELECT node, replica, unanswered_since_ms FROM node_seen WHERE asked_ms >= $1";

/// A console sign-in attempt to reserve ([`AccountStore::reserve_sign_in`]).
#[derive(Debug, Clone)]
pub struct SignInAttempt<'a> {
    pub id: &'a str,
    /// Its client's window (an address, or an IPv6 /64).
    pub client: &'a str,
    /// It also counts in the remote clients' window.
    pub remote: bool,
    pub now_ms: i64,
    pub window_ms: i64,
    /// Attempts one client's window holds.
    pub per_client: usize,
    /// Attempts the remote clients' window holds.
    pub remote_max: usize,
}

/// A full sign-in window: the remote clients' (else the client's own), and the ms until it
/// has room.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SignInFull {
    pub remote: bool,
    pub wait_ms: i64,
}

/// [`AccountStore::reserve_sign_in`]'s statements, one text for both stores.
const SIGN_IN_PRUNE: &str = "DELETE FROM sign_in_attempts WHERE at_ms <= $1";
const SIGN_IN_OF_CLIENT: &str = "SELECT failed, at_ms FROM sign_in_attempts WHERE client = $1";
const SIGN_IN_OF_REMOTES: &str = "SELECT failed, at_ms FROM sign_in_attempts WHERE remote = 1";
const SIGN_IN_INSERT: &str =
    "INSERT INTO sign_in_attempts (id, client, remote, at_ms, failed) VALUES ($1, $2, $3, $4, 0)";
const SIGN_IN_FAILED: &str = "UPDATE sign_in_attempts SET failed = 1, at_ms = $2 WHERE id = $1";
const SIGN_IN_SUCCEEDED: &str = "DELETE FROM sign_in_attempts WHERE id = $1";

/// Whether a window holding `rows` (failed, at_ms) has no room for one more of `allowed`
/// attempts at `now`: the ms until it has (its oldest failure leaving it; a window full of
/// attempts in flight alone has room within a hash's time).
fn sign_in_window_full(rows: &[(i64, i64)], now: i64, window: i64, allowed: usize) -> Option<i64> {
    if rows.len() < allowed {
        return None;
    }
    let failures: Vec<i64> = rows
        .iter()
        .filter(|(failed, _)| *failed != 0)
        .map(|(_, at)| *at)
        .collect();
    Some(match failures.iter().min() {
        Some(oldest) if failures.len() >= allowed => oldest + window - now,
        _ => 1000,
    })
}

/// [`AccountStore::reserve_sign_in`] in transaction `$tx` of either store (the statements
/// are the same text; only the transaction's type differs).
macro_rules! reserve_sign_in_in {
    ($tx:expr, $a:expr) => {{
        let a: &$crate::store::SignInAttempt<'_> = $a;
        sqlx::query($crate::store::SIGN_IN_PRUNE)
            .bind(a.now_ms - a.window_ms)
            .execute(&mut *$tx)
            .await?;
        let mine: Vec<(i64, i64)> = sqlx::query_as($crate::store::SIGN_IN_OF_CLIENT)
            .bind(a.client)
            .fetch_all(&mut *$tx)
            .await?;
        let full = match $crate::store::sign_in_window_full(&mine, a.now_ms, a.window_ms, a.per_client) {
            Some(wait_ms) => Some($crate::store::SignInFull { remote: false, wait_ms }),
            None if a.remote => {
                let remotes: Vec<(i64, i64)> = sqlx::query_as($crate::store::SIGN_IN_OF_REMOTES)
                    .fetch_all(&mut *$tx)
                    .await?;
                $crate::store::sign_in_window_full(&remotes, a.now_ms, a.window_ms, a.remote_max)
                    .map(|wait_ms| $crate::store::SignInFull { remote: true, wait_ms })
            }
            None => None,
        };
        match full {
            Some(full) => Err(full),
            None => {
                sqlx::query($crate::store::SIGN_IN_INSERT)
                    .bind(a.id)
                    .bind(a.client)
                    .bind(i64::from(a.remote))
                    .bind(a.now_ms)
                    .execute(&mut *$tx)
                    .await?;
                Ok(())
            }
        }
    }};
}
use reserve_sign_in_in;

/// [`AccountStore::end_sign_in`] on `$pool` of either store.
macro_rules! end_sign_in_on {
    ($pool:expr, $id:expr, $failed:expr, $now:expr) => {{
        match $failed {
            true => {
                sqlx::query($crate::store::SIGN_IN_FAILED)
                    .bind($id)
                    .bind($now)
                    .execute($pool)
                    .await?
            }
            false => {
                sqlx::query($crate::store::SIGN_IN_SUCCEEDED)
                    .bind($id)
                    .execute($pool)
                    .await?
            }
        };
        Ok(())
    }};
}
use end_sign_in_on;

/// [`SandboxStore::parked_images`], one statement both stores run.
const PARKED_IMAGES: &str = "SELECT parked_image FROM sandboxes WHERE parked_image IS NOT NULL";
/// [`SandboxStore::parked_of_ended`], one statement both stores run.
const PARKED_OF_ENDED: &str =
    "SELECT id, parked_image FROM sandboxes WHERE state IN ('deleted', 'failed') AND parked_image IS NOT NULL";

/// A session start to reserve ([`SandboxStore::reserve_session_start`]).
#[derive(Debug, Clone)]
pub struct SessionStart<'a> {
    pub id: &'a str,
    pub sandbox_id: &'a str,
    /// Sessions the sandbox may hold at once: running and starting.
    pub limit: u32,
    pub now_ms: i64,
    /// When the reservation stops counting should its replica die before ending it.
    pub until_ms: i64,
}

/// [`SandboxStore::reserve_session_start`]'s statements, one text for both stores.
const SESSION_STARTS_PRUNE: &str = "DELETE FROM session_starts WHERE until_ms <= $1";
const SESSIONS_HELD: &str = "SELECT (SELECT COUNT(*) FROM sessions WHERE sandbox_id = $1 AND NOT exited) \
     + (SELECT COUNT(*) FROM session_starts WHERE sandbox_id = $1)";
const SESSION_START_INSERT: &str = "INSERT INTO session_starts (id, sandbox_id, until_ms) VALUES ($1, $2, $3)";
const SESSION_START_END: &str = "DELETE FROM session_starts WHERE id = $1";

/// [`SandboxStore::reserve_session_start`] in transaction `$tx` of either store, which holds
/// the sandbox's starts still meanwhile.
macro_rules! reserve_session_start_in {
    ($tx:expr, $s:expr) => {{
        let s: &$crate::store::SessionStart<'_> = $s;
        sqlx::query($crate::store::SESSION_STARTS_PRUNE)
            .bind(s.now_ms)
            .execute(&mut *$tx)
            .await?;
        let (held,): (i64,) = sqlx::query_as($crate::store::SESSIONS_HELD)
            .bind(s.sandbox_id)
            .fetch_one(&mut *$tx)
            .await?;
        let held = u32::try_from(held).unwrap_or(u32::MAX);
        if held >= s.limit {
            Err(held)
        } else {
            sqlx::query($crate::store::SESSION_START_INSERT)
                .bind(s.id)
                .bind(s.sandbox_id)
                .bind(s.until_ms)
                .execute(&mut *$tx)
                .await?;
            Ok(())
        }
    }};
}
use reserve_session_start_in;

/// An operation [`OperationStore::claim_operations`] took, with its lease's epoch: 1 for the
/// lease it was inserted with, one more for each claim since. Calls to nodes made for it carry
/// the epoch, and a node refuses one lower than it has seen (`nodes/serve.rs`).
#[derive(Debug, Clone)]
pub struct Claimed {
    pub op: Operation,
    pub epoch: i64,
}

/// Take or keep a duty: one statement both stores run (`?` placeholders for SQLite, numbered
/// for Postgres): the row is written only if it is free, lapsed or this holder's.
const LEAD: &str = "INSERT INTO duties (duty, holder, until_ms) VALUES ($1, $2, $3) \
     ON CONFLICT (duty) DO UPDATE SET holder = excluded.holder, until_ms = excluded.until_ms \
     WHERE duties.until_ms < $4 OR duties.holder = excluded.holder";

/// How long an operation's lease lasts unless renewed: how soon another replica takes over
/// the operations of one that died. Renewed every third of it.
pub const LEASE_MS: i64 = 10_000;

/// Who leases the operations a store records ([`OperationStore::claim_operations`]): every
/// operation inserted through a store is leased to its holder for [`LEASE_MS`].
#[derive(Debug, Clone)]
pub struct Lease {
    /// [`Lease::LOCAL`] for a single-host server (one process per data dir: a restart takes over
    /// its own operations at once), else a random id per process.
    pub holder: String,
    /// How long a lease lasts unless renewed ([`LEASE_MS`]).
    pub ms: i64,
}

impl Lease {
    pub const LOCAL: &'static str = "local";

    /// A holder of its own: one of many replicas.
    pub fn replica() -> Self {
        Lease {
            holder: format!("replica-{}", airlock_runtime::datadir::random_hex(8)),
            ms: LEASE_MS,
        }
    }

    fn local() -> Self {
        Lease {
            holder: Self::LOCAL.into(),
            ms: LEASE_MS,
        }
    }

    /// When a lease taken now lapses.
    fn until(&self) -> i64 {
        crate::records::now_ms() + self.ms
    }
}

/// What [`SnapshotStore::admit_snapshot`] decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SnapshotAdmission {
    /// Recorded as being saved, holding its reserve.
    Admitted,
    /// The tenant has a snapshot of that name already (saved or being saved).
    NameTaken,
    /// The tenant is gone (deleted while the request ran).
    NoTenant,
}

#[async_trait]
pub trait SnapshotStore: Send + Sync {
    /// Record `snapshot` as being saved, holding `reserve_mib` of its tenant's disk quota and of
    /// the node's disk budget until [`SnapshotStore::snapshot_saved`], in one atomic step that
    /// checks both as a create's admission does (past either,
    /// [`StoreError::QuotaExceeded`] (`disk_mib`) or [`StoreError::NodeBudgetExceeded`]
    /// (`disk`)). A snapshot being saved is not listed or found by id or name.
    async fn admit_snapshot(
        &self,
        snapshot: &SnapshotRecord,
        reserve_mib: u64,
        quota: &Quota,
        budget: &NodeBudget,
    ) -> Result<SnapshotAdmission, StoreError>;
    /// A save is done: record its size and digest; the snapshot holds its size from now on.
    /// False when its record is gone (its tenant was deleted meanwhile).
    async fn snapshot_saved(&self, snapshot: &SnapshotRecord) -> Result<bool, StoreError>;
    /// The tenant's saved snapshot by id, name or content digest (the newest of equal ones).
    async fn get_snapshot(&self, tenant_id: &str, id_or_name: &str) -> Result<Option<SnapshotRecord>, StoreError>;
    /// The tenant's saved snapshots (not forks' images), oldest first, of one sandbox if given.
    async fn list_snapshots(
        &self,
        tenant_id: &str,
        sandbox_id: Option<&str>,
    ) -> Result<Vec<SnapshotRecord>, StoreError>;
    /// Every snapshot record of the tenant: saved or being saved, forks' images too.
    async fn tenant_snapshots(&self, tenant_id: &str) -> Result<Vec<SnapshotRecord>, StoreError>;
    /// Whether it was there.
    async fn delete_snapshot(&self, tenant_id: &str, id: &str) -> Result<bool, StoreError>;
    /// Every tenant's images a restart cut short, recorded before `before_ms`: forks' images
    /// (the fork stopped) and saves still under way.
    async fn interrupted_images(&self, before_ms: i64) -> Result<Vec<SnapshotRecord>, StoreError>;
    /// The id of every snapshot of every tenant (being saved too).
    async fn snapshot_ids(&self) -> Result<Vec<String>, StoreError>;
}

#[async_trait]
pub trait E2bStore: Send + Sync {
    /// The template name the E2B SDK created the sandbox with, echoed back as its `templateID`.
    async fn set_e2b_alias(&self, sandbox_id: &str, alias: &str) -> Result<(), StoreError>;
    async fn e2b_alias(&self, sandbox_id: &str) -> Result<Option<String>, StoreError>;
}

/// Tenants as the platform administers them, their keys, the console account, admin sign-ins
/// and the audit log.
#[async_trait]
pub trait AccountStore: Send + Sync {
    /// A new tenant; `Ok(None)` if the name is taken.
    async fn create_tenant(&self, name: &str) -> Result<Option<Tenant>, StoreError>;
    /// Every tenant with its creation time, by name.
    async fn list_tenants(&self) -> Result<Vec<(Tenant, i64)>, StoreError>;
    /// Remove a tenant: its keys, quotas, egress policy, snapshot records and its sandboxes'
    /// E2B state and access tokens go with it (its sandboxes must be deleted first: their rows
    /// stay as a record; the node removes its snapshots' images).
    async fn delete_tenant(&self, tenant_id: &str) -> Result<(), StoreError>;
    /// Mint a named key for an existing tenant; the key (shown once) and its record.
    async fn mint_key(&self, tenant_id: &str, format: KeyFormat, name: &str)
        -> Result<(String, KeyRecord), StoreError>;
    async fn list_keys(&self, tenant_id: &str) -> Result<Vec<KeyRecord>, StoreError>;
    /// Revoke the tenant's key `key_id` (effective on its next use); false if it has no such key.
    async fn revoke_key(&self, tenant_id: &str, key_id: &str) -> Result<bool, StoreError>;
    /// The argon2 hash of an account's password.
    async fn password_hash(&self, account: &str) -> Result<Option<String>, StoreError>;
    async fn set_password_hash(&self, account: &str, hash: &str) -> Result<(), StoreError>;
    /// Record an admin token (by its hash) valid until `expires_at_ms`.
    async fn insert_admin_session(&self, token_hash: &str, account: &str, expires_at_ms: i64)
        -> Result<(), StoreError>;
    /// The account an unexpired admin token (by its hash) belongs to; expired ones are removed.
    async fn admin_session(&self, token_hash: &str, now_ms: i64) -> Result<Option<String>, StoreError>;
    /// Reserve a console sign-in attempt (`core/sign_in.rs`): unless `attempt.client`'s window,
    /// or (for a remote client) the remote clients' window, already holds as many attempts as
    /// it allows (failed ones and ones in flight, within the window before `now_ms`), record
    /// this one in flight. Every replica counts in the same windows.
    async fn reserve_sign_in(&self, attempt: &SignInAttempt<'_>) -> Result<Result<(), SignInFull>, StoreError>;
    /// End sign-in attempt `id`: a failure counts in its windows from `now_ms`, a success
    /// leaves them.
    async fn end_sign_in(&self, id: &str, failed: bool, now_ms: i64) -> Result<(), StoreError>;
    /// Write an audit row (with its `count`); its `seq`.
    async fn insert_audit(&self, record: &AuditRecord) -> Result<i64, StoreError>;
    /// Add `by` to the count of audit row `seq` (repeats of it, coalesced).
    async fn add_audit_count(&self, seq: i64, by: u64) -> Result<(), StoreError>;
    /// Audit rows newest first: before `filter.before_seq` (if set), of `filter.tenant` and
    /// `filter.action` (if set), at most `limit`.
    async fn audit(&self, filter: &AuditFilter, limit: u32) -> Result<Vec<AuditRecord>, StoreError>;
    /// Remove audit rows older than `before_ms`; how many went.
    async fn prune_audit(&self, before_ms: i64) -> Result<u64, StoreError>;
}

/// The whole store, as the server holds it.
pub trait Store:
    TenantStore
    + SandboxStore
    + SnapshotStore
    + OperationStore
    + E2bStore
    + AccountStore
    + BuildStore
    + VolumeStore
    + ScrapeTokenStore
    + EventStore
{
}

impl<
        T: TenantStore
            + SandboxStore
            + SnapshotStore
            + OperationStore
            + E2bStore
            + AccountStore
            + BuildStore
            + VolumeStore
            + ScrapeTokenStore
            + EventStore,
    > Store for T
{
}

// What both SQL stores share: their errors, fragments of their queries (valid SQL on both) and row values
// made the same way.

impl From<sqlx::Error> for StoreError {
    fn from(e: sqlx::Error) -> Self {
        StoreError::backend(e)
    }
}

impl From<sqlx::migrate::MigrateError> for StoreError {
    fn from(e: sqlx::migrate::MigrateError) -> Self {
        StoreError::backend(e)
    }
}

/// `state IN (...)` of the states of a sandbox that exists, written from
/// [`crate::records::LIVE_STATES`] (its one definition) wherever a query says `{LIVE}`.
const LIVE: LiveStates = LiveStates;

struct LiveStates;

impl std::fmt::Display for LiveStates {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("state IN (")?;
        for (i, s) in crate::records::LIVE_STATES.iter().enumerate() {
            let sep = if i == 0 { "" } else { ", " };
            write!(f, "{sep}'{}'", s.as_str())?;
        }
        f.write_str(")")
    }
}
/// Per row of a live sandbox: 1 unless it is suspended (no VM: it holds its disk, no place, CPU
/// or memory), for the sums of what counts against quotas and budgets.
const HOLDS_VM: &str = "(CASE WHEN state = 'suspended' THEN 0 ELSE 1 END)";
/// Per row of a live sandbox: the disk it holds, its overlay at full size plus the memory a
/// suspend saved (or will: see `saved_mib`, migration 0012).
const DISK_HELD: &str = "(disk_mib + saved_mib)";
/// The window `creates_per_minute` counts in.
const RATE_WINDOW_MS: i64 = 60_000;

/// An operation's creation time in ms (now, should its RFC 3339 time not parse).
fn op_created_ms(op: &Operation) -> i64 {
    humantime::parse_rfc3339(&op.created_at)
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map(|d| d.as_millis() as i64)
        .unwrap_or_else(crate::records::now_ms)
}

/// A new tenant's id: opaque (`tn_` + 16 random hex), never its name, so a tenant made later
/// under a deleted one's name shares nothing recorded under the old id. The bootstrap tenant
/// `default` keeps the id `default` (stores before this had it; it can't be deleted).
fn new_tenant_id(name: &str) -> String {
    if name == "default" {
        return name.into();
    }
    format!("tn_{}", airlock_runtime::datadir::random_hex(8))
}
