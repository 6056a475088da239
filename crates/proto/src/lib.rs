//! The protocol between the host and the guest agent.
//!
//! The agent serves HTTP/2 over one byte stream (virtio-serial today, vsock under Firecracker).
//! HTTP/2 gives us multiplexing, per-stream flow control and streamed bodies for free, so a
//! 5 MiB stdout stream and a file upload share the channel without head-of-line blocking.
//! This crate holds the JSON bodies and the binary framing of process output; both doors of
//! the host API translate onto these types, nothing else speaks to the guest.

pub mod frame;
pub mod routes;

pub use routes::{Route, RouteError};

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Name of the virtio-serial port the agent listens on (guest sees `/dev/virtio-ports/<name>`).
pub const AGENT_PORT_NAME: &str = "airlock.agent";
/// Session start, before HTTP/2: the host writes `HELLO <nonce>\n`, the agent answers
/// `READY <nonce>\n`, and HTTP/2 begins. Each side discards whatever came before, so a new host
/// connection resynchronizes even if a previous session died mid-frame (the virtio-serial port
/// carries both sessions' bytes and the guest may not notice a quick disconnect/reconnect).
pub const SESSION_HELLO: &str = "AIRLOCK-HELLO ";
pub const SESSION_READY: &str = "AIRLOCK-READY ";
/// Longest line either side scans for before giving up on it.
pub const SESSION_LINE_MAX: usize = 256;

/// The guest's network: the same in every sandbox (each sandbox has its own network namespace on
/// the host, so the same addresses never meet; a snapshot restores anywhere). The host configures
/// the other end (the tap in the sandbox's namespace); the agent configures the guest's side.
pub mod net {
    /// The guest's NIC (virtio-net), as the guest kernel names it.
    pub const GUEST_IF: &str = "eth0";
    /// The guest's address: carrier-grade NAT space (RFC 6598), which no sandbox may reach
    /// anyway, so the four addresses of the link hide no destination a policy could allow.
    pub const GUEST_ADDR: [u8; 4] = [100, 96, 0, 2];
    /// The gateway: the tap's address in the sandbox's namespace; also the guest's only DNS server.
    pub const GATEWAY: [u8; 4] = [100, 96, 0, 1];
    /// Prefix length of the guest link (a /30: the guest and the gateway).
    pub const PREFIX_LEN: u8 = 30;
    /// The guest NIC's MAC (locally administered), fixed so a snapshot's ARP cache stays right.
    pub const GUEST_MAC: &str = "02:a1:00:00:00:02";
    /// The gateway side's MAC (the tap), fixed for the same reason.
    pub const GATEWAY_MAC: &str = "02:a1:00:00:00:01";
}

/// Agent protocol version, bumped on incompatible changes.
pub const PROTOCOL_VERSION: u32 = 1;

/// Error body of every non-2xx agent response.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct ErrorBody {
    pub code: ErrorCode,
    pub message: String,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    NotFound,
    AlreadyExists,
    InvalidArgument,
    PermissionDenied,
    NotADirectory,
    IsADirectory,
    Internal,
}

impl ErrorCode {
    pub fn http_status(self) -> u16 {
        match self {
            ErrorCode::NotFound => 404,
            ErrorCode::AlreadyExists => 409,
            ErrorCode::InvalidArgument | ErrorCode::NotADirectory | ErrorCode::IsADirectory => 400,
            ErrorCode::PermissionDenied => 403,
            ErrorCode::Internal => 500,
        }
    }
}

/// Who a VM is, given by the host over the channel (`POST /identity`) right after every boot
/// or restore: a VM restored from a snapshot carries the snapshot's boot arguments, clock and
/// random state, so none of these may come from there.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Identity {
    pub hostname: String,
    /// 32 lowercase hex digits (`/etc/machine-id`).
    pub machine_id: String,
    /// Fresh random bytes (hex) mixed into the guest's pool, which then reseeds.
    pub entropy_hex: String,
    /// The host's clock (ns since the epoch) when the call was made.
    pub unix_time_ns: u64,
    /// The sandbox's environment variables, for what runs in the guest without the host
    /// starting it (a template's own process, such as the code interpreter, reads them from
    /// [`SANDBOX_ENV_PATH`]). Absent: unchanged (a resume).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub env: Option<BTreeMap<String, String>>,
}

/// Where the agent keeps the sandbox's environment variables ([`Identity::env`]) as a JSON
/// object, readable by every user in the guest (as E2B's envd serves them on `/envs`).
pub const SANDBOX_ENV_PATH: &str = "/run/airlock/env.json";

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Health {
    pub version: String,
    pub protocol: u32,
    /// Random per boot; a changed value tells the host the guest rebooted.
    pub boot_id: String,
    pub uptime_ms: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Metrics {
    pub cpu_count: u32,
    /// Busy share of all CPUs since the previous metrics call (0..=100).
    pub cpu_used_pct: f64,
    pub mem_total_bytes: u64,
    pub mem_used_bytes: u64,
    pub disk_total_bytes: u64,
    pub disk_used_bytes: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct PtySize {
    pub cols: u16,
    pub rows: u16,
}

/// A process to start in the guest.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, Default)]
pub struct ProcessSpec {
    pub argv: Vec<String>,
    /// Working directory; defaults to the user's home.
    #[serde(default)]
    pub cwd: Option<String>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// User name from the guest's /etc/passwd; defaults to `root`.
    #[serde(default)]
    pub user: Option<String>,
    /// Killed (whole process group, SIGKILL) after this many milliseconds.
    #[serde(default)]
    pub timeout_ms: Option<u64>,
    /// Keep stdin open for `stdin` writes; otherwise stdin is /dev/null.
    #[serde(default)]
    pub stdin: bool,
    /// Run on a pseudo-terminal of this size (stdout and stderr merge into `stdout`).
    #[serde(default)]
    pub pty: Option<PtySize>,
    /// Free-form tag the host may use to find the process again (e.g. an API session id).
    #[serde(default)]
    pub tag: Option<String>,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum ProcessState {
    Running,
    Exited,
}

/// How a process ended.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct ExitStatus {
    /// Exit code when the process exited on its own.
    pub exit_code: Option<i32>,
    /// Signal number when a signal terminated it.
    pub signal: Option<i32>,
    /// True when the agent killed it because its timeout passed.
    #[serde(default)]
    pub timed_out: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct ProcessInfo {
    pub id: u64,
    pub pid: u32,
    pub tag: Option<String>,
    pub argv: Vec<String>,
    pub cwd: String,
    pub user: String,
    pub pty: bool,
    pub stdin: bool,
    pub state: ProcessState,
    pub exit: Option<ExitStatus>,
    /// Milliseconds since the Unix epoch.
    pub started_at_ms: u64,
    pub ended_at_ms: Option<u64>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct SignalRequest {
    /// Signal number (e.g. 15 for SIGTERM).
    pub signal: i32,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum FileKind {
    File,
    Dir,
    Symlink,
    Other,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct FileStat {
    pub path: String,
    pub name: String,
    pub kind: FileKind,
    pub size: u64,
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub owner: String,
    pub group: String,
    /// Milliseconds since the Unix epoch.
    pub modified_ms: u64,
    /// A symlink's target as written (`readlink`).
    pub symlink_target: Option<String>,
    /// A symlink's target fully resolved (every link on the way followed, as `realpath`):
    /// absolute; `None` for a dangling link, and from agents older than this field.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub symlink_resolved: Option<String>,
    /// What a symlink resolves to: its kind and permission bits (`None` when dangling).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub link_target: Option<LinkTarget>,
    /// User metadata: the file's `user.e2b.<key>` extended attributes, prefix stripped (a
    /// symlink's are its target's). Only entries whose key and value are UTF-8.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub metadata: BTreeMap<String, String>,
}

/// What a symlink points at, once resolved.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
pub struct LinkTarget {
    pub kind: FileKind,
    /// Permission bits of the target.
    pub mode: u32,
}

/// The xattr namespace user metadata of files lives in (as E2B's envd keeps it).
pub const METADATA_XATTR_PREFIX: &str = "user.e2b.";
/// Longest metadata key: the whole xattr name (prefix included) is at most 255 bytes.
pub const METADATA_KEY_MAX: usize = 255 - METADATA_XATTR_PREFIX.len();
/// Most metadata one file holds: names (prefix included) plus values, in bytes (ext4 keeps a
/// file's xattrs within one 4 KiB block).
pub const METADATA_TOTAL_MAX: usize = 4096;

/// Check a file's metadata: keys non-empty, at most [`METADATA_KEY_MAX`] bytes, keys and values
/// printable US-ASCII, all of it within [`METADATA_TOTAL_MAX`].
pub fn check_metadata(metadata: &BTreeMap<String, String>) -> Result<(), String> {
    fn printable(what: &str, s: &str) -> Result<(), String> {
        match s.bytes().position(|c| !(0x20..=0x7e).contains(&c)) {
            Some(i) => Err(format!(
                "metadata {what} contains non-printable-ASCII byte 0x{:02x} at offset {i}",
                s.as_bytes()[i]
            )),
            None => Ok(()),
        }
    }
    let mut total = 0;
    for (k, v) in metadata {
        if k.is_empty() {
            return Err("metadata key must not be empty".into());
        }
        if k.len() > METADATA_KEY_MAX {
            return Err(format!("metadata key {k:?} exceeds {METADATA_KEY_MAX} bytes"));
        }
        printable("key", k)?;
        printable(&format!("value for key {k:?}"), v)?;
        total += METADATA_XATTR_PREFIX.len() + k.len() + v.len();
    }
    if total > METADATA_TOTAL_MAX {
        return Err(format!(
            "total metadata size {total} exceeds {METADATA_TOTAL_MAX} bytes"
        ));
    }
    Ok(())
}

/// Where the agent also mounts each volume for the host's file calls on it: a bind of the same
/// filesystem that follows no symlink (`MS_NOSYMFOLLOW`), so a link planted in the volume
/// cannot lead a call outside it. `<dir>/<serial>`.
pub const VOLUME_ACCESS_DIR: &str = "/run/airlock/volumes";

/// The longest volume serial (QEMU's `scsi-hd` serial limit is 36).
pub const VOLUME_SERIAL_MAX: usize = 36;

/// A disk the host attached (a `scsi-hd` whose serial is `serial`), to mount at `path`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct MountVolume {
    pub serial: String,
    pub path: String,
    #[serde(default)]
    pub read_only: bool,
    /// A fresh volume's root directory is given to this user (the sandbox's default), so its
    /// processes can write there.
    #[serde(default)]
    pub owner: Option<String>,
}

impl MountVolume {
    /// The volume's access path in the guest ([`VOLUME_ACCESS_DIR`]).
    pub fn access_path(serial: &str) -> String {
        format!("{VOLUME_ACCESS_DIR}/{serial}")
    }

    /// A serial both ends accept: ASCII letters, digits and `-`, at most
    /// [`VOLUME_SERIAL_MAX`].
    pub fn valid_serial(serial: &str) -> bool {
        !serial.is_empty()
            && serial.len() <= VOLUME_SERIAL_MAX
            && serial.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct MkdirRequest {
    pub path: String,
    /// Owner of the directories created.
    #[serde(default)]
    pub user: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct MkdirResponse {
    /// False when the directory already existed.
    pub created: bool,
    pub stat: FileStat,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct RenameRequest {
    pub from: String,
    pub to: String,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum WatchEventKind {
    Create,
    Write,
    Remove,
    Rename,
    Chmod,
}

/// One filesystem change under a watched directory; sent as one JSON line.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct WatchEvent {
    pub kind: WatchEventKind,
    /// Absolute path in the guest.
    pub path: String,
    /// The entry at `path` when the event was handled, for watches asked for entries: only for
    /// creates, writes and chmods (after a remove or rename the path names something else, if
    /// anything), and not when it was gone already.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub entry: Option<FileStat>,
}
