//! A VM this node runs ([`Vm`]): its record (`<dir>/sandbox.json`), its VMM handle, its network
//! and its agent session; and the identity a VM is given once its agent answers. Uses only the
//! VMM handle, the agent client and the network's link.

use crate::agent::AgentClient;
use crate::datadir::random_hex;
use crate::error::{Result, RuntimeError};
use crate::net::SandboxLink;
use crate::vmm::{Accel, Resources, ResumeSpec, VmHandle, VolumeDisk};
use airlock_proto::frame::EventKind;
use airlock_proto::{ExitStatus, ProcessSpec};
use futures_util::StreamExt;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

/// A VM's record file in its dir.
pub const RECORD: &str = "sandbox.json";

/// What a VM is, as recorded in `<dir>/sandbox.json` (so a restarted process can re-attach).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct VmRecord {
    pub id: String,
    pub template: String,
    pub template_digest: String,
    pub runtime: String,
    pub accel: Accel,
    pub resources: Resources,
    /// RFC 3339.
    pub created_at: String,
    /// Where its VM started from.
    #[serde(default)]
    pub start: StartKind,
    /// From the VMM's start to the agent's READY with its identity applied.
    #[serde(default)]
    pub start_ms: u64,
    /// The machine id it was given (a resume gives it the same one again).
    #[serde(default)]
    pub machine_id: String,
    /// The machine its VM is (files, kernel command line, memory layout): what a resume
    /// starts again. Absent in records of an older server (such a VM cannot suspend).
    #[serde(default)]
    pub machine: Option<ResumeSpec>,
    /// This start of the sandbox on this node (random, new for every VM started here; a pause
    /// or suspend and resume keep it). A caller names it so a change meant for an earlier run
    /// of the same id (a reaper's, read from an old report) cannot end a newer one. Empty in
    /// records of an older server.
    #[serde(default)]
    pub run: String,
    /// The volumes attached to it, in their slots (a resume attaches them again).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub volumes: Vec<VolumeDisk>,
}

impl VmRecord {
    /// Write it to `<dir>/sandbox.json`.
    pub fn write(&self, dir: &std::path::Path) -> Result<()> {
        crate::datadir::write_atomic(
            &dir.join(RECORD),
            &serde_json::to_vec_pretty(self).expect("serializable"),
        )
    }

    /// The record in `dir`, if one is there and readable.
    pub fn load(dir: &std::path::Path) -> Option<Self> {
        serde_json::from_slice(&std::fs::read(dir.join(RECORD)).ok()?).ok()
    }
}

/// Where a VM started from. The names on disk (`restore`, `snapshot`) are the earlier ones.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum StartKind {
    #[default]
    Boot,
    /// From its template's base snapshot.
    #[serde(rename = "restore")]
    BaseSnapshot,
    /// From an image saved from another VM (a tenant's snapshot, a fork).
    #[serde(rename = "snapshot")]
    Image,
    /// Claimed from a warm pool (`start_ms` is the claim).
    Pool,
}

/// How long a suspend or resume took, for the caller to report.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timing {
    pub ms: u64,
}

/// Collected result of a command run to completion.
#[derive(Debug, Clone)]
pub struct Output {
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    pub exit: ExitStatus,
}

/// A running (or paused) VM of this node.
pub struct Vm {
    pub record: VmRecord,
    /// Its VMM process (pid, dir, sockets).
    pub handle: VmHandle,
    /// Its network (namespace, veth, tables), when the runtime makes networks.
    pub net: Option<SandboxLink>,
    /// Connected lazily: a VM found paused after a restart has no session until it resumes.
    pub(super) agent: tokio::sync::Mutex<Option<AgentClient>>,
    /// Its VMM is meant to exit (a delete or a suspend): the exit is not a crash.
    pub(super) deleting: AtomicBool,
    pub(super) paused: AtomicBool,
    /// Its volumes now (the record's, and those attached since).
    volumes: std::sync::Mutex<Vec<VolumeDisk>>,
}

impl Vm {
    /// A VM's handle, not yet in any runtime map.
    pub(super) fn new(
        record: VmRecord,
        vm: VmHandle,
        net: Option<SandboxLink>,
        client: Option<AgentClient>,
        paused: bool,
    ) -> Arc<Self> {
        Arc::new(Self {
            volumes: std::sync::Mutex::new(record.volumes.clone()),
            record,
            handle: vm,
            net,
            agent: tokio::sync::Mutex::new(client),
            deleting: AtomicBool::new(false),
            paused: AtomicBool::new(paused),
        })
    }

    pub fn id(&self) -> &str {
        &self.record.id
    }

    /// The agent session, reconnected if the channel dropped (e.g. after a server restart).
    /// A paused VM has none: its guest cannot answer until it resumes.
    pub async fn agent(&self) -> Result<AgentClient> {
        if self.is_paused() {
            return Err(RuntimeError::NotRunning(format!("{} (paused)", self.id())));
        }
        let mut guard = self.agent.lock().await;
        match guard.as_ref() {
            Some(c) if !c.is_closed() => Ok(c.clone()),
            _ => {
                let (client, _) =
                    AgentClient::connect_ready(&self.handle.agent_socket, Duration::from_secs(10)).await?;
                *guard = Some(client.clone());
                Ok(client)
            }
        }
    }

    /// The volumes attached to it.
    pub fn volumes(&self) -> Vec<VolumeDisk> {
        self.volumes.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Its record as it is now (with the volumes attached since it started), also written to
    /// its dir.
    pub(super) fn add_volume(&self, disk: VolumeDisk) -> Result<()> {
        let mut volumes = self.volumes.lock().unwrap_or_else(|e| e.into_inner());
        volumes.push(disk);
        let mut record = self.record.clone();
        record.volumes = volumes.clone();
        record.write(&self.handle.dir)
    }

    /// Its record with the volumes it has now.
    pub fn record_now(&self) -> VmRecord {
        let mut record = self.record.clone();
        record.volumes = self.volumes();
        record
    }

    pub fn is_paused(&self) -> bool {
        self.paused.load(Ordering::SeqCst)
    }

    pub(super) fn is_deleting(&self) -> bool {
        self.deleting.load(Ordering::SeqCst)
    }

    pub(super) fn set_deleting(&self, on: bool) {
        self.deleting.store(on, Ordering::SeqCst);
    }

    pub(super) fn set_paused(&self, on: bool) {
        self.paused.store(on, Ordering::SeqCst);
    }

    /// End the host's session with a VM about to be saved: the guest sees its host leave, so the
    /// restored guest serves a new session at once (its processes and their output stay in the
    /// guest). Every stream on the session ends.
    pub(super) async fn end_session(&self) {
        if let Some(client) = self.agent.lock().await.take() {
            client.close();
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Run a command to completion and collect its output (tests, CLI, benchmarks).
    pub async fn run(&self, spec: ProcessSpec) -> Result<Output> {
        let agent = self.agent().await?;
        let info = agent.spawn(&spec).await?;
        let mut events = Box::pin(agent.events(info.id, 0).await?);
        let (mut stdout, mut stderr) = (Vec::new(), Vec::new());
        while let Some(ev) = events.next().await {
            match ev?.kind {
                EventKind::Stdout(b) => stdout.extend_from_slice(&b),
                EventKind::Stderr(b) => stderr.extend_from_slice(&b),
                EventKind::Exit(exit) => return Ok(Output { stdout, stderr, exit }),
            }
        }
        Err(RuntimeError::Agent(crate::agent::AgentError::Protocol(
            "event stream ended before the exit".into(),
        )))
    }
}

/// A VM's identity: its hostname is its id, its machine id the one it was given; the entropy
/// and the clock are fresh; `env` (if given) replaces the guest's copy of the VM's environment.
pub(super) fn identity(record: &VmRecord, env: Option<&BTreeMap<String, String>>) -> airlock_proto::Identity {
    airlock_proto::Identity {
        hostname: record.id.clone(),
        machine_id: record.machine_id.clone(),
        entropy_hex: random_hex(64),
        unix_time_ns: SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0),
        env: env.cloned(),
    }
}

/// VM ids are lowercase hex/alphanumerics: they end up in paths and host names.
pub fn valid_sandbox_id(id: &str) -> bool {
    (8..=40).contains(&id.len()) && id.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit())
}

#[cfg(test)]
mod tests {
    use super::StartKind;

    #[test]
    fn start_kinds_keep_their_names_on_disk() {
        for (kind, name) in [
            (StartKind::Boot, "\"boot\""),
            (StartKind::BaseSnapshot, "\"restore\""),
            (StartKind::Image, "\"snapshot\""),
            (StartKind::Pool, "\"pool\""),
        ] {
            assert_eq!(serde_json::to_string(&kind).unwrap(), name);
            assert_eq!(serde_json::from_str::<StartKind>(name).unwrap(), kind);
        }
    }
}
