//! The domain's records: what the store persists and the core hands the doors (each door
//! renders them in its own wire format). Plain data, no I/O.

use crate::model::{Resources, Sandbox, SandboxState};
use std::collections::BTreeMap;

pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

/// Milliseconds since the epoch as RFC 3339 (`2024-01-02T03:04:05.678Z`).
///
/// Total: times before 1970 read as the epoch, and times past the last millisecond of year 9999
/// (which RFC 3339 cannot spell, and humantime's formatter refuses with an error that would panic
/// `to_string`) as that millisecond. A guest sets file times, so they are never trusted.
pub fn rfc3339(ms: i64) -> String {
    /// 9999-12-31T23:59:59.999Z
    const MAX_MS: i64 = 253_402_300_799_999;
    let t = std::time::UNIX_EPOCH + std::time::Duration::from_millis(ms.clamp(0, MAX_MS) as u64);
    humantime::format_rfc3339_millis(t).to_string()
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tenant {
    pub id: String,
    pub name: String,
}

/// A sandbox as recorded, with what the API shows plus what the engine needs.
#[derive(Debug, Clone)]
pub struct SandboxRecord {
    pub id: String,
    pub tenant_id: String,
    pub state: SandboxState,
    pub template: String,
    pub template_digest: String,
    pub runtime: String,
    pub accel: String,
    pub resources: Resources,
    pub env: BTreeMap<String, String>,
    pub metadata: BTreeMap<String, String>,
    pub created_at_ms: i64,
    pub expires_at_ms: i64,
    /// Its egress, fixed at create.
    pub egress: EgressSpec,
    /// How its VM started (none until it runs).
    pub start: Option<crate::model::SandboxStart>,
    pub lifecycle: crate::model::Lifecycle,
    /// The lifetime it was created with (a sandbox its timeout suspended gets it again on resume).
    pub timeout_ms: i64,
    /// The snapshot it was made from, if any (its memory, processes and disk).
    pub image_id: Option<String>,
    /// The node it was placed on (`Nodes::members`' name; '' for the one node of single-host
    /// mode). Its budgets count it.
    pub node: String,
    /// Which start on that node its VM is (`nodes::VmReport::run`); '' until it runs.
    pub run: String,
}

/// Where a suspended sandbox waits while on no node: a draining node parked it in object
/// storage (`Nodes::park`), and any node with the same machine fingerprint resumes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParkedImage {
    pub image: String,
    pub fingerprint: String,
    /// It ran when its node drained: the replicas start it again elsewhere at once
    /// (`Core::spawn_rehoming`), since its tenant never asked it to stop.
    pub resume: bool,
}

/// A sandbox's egress as recorded at create and fixed for its life: the profiles chosen, whether
/// it is sealed (no egress at all), and the tenant base policy it runs under (the tenant's as it
/// was at create, narrowed by the create; later changes to the tenant's policy don't reach it).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct EgressSpec {
    pub profiles: Vec<String>,
    pub sealed: bool,
    pub tenant: airlock_egress::TenantPolicy,
}

impl EgressSpec {
    /// The policy it gives under `config`, and the profiles it names that `config` lacks, which
    /// are left out: a sandbox then reaches less, never more.
    pub fn policy(&self, config: &airlock_egress::EgressConfig) -> (airlock_egress::Policy, Vec<String>) {
        let (known, missing): (Vec<&String>, Vec<&String>) =
            self.profiles.iter().partition(|n| config.profiles.get(n).is_some());
        let tenant = if self.sealed {
            airlock_egress::TenantPolicy::sealed()
        } else {
            self.tenant.clone()
        };
        let known: Vec<&str> = known.into_iter().map(String::as_str).collect();
        let policy = airlock_egress::Policy::new(config, tenant, &known).expect("only configured profiles are named");
        (policy, missing.into_iter().cloned().collect())
    }
}

impl Default for EgressSpec {
    /// Sealed: nothing allowed (and what a sandbox from before egress reads as).
    fn default() -> Self {
        EgressSpec {
            profiles: Vec::new(),
            sealed: true,
            tenant: airlock_egress::TenantPolicy::sealed(),
        }
    }
}

impl SandboxRecord {
    /// Whether a request to its guest (envd, a port, a file) is served: it runs, or it is held
    /// and resumes on traffic (`auto_resume`; [`crate::core::Core::agent_for`] resumes it).
    pub fn answers_requests(&self) -> bool {
        match self.state {
            SandboxState::Running => true,
            SandboxState::Paused | SandboxState::Suspended | SandboxState::Resuming => self.lifecycle.auto_resume,
            _ => false,
        }
    }

    pub fn view(&self) -> Sandbox {
        Sandbox {
            id: self.id.clone(),
            state: self.state,
            template: self.template.clone(),
            template_digest: self.template_digest.clone(),
            runtime: self.runtime.clone(),
            accel: self.accel.clone(),
            resources: self.resources,
            metadata: self.metadata.clone(),
            created_at: rfc3339(self.created_at_ms),
            expires_at: rfc3339(self.expires_at_ms),
            egress: crate::model::SandboxEgress {
                profiles: self.egress.profiles.clone(),
                sealed: self.egress.sealed,
            },
            lifecycle: self.lifecycle,
            start: self.start.clone(),
        }
    }
}

#[derive(Debug, Clone)]
pub struct SessionRecord {
    pub id: String,
    pub sandbox_id: String,
    pub process_id: u64,
    pub argv: Vec<String>,
    pub cwd: String,
    pub user: String,
    pub pty: bool,
    pub exit_code: Option<i32>,
    pub signal: Option<i32>,
    pub timed_out: bool,
    pub exited: bool,
    pub started_at_ms: i64,
    pub ended_at_ms: Option<i64>,
    /// The caller's own label for the process (e.g. an E2B process tag), if it gave one.
    pub tag: Option<String>,
}

/// The states of a sandbox that exists (a suspended one holds only its disk and saved memory: it
/// counts against disk quotas and budgets, not against sandboxes, vcpu or memory).
pub const LIVE_STATES: [SandboxState; 6] = [
    SandboxState::Creating,
    SandboxState::Running,
    SandboxState::Paused,
    SandboxState::Suspended,
    SandboxState::Resuming,
    SandboxState::Deleting,
];

/// A snapshot as recorded: an image of a sandbox, owned by its tenant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotRecord {
    pub id: String,
    pub tenant_id: String,
    pub name: Option<String>,
    pub kind: SnapshotKind,
    pub sandbox_id: String,
    pub template: String,
    pub resources: Resources,
    pub bytes: u64,
    /// Content address, `sha256:<hex>` (snapshots; forks' images have none).
    pub digest: Option<String>,
    pub created_at_ms: i64,
    /// Its image is in object storage too (`Nodes::share_image`), saved on the machine of this
    /// fingerprint: any node of that machine starts a sandbox from it. None: on its node only.
    pub shared: Option<String>,
}

impl SnapshotRecord {
    pub fn view(&self) -> crate::model::Snapshot {
        crate::model::Snapshot {
            id: self.id.clone(),
            name: self.name.clone(),
            sandbox_id: self.sandbox_id.clone(),
            template: self.template.clone(),
            resources: self.resources,
            bytes: self.bytes,
            digest: self.digest.clone(),
            created_at: rfc3339(self.created_at_ms),
        }
    }
}

/// Why a snapshot exists.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SnapshotKind {
    /// Made by its tenant; kept until deleted.
    Snapshot,
    /// What a fork's children start from; removed once they have.
    Fork,
}

/// An API key as it is listed: never the key itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyRecord {
    /// `key_<16 hex>`, derived from the key's hash: what a key is listed and revoked by.
    pub id: String,
    pub tenant_id: String,
    pub name: String,
    /// The key's first 8 characters, to tell keys apart.
    pub prefix: String,
    pub created_at_ms: i64,
    pub last_used_at_ms: Option<i64>,
    pub revoked_at_ms: Option<i64>,
}

/// A lifecycle event of a sandbox (`sandbox.created`, `sandbox.paused`, ...).
#[derive(Debug, Clone, PartialEq)]
pub struct EventRecord {
    /// Increasing in the order events were recorded; 0 before it is.
    pub seq: i64,
    /// `ev_<hex>`.
    pub id: String,
    pub tenant_id: String,
    pub sandbox_id: String,
    /// `sandbox.<what>`: [`crate::model::EventKind`]'s names.
    pub kind: String,
    pub at_ms: i64,
    /// What else the event says (its template, how it started, an error...).
    pub data: serde_json::Value,
}

/// A tenant's webhook and how far its deliveries got.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WebhookRecord {
    /// `wh_<hex>`.
    pub id: String,
    pub tenant_id: String,
    pub name: String,
    pub url: String,
    /// The event kinds it gets (empty: every kind).
    pub kinds: Vec<String>,
    pub enabled: bool,
    pub created_at_ms: i64,
    /// The last event handled (delivered, or given up on).
    pub cursor_seq: i64,
    /// Tries of the next event so far, and when it is tried again.
    pub attempts: u32,
    pub next_at_ms: i64,
    pub last_status: Option<u16>,
    pub last_error: Option<String>,
    pub last_attempt_at_ms: Option<i64>,
}

/// One attempt to deliver an event to a webhook.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeliveryRecord {
    pub webhook_id: String,
    pub event_id: String,
    pub attempt: u32,
    pub at_ms: i64,
    /// The receiver's HTTP status, if it answered.
    pub status: Option<u16>,
    pub error: Option<String>,
    pub duration_ms: u64,
}

/// A scrape token as it is listed: never the token itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScrapeTokenRecord {
    /// `st_<16 hex>`.
    pub id: String,
    pub name: String,
    /// The account that minted it.
    pub created_by: String,
    pub created_at_ms: i64,
}

/// One audit row: who did what to which object, and how it ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuditRecord {
    /// Increasing; `0` for a row not yet written.
    pub seq: i64,
    pub at_ms: i64,
    /// `root@local`, `key:<key id>`, `sandbox:<id>` or `anonymous`.
    pub actor: String,
    pub tenant: Option<String>,
    pub action: String,
    pub object: Option<String>,
    /// `ok` or the error code.
    pub result: String,
    /// How many times it happened: repeats of a refusal within about a minute of `at_ms` are
    /// one row (see `core::audit`).
    pub count: u64,
}

/// Which audit rows to read.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AuditFilter {
    pub before_seq: Option<i64>,
    pub tenant: Option<String>,
    pub action: Option<String>,
}

/// An audit row as `/v1` shows it: the time in RFC 3339 where the store keeps milliseconds.
impl From<AuditRecord> for crate::model::AuditEntry {
    fn from(r: AuditRecord) -> Self {
        crate::model::AuditEntry {
            seq: r.seq,
            at: rfc3339(r.at_ms),
            actor: r.actor,
            tenant: r.tenant,
            action: r.action,
            object: r.object,
            result: r.result,
            count: r.count,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339_is_total() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(rfc3339(1_700_000_000_123), "2023-11-14T22:13:20.123Z");
        for past in [-1, -86_400_000, i64::MIN] {
            assert_eq!(rfc3339(past), "1970-01-01T00:00:00.000Z", "{past}");
        }
        // A guest's file mtime past year 9999 (u64::MAX read as i64 is -1: the epoch).
        for future in [253_402_300_800_000, i64::MAX, u64::MAX as i64, (u64::MAX >> 1) as i64] {
            let s = rfc3339(future);
            assert!(
                s == "9999-12-31T23:59:59.999Z" || s == "1970-01-01T00:00:00.000Z",
                "{future}: {s}"
            );
        }
        assert_eq!(rfc3339(i64::MAX), "9999-12-31T23:59:59.999Z");
    }
}

/// Where a template build is (E2B's vocabulary, which the native door shares).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BuildStatus {
    /// Recorded; its build VM is being admitted or started.
    Waiting,
    Building,
    Ready,
    /// It failed, was cancelled, or its replica stopped while it ran.
    Error,
}

impl BuildStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            BuildStatus::Waiting => "waiting",
            BuildStatus::Building => "building",
            BuildStatus::Ready => "ready",
            BuildStatus::Error => "error",
        }
    }

    pub fn parse(s: &str) -> Self {
        match s {
            "waiting" => BuildStatus::Waiting,
            "building" => BuildStatus::Building,
            "ready" => BuildStatus::Ready,
            _ => BuildStatus::Error,
        }
    }

    pub fn ended(self) -> bool {
        matches!(self, BuildStatus::Ready | BuildStatus::Error)
    }
}

/// A tenant's volume: a disk on `node` ('' in single-host mode) that outlives sandboxes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeRecord {
    /// `vol-` and 16 hex: the disk's name on its node and its serial in guests.
    pub id: String,
    pub tenant_id: String,
    pub name: String,
    pub size_mib: u64,
    pub node: String,
    /// sha256 of the volume's own token (E2B's content API), hex; '' before one is issued.
    pub token_hash: String,
    pub created_at_ms: i64,
}

/// A volume a sandbox mounts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeMountRecord {
    pub volume_id: String,
    pub path: String,
    pub read_only: bool,
}

/// A sandbox not ended that mounts a volume.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeHolderRecord {
    pub sandbox_id: String,
    pub read_only: bool,
    pub state: String,
}

/// A build of a tenant's template `name:tag`, as recorded. The template is the newest ready
/// build of its name and tag.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BuildRecord {
    pub id: String,
    pub tenant_id: String,
    pub name: String,
    pub tag: String,
    pub status: BuildStatus,
    /// The definition as the core parsed it (JSON).
    pub definition: String,
    /// What its content came from (parent digest and steps): an equal key is the same build.
    pub cache_key: Option<String>,
    /// The built image's name in the nodes' template stores, once ready.
    pub template: Option<String>,
    pub digest: Option<String>,
    /// The built image's manifest in the nodes' stores (JSON), once ready.
    pub manifest: Option<String>,
    /// The node it was built on.
    pub node: String,
    /// The sandbox its steps run in while it builds.
    pub sandbox_id: Option<String>,
    /// The step running now (`base`, `1`..`N`, `finalize`).
    pub step: Option<String>,
    pub error: Option<String>,
    pub error_step: Option<String>,
    pub created_at_ms: i64,
    pub finished_at_ms: Option<i64>,
    pub heartbeat_ms: i64,
}

/// One line of a build's log.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct BuildLogEntry {
    /// Its place in the build's log, from 0.
    pub seq: i64,
    pub at_ms: i64,
    /// `debug`, `info`, `warn` or `error`.
    pub level: String,
    pub step: String,
    pub message: String,
}

/// A build VM saved after a step (the step cache), under the key of what made it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CachedStep {
    pub tenant_id: String,
    pub cache_key: String,
    /// The saved image (on `node`).
    pub image_id: String,
    /// The template the build started from (what the image's machine is).
    pub template: String,
    pub resources: Resources,
    /// The user, workdir and env the steps so far left (JSON).
    pub context: String,
    pub node: String,
    pub used_at_ms: i64,
}
