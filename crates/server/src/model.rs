//! The domain's records (sandbox, operation, session states) as the native `/v1` API shows them;
//! the OpenAPI document is generated from these types. The store keeps them, the core and the
//! engine change them, the E2B door translates them.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use utoipa::ToSchema;

#[derive(Debug, Clone, Copy, Serialize, Deserialize, ToSchema, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum SandboxState {
    Creating,
    Running,
    /// Frozen in memory (vCPUs stopped); resume to run again. Its timeout is stopped meanwhile
    /// (for at most 24 h).
    Paused,
    /// Saved to disk (memory, devices, disk) with no VM running: it holds only disk space.
    /// Resume to run again, with its files and processes as they were. Its timeout is stopped
    /// meanwhile (for at most 30 days).
    Suspended,
    /// Being started again from its suspended state.
    Resuming,
    Deleting,
    Deleted,
    Failed,
    /// Its node stopped answering every replica for longer than the grace (many hosts): its VM
    /// is presumed gone, and is removed if that node comes back.
    Lost,
}

impl SandboxState {
    /// Running, or held (paused, suspended, resuming): what E2B calls a live sandbox.
    pub fn is_held_or_running(self) -> bool {
        matches!(
            self,
            SandboxState::Running | SandboxState::Paused | SandboxState::Suspended | SandboxState::Resuming
        )
    }

    /// Deleted, failed or lost: it has no VM to keep, and whatever is kept about it elsewhere
    /// goes with it.
    pub fn is_ended(self) -> bool {
        matches!(self, SandboxState::Deleted | SandboxState::Failed | SandboxState::Lost)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            SandboxState::Creating => "creating",
            SandboxState::Running => "running",
            SandboxState::Paused => "paused",
            SandboxState::Suspended => "suspended",
            SandboxState::Resuming => "resuming",
            SandboxState::Deleting => "deleting",
            SandboxState::Deleted => "deleted",
            SandboxState::Failed => "failed",
            SandboxState::Lost => "lost",
        }
    }
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "creating" => SandboxState::Creating,
            "running" => SandboxState::Running,
            "paused" => SandboxState::Paused,
            "suspended" => SandboxState::Suspended,
            "resuming" => SandboxState::Resuming,
            "deleting" => SandboxState::Deleting,
            "deleted" => SandboxState::Deleted,
            "failed" => SandboxState::Failed,
            "lost" => SandboxState::Lost,
            _ => return None,
        })
    }
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, ToSchema, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum OperationKind {
    Create,
    Delete,
    Pause,
    Suspend,
    Resume,
    Snapshot,
}

impl OperationKind {
    pub fn as_str(self) -> &'static str {
        match self {
            OperationKind::Create => "create",
            OperationKind::Delete => "delete",
            OperationKind::Pause => "pause",
            OperationKind::Suspend => "suspend",
            OperationKind::Snapshot => "snapshot",
            OperationKind::Resume => "resume",
        }
    }
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "create" => OperationKind::Create,
            "delete" => OperationKind::Delete,
            "pause" => OperationKind::Pause,
            "suspend" => OperationKind::Suspend,
            "snapshot" => OperationKind::Snapshot,
            "resume" => OperationKind::Resume,
            _ => return None,
        })
    }
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, ToSchema, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum OperationState {
    Pending,
    Running,
    Succeeded,
    Failed,
}

impl OperationState {
    pub fn as_str(self) -> &'static str {
        match self {
            OperationState::Pending => "pending",
            OperationState::Running => "running",
            OperationState::Succeeded => "succeeded",
            OperationState::Failed => "failed",
        }
    }
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "pending" => OperationState::Pending,
            "running" => OperationState::Running,
            "succeeded" => OperationState::Succeeded,
            "failed" => OperationState::Failed,
            _ => return None,
        })
    }
    pub fn is_final(self) -> bool {
        matches!(self, OperationState::Succeeded | OperationState::Failed)
    }
}

/// A record of one slow lifecycle change. Poll it until `state` is final.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq)]
pub struct Operation {
    pub id: String,
    pub kind: OperationKind,
    pub state: OperationState,
    pub sandbox_id: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<ErrorBody>,
    /// RFC 3339.
    pub created_at: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub finished_at: Option<String>,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, ToSchema, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct ResourcesSpec {
    /// Virtual CPUs (1 to the host's CPU count). Default 1.
    #[schema(minimum = 1)]
    pub vcpu: Option<u32>,
    /// Guest memory in MiB (at least 128). Default 512.
    #[schema(minimum = 128)]
    pub memory_mib: Option<u32>,
    /// Root disk in MiB (at least the template image). Default 2048.
    #[schema(minimum = 1)]
    pub disk_mib: Option<u32>,
}

/// A sandbox's shape: the runtime's own type, documented as it is (one definition).
pub use airlock_runtime::Resources;

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateSandboxRequest {
    /// Template name (`seed`, `seed:latest`) or digest (`sha256:...`).
    #[schema(min_length = 1)]
    pub template: String,
    /// VMM: `qemu` (default) or `fc` (Firecracker, where installed).
    pub runtime: Option<String>,
    pub resources: Option<ResourcesSpec>,
    /// Lifetime, e.g. `"10m"`, `"90s"`, `"2h"` (1s to 24h). Default 5m. The server deletes the
    /// sandbox when it passes.
    pub timeout: Option<String>,
    /// Environment variables for every command session.
    pub env: Option<BTreeMap<String, String>>,
    /// Free-form labels, filterable in the list.
    pub metadata: Option<BTreeMap<String, String>>,
    /// What happens when the timeout passes: `delete` (the default) or `suspend` (saved to disk,
    /// resumable for 30 days; it gets its whole timeout again when it resumes).
    pub on_timeout: Option<OnTimeout>,
    /// Resume the sandbox when a request reaches it (a session, a file, a port, E2B's envd)
    /// while it is suspended or paused. Default false: such a request gets 409 `invalid_state`.
    pub auto_resume: Option<bool>,
    /// The tenant's volumes to mount: one sandbox may have a volume read-write, or any number
    /// read-only, never both. The sandbox starts on the volumes' node.
    pub volumes: Option<Vec<VolumeMount>>,
}

/// A volume mounted in a new sandbox.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq, Eq)]
pub struct VolumeMount {
    /// The volume's id or name.
    pub volume: String,
    /// Absolute path in the guest (made if missing).
    pub path: String,
    #[serde(default)]
    pub read_only: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct CreateVolumeRequest {
    /// 1 to 64 letters, digits, `-`, `_`, `.`; unique in the tenant.
    pub name: String,
    /// Size in MiB (16 to 1048576; default 1024). The disk is sparse: only what is written
    /// takes space, but the whole size counts against `volume_mib` and the node's disk.
    pub size_mib: Option<u64>,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ResizeVolumeRequest {
    /// The new size in MiB: a volume only grows.
    pub size_mib: u64,
}

/// A tenant's volume: a disk that outlives sandboxes.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct Volume {
    /// `vol-<hex>`.
    pub id: String,
    pub name: String,
    pub size_mib: u64,
    pub created_at: String,
    /// The node it lives on ('' in single-host mode).
    pub node: String,
    /// Sandboxes (not ended) that mount it.
    pub mounted_by: Vec<VolumeHolder>,
    /// Bytes its disk takes now (sparse), if its node answered.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub used_bytes: Option<u64>,
    /// The volume's own token (E2B's content API), only in the create's answer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq, Eq)]
pub struct VolumeHolder {
    pub sandbox_id: String,
    pub read_only: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct VolumeList {
    pub volumes: Vec<Volume>,
}

/// An image of a sandbox saved while it ran (memory, running processes, files); new sandboxes
/// start from it (`"template": "<its id or name>"`). Owned by the tenant that made it.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq, Eq)]
pub struct Snapshot {
    /// `snap_<hex>`.
    pub id: String,
    pub name: Option<String>,
    /// The sandbox it was saved from.
    pub sandbox_id: String,
    pub template: String,
    /// Fixed by the saved machine: sandboxes made from it have these.
    pub resources: Resources,
    /// Disk space it holds (saved memory and disk).
    pub bytes: u64,
    /// Content address, `sha256:<hex>`: a digest over its saved memory and device state, its
    /// disk, its template's content and its resources. Equal digests restore to the same
    /// machine. A create may name the snapshot by it, as by its id or name.
    pub digest: Option<String>,
    pub created_at: String,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
pub struct CreateSnapshotRequest {
    /// A name unique among the tenant's snapshots (letters, digits, `-`, `_`, `.`; at most 64).
    pub name: Option<String>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
pub struct ForkRequest {
    /// How many sandboxes (1 to 20; default 1).
    pub count: Option<u32>,
    /// Their lifetime (default 5m).
    pub timeout: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ForkAccepted {
    /// One create per child that was admitted, each with its own operation.
    pub sandboxes: Vec<OperationAccepted>,
    /// Why the others were not (a quota, the node's budget).
    pub errors: Vec<ErrorBody>,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct SnapshotList {
    pub snapshots: Vec<Snapshot>,
}

/// What a sandbox's timeout does.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, ToSchema, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum OnTimeout {
    #[default]
    Delete,
    Suspend,
}

impl OnTimeout {
    pub fn as_str(self) -> &'static str {
        match self {
            OnTimeout::Delete => "delete",
            OnTimeout::Suspend => "suspend",
        }
    }
}

/// A sandbox's lifecycle settings, chosen at create.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, ToSchema, PartialEq, Eq)]
pub struct Lifecycle {
    pub on_timeout: OnTimeout,
    pub auto_resume: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct OperationAccepted {
    pub operation: Operation,
    pub sandbox_id: String,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq)]
pub struct Sandbox {
    pub id: String,
    pub state: SandboxState,
    pub template: String,
    /// Resolved template digest (`sha256:...`).
    pub template_digest: String,
    pub runtime: String,
    /// `kvm` or `tcg`.
    pub accel: String,
    pub resources: Resources,
    pub metadata: BTreeMap<String, String>,
    pub created_at: String,
    pub expires_at: String,
    pub egress: SandboxEgress,
    pub lifecycle: Lifecycle,
    /// How its VM started, once it runs: booted, or restored from its template's base snapshot.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start: Option<SandboxStart>,
}

/// What a boot settled.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Booted {
    pub template_digest: String,
    pub accel: String,
    pub start: SandboxStart,
    /// Which start of the sandbox on its node this is (`nodes::VmReport::run`).
    #[serde(default)]
    pub run: String,
}

/// How a sandbox's VM started.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq, Eq)]
pub struct SandboxStart {
    /// `boot` (a cold boot) or `restore` (from the base snapshot of its template and shape).
    pub from: String,
    /// From the VMM's start to the guest agent ready, with the sandbox's identity applied.
    pub ms: u64,
}

/// A sandbox's egress, chosen at create and fixed for its life (`GET .../egress` shows the whole
/// effective policy).
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq, Eq)]
pub struct SandboxEgress {
    /// The egress profiles it runs with (the server's default profiles unless a signed-in create
    /// chose others with `X-Airlock-Egress-Profiles`).
    pub profiles: Vec<String>,
    /// No egress at all (E2B `allow_internet_access=False`).
    pub sealed: bool,
}

/// Exact domains, addresses and networks.
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct EgressRules {
    #[serde(default)]
    pub domains: Vec<String>,
    #[serde(default)]
    pub ips: Vec<String>,
    #[serde(default)]
    pub cidrs: Vec<String>,
}

/// What decides a sandbox's egress, in order: the platform's denies (always), the tenant's
/// denies, then the tenant's allows and the profiles' (anything else is denied).
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq, Eq)]
pub struct EffectiveEgressPolicy {
    pub sealed: bool,
    /// Ranges no rule opens (`127.0.0.0/8 (loopback)`), and the host's own addresses.
    pub platform_deny: Vec<String>,
    pub tenant_deny: EgressRules,
    pub tenant_allow: EgressRules,
    /// Profile name -> what it allows.
    pub profiles: BTreeMap<String, EgressRules>,
}

/// A sandbox's egress decisions: the egress crate's own counters, documented as they are.
pub use airlock_egress::EgressCounters;

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq, Eq)]
pub struct EgressDenial {
    /// RFC 3339.
    pub at: String,
    /// `dns` or `tcp`.
    pub path: String,
    /// `name:port`, `ip:port`, or for DNS the name and type (`example.com A`).
    pub destination: String,
    /// The rule that denied it (`default deny`, `tenant deny domain x`, `platform deny ...`).
    pub rule: String,
}

/// `GET /v1/sandboxes/{id}/egress`: why a sandbox can reach what it can.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq, Eq)]
pub struct EgressReport {
    pub sandbox_id: String,
    pub policy: EffectiveEgressPolicy,
    pub counters: EgressCounters,
    /// Oldest first; the most recent few only.
    pub recent_denials: Vec<EgressDenial>,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct SandboxList {
    pub sandboxes: Vec<Sandbox>,
    /// Pass as `page_token` to get the next page; absent on the last page.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub next_page_token: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq, Eq)]
pub struct PtySpec {
    #[schema(minimum = 1, maximum = 65535)]
    pub cols: u16,
    #[schema(minimum = 1, maximum = 65535)]
    pub rows: u16,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateSessionRequest {
    /// Program and arguments; no shell is involved unless you run one.
    #[schema(min_items = 1)]
    pub argv: Vec<String>,
    /// Working directory (default: the user's home).
    pub cwd: Option<String>,
    pub env: Option<BTreeMap<String, String>>,
    /// `user` (default) or `root`, or any account in the template.
    pub user: Option<String>,
    /// Kill the process after this long, e.g. `"30s"`.
    pub timeout: Option<String>,
    /// Keep stdin open for `POST .../stdin`.
    pub stdin: Option<bool>,
    /// Run on a terminal of this size.
    pub pty: Option<PtySpec>,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, ToSchema, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum SessionState {
    Running,
    Exited,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq)]
pub struct Session {
    pub id: String,
    pub sandbox_id: String,
    pub state: SessionState,
    pub argv: Vec<String>,
    pub cwd: String,
    pub user: String,
    pub pty: bool,
    /// The label the caller gave the process (E2B's process tag), if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tag: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
    /// Terminating signal, e.g. `SIGKILL`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub signal: Option<String>,
    pub timed_out: bool,
    pub started_at: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ended_at: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct StdinRequest {
    /// Base64 bytes to write.
    pub data: Option<String>,
    /// Close stdin after writing (EOF).
    pub eof: Option<bool>,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SignalRequest {
    /// `SIGTERM`, `TERM`, or a number as a string (`"15"`).
    pub signal: String,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct FileInfo {
    pub path: String,
    pub name: String,
    /// `file`, `dir`, `symlink` or `other`.
    pub kind: String,
    pub size: u64,
    /// Permission bits, octal string like `"0644"`.
    pub mode: String,
    pub owner: String,
    pub group: String,
    pub modified_at: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub symlink_target: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct FileList {
    pub entries: Vec<FileInfo>,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct Template {
    pub name: String,
    pub digest: String,
    pub kernel_version: String,
    pub size_bytes: u64,
    pub built_at: String,
    /// A tenant's own template: its tag and the build that serves it (absent on platform ones).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tag: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub build_id: Option<String>,
}

impl From<airlock_runtime::template::TemplateManifest> for Template {
    fn from(m: airlock_runtime::template::TemplateManifest) -> Self {
        Template {
            name: m.name,
            digest: m.digest,
            kernel_version: m.kernel_version,
            size_bytes: m.size_bytes,
            built_at: m.built_at,
            tag: None,
            build_id: None,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct TemplateList {
    pub templates: Vec<Template>,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct SystemInfo {
    pub version: String,
    /// Accelerator sandboxes boot with: `kvm` or `tcg`.
    pub accel: String,
    pub runtimes: Vec<String>,
    /// The node's CPUs, memory and running sandboxes (of every tenant): `GET /v1/admin/system`
    /// only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capacity: Option<Capacity>,
    pub egress: EgressInfo,
    /// Warm pools: VMs kept ready per template and shape for creates to claim.
    /// `GET /v1/admin/system` only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pools: Option<Vec<PoolInfo>>,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq, Eq)]
pub struct PoolInfo {
    pub template: String,
    pub resources: Resources,
    /// How many VMs it keeps ready.
    pub size: usize,
    pub ready: usize,
    pub starting: usize,
    /// Creates that claimed one of its VMs (`start.from: pool`), and creates of its template
    /// and shape that found it empty.
    pub hits: u64,
    pub misses: u64,
}

/// `PUT /v1/admin/pools`: a pool's size (0 empties it).
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct PoolRequest {
    pub template: String,
    /// Default: the server's default resources.
    pub resources: Option<ResourcesSpec>,
    pub size: usize,
}

/// The server's egress configuration (from `AIRLOCK_EGRESS_PROFILES` at startup).
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct EgressInfo {
    /// sha256 of the canonical configuration (always-denied ranges and every profile): equal on
    /// every replica that runs the same one.
    pub digest: String,
    pub profiles: Vec<EgressProfileInfo>,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct EgressProfileInfo {
    pub name: String,
    /// Applied to every create that selects no profiles.
    pub default: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct Capacity {
    pub cpus: u32,
    pub memory_mib: u64,
    pub sandboxes_running: u32,
}

/// `GET /v1/admin/nodes`: one node as the replica answering sees it now.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq, Eq)]
pub struct NodeInfo {
    /// Its name in sandbox records ('' for single-host mode's one node, in the server).
    pub name: String,
    /// `ready`; `draining` (its sandboxes are being taken off it); `refusing` (it answers but
    /// takes no new sandbox: `reason` says why); `unreachable` (its last report failed; its
    /// running sandboxes are lost once every replica has had no answer for the grace).
    pub state: NodeState,
    /// Why it takes no new sandbox now, if it does not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Its machine: a parked sandbox resumes only on a node of the same.
    pub fingerprint: String,
    /// It has object storage: on drain its sandboxes move to another node.
    pub parks: bool,
    pub cpus: u32,
    pub memory_mib: u64,
    pub disk_free_mib: u64,
    pub sandboxes_running: u32,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, ToSchema, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum NodeState {
    Ready,
    Draining,
    Refusing,
    Unreachable,
}

/// Event payloads on a session's SSE stream (`event:` names in parentheses).
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct OutputEvent {
    /// Base64 bytes (`stdout`, `stderr`).
    pub data: String,
}

/// (`output_truncated`) Events `first_seq..=last_seq` are gone: the guest keeps a bounded
/// tail of each process's output (32 MiB), and this reader came after they were dropped.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct TruncatedEvent {
    pub first_seq: u64,
    pub last_seq: u64,
    pub message: String,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ExitedEvent {
    /// (`process_exited`)
    #[serde(skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub signal: Option<String>,
    pub timed_out: bool,
}

/// Error body of every non-2xx response, and the error a failed operation records.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq, Eq)]
pub struct ErrorBody {
    /// snake_case error code, stable across versions.
    pub code: String,
    /// Human-readable explanation, naming the field or the fix.
    pub message: String,
}

/// A tenant's limits. `null`: no limit of its own (the node's budgets always apply). What the
/// operator sets (`airlock tenant quota set`) wins over the server's defaults (`--max-sandboxes`,
/// `--max-sessions`).
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, ToSchema, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct Quota {
    /// Live sandboxes (creating, running, paused, resuming, deleting) at once; suspended ones
    /// hold no VM and count only for disk.
    #[serde(default)]
    pub sandboxes: Option<u32>,
    /// vCPUs of its live sandboxes together (suspended ones not counted).
    #[serde(default)]
    pub vcpu: Option<u64>,
    /// Memory of its live sandboxes together, MiB (suspended ones not counted).
    #[serde(default)]
    pub memory_mib: Option<u64>,
    /// Disk of its live sandboxes together, MiB (each counted at its full size, suspended too,
    /// plus the memory a suspend saves), and of its snapshots (each counted at its sandbox's
    /// disk plus memory while it is saved, then at its size).
    #[serde(default)]
    pub disk_mib: Option<u64>,
    /// Running sessions (processes started through either door) per sandbox.
    #[serde(default)]
    pub sessions_per_sandbox: Option<u32>,
    /// Creates admitted in any 60 seconds; past it, 429 `rate_limited` with `Retry-After`.
    #[serde(default)]
    pub creates_per_minute: Option<u32>,
    /// Its volumes' sizes together, MiB.
    #[serde(default)]
    pub volume_mib: Option<u64>,
}

impl Quota {
    /// Each limit of `self`, else `defaults`'.
    pub fn or(self, defaults: Quota) -> Quota {
        Quota {
            sandboxes: self.sandboxes.or(defaults.sandboxes),
            vcpu: self.vcpu.or(defaults.vcpu),
            memory_mib: self.memory_mib.or(defaults.memory_mib),
            disk_mib: self.disk_mib.or(defaults.disk_mib),
            sessions_per_sandbox: self.sessions_per_sandbox.or(defaults.sessions_per_sandbox),
            creates_per_minute: self.creates_per_minute.or(defaults.creates_per_minute),
            volume_mib: self.volume_mib.or(defaults.volume_mib),
        }
    }
}

/// What a tenant's live sandboxes and snapshots hold now, and its creates of the last 60 seconds.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, ToSchema, PartialEq, Eq)]
pub struct TenantUsage {
    pub sandboxes: u32,
    pub vcpu: u64,
    pub memory_mib: u64,
    /// Its sandboxes' disks (and saved memory) and its snapshots together, as `disk_mib` counts.
    pub disk_mib: u64,
    /// Its snapshots (forks' images included, and saves under way).
    #[serde(default)]
    pub snapshots: u32,
    /// What of `disk_mib` its snapshots hold.
    #[serde(default)]
    pub snapshot_disk_mib: u64,
    pub creates_last_minute: u32,
}

/// `GET /v1/tenant`: the caller's tenant, its limits in force and its usage against them.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct TenantInfo {
    pub name: String,
    pub quota: Quota,
    pub usage: TenantUsage,
}

/// `POST /v1/admin/login`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct LoginRequest {
    /// `root@local`.
    pub username: String,
    pub password: String,
}

/// An admin token: `Authorization: Bearer <token>` on `/v1/admin/*` until `expires_at`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct AdminToken {
    pub token: String,
    pub expires_at: String,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateTenantRequest {
    /// 1 to 63 of a-z, 0-9 and '-'.
    pub name: String,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct TenantSummary {
    pub name: String,
    pub created_at: String,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct TenantList {
    pub tenants: Vec<TenantSummary>,
}

/// `DELETE /v1/admin/tenants/{name}`: its keys are revoked and its sandboxes being deleted.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct TenantDeleted {
    pub name: String,
    pub sandboxes_deleting: u32,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateKeyRequest {
    /// What the key is for (shown in listings).
    #[serde(default)]
    pub name: String,
    /// Spell it `e2b_<hex>` (the shape e2b SDKs 2.26 to 2.5x require of `E2B_API_KEY`).
    #[serde(default)]
    pub e2b: bool,
}

/// An API key as listed: never the key itself.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct KeyView {
    /// What the key is revoked by.
    pub id: String,
    pub name: String,
    /// The key's first 8 characters.
    pub prefix: String,
    pub created_at: String,
    pub last_used_at: Option<String>,
    pub revoked_at: Option<String>,
}

/// A new key: `key` is shown this once (only its hash is kept).
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct NewKey {
    pub key: String,
    #[serde(flatten)]
    pub info: KeyView,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct KeyList {
    pub keys: Vec<KeyView>,
}

/// What happened to a sandbox: an event's `type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, ToSchema)]
pub enum EventKind {
    /// It runs (its create finished).
    #[serde(rename = "sandbox.created")]
    Created,
    /// Its timeout or metadata changed.
    #[serde(rename = "sandbox.updated")]
    Updated,
    #[serde(rename = "sandbox.paused")]
    Paused,
    #[serde(rename = "sandbox.suspended")]
    Suspended,
    #[serde(rename = "sandbox.resumed")]
    Resumed,
    #[serde(rename = "sandbox.snapshotted")]
    Snapshotted,
    /// Children were made from it (`data.children`).
    #[serde(rename = "sandbox.forked")]
    Forked,
    /// Deleted (by a caller, or after its timeout).
    #[serde(rename = "sandbox.killed")]
    Killed,
    /// Its timeout passed: it is deleted, or suspended with `on_timeout: suspend`
    /// (`data.action`); the `killed` or `suspended` event follows.
    #[serde(rename = "sandbox.timed_out")]
    TimedOut,
    /// Its create failed, or its VM ended on its own (`data.error`).
    #[serde(rename = "sandbox.failed")]
    Failed,
}

impl EventKind {
    pub const ALL: [EventKind; 10] = [
        EventKind::Created,
        EventKind::Updated,
        EventKind::Paused,
        EventKind::Suspended,
        EventKind::Resumed,
        EventKind::Snapshotted,
        EventKind::Forked,
        EventKind::Killed,
        EventKind::TimedOut,
        EventKind::Failed,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            EventKind::Created => "sandbox.created",
            EventKind::Updated => "sandbox.updated",
            EventKind::Paused => "sandbox.paused",
            EventKind::Suspended => "sandbox.suspended",
            EventKind::Resumed => "sandbox.resumed",
            EventKind::Snapshotted => "sandbox.snapshotted",
            EventKind::Forked => "sandbox.forked",
            EventKind::Killed => "sandbox.killed",
            EventKind::TimedOut => "sandbox.timed_out",
            EventKind::Failed => "sandbox.failed",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|k| k.as_str() == s)
    }
}

/// A sandbox's lifecycle event.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct Event {
    pub id: String,
    /// Increasing in the order events were recorded: the events API's cursor, an SSE stream's
    /// event id.
    pub seq: i64,
    #[serde(rename = "type")]
    pub kind: String,
    pub sandbox_id: String,
    pub at: String,
    /// What else it says: the sandbox's template, how it started, an error, ...
    #[schema(value_type = Object)]
    pub data: serde_json::Value,
}

/// A page of events, newest first; `next_before` asks for the page after it.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct EventList {
    pub events: Vec<Event>,
    pub next_before: Option<i64>,
}

/// `POST /v1/webhooks`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateWebhookRequest {
    /// Where events are POSTed (http or https; not to loopback, private, link-local or
    /// metadata addresses unless the operator allows it).
    pub url: String,
    /// The event types it gets (`sandbox.created`, ...); empty or left out: every type.
    #[serde(default)]
    pub events: Vec<String>,
    #[serde(default)]
    pub name: String,
}

/// `PATCH /v1/webhooks/{id}`: what is given changes.
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct UpdateWebhookRequest {
    pub url: Option<String>,
    pub events: Option<Vec<String>>,
    pub name: Option<String>,
    pub enabled: Option<bool>,
}

/// A webhook as listed: never its secret.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct WebhookView {
    pub id: String,
    pub name: String,
    pub url: String,
    pub events: Vec<String>,
    pub enabled: bool,
    pub created_at: String,
    /// The last delivery attempt: when, the receiver's status (none: no answer), the error.
    pub last_attempt_at: Option<String>,
    pub last_status: Option<u16>,
    pub last_error: Option<String>,
    /// Failed tries of the event it delivers next.
    pub attempts: u32,
}

/// A new webhook: `secret` is shown this once. Each delivery carries `Airlock-Signature:
/// t=<unix seconds>,v1=<hex HMAC-SHA256 of "<t>.<body>" under the secret>`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct NewWebhook {
    pub secret: String,
    #[serde(flatten)]
    pub info: WebhookView,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct WebhookList {
    pub webhooks: Vec<WebhookView>,
}

/// One delivery attempt.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct DeliveryView {
    pub event_id: String,
    pub attempt: u32,
    pub at: String,
    pub status: Option<u16>,
    pub error: Option<String>,
    pub duration_ms: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct DeliveryList {
    pub deliveries: Vec<DeliveryView>,
}

/// `POST /v1/admin/scrape-tokens`.
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateScrapeTokenRequest {
    /// What the token is for (shown in listings): the Prometheus that presents it.
    #[serde(default)]
    pub name: String,
}

/// A scrape token as listed: never the token itself.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ScrapeTokenView {
    /// What the token is revoked by.
    pub id: String,
    pub name: String,
    /// The account that minted it.
    pub created_by: String,
    pub created_at: String,
}

/// A new scrape token: `token` is shown this once (only its hash is kept). Prometheus presents
/// it as `Authorization: Bearer <token>` (`authorization.credentials` of a scrape config).
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct NewScrapeToken {
    pub token: String,
    #[serde(flatten)]
    pub info: ScrapeTokenView,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ScrapeTokenList {
    pub tokens: Vec<ScrapeTokenView>,
}

/// One audit row.
// The wire differs from the record (`records::AuditRecord`): `at` is RFC 3339 where the store
// keeps `at_ms` (a doc comment would become the schema's description).
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct AuditEntry {
    pub seq: i64,
    pub at: String,
    /// `root@local`, `key:<key id>`, `anonymous`, ...
    pub actor: String,
    pub tenant: Option<String>,
    /// `login`, `tenant.create`, `key.revoke`, `sandbox.create`, ...
    pub action: String,
    pub object: Option<String>,
    /// `ok`, or the error code.
    pub result: String,
    /// How many times it happened: repeats of a refusal (the same actor, action, object and
    /// result) within about a minute of `at` are this one row.
    pub count: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct AuditPage {
    pub entries: Vec<AuditEntry>,
}

/// A tenant's base egress policy, as the admin API reads and writes it.
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct TenantEgressPolicy {
    #[serde(default)]
    pub allow: EgressRules,
    #[serde(default)]
    pub deny: EgressRules,
}

/// A step of a template build: `RUN [cmd, user?]`, `COPY [src, dest, user?, mode?]` (with
/// `filesHash`, an uploaded context), `ENV [k1, v1, ...]`, `WORKDIR [path]`, `USER [name]`. The
/// same shape as E2B's build steps: both doors take it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct BuildStep {
    #[serde(rename = "type")]
    pub kind: StepKind,
    #[serde(default)]
    pub args: Vec<String>,
    /// COPY: the uploaded context (its sha256, as `POST /v1/templates/contexts` answered).
    #[serde(
        default,
        rename = "filesHash",
        alias = "files_hash",
        skip_serializing_if = "Option::is_none"
    )]
    pub files_hash: Option<String>,
    /// Run it even if a cached result exists.
    #[serde(default)]
    pub force: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "UPPERCASE")]
pub enum StepKind {
    Run,
    Copy,
    Env,
    Workdir,
    User,
}

impl StepKind {
    pub fn name(self) -> &'static str {
        match self {
            StepKind::Run => "RUN",
            StepKind::Copy => "COPY",
            StepKind::Env => "ENV",
            StepKind::Workdir => "WORKDIR",
            StepKind::User => "USER",
        }
    }
}

/// A template build: a Dockerfile (with `context` for its COPY lines) or `from` and `steps`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct BuildTemplateRequest {
    /// `name[:tag]` (tag `default` when none).
    pub name: String,
    /// The parent: a platform template, one of the tenant's, or an OCI image (`registry/repo:tag`,
    /// pulled where the operator allows); with `dockerfile`, its FROM.
    #[serde(default)]
    pub from: Option<String>,
    #[serde(default)]
    pub steps: Vec<BuildStep>,
    /// A Dockerfile (FROM, RUN, COPY, ADD of local files, ENV, WORKDIR, USER, ARG, CMD, ENTRYPOINT).
    #[serde(default)]
    pub dockerfile: Option<String>,
    /// The uploaded context the Dockerfile's COPY lines copy from.
    #[serde(default)]
    pub context: Option<String>,
    /// Started in every sandbox of the template (restored running, from its base snapshot).
    #[serde(default)]
    pub start_cmd: Option<String>,
    /// A command that exits 0 once the start command is ready.
    #[serde(default)]
    pub ready_cmd: Option<String>,
    /// Rebuild every step.
    #[serde(default)]
    pub force: bool,
    #[serde(default)]
    pub vcpu: Option<u32>,
    #[serde(default)]
    pub memory_mib: Option<u32>,
    #[serde(default)]
    pub disk_mib: Option<u32>,
    /// The registry account to pull an image parent with (this build only; never stored).
    #[serde(default)]
    pub registry_auth: Option<airlock_runtime::template::RegistryCredentials>,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct BuildFailure {
    pub message: String,
    /// `base`, the step's number (1-based), or `finalize`.
    pub step: String,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct TemplateBuild {
    pub id: String,
    pub name: String,
    pub tag: String,
    /// `waiting`, `building`, `ready` or `error`.
    pub status: String,
    /// The step running now, or the last one.
    pub step: Option<String>,
    pub error: Option<BuildFailure>,
    pub digest: Option<String>,
    pub created_at: String,
    pub finished_at: Option<String>,
}

impl From<crate::records::BuildRecord> for TemplateBuild {
    fn from(b: crate::records::BuildRecord) -> Self {
        TemplateBuild {
            error: b.error.map(|message| BuildFailure {
                message,
                step: b.error_step.unwrap_or_default(),
            }),
            id: b.id,
            name: b.name,
            tag: b.tag,
            status: b.status.as_str().into(),
            step: b.step,
            digest: b.digest,
            created_at: crate::records::rfc3339(b.created_at_ms),
            finished_at: b.finished_at_ms.map(crate::records::rfc3339),
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct BuildLogLine {
    /// Its place in the build's log, from 0 (an SSE event's id).
    pub seq: i64,
    pub at: String,
    pub level: String,
    pub step: String,
    pub message: String,
}

impl From<crate::records::BuildLogEntry> for BuildLogLine {
    fn from(e: crate::records::BuildLogEntry) -> Self {
        BuildLogLine {
            seq: e.seq,
            at: crate::records::rfc3339(e.at_ms),
            level: e.level,
            step: e.step,
            message: e.message,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct BuildLogs {
    pub build: TemplateBuild,
    pub entries: Vec<BuildLogLine>,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct BuildList {
    pub builds: Vec<TemplateBuild>,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ContextUploaded {
    /// Name it in COPY steps (`filesHash`) or as a Dockerfile build's `context`.
    pub hash: String,
}
