//! Sandboxes on this node: create (overlay + VM + agent ready), find, re-attach after a restart,
//! delete, and clean up after a VMM that died on its own.

use crate::agent::AgentClient;
use crate::datadir::{random_hex, write_atomic, DataDir, FileLock};
use crate::error::{Result, RuntimeError};
use crate::net::{Network, NetworkOptions, SandboxLink};
use crate::snapshot::BaseSnapshot;
use crate::template::{Template, TemplateStore};
use crate::vmm::qemu::QemuVmm;
use crate::vmm::{wait_exit, Accel, NetAttach, ResumeSpec, SnapshotRole, VmHandle, VmSpec, Vmm};
use airlock_proto::frame::EventKind;
use airlock_proto::{ExitStatus, ProcessSpec};
use futures_util::StreamExt;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

pub use crate::vmm::{Resources, MAX_DISK_MIB, MIN_MEMORY_MIB};

/// What a sandbox is, as recorded in `<dir>/sandbox.json` (so a restarted server can re-attach).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct SandboxRecord {
    pub id: String,
    pub template: String,
    pub template_digest: String,
    pub runtime: String,
    pub accel: Accel,
    pub resources: Resources,
    /// RFC 3339.
    pub created_at: String,
    /// Whether its VM booted or was restored from a base snapshot.
    #[serde(default)]
    pub start: StartKind,
    /// From the VMM's start to the agent's READY with its identity applied.
    #[serde(default)]
    pub start_ms: u64,
    /// The machine id it was given (a resume gives it the same one again).
    #[serde(default)]
    pub machine_id: String,
    /// The machine its VM is (files, kernel command line, memory layout): what a resume
    /// starts again. Absent in records of an older server (such a sandbox cannot suspend).
    #[serde(default)]
    pub machine: Option<ResumeSpec>,
}

/// A suspended sandbox's marker (`suspend.json` next to its saved state `suspend.state`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct SuspendRecord {
    /// RFC 3339.
    pub saved_at: String,
    pub state_bytes: u64,
    pub save_ms: u64,
}

/// How long a suspend or resume took, for the caller to report.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timing {
    pub ms: u64,
}

#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum StartKind {
    #[default]
    Boot,
    /// From its template's base snapshot.
    Restore,
    /// From an image saved from another sandbox (a snapshot, a fork).
    Snapshot,
    /// Claimed from a warm pool (`start_ms` is the claim).
    Pool,
}

/// What a launched VM is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Purpose {
    /// A tenant's sandbox: its network gets egress, and the runtime adopts it.
    Sandbox,
    /// A warm pool's VM: sealed (no egress until a claim attaches it), marked `pool.json`, kept
    /// out of the runtime's sandboxes.
    Pool,
    /// The KVM probe at start: sealed, since the server's egress side is not up yet (and a probe
    /// needs none), and discarded once it answered.
    Probe,
}

/// Where a new sandbox's VM comes from.
enum Source<'a> {
    Boot(&'a Template, Resources),
    Base(&'a Template, Resources, &'a BaseSnapshot),
    Image(&'a crate::image::Image),
}

pub struct Sandbox {
    pub record: SandboxRecord,
    pub vm: VmHandle,
    /// Its network (namespace, veth, tables), when the runtime makes networks.
    pub net: Option<SandboxLink>,
    /// Connected lazily: a VM found paused after a restart has no session until it resumes.
    agent: tokio::sync::Mutex<Option<AgentClient>>,
    /// Its VMM is meant to exit (a delete or a suspend): the exit is not a crash.
    deleting: AtomicBool,
    paused: AtomicBool,
}

/// Collected result of a command run to completion.
#[derive(Debug, Clone)]
pub struct Output {
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    pub exit: ExitStatus,
}

impl Sandbox {
    pub fn id(&self) -> &str {
        &self.record.id
    }

    /// The agent session, reconnected if the channel dropped (e.g. after a server restart).
    /// A paused sandbox has none: its guest cannot answer until it resumes.
    pub async fn agent(&self) -> Result<AgentClient> {
        if self.is_paused() {
            return Err(RuntimeError::NotRunning(format!("{} (paused)", self.id())));
        }
        let mut guard = self.agent.lock().await;
        match guard.as_ref() {
            Some(c) if !c.is_closed() => Ok(c.clone()),
            _ => {
                let (client, _) = AgentClient::connect_ready(&self.vm.agent_socket, Duration::from_secs(10)).await?;
                *guard = Some(client.clone());
                Ok(client)
            }
        }
    }

    pub fn is_paused(&self) -> bool {
        self.paused.load(Ordering::SeqCst)
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

/// Run a template's start process and wait until its port accepts connections.
/// How long a template's own process (e.g. the code interpreter with its Jupyter kernel) may take
/// to answer on its port, at least: far longer than the agent's boot under TCG on a busy host.
const TEMPLATE_START_LIMIT: Duration = Duration::from_secs(300);

async fn start_template_process(
    client: &AgentClient,
    start: &crate::template::StartSpec,
    limit: Duration,
) -> Result<()> {
    let limit = limit.max(TEMPLATE_START_LIMIT);
    let spec = ProcessSpec {
        argv: start.argv.clone(),
        user: Some(start.user.clone()),
        tag: Some("airlock-template-start".into()),
        ..Default::default()
    };
    let info = client.spawn(&spec).await?;
    let deadline = Instant::now() + limit;
    loop {
        if client.tunnel(start.ready_port).await.is_ok() {
            return Ok(());
        }
        let p = client.process(info.id).await?;
        if p.state == airlock_proto::ProcessState::Exited {
            let mut out = Vec::new();
            let mut events = Box::pin(client.events(info.id, 0).await?);
            while let Some(Ok(ev)) = events.next().await {
                if let EventKind::Stdout(b) | EventKind::Stderr(b) = ev.kind {
                    out.extend_from_slice(&b);
                }
            }
            let tail = String::from_utf8_lossy(&out[out.len().saturating_sub(2000)..]).to_string();
            return Err(RuntimeError::TemplateStart {
                argv: start.argv.clone(),
                output: tail,
            });
        }
        if Instant::now() > deadline {
            return Err(RuntimeError::PortNotReady {
                port: start.ready_port,
                waited_ms: limit.as_millis() as u64,
            });
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

pub struct RuntimeOptions {
    pub data_dir: PathBuf,
    /// Force an accelerator instead of probing (`AIRLOCK_ACCEL=kvm|tcg` does the same).
    pub accel: Option<Accel>,
    /// How long a guest may take from VMM start to agent ready.
    pub boot_timeout: Duration,
    /// QEMU binary (default: `AIRLOCK_QEMU`, else `qemu-system-x86_64` on PATH).
    pub qemu: Option<PathBuf>,
    /// The VMM driver to use instead of QEMU (tests inject `fake::FakeVmm`); `qemu` is then unused.
    pub vmm: Option<Arc<dyn Vmm>>,
    /// Give every sandbox a network namespace and a NIC (see [`crate::net`]); `None`: no NIC.
    /// On by default; `AIRLOCK_SANDBOX_NETWORK=off` turns it off.
    pub network: Option<NetworkOptions>,
    /// Re-attach to an earlier process's VMs in the background (several at a time) instead of
    /// before `open` returns: a server can listen at once. Until a sandbox is settled it is not
    /// in `get`/`list`; [`Runtime::settled`] waits for one, [`Runtime::settled_all`] for all.
    pub reconcile_in_background: bool,
    /// Restore creates from base snapshots (see `snapshot.rs`), building one in the background
    /// for each template and shape the first time it is created. On by default where the VMM
    /// can; `AIRLOCK_BASE_SNAPSHOTS=off` turns it off.
    pub base_snapshots: bool,
}

impl RuntimeOptions {
    pub fn new(data_dir: impl Into<PathBuf>) -> Self {
        Self {
            data_dir: data_dir.into(),
            accel: None,
            boot_timeout: Duration::from_secs(90),
            qemu: None,
            vmm: None,
            network: match std::env::var("AIRLOCK_SANDBOX_NETWORK").as_deref() {
                Ok("off") => None,
                _ => Some(NetworkOptions::default()),
            },
            reconcile_in_background: false,
            base_snapshots: !matches!(std::env::var("AIRLOCK_BASE_SNAPSHOTS").as_deref(), Ok("off")),
        }
    }
}

struct Inner {
    _lock: FileLock,
    data: DataDir,
    templates: TemplateStore,
    vmm: Arc<dyn Vmm>,
    net: Option<Network>,
    forced_accel: Option<Accel>,
    accel: tokio::sync::OnceCell<Accel>,
    boot_timeout: Duration,
    sandboxes: Mutex<HashMap<String, Arc<Sandbox>>>,
    /// Ids of sandboxes whose VMM exited on its own (not through `delete`), after their cleanup.
    exits: tokio::sync::broadcast::Sender<String>,
    /// Sandbox dirs of an earlier process not yet reconciled (re-attached or removed).
    unsettled: Mutex<std::collections::HashSet<String>>,
    /// Bumped whenever one of them is settled.
    settled: tokio::sync::watch::Sender<u64>,
    base_snapshots: bool,
    /// Keys of base snapshots being built, or whose build failed (not tried again by this process).
    snapshot_builds: Mutex<std::collections::HashSet<String>>,
    /// Builder VMs running now, by build id (stopped by [`Runtime::stop_snapshot_builds`]).
    builders: Mutex<HashMap<String, VmHandle>>,
    /// Suspended sandboxes: no VMM, no network; their dir holds the saved state.
    suspended: Mutex<HashMap<String, SandboxRecord>>,
    /// Warm pools (see `pool.rs`), and pool VMs claimed for a create not yet handed out.
    pools: Mutex<HashMap<crate::pool::PoolKey, PoolState>>,
    claimed: Mutex<HashMap<String, Arc<Sandbox>>>,
}

impl Inner {
    /// Remove a sandbox whose VMM is gone: its dir, and what the driver held for it outside.
    fn discard(&self, dir: &std::path::Path) -> std::io::Result<()> {
        self.vmm.release(dir);
        match std::fs::remove_dir_all(dir) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        }
    }
}

/// The node runtime. Cheap to clone.
#[derive(Clone)]
pub struct Runtime {
    inner: Arc<Inner>,
}

#[derive(Debug, Clone)]
pub struct CreateSandbox {
    /// Id to give the sandbox (the API assigns it before the boot starts); random when absent.
    pub id: Option<String>,
    pub template: String,
    pub resources: Resources,
    /// Start from this saved image ([`Runtime::save_image`]) instead: its machine, memory,
    /// processes and disk; `template` and `resources` are then the image's.
    pub image: Option<String>,
    /// The sandbox's environment variables, handed to the guest with its identity.
    pub env: BTreeMap<String, String>,
}

/// One warm pool's VMs and counters.
#[derive(Default)]
struct PoolState {
    target: usize,
    ready: Vec<Arc<Sandbox>>,
    starting: usize,
    filling: bool,
    hits: u64,
    misses: u64,
}

/// How long after a claim its pool starts refilling.
const REFILL_DELAY: Duration = Duration::from_secs(2);

/// A suspended sandbox's marker in its dir ([`SuspendRecord`]); its state is [`SUSPEND_STATE`].
pub const SUSPEND_MARKER: &str = "suspend.json";
pub const SUSPEND_STATE: &str = "suspend.state";
/// The longest a suspend's save or a resume's load may take (the state is the guest's RAM in use).
const SUSPEND_LIMIT: Duration = Duration::from_secs(120);

/// Sandbox ids are lowercase hex/alphanumerics: they end up in paths and host names.
pub fn valid_sandbox_id(id: &str) -> bool {
    (8..=40).contains(&id.len()) && id.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit())
}

/// Sandboxes of an earlier process reconciled at once after a restart.
pub const RECONCILE_AT_ONCE: usize = 8;

/// How often console logs are checked against their cap: a log holds at most the cap plus what
/// its guest writes in this long (an emulated UART exits to QEMU for every byte).
const CONSOLE_TRIM_EVERY: Duration = Duration::from_millis(250);

impl Runtime {
    /// Open the data dir, find QEMU (unless `opts.vmm` brings a driver), and re-attach to (or
    /// clean up after) existing sandboxes.
    pub async fn open(opts: RuntimeOptions) -> Result<Self> {
        let data = DataDir::open(&opts.data_dir)?;
        let vmm: Arc<dyn Vmm> = match opts.vmm {
            Some(vmm) => vmm,
            None => {
                let jailer = crate::jail::Jailer::new(crate::jail::JailConfig::from_env()?, data.root());
                Arc::new(QemuVmm::locate(opts.qemu.as_deref())?.with_jailer(Arc::new(jailer)))
            }
        };
        // One runtime per data dir: a second one would adopt (and fight over) the same VMs.
        let lock = FileLock::try_acquire(&data.root().join("runtime.lock"))?
            .ok_or_else(|| RuntimeError::DataDirInUse(data.root().display().to_string()))?;
        let forced_accel = opts.accel.or_else(|| match std::env::var("AIRLOCK_ACCEL").as_deref() {
            Ok("kvm") => Some(Accel::Kvm),
            Ok("tcg") => Some(Accel::Tcg),
            _ => None,
        });
        let net = match opts.network {
            Some(o) => {
                let net = Network::new(data.root(), o)?;
                net.check_tools().await?;
                Some(net)
            }
            None => None,
        };
        let rt = Self {
            inner: Arc::new(Inner {
                _lock: lock,
                templates: TemplateStore::new(data.clone()),
                data,
                vmm,
                net,
                forced_accel,
                accel: tokio::sync::OnceCell::new(),
                boot_timeout: opts.boot_timeout,
                sandboxes: Mutex::new(HashMap::new()),
                exits: tokio::sync::broadcast::channel(256).0,
                unsettled: Mutex::default(),
                settled: tokio::sync::watch::channel(0).0,
                base_snapshots: opts.base_snapshots,
                snapshot_builds: Mutex::default(),
                builders: Mutex::default(),
                suspended: Mutex::default(),
                pools: Mutex::default(),
                claimed: Mutex::default(),
            }),
        };
        rt.remove_interrupted_builds().await;
        rt.prune_snapshots();
        for dir in crate::image::unfinished(&rt.inner.data.images()) {
            tracing::info!("removing an unfinished image {}", dir.display());
            let _ = std::fs::remove_dir_all(dir);
        }
        rt.prune_blobs();
        rt.spawn_console_trimmer();
        if opts.reconcile_in_background {
            let entries = rt.unsettled_entries();
            let weak = Arc::downgrade(&rt.inner);
            tokio::spawn(async move { Self::reconcile(weak, entries).await });
        } else {
            let entries = rt.unsettled_entries();
            Self::reconcile(Arc::downgrade(&rt.inner), entries).await;
        }
        Ok(rt)
    }

    /// The sandbox dirs an earlier process left, each recorded as not yet settled.
    fn unsettled_entries(&self) -> Vec<std::fs::DirEntry> {
        let entries: Vec<_> = std::fs::read_dir(self.inner.data.sandboxes())
            .into_iter()
            .flatten()
            .flatten()
            .collect();
        self.inner
            .unsettled
            .lock()
            .unwrap()
            .extend(entries.iter().map(|e| e.file_name().to_string_lossy().into_owned()));
        entries
    }

    /// Whether this runtime knows what became of sandbox `id` after a restart (re-attached or
    /// removed); always true for sandboxes it created itself.
    pub fn is_settled(&self, id: &str) -> bool {
        !self.inner.unsettled.lock().unwrap().contains(id)
    }

    /// Wait until sandbox `id` is settled (see [`RuntimeOptions::reconcile_in_background`]).
    pub async fn settled(&self, id: &str) {
        let mut news = self.inner.settled.subscribe();
        while !self.is_settled(id) {
            if news.changed().await.is_err() {
                return;
            }
        }
    }

    /// Wait until every sandbox of the earlier process is settled.
    pub async fn settled_all(&self) {
        let mut news = self.inner.settled.subscribe();
        while !self.inner.unsettled.lock().unwrap().is_empty() {
            if news.changed().await.is_err() {
                return;
            }
        }
    }

    /// Keep every sandbox's `console.log` under [`crate::vmm::CONSOLE_CAP`] (see
    /// [`crate::vmm::trim_console`]): a guest flooding its serial port fills the host's disk
    /// otherwise. One task for the whole data dir, walking the sandbox dirs on disk, so VMs
    /// still booting and VMs re-attached after a restart are covered alike (while no server
    /// runs, nothing trims; the next start does). It ends with the runtime.
    fn spawn_console_trimmer(&self) {
        let alive = Arc::downgrade(&self.inner);
        let root = self.inner.data.sandboxes();
        tokio::spawn(async move {
            while alive.strong_count() > 0 {
                let root = root.clone();
                let _ = tokio::task::spawn_blocking(move || {
                    for entry in std::fs::read_dir(&root).into_iter().flatten().flatten() {
                        let log = entry.path().join("console.log");
                        match crate::vmm::trim_console(&log) {
                            Ok(true) => tracing::debug!("trimmed {}", log.display()),
                            Ok(false) => {}
                            Err(e) => tracing::warn!("cannot trim {}: {e}", log.display()),
                        }
                    }
                })
                .await;
                tokio::time::sleep(CONSOLE_TRIM_EVERY).await;
            }
        });
    }

    pub fn data_dir(&self) -> &DataDir {
        &self.inner.data
    }

    pub fn templates(&self) -> &TemplateStore {
        &self.inner.templates
    }

    /// The sandboxes' networks, when the runtime makes them.
    pub fn network(&self) -> Option<&Network> {
        self.inner.net.as_ref()
    }

    pub fn runtime_name(&self) -> &'static str {
        self.inner.vmm.name()
    }

    /// The isolation VMs run in (uid, filesystem, cgroups), where the driver jails them.
    pub fn isolation(&self) -> Option<crate::jail::Isolation> {
        self.inner.vmm.isolation()
    }

    /// Ids of sandboxes whose VMM exited on its own (crash, `kill -9`, power-off from inside),
    /// sent once the sandbox is gone from this runtime and its dir is removed. Deletes are not
    /// reported. Only exits after this call are seen.
    pub fn exits(&self) -> tokio::sync::broadcast::Receiver<String> {
        self.inner.exits.subscribe()
    }

    /// Sandbox dirs left from an earlier process: re-attach live VMs, remove the rest, up to
    /// [`RECONCILE_AT_ONCE`] at a time (an agent that does not answer costs its 10 s only to
    /// its own sandbox). Each is marked settled when done. Stops early if the runtime goes.
    async fn reconcile(inner: std::sync::Weak<Inner>, entries: Vec<std::fs::DirEntry>) {
        futures_util::stream::iter(entries)
            .for_each_concurrent(RECONCILE_AT_ONCE, |entry| {
                let inner = inner.clone();
                async move {
                    let Some(inner) = inner.upgrade() else { return };
                    let rt = Runtime { inner };
                    rt.reconcile_dir(&entry).await;
                    let id = entry.file_name().to_string_lossy().into_owned();
                    rt.inner.unsettled.lock().unwrap().remove(&id);
                    rt.inner.settled.send_modify(|n| *n += 1);
                }
            })
            .await;
        // Networks and jails a crash left without a sandbox (or whose dir is gone), once every
        // dir is settled. A sandbox dir still there is live or booting (a create may already
        // run): its network and jail stay.
        let Some(inner) = inner.upgrade() else { return };
        let mut live: std::collections::HashSet<String> = inner.sandboxes.lock().unwrap().keys().cloned().collect();
        live.extend(inner.builders.lock().unwrap().keys().cloned());
        live.extend(
            std::fs::read_dir(inner.data.sandboxes())
                .into_iter()
                .flatten()
                .flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned()),
        );
        if let Some(net) = &inner.net {
            net.sweep(&live).await;
        }
        inner.vmm.sweep(&live);
    }

    /// One sandbox dir left from an earlier process: re-attach its live VM, or remove it.
    async fn reconcile_dir(&self, entry: &std::fs::DirEntry) {
        {
            let dir = entry.path();
            let record: Option<SandboxRecord> = std::fs::read(dir.join("sandbox.json"))
                .ok()
                .and_then(|b| serde_json::from_slice(&b).ok());
            let vm = VmHandle::load(&dir);
            let link = SandboxLink::load(&dir);
            if dir.join(crate::pool::MARKER).is_file() {
                // A pool VM of the earlier process: never handed out, it just goes.
                let vm = vm.or_else(|| VmHandle::orphan(&dir, self.inner.vmm.name()));
                if let Some(vm) = vm.filter(|vm| self.inner.vmm.is_running(vm)) {
                    let _ = self.inner.vmm.stop(&vm, Duration::from_secs(2)).await;
                }
                self.remove_network(link.as_ref()).await;
                let _ = self.inner.discard(&dir);
                return;
            }
            if let (Some(record), true) = (&record, dir.join(SUSPEND_MARKER).is_file()) {
                // Suspended (or interrupted while it resumed: the saved state is still whole).
                if let Some(vm) = vm.filter(|vm| self.inner.vmm.is_running(vm)) {
                    let _ = self.inner.vmm.stop(&vm, Duration::from_secs(2)).await;
                }
                self.remove_network(link.as_ref()).await;
                self.inner.vmm.release(&dir);
                tracing::info!(id = %record.id, "found suspended");
                self.inner
                    .suspended
                    .lock()
                    .unwrap()
                    .insert(record.id.clone(), record.clone());
                return;
            }
            match (record, vm) {
                (Some(record), Some(vm)) if self.inner.vmm.is_running(&vm) => {
                    let net = match self.reattach_network(link, &dir).await {
                        Ok(net) => net,
                        Err(e) => {
                            tracing::warn!(id = %record.id, "its network cannot be restored ({e}); removing it");
                            let _ = self.inner.vmm.stop(&vm, Duration::from_secs(2)).await;
                            self.remove_network(SandboxLink::load(&dir).as_ref()).await;
                            let _ = self.inner.discard(&dir);
                            return;
                        }
                    };
                    if self.inner.vmm.is_paused(&vm).await.unwrap_or(false) {
                        tracing::info!(id = %record.id, pid = vm.pid, "re-attached to paused sandbox");
                        self.adopt(record, vm, net, None, true);
                        return;
                    }
                    match AgentClient::connect_ready(&vm.agent_socket, Duration::from_secs(10)).await {
                        Ok((client, _)) => {
                            tracing::info!(id = %record.id, pid = vm.pid, "re-attached to running sandbox");
                            self.adopt(record, vm, net, Some(client), false);
                        }
                        Err(e) => {
                            tracing::warn!(id = %record.id, "running VM's agent does not answer ({e}); removing it");
                            let _ = self.inner.vmm.stop(&vm, Duration::from_secs(2)).await;
                            self.remove_network(net.as_ref()).await;
                            let _ = self.inner.discard(&dir);
                        }
                    }
                }
                (_, vm) => {
                    // No VM record but a pid file: the server died between spawning the VMM
                    // and recording it; the pid (checked against the sandbox dir) finds it.
                    let vm = vm.or_else(|| VmHandle::orphan(&dir, self.inner.vmm.name()));
                    if let Some(vm) = vm.filter(|vm| self.inner.vmm.is_running(vm)) {
                        let _ = self.inner.vmm.stop(&vm, Duration::from_secs(2)).await;
                    }
                    tracing::info!("removing leftovers of sandbox {}", dir.display());
                    self.remove_network(link.as_ref()).await;
                    let _ = self.inner.discard(&dir);
                }
            }
        }
    }

    /// The network of a sandbox found running: its recorded link, served again. A sandbox
    /// without a record when the runtime makes networks was started without one: it keeps none.
    async fn reattach_network(&self, link: Option<SandboxLink>, dir: &std::path::Path) -> Result<Option<SandboxLink>> {
        let (Some(net), Some(mut link)) = (&self.inner.net, link) else {
            return Ok(None);
        };
        net.reattach(&mut link).await?;
        write_atomic(
            &SandboxLink::record_path(dir),
            &serde_json::to_vec_pretty(&link).expect("serializable"),
        )?;
        Ok(Some(link))
    }

    async fn remove_network(&self, link: Option<&SandboxLink>) {
        if let (Some(net), Some(link)) = (&self.inner.net, link) {
            net.remove(link).await;
        }
    }

    fn adopt(
        &self,
        record: SandboxRecord,
        vm: VmHandle,
        net: Option<SandboxLink>,
        client: Option<AgentClient>,
        paused: bool,
    ) -> Arc<Sandbox> {
        let sb = sandbox(record, vm, net, client, paused);
        self.inner
            .sandboxes
            .lock()
            .unwrap()
            .insert(sb.id().to_string(), sb.clone());
        self.watch_vmm(sb.clone());
        sb
    }

    /// When the VMM dies on its own (crash, `kill -9`), remove everything the sandbox had and
    /// report it on `exits`. The watcher does not keep the runtime alive: once the runtime is
    /// dropped (a server restart), its VMs are left for the next one to re-attach.
    fn watch_vmm(&self, sb: Arc<Sandbox>) {
        let rt = Arc::downgrade(&self.inner);
        let sb = Arc::downgrade(&sb);
        let Some((pid, dir)) = sb.upgrade().map(|sb| (sb.vm.pid, sb.vm.dir.clone())) else {
            return;
        };
        tokio::spawn(async move {
            while !wait_exit(pid, Duration::from_secs(3600)).await {}
            let Some(inner) = rt.upgrade() else { return };
            let Some(sb) = sb.upgrade() else { return };
            if sb.deleting.load(Ordering::SeqCst) {
                return;
            }
            tracing::warn!(id = %sb.id(), pid, "VMM exited on its own; cleaning up the sandbox");
            let removed = {
                let mut map = inner.sandboxes.lock().unwrap();
                match map.get(sb.id()) {
                    Some(cur) if Arc::ptr_eq(cur, &sb) => map.remove(sb.id()),
                    _ => None,
                }
            };
            if removed.is_some() {
                if let (Some(net), Some(link)) = (&inner.net, &sb.net) {
                    net.remove(link).await;
                }
                let _ = inner.discard(&dir);
                let _ = inner.exits.send(sb.id().to_string());
            }
        });
    }

    /// The accelerator sandboxes use: forced, cached, or found by booting a KVM probe guest once.
    pub async fn accel(&self) -> Accel {
        if let Some(a) = self.inner.forced_accel {
            return a;
        }
        *self.inner.accel.get_or_init(|| self.detect_accel()).await
    }

    async fn detect_accel(&self) -> Accel {
        let kvm_usable = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/kvm")
            .is_ok();
        if !kvm_usable {
            tracing::info!("accel: tcg (no usable /dev/kvm)");
            return Accel::Tcg;
        }
        let Ok(template) = self.inner.templates.resolve(crate::template::SEED) else {
            tracing::info!("accel: tcg for now (no seed template to probe KVM with)");
            return Accel::Tcg;
        };
        let key = format!(
            "{}|{}|{}",
            std::fs::read_to_string("/proc/sys/kernel/osrelease")
                .unwrap_or_default()
                .trim(),
            template.manifest.kernel_version,
            self.inner.vmm.name()
        );
        let cache = self.inner.data.accel_cache();
        if let Some(cached) = std::fs::read(&cache)
            .ok()
            .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
            .filter(|v| v["key"] == key)
            .and_then(|v| serde_json::from_value::<Accel>(v["accel"].clone()).ok())
        {
            tracing::info!("accel: {cached} (cached probe verdict)");
            return cached;
        }
        let started = Instant::now();
        let verdict = match self
            .launch(
                random_hex(10),
                Source::Boot(
                    &template,
                    Resources {
                        vcpu: 1,
                        memory_mib: 256,
                        disk_mib: template.manifest.rootfs_bytes.div_ceil(1 << 20) as u32,
                    },
                ),
                Accel::Kvm,
                Duration::from_secs(10),
                Purpose::Probe,
                &BTreeMap::new(),
            )
            .await
        {
            Ok(sb) => {
                self.discard_unadopted(&sb).await;
                Accel::Kvm
            }
            Err(e) => {
                tracing::info!("KVM probe guest did not come up ({e})");
                Accel::Tcg
            }
        };
        tracing::info!("accel: {verdict} (probed in {:.1}s)", started.elapsed().as_secs_f64());
        let _ = write_atomic(
            &cache,
            serde_json::json!({ "key": key, "accel": verdict })
                .to_string()
                .as_bytes(),
        );
        verdict
    }

    pub async fn create(&self, req: CreateSandbox) -> Result<Arc<Sandbox>> {
        let id = match req.id.clone() {
            Some(id) if !valid_sandbox_id(&id) => return Err(RuntimeError::InvalidSandboxId(id)),
            Some(id) if self.get(&id).is_ok() => return Err(RuntimeError::SandboxIdTaken(id)),
            Some(id) => id,
            None => random_hex(10),
        };
        let claimed = self.inner.claimed.lock().unwrap().remove(&id);
        if let Some(vm) = claimed {
            match self.hand_out(vm, &req.env).await {
                Ok(sb) => return Ok(sb),
                Err(e) => tracing::warn!(%id, "a claimed pool VM could not be handed out ({e}); starting one instead"),
            }
        }
        self.start_new(id, &req, Purpose::Sandbox).await
    }

    /// Start a new VM for `id` as `req` asks, for `purpose`.
    async fn start_new(&self, id: String, req: &CreateSandbox, purpose: Purpose) -> Result<Arc<Sandbox>> {
        if let Some(image) = &req.image {
            let image = self
                .image(image)
                .ok_or_else(|| RuntimeError::UnknownImage(image.clone()))?;
            let accel = image.manifest.accel;
            return self
                .launch(
                    id,
                    Source::Image(&image),
                    accel,
                    self.inner.boot_timeout,
                    purpose,
                    &req.env,
                )
                .await;
        }
        let template = self.inner.templates.resolve(&req.template)?;
        req.resources.validate(&template)?;
        let accel = self.accel().await;
        let resources = shape(&template, req.resources);
        let limit = self.inner.boot_timeout;
        if let Some(key) = self.snapshot_key(&template, &resources, accel) {
            match BaseSnapshot::find(&self.inner.data.snapshots(), &key) {
                Some(snap) => match self
                    .launch(
                        id.clone(),
                        Source::Base(&template, resources, &snap),
                        accel,
                        limit,
                        purpose,
                        &req.env,
                    )
                    .await
                {
                    Ok(sb) => return Ok(sb),
                    Err(e) => {
                        tracing::warn!(%id, snapshot = %key, "restore failed, booting instead: {e}");
                        // A VM that did not come back from it: the snapshot goes (clones running
                        // from it keep their open files), and the next create builds it again.
                        if matches!(e, RuntimeError::BootFailed { .. } | RuntimeError::ControlCommand { .. }) {
                            let _ = std::fs::remove_dir_all(&snap.dir);
                        }
                    }
                },
                None => self.want_base_snapshot(key, template.clone(), resources, accel),
            }
        }
        self.launch(id, Source::Boot(&template, resources), accel, limit, purpose, &req.env)
            .await
    }

    /// Start a VM for sandbox `id` from `source` (a boot, a base snapshot's restore, a saved
    /// image's restore) and give it its identity once the agent answers.
    async fn launch(
        &self,
        id: String,
        source: Source<'_>,
        accel: Accel,
        limit: Duration,
        purpose: Purpose,
        env: &BTreeMap<String, String>,
    ) -> Result<Arc<Sandbox>> {
        let dir = self.inner.data.sandboxes().join(&id);
        // Not `create_dir_all`: an existing dir is a sandbox with this id still booting.
        std::fs::create_dir(&dir).map_err(|e| match e.kind() {
            std::io::ErrorKind::AlreadyExists => RuntimeError::SandboxIdTaken(id.clone()),
            _ => RuntimeError::io(&dir, e),
        })?;
        let (template, template_digest, resources, start) = match &source {
            Source::Boot(t, r) => (&t.manifest.name, &t.manifest.digest, *r, StartKind::Boot),
            Source::Base(t, r, _) => (&t.manifest.name, &t.manifest.digest, *r, StartKind::Restore),
            Source::Image(i) => (
                &i.manifest.template,
                &i.manifest.template_digest,
                i.manifest.resources,
                StartKind::Snapshot,
            ),
        };
        let mut record = SandboxRecord {
            id: id.clone(),
            template: template.clone(),
            template_digest: template_digest.clone(),
            runtime: self.inner.vmm.name().into(),
            accel,
            resources,
            created_at: humantime::format_rfc3339_millis(SystemTime::now()).to_string(),
            start,
            start_ms: 0,
            machine_id: random_hex(16),
            machine: None,
        };
        let mut link = None;
        let started = Instant::now();
        let result = async {
            let spec = self.machine(&id, &dir, &source, accel, &mut record);
            if purpose == Purpose::Pool {
                write_atomic(&dir.join(crate::pool::MARKER), b"{}")?;
            }
            write_atomic(
                &dir.join("sandbox.json"),
                &serde_json::to_vec_pretty(&record).expect("serializable"),
            )?;
            let vm = self.start_vm(&id, &dir, spec, &mut link, purpose != Purpose::Sandbox).await?;
            let vmm_ms = started.elapsed().as_millis();
            let ready = async {
                if !matches!(source, Source::Boot(..)) {
                    self.snapshotting("restore")?.complete_restore(&vm, SUSPEND_LIMIT).await?;
                }
                let restored_ms = started.elapsed().as_millis();
                let client = AgentClient::connect_within(&vm.agent_socket, limit).await?;
                let agent_ms = started.elapsed().as_millis();
                client.set_identity(&identity(&record, Some(env))).await?;
                // Where a start's time goes (the restore path's profile; `boot-profile` has the boot's).
                tracing::debug!(
                    %id,
                    "started: network + VMM up {vmm_ms} ms, state loaded {restored_ms} ms, agent ready {agent_ms} ms, identity set {} ms",
                    started.elapsed().as_millis()
                );
                // A restored VM runs its template's process already: it was saved running.
                if let Source::Boot(Template { manifest: m, .. }, _) = &source {
                    if let Some(start) = &m.start {
                        start_template_process(&client, start, limit).await?;
                    }
                }
                Ok::<_, RuntimeError>(client)
            };
            let doing = if matches!(source, Source::Boot(..)) { "boot" } else { "restore" };
            ready_or_died(&id, &vm, doing, ready).await.map(|client| (vm, client))
        }
        .await;
        match result {
            Ok((vm, client)) => {
                record.start_ms = started.elapsed().as_millis() as u64;
                let _ = write_atomic(
                    &dir.join("sandbox.json"),
                    &serde_json::to_vec_pretty(&record).expect("serializable"),
                );
                if purpose != Purpose::Sandbox {
                    return Ok(sandbox(record, vm, link, Some(client), false));
                }
                Ok(self.adopt(record, vm, link, Some(client), false))
            }
            Err(e) => {
                if let Some(vm) = VmHandle::load(&dir) {
                    let _ = self.inner.vmm.stop(&vm, Duration::from_secs(2)).await;
                }
                self.remove_network(link.as_ref()).await;
                let _ = self.inner.discard(&dir);
                Err(e)
            }
        }
    }

    /// The machine sandbox `id` runs as when started from `source`, recorded in `record` (what a
    /// resume starts again). Its own links to the files it runs on (`held/`): a suspended VM
    /// resumes on them even after its template is rebuilt, its base snapshot pruned or its
    /// image deleted.
    fn machine(
        &self,
        id: &str,
        dir: &std::path::Path,
        source: &Source<'_>,
        accel: Accel,
        record: &mut SandboxRecord,
    ) -> VmSpec {
        let (kernel, initrd, rootfs) = match source {
            Source::Boot(t, _) | Source::Base(t, _, _) => (t.kernel(), t.initrd(), t.rootfs()),
            Source::Image(i) => (
                i.manifest.machine.kernel.clone(),
                i.manifest.machine.initrd.clone(),
                i.manifest.machine.rootfs.clone(),
            ),
        };
        let files = [
            hold(dir, "kernel", &kernel),
            hold(dir, "initrd", &initrd),
            hold(dir, "rootfs", &rootfs),
        ];
        let mut spec = VmSpec::new(id, dir.to_path_buf(), files, record.resources, accel);
        let (cmdline, memory_backend, layers) = match source {
            Source::Boot(..) => (crate::vmm::qemu::kernel_cmdline(id), false, vec![]),
            Source::Base(_, _, snap) => {
                let disk = hold(dir, "frozen-disk.qcow2", &snap.disk());
                spec.snapshot = Some(SnapshotRole::Clone {
                    memory: snap.memory(),
                    state: snap.state(),
                    disk: disk.clone(),
                    cmdline: snap.manifest.cmdline.clone(),
                });
                (snap.manifest.cmdline.clone(), true, vec![disk])
            }
            Source::Image(i) => {
                let m = &i.manifest.machine;
                let layers = m
                    .layers
                    .iter()
                    .enumerate()
                    .map(|(n, layer)| hold(dir, &format!("layer-{n}.qcow2"), layer))
                    .collect();
                (m.cmdline.clone(), m.memory_backend, layers)
            }
        };
        let machine = ResumeSpec {
            cmdline,
            memory_backend,
            layers,
            kernel: spec.kernel.clone(),
            initrd: spec.initrd.clone(),
            rootfs: spec.rootfs.clone(),
        };
        if let Source::Image(i) = source {
            spec.snapshot = Some(SnapshotRole::Resume {
                state: i.state(),
                resume: machine.clone(),
                new_overlay: true,
            });
        }
        record.machine = Some(machine);
        spec
    }

    /// Give `spec` its network (recorded in `dir`) and start its VMM. A snapshot's builder gets
    /// the NIC (its clones have one) but no egress.
    async fn start_vm(
        &self,
        id: &str,
        dir: &std::path::Path,
        mut spec: VmSpec,
        link: &mut Option<SandboxLink>,
        sealed: bool,
    ) -> Result<VmHandle> {
        if let Some(net) = &self.inner.net {
            let made_at = Instant::now();
            let (made, tap) = match spec.snapshot {
                Some(SnapshotRole::Builder { .. }) => net.create_sealed(id).await?,
                _ if sealed => net.create_sealed(id).await?,
                _ => net.create(id).await?,
            };
            write_atomic(
                &SandboxLink::record_path(dir),
                &serde_json::to_vec_pretty(&made).expect("serializable"),
            )?;
            tracing::debug!(%id, "network made in {} ms", made_at.elapsed().as_millis());
            *link = Some(made);
            spec.network = Some(NetAttach {
                tap: Arc::new(tap),
                mac: airlock_proto::net::GUEST_MAC.into(),
            });
        }
        // QEMU holds its own copy of the tap once started: when it exits, the tap goes.
        self.inner.vmm.start(&spec).await
    }

    /// The key of the base snapshot a create of `template` with `resources` restores from, where
    /// base snapshots are on and the VMM can restore.
    fn snapshot_key(&self, template: &Template, resources: &Resources, accel: Accel) -> Option<String> {
        if !self.inner.base_snapshots {
            return None;
        }
        let vmm = self.inner.vmm.snapshotting()?.build_id();
        Some(crate::snapshot::key(
            &template.manifest.digest,
            resources,
            accel,
            &vmm,
            &builder_cmdline(),
        ))
    }

    /// The base snapshot for `template` and `resources`, if one is built.
    pub async fn base_snapshot(&self, template: &str, resources: Resources) -> Option<BaseSnapshot> {
        let template = self.inner.templates.resolve(template).ok()?;
        let key = self.snapshot_key(&template, &shape(&template, resources), self.accel().await)?;
        BaseSnapshot::find(&self.inner.data.snapshots(), &key)
    }

    /// Build the base snapshot `key` in the background, unless it is being built or failed.
    fn want_base_snapshot(&self, key: String, template: Template, resources: Resources, accel: Accel) {
        if !self.inner.snapshot_builds.lock().unwrap().insert(key.clone()) {
            return;
        }
        let rt = self.clone();
        tokio::spawn(async move {
            // One build at a time: each is a whole boot.
            static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
            let _turn = ONE_AT_A_TIME.lock().await;
            match rt.build_base_snapshot(&key, &template, resources, accel).await {
                Ok(snap) => {
                    tracing::info!(
                        template = %template.manifest.name, snapshot = %key,
                        "base snapshot built: boot {} ms, save {} ms", snap.manifest.boot_ms, snap.manifest.save_ms
                    );
                    rt.inner.snapshot_builds.lock().unwrap().remove(&key);
                }
                Err(e) => {
                    tracing::warn!(template = %template.manifest.name, snapshot = %key, "base snapshot build failed: {e}")
                }
            }
        });
    }

    /// Boot `template` with `resources` once, wait for its agent (and start process), and save it
    /// as base snapshot `key`.
    pub async fn build_base_snapshot(
        &self,
        key: &str,
        template: &Template,
        resources: Resources,
        accel: Accel,
    ) -> Result<BaseSnapshot> {
        let root = self.inner.data.snapshots();
        let (id, dir) = crate::snapshot::new_build_dir(&root)?;
        let mut link = None;
        let started = Instant::now();
        let result = async {
            let snapshotting = self.snapshotting("save")?;
            let memory = crate::snapshot::create_memory_file(&dir, resources.memory_mib)?;
            let cmdline = builder_cmdline();
            let mut spec = VmSpec::for_template(&id, dir.clone(), template, resources, accel);
            spec.snapshot = Some(SnapshotRole::Builder {
                memory,
                state: crate::snapshot::state_path(&dir),
                cmdline: cmdline.clone(),
            });
            let vm = self.start_vm(&id, &dir, spec, &mut link, true).await?;
            self.inner.builders.lock().unwrap().insert(id.clone(), vm.clone());
            let limit = self.inner.boot_timeout;
            let (client, _) = AgentClient::connect_ready(&vm.agent_socket, limit).await?;
            if let Some(start) = &template.manifest.start {
                start_template_process(&client, start, limit).await?;
            }
            // Saved between sessions: a clone's host starts a new one.
            drop(client);
            tokio::time::sleep(Duration::from_millis(300)).await;
            let boot_ms = started.elapsed().as_millis() as u64;
            let saving = Instant::now();
            snapshotting.save(&vm, Duration::from_secs(120)).await?;
            Ok::<_, RuntimeError>(crate::snapshot::SnapshotManifest {
                key: key.to_string(),
                template: template.manifest.name.clone(),
                template_digest: template.manifest.digest.clone(),
                resources,
                accel,
                vmm: snapshotting.build_id(),
                cmdline,
                created_at: humantime::format_rfc3339_seconds(SystemTime::now()).to_string(),
                boot_ms,
                save_ms: saving.elapsed().as_millis() as u64,
            })
        }
        .await;
        let builder = self.inner.builders.lock().unwrap().remove(&id);
        match result {
            Ok(manifest) => {
                self.end_build(&dir, builder, false).await;
                crate::snapshot::seal(&root, &dir, manifest)
            }
            Err(e) => {
                self.end_build(&dir, builder, true).await;
                Err(e)
            }
        }
    }

    /// The VMM's snapshot capability, for `what` (an error naming it where the VMM has none).
    fn snapshotting(&self, what: &str) -> Result<&dyn crate::vmm::Snapshotting> {
        self.inner
            .vmm
            .snapshotting()
            .ok_or_else(|| RuntimeError::ControlCommand {
                command: what.into(),
                reason: format!("this VMM cannot {what}"),
            })
    }

    /// What a build in `dir` had outside its files: its VM (if it still runs), its network (as
    /// recorded in `dir`), its jail; and, with `remove_dir`, the dir itself.
    async fn end_build(&self, dir: &std::path::Path, vm: Option<VmHandle>, remove_dir: bool) {
        let vm = vm
            .or_else(|| VmHandle::load(dir))
            .or_else(|| VmHandle::orphan(dir, self.inner.vmm.name()));
        if let Some(vm) = vm.filter(|vm| self.inner.vmm.is_running(vm)) {
            let _ = self.inner.vmm.stop(&vm, Duration::from_secs(2)).await;
        }
        self.remove_network(SandboxLink::load(dir).as_ref()).await;
        self.inner.vmm.release(dir);
        if remove_dir {
            let _ = std::fs::remove_dir_all(dir);
        }
    }

    /// Stop the builds running now (a server shutting down): the build's own cleanup may not get
    /// to run before the exit.
    pub async fn stop_snapshot_builds(&self) {
        let builders: Vec<VmHandle> = self.inner.builders.lock().unwrap().drain().map(|(_, vm)| vm).collect();
        for vm in builders {
            let dir = vm.dir.clone();
            self.end_build(&dir, Some(vm), true).await;
        }
    }

    /// Remove base snapshots no create can restore from any more: of a template digest no
    /// template has now (rebuilt or removed), or saved by another VMM build. Clones running from
    /// one keep its files open, so they run on.
    fn prune_snapshots(&self) {
        let digests: std::collections::HashSet<String> =
            self.inner.templates.list().into_iter().map(|m| m.digest).collect();
        let vmm = self.inner.vmm.snapshotting().map(|s| s.build_id());
        for dir in crate::snapshot::stale(&self.inner.data.snapshots(), &digests, vmm.as_deref()) {
            tracing::info!(
                "removing base snapshot {}: nothing restores from it any more",
                dir.display()
            );
            let _ = std::fs::remove_dir_all(dir);
        }
    }

    /// Template images no template names any more and nothing was made from: every rebuild of a
    /// template leaves the old one behind. A sandbox or image made from one is counted as using
    /// it (their `held/` links would keep its files anyway); with a dir whose record cannot be
    /// read, nothing is removed.
    fn prune_blobs(&self) {
        let mut in_use = std::collections::BTreeSet::new();
        for root in [self.inner.data.sandboxes(), self.inner.data.images()] {
            for entry in std::fs::read_dir(&root).into_iter().flatten().flatten() {
                let record = ["sandbox.json", "image.json"]
                    .iter()
                    .find_map(|f| std::fs::read(entry.path().join(f)).ok())
                    .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok());
                let Some(digest) = record.as_ref().and_then(|r| r["template_digest"].as_str()) else {
                    tracing::info!(
                        "not pruning template images: {} has no readable record",
                        entry.path().display()
                    );
                    return;
                };
                in_use.insert(digest.trim_start_matches("sha256:").to_string());
            }
        }
        self.inner.templates.prune_blobs(&in_use);
    }

    /// Builds an earlier process left unfinished (it crashed or was stopped): their VMs stopped,
    /// their networks and dirs removed.
    async fn remove_interrupted_builds(&self) {
        let root = self.inner.data.snapshots();
        for entry in std::fs::read_dir(&root).into_iter().flatten().flatten() {
            let name = entry.file_name().to_string_lossy().to_string();
            if !name.starts_with(crate::snapshot::BUILD_PREFIX) {
                continue;
            }
            tracing::info!("removing an interrupted base snapshot build {}", entry.path().display());
            self.end_build(&entry.path(), None, true).await;
        }
    }

    /// A sandbox of the earlier process is found only once settled (it is put in the map
    /// before it is marked settled): whoever finds it may rely on it being decided.
    pub fn get(&self, id: &str) -> Result<Arc<Sandbox>> {
        if !self.is_settled(id) {
            return Err(RuntimeError::UnknownSandbox(id.into()));
        }
        self.inner
            .sandboxes
            .lock()
            .unwrap()
            .get(id)
            .cloned()
            .ok_or_else(|| RuntimeError::UnknownSandbox(id.into()))
    }

    /// The data dir filesystem's space: what is free (for an unprivileged writer, as statvfs
    /// reports it), what this runtime's sandboxes already hold in it (allocated blocks of
    /// their dirs: overlays, console logs, a suspended one's saved memory) and what saved images
    /// hold, and what warm pool VMs may still write. A node's disk budget is the sum of the
    /// first three less the last, since the sandboxes' and images' own growth comes out of what
    /// they hold plus what is free, and a pool VM's disk grows to its full size before any
    /// record counts it.
    pub fn disk_space(&self) -> DiskSpace {
        let free_bytes = nix::sys::statvfs::statvfs(self.inner.data.root())
            .map(|s| s.blocks_available() * s.fragment_size())
            .unwrap_or(0);
        let root = self.inner.data.sandboxes();
        let held_bytes = self
            .list()
            .iter()
            .map(|sb| sb.id().to_string())
            .chain(self.suspended())
            .map(|id| allocated_bytes(&root.join(id), false))
            .sum::<u64>();
        // An image's links to its template's files (and a sandbox's links to the image) are
        // counted by no one: only files no other name holds are the image's own.
        let images = self.inner.data.images();
        let image_bytes = self
            .images()
            .iter()
            .map(|id| allocated_bytes(&images.join(id), true))
            .sum::<u64>();
        let pool_mib = {
            let pools = self.inner.pools.lock().unwrap();
            let claimed = self.inner.claimed.lock().unwrap();
            let unheld = |sb: &Arc<Sandbox>| {
                (sb.record.resources.disk_mib as u64).saturating_sub(allocated_bytes(&sb.vm.dir, false) >> 20)
            };
            pools
                .iter()
                .map(|(k, p)| p.ready.iter().map(unheld).sum::<u64>() + p.starting as u64 * k.resources.disk_mib as u64)
                .sum::<u64>()
                + claimed.values().map(unheld).sum::<u64>()
        };
        DiskSpace {
            free_mib: free_bytes >> 20,
            held_by_sandboxes_mib: held_bytes >> 20,
            held_by_images_mib: image_bytes >> 20,
            pool_unheld_mib: pool_mib,
        }
    }

    pub fn list(&self) -> Vec<Arc<Sandbox>> {
        let unsettled = self.inner.unsettled.lock().unwrap().clone();
        let mut v: Vec<_> = (self.inner.sandboxes.lock().unwrap().values())
            .filter(|sb| !unsettled.contains(sb.id()))
            .cloned()
            .collect();
        v.sort_by(|a, b| a.record.created_at.cmp(&b.record.created_at));
        v
    }

    /// Freeze a sandbox in memory: its vCPUs stop, its RAM and disk stay. Idempotent.
    pub async fn pause(&self, id: &str) -> Result<()> {
        let sb = self.get(id)?;
        if !sb.is_paused() {
            self.inner.vmm.pause(&sb.vm).await?;
            sb.paused.store(true, Ordering::SeqCst);
        }
        Ok(())
    }

    /// The saved image `id`, if it exists and this VMM can load it.
    pub fn image(&self, id: &str) -> Option<crate::image::Image> {
        let image = crate::image::Image::find(&self.inner.data.images(), id)?;
        let vmm = self.inner.vmm.snapshotting()?.build_id();
        (image.manifest.vmm == vmm).then_some(image)
    }

    /// Ids of the saved images.
    pub fn images(&self) -> Vec<String> {
        std::fs::read_dir(self.inner.data.images())
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect()
    }

    /// Remove image `id` (sandboxes made from it run on; a missing one is not an error).
    pub fn delete_image(&self, id: &str) -> Result<()> {
        crate::image::remove(&self.inner.data.images(), id)
    }

    /// Save sandbox `id` as image `image_id` while it runs on: it is stopped only while its
    /// memory is written and its disk copied, then runs again (a paused one stays paused), with
    /// its sessions intact. Sandboxes made from the image ([`CreateSandbox::image`]) start with
    /// its memory, processes and files at that moment.
    pub async fn save_image(&self, id: &str, image_id: &str) -> Result<crate::image::Image> {
        use crate::image::{Image, ImageManifest, MANIFEST};
        if !crate::image::valid_image_id(image_id) {
            return Err(RuntimeError::InvalidSandboxId(image_id.into()));
        }
        let sb = self.get(id)?;
        if sb.is_paused() {
            return Err(RuntimeError::NotRunning(format!("{id} (paused; resume it first)")));
        }
        let snapshotting = self.snapshotting("snapshot")?;
        let machine = sb.record.machine.clone().ok_or_else(|| RuntimeError::ControlCommand {
            command: "snapshot".into(),
            reason: format!("sandbox {id} was started by an older server that did not record its machine"),
        })?;
        let dir = self.inner.data.images().join(image_id);
        std::fs::create_dir(&dir).map_err(|e| RuntimeError::io(&dir, e))?;
        let saved = async {
            let layers: Vec<PathBuf> = std::iter::once(dir.join("disk.qcow2"))
                .chain(
                    machine
                        .layers
                        .iter()
                        .enumerate()
                        .map(|(n, layer)| hold(&dir, &format!("layer-{n}.qcow2"), layer)),
                )
                .collect();
            let image_machine = ResumeSpec {
                layers,
                kernel: hold(&dir, "kernel", &machine.kernel),
                initrd: hold(&dir, "initrd", &machine.initrd),
                rootfs: hold(&dir, "rootfs", &machine.rootfs),
                ..machine.clone()
            };
            let started = Instant::now();
            let to = create_state_file(&dir.join("state"))?;
            let was_running = snapshotting.save_state(&sb.vm, to, SUSPEND_LIMIT).await?;
            // Stopped, its images flushed: the overlay as it is now is the image's disk.
            let copied = copy_file(&sb.vm.dir.join("disk.qcow2"), &dir.join("disk.qcow2")).await;
            if was_running {
                self.inner.vmm.resume(&sb.vm).await?;
            }
            copied?;
            let size = |name: &str| std::fs::metadata(dir.join(name)).map(|m| m.len()).unwrap_or(0);
            let manifest = ImageManifest {
                id: image_id.to_string(),
                source: id.to_string(),
                template: sb.record.template.clone(),
                template_digest: sb.record.template_digest.clone(),
                resources: sb.record.resources,
                accel: sb.record.accel,
                vmm: snapshotting.build_id(),
                machine: image_machine,
                created_at: humantime::format_rfc3339_millis(SystemTime::now()).to_string(),
                state_bytes: size("state"),
                disk_bytes: size("disk.qcow2"),
                save_ms: started.elapsed().as_millis() as u64,
                digest: None,
            };
            write_atomic(
                &dir.join(MANIFEST),
                &serde_json::to_vec_pretty(&manifest).expect("serializable"),
            )?;
            Ok::<_, RuntimeError>(Image {
                dir: dir.clone(),
                manifest,
            })
        }
        .await;
        if saved.is_err() {
            let _ = std::fs::remove_dir_all(&dir);
        }
        let image = saved?;
        tracing::info!(%id, image = %image_id, ms = image.manifest.save_ms, bytes = image.bytes(), "image saved");
        Ok(image)
    }

    /// Compute image `image_id`'s content address ([`crate::image::Image::content_digest`]) and
    /// record it in its manifest; a digest recorded before is returned as it is. Off the save's
    /// path: the sandbox it came from runs meanwhile, and forks' images need none.
    pub async fn digest_image(&self, image_id: &str) -> Result<String> {
        use crate::image::{Image, MANIFEST};
        let root = self.inner.data.images();
        let image = Image::find(&root, image_id).ok_or_else(|| RuntimeError::UnknownImage(image_id.into()))?;
        if let Some(d) = &image.manifest.digest {
            return Ok(d.clone());
        }
        tokio::task::spawn_blocking(move || {
            let started = Instant::now();
            let digest = image.content_digest()?;
            let manifest = crate::image::ImageManifest {
                digest: Some(digest.clone()),
                ..image.manifest.clone()
            };
            write_atomic(
                &image.dir.join(MANIFEST),
                &serde_json::to_vec_pretty(&manifest).expect("serializable"),
            )?;
            tracing::info!(image = %manifest.id, %digest, ms = started.elapsed().as_millis() as u64, "image digested");
            Ok(digest)
        })
        .await
        .map_err(|e| RuntimeError::io(&root, std::io::Error::other(e.to_string())))?
    }

    /// Keep `size` VMs of `template` with `resources` ready for creates to claim (0 empties the
    /// pool). Filled in the background, one VM at a time.
    pub fn set_pool(&self, template: &str, resources: Resources, size: usize) -> Result<crate::pool::PoolKey> {
        let key = self.pool_key(template, resources)?;
        let extra: Vec<Arc<Sandbox>> = {
            let mut pools = self.inner.pools.lock().unwrap();
            let pool = pools.entry(key.clone()).or_default();
            pool.target = size;
            let keep = size.min(pool.ready.len());
            pool.ready.drain(keep..).collect()
        };
        let rt = self.clone();
        tokio::spawn(async move {
            for sb in extra {
                rt.discard_unadopted(&sb).await;
            }
        });
        self.refill(key.clone());
        Ok(key)
    }

    /// The pool a create of `template` with `resources` claims from (the template resolved, the
    /// resources validated and shaped as a create's are).
    fn pool_key(&self, template: &str, resources: Resources) -> Result<crate::pool::PoolKey> {
        let t = self.inner.templates.resolve(template)?;
        resources.validate(&t)?;
        Ok(crate::pool::PoolKey {
            template: t.manifest.name.clone(),
            resources: shape(&t, resources),
        })
    }

    /// Every pool, as it is now.
    pub fn pools(&self) -> Vec<crate::pool::PoolStatus> {
        let pools = self.inner.pools.lock().unwrap();
        let mut v: Vec<_> = pools
            .iter()
            .map(|(k, p)| crate::pool::PoolStatus {
                template: k.template.clone(),
                resources: k.resources,
                size: p.target,
                ready: p.ready.len(),
                starting: p.starting,
                hits: p.hits,
                misses: p.misses,
            })
            .collect();
        v.sort_by(|a, b| a.template.cmp(&b.template));
        v
    }

    /// Memory the pools' VMs hold (ready, starting or claimed), in MiB.
    pub fn pool_memory_mib(&self) -> u64 {
        let pools = self.inner.pools.lock().unwrap();
        let pooled: u64 = pools
            .iter()
            .map(|(k, p)| (p.ready.len() + p.starting) as u64 * k.resources.memory_mib as u64)
            .sum();
        let claimed: u64 = self
            .inner
            .claimed
            .lock()
            .unwrap()
            .values()
            .map(|sb| sb.record.resources.memory_mib as u64)
            .sum();
        pooled + claimed
    }

    /// A ready VM of `template` with `resources` for a create, if the pool has one: its id is
    /// the sandbox's; [`Runtime::create`] with that id hands it out. [`Runtime::unclaim`] gives
    /// it back when the create does not go ahead.
    pub fn claim(&self, template: &str, resources: Resources) -> Option<String> {
        // Every create asks: without pools, nothing is looked up.
        if self.inner.pools.lock().unwrap().is_empty() {
            return None;
        }
        let key = self.pool_key(template, resources).ok()?;
        let got = {
            let mut pools = self.inner.pools.lock().unwrap();
            let pool = pools.get_mut(&key)?;
            let got = loop {
                match pool.ready.pop() {
                    Some(sb) if self.inner.vmm.is_running(&sb.vm) => break Some(sb),
                    Some(_) => continue,
                    None => break None,
                }
            };
            if got.is_some() {
                pool.hits += 1;
            } else {
                pool.misses += 1;
            }
            got
        };
        // Refilled a little later: the creates claiming now (a burst) get the CPU first.
        let rt = self.clone();
        tokio::spawn(async move {
            tokio::time::sleep(REFILL_DELAY).await;
            rt.refill(key);
        });
        let sb = got?;
        let id = sb.id().to_string();
        self.inner.claimed.lock().unwrap().insert(id.clone(), sb);
        Some(id)
    }

    /// Give a claimed VM back to its pool (its create was refused): it was never handed out.
    pub fn unclaim(&self, id: &str) {
        let Some(sb) = self.inner.claimed.lock().unwrap().remove(id) else {
            return;
        };
        let key = crate::pool::PoolKey {
            template: sb.record.template.clone(),
            resources: sb.record.resources,
        };
        let back = {
            let mut pools = self.inner.pools.lock().unwrap();
            match pools.get_mut(&key) {
                Some(pool) if pool.ready.len() < pool.target => {
                    pool.ready.push(sb);
                    None
                }
                _ => Some(sb),
            }
        };
        if let Some(sb) = back {
            let rt = self.clone();
            tokio::spawn(async move { rt.discard_unadopted(&sb).await });
        }
    }

    /// A claimed pool VM becomes sandbox `vm.id()`: its network gets the sandbox's egress, its
    /// clock and entropy are set again, and it leaves the pool for good.
    async fn hand_out(&self, vm: Arc<Sandbox>, env: &BTreeMap<String, String>) -> Result<Arc<Sandbox>> {
        let started = Instant::now();
        let dir = vm.vm.dir.clone();
        let handed = async {
            let mut link = vm.net.clone();
            if let (Some(net), Some(l)) = (&self.inner.net, link.as_mut()) {
                net.reattach(l).await?;
                write_atomic(
                    &SandboxLink::record_path(&dir),
                    &serde_json::to_vec_pretty(l).expect("serializable"),
                )?;
            }
            let client = vm.agent().await?;
            client.set_identity(&identity(&vm.record, Some(env))).await?;
            Ok::<_, RuntimeError>((link, client))
        };
        match handed.await {
            Ok((link, client)) => {
                let mut record = vm.record.clone();
                record.start = StartKind::Pool;
                record.start_ms = started.elapsed().as_millis() as u64;
                let _ = write_atomic(
                    &dir.join("sandbox.json"),
                    &serde_json::to_vec_pretty(&record).expect("serializable"),
                );
                let _ = std::fs::remove_file(dir.join(crate::pool::MARKER));
                Ok(self.adopt(record, vm.vm.clone(), link, Some(client), false))
            }
            Err(e) => {
                self.discard_unadopted(&vm).await;
                Err(e)
            }
        }
    }

    /// Stop a pool VM and remove everything it had.
    /// Stop a VM that never became a sandbox (a pool VM, a probe) and remove all it had.
    async fn discard_unadopted(&self, sb: &Sandbox) {
        let _ = self.inner.vmm.stop(&sb.vm, Duration::from_secs(2)).await;
        self.remove_network(sb.net.as_ref()).await;
        let _ = self.inner.discard(&sb.vm.dir);
    }

    /// Start pool VMs until `key`'s pool has its size (one filler per pool, one VM at a time).
    fn refill(&self, key: crate::pool::PoolKey) {
        {
            let mut pools = self.inner.pools.lock().unwrap();
            let Some(pool) = pools.get_mut(&key) else { return };
            if pool.filling || pool.ready.len() + pool.starting >= pool.target {
                return;
            }
            pool.filling = true;
        }
        let rt = self.clone();
        tokio::spawn(async move {
            loop {
                let wanted = {
                    let mut pools = rt.inner.pools.lock().unwrap();
                    let Some(pool) = pools.get_mut(&key) else { return };
                    let wanted = pool.ready.len() + pool.starting < pool.target;
                    if wanted {
                        pool.starting += 1;
                    } else {
                        pool.filling = false;
                    }
                    wanted
                };
                if !wanted {
                    return;
                }
                let req = CreateSandbox {
                    id: None,
                    template: key.template.clone(),
                    resources: key.resources,
                    image: None,
                    env: BTreeMap::new(),
                };
                let started = match rt.start_new(random_hex(10), &req, Purpose::Pool).await {
                    // Its first command warms what every first command costs (under TCG, the
                    // translation of the agent's spawn path): the platform's own `true`, which
                    // leaves nothing behind, before any tenant's.
                    Ok(sb) => match sb
                        .run(ProcessSpec {
                            argv: vec!["true".into()],
                            ..Default::default()
                        })
                        .await
                    {
                        Ok(_) => Ok(sb),
                        Err(e) => {
                            rt.discard_unadopted(&sb).await;
                            Err(e)
                        }
                    },
                    Err(e) => Err(e),
                };
                let extra = {
                    let mut pools = rt.inner.pools.lock().unwrap();
                    let pool = pools.entry(key.clone()).or_default();
                    pool.starting -= 1;
                    match started {
                        Ok(sb) if pool.ready.len() < pool.target => {
                            pool.ready.push(sb);
                            None
                        }
                        Ok(sb) => Some(Ok(sb)),
                        Err(e) => Some(Err(e)),
                    }
                };
                match extra {
                    None => {}
                    Some(Ok(sb)) => rt.discard_unadopted(&sb).await,
                    Some(Err(e)) => {
                        tracing::warn!(template = %key.template, "a warm pool VM did not start: {e}");
                        // Not a hot loop on a broken template: the next claim tries again.
                        rt.inner.pools.lock().unwrap().entry(key.clone()).or_default().filling = false;
                        return;
                    }
                }
            }
        });
    }

    /// Stop every pool VM (a server shutting down: they were never handed out).
    pub async fn drain_pools(&self) {
        let vms: Vec<Arc<Sandbox>> = {
            let mut pools = self.inner.pools.lock().unwrap();
            let mut v: Vec<_> = pools
                .values_mut()
                .flat_map(|p| {
                    p.target = 0;
                    p.ready.drain(..).collect::<Vec<_>>()
                })
                .collect();
            v.extend(self.inner.claimed.lock().unwrap().drain().map(|(_, sb)| sb));
            v
        };
        for sb in vms {
            self.discard_unadopted(&sb).await;
        }
    }

    /// Let a paused or suspended sandbox run again. Idempotent.
    pub async fn resume(&self, id: &str) -> Result<()> {
        if self.is_suspended(id) {
            return self.resume_suspended(id).await.map(drop);
        }
        let sb = self.get(id)?;
        if sb.is_paused() {
            self.inner.vmm.resume(&sb.vm).await?;
            sb.paused.store(false, Ordering::SeqCst);
        }
        Ok(())
    }

    pub fn is_suspended(&self, id: &str) -> bool {
        self.inner.suspended.lock().unwrap().contains_key(id)
    }

    /// Ids of the suspended sandboxes.
    pub fn suspended(&self) -> Vec<String> {
        self.inner.suspended.lock().unwrap().keys().cloned().collect()
    }

    /// Save a running (or paused) sandbox's whole state (RAM, devices) into its dir and end its
    /// VMM: its memory, CPU and network are freed, its disk and saved state stay until
    /// [`Runtime::resume`] (also after a restart) or [`Runtime::delete`]. Idempotent.
    pub async fn suspend(&self, id: &str) -> Result<Timing> {
        if self.is_suspended(id) {
            return Ok(Timing { ms: 0 });
        }
        let sb = self.get(id)?;
        let snapshotting = self.snapshotting("suspend")?;
        if sb.record.machine.is_none() {
            return Err(RuntimeError::ControlCommand {
                command: "suspend".into(),
                reason: format!("sandbox {id} was started by an older server that did not record its machine"),
            });
        }
        let started = Instant::now();
        let dir = sb.vm.dir.clone();
        sb.deleting.store(true, Ordering::SeqCst);
        end_session(&sb).await;
        let state = dir.join(SUSPEND_STATE);
        let saving = async {
            let to = create_state_file(&dir.join(format!("{SUSPEND_STATE}.tmp")))?;
            snapshotting.save_state(&sb.vm, to, SUSPEND_LIMIT).await?;
            std::fs::rename(dir.join(format!("{SUSPEND_STATE}.tmp")), &state)
                .map_err(|e| RuntimeError::io(&state, e))?;
            std::fs::metadata(&state).map_err(|e| RuntimeError::io(&state, e))
        };
        let saved = match saving.await {
            Ok(meta) => meta,
            Err(e) => {
                let _ = std::fs::remove_file(dir.join(format!("{SUSPEND_STATE}.tmp")));
                if self.inner.vmm.is_running(&sb.vm) {
                    // Not saved: it runs on as it was (`save_state` let it run again).
                    sb.deleting.store(false, Ordering::SeqCst);
                } else {
                    self.forget_gone(&sb).await;
                }
                return Err(e);
            }
        };
        // Saved: the VMM goes.
        let _ = self.inner.vmm.stop(&sb.vm, Duration::from_secs(5)).await;
        let marker = SuspendRecord {
            saved_at: humantime::format_rfc3339_millis(SystemTime::now()).to_string(),
            state_bytes: saved.len(),
            save_ms: started.elapsed().as_millis() as u64,
        };
        write_atomic(
            &dir.join(SUSPEND_MARKER),
            &serde_json::to_vec_pretty(&marker).expect("serializable"),
        )?;
        // Suspended before it leaves the running ones: it is never seen as gone.
        self.inner
            .suspended
            .lock()
            .unwrap()
            .insert(id.to_string(), sb.record.clone());
        self.inner.sandboxes.lock().unwrap().remove(id);
        self.remove_network(sb.net.as_ref()).await;
        self.inner.vmm.release(&dir);
        tracing::info!(%id, bytes = marker.state_bytes, ms = marker.save_ms, "suspended");
        Ok(Timing { ms: marker.save_ms })
    }

    /// A sandbox whose VMM is gone while it was meant to keep running: removed, as after a crash.
    async fn forget_gone(&self, sb: &Arc<Sandbox>) {
        self.inner.sandboxes.lock().unwrap().remove(sb.id());
        self.remove_network(sb.net.as_ref()).await;
        let _ = self.inner.discard(&sb.vm.dir);
        let _ = self.inner.exits.send(sb.id().to_string());
    }

    /// Start a suspended sandbox's VM again from its saved state, with a new network, and give
    /// it its identity again (the clock moved on). On failure it stays suspended.
    async fn resume_suspended(&self, id: &str) -> Result<Arc<Sandbox>> {
        let mut record = self
            .inner
            .suspended
            .lock()
            .unwrap()
            .get(id)
            .cloned()
            .ok_or_else(|| RuntimeError::UnknownSandbox(id.into()))?;
        let machine = record
            .machine
            .clone()
            .ok_or_else(|| RuntimeError::UnknownSandbox(id.into()))?;
        let dir = self.inner.data.sandboxes().join(id);
        let limit = self.inner.boot_timeout;
        let started = Instant::now();
        let mut link = None;
        let files = [machine.kernel.clone(), machine.initrd.clone(), machine.rootfs.clone()];
        let mut spec = VmSpec::new(id, dir.clone(), files, record.resources, record.accel);
        spec.snapshot = Some(SnapshotRole::Resume {
            state: dir.join(SUSPEND_STATE),
            resume: machine,
            new_overlay: false,
        });
        let result = async {
            let vm = self.start_vm(id, &dir, spec, &mut link, false).await?;
            let ready = async {
                self.snapshotting("resume")?
                    .complete_restore(&vm, SUSPEND_LIMIT)
                    .await?;
                let client = AgentClient::connect_within(&vm.agent_socket, limit).await?;
                // Its environment is in its saved memory already.
                client.set_identity(&identity(&record, None)).await?;
                Ok::<_, RuntimeError>(client)
            };
            ready_or_died(id, &vm, "resume", ready).await.map(|client| (vm, client))
        }
        .await;
        match result {
            Ok((vm, client)) => {
                for done in [SUSPEND_MARKER, SUSPEND_STATE] {
                    let _ = std::fs::remove_file(dir.join(done));
                }
                record.start_ms = started.elapsed().as_millis() as u64;
                tracing::info!(%id, ms = record.start_ms, "resumed");
                let sb = self.adopt(record, vm, link, Some(client), false);
                self.inner.suspended.lock().unwrap().remove(id);
                Ok(sb)
            }
            Err(e) => {
                if let Some(vm) = VmHandle::load(&dir).filter(|vm| self.inner.vmm.is_running(vm)) {
                    let _ = self.inner.vmm.stop(&vm, Duration::from_secs(2)).await;
                }
                self.remove_network(link.as_ref()).await;
                self.inner.vmm.release(&dir);
                Err(e)
            }
        }
    }

    /// Stop the VM and remove its dir (overlay, sockets, logs). Unknown ids are an error.
    pub async fn delete(&self, id: &str) -> Result<()> {
        if self.inner.suspended.lock().unwrap().remove(id).is_some() {
            let dir = self.inner.data.sandboxes().join(id);
            return self.inner.discard(&dir).map_err(|e| RuntimeError::io(&dir, e));
        }
        let sb = self.get(id)?;
        sb.deleting.store(true, Ordering::SeqCst);
        let stopped = self.inner.vmm.stop(&sb.vm, Duration::from_secs(5)).await;
        self.inner.sandboxes.lock().unwrap().remove(id);
        self.remove_network(sb.net.as_ref()).await;
        self.inner
            .discard(&sb.vm.dir)
            .map_err(|e| RuntimeError::io(&sb.vm.dir, e))?;
        stopped
    }
}

/// See [`Runtime::disk_space`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DiskSpace {
    pub free_mib: u64,
    pub held_by_sandboxes_mib: u64,
    /// Saved images' own files (their memory and disk), not their links to templates' files.
    pub held_by_images_mib: u64,
    /// What warm pool VMs (ready, starting or claimed) may still write: each one's full disk
    /// less what its dir holds.
    pub pool_unheld_mib: u64,
}

/// Blocks allocated to the files directly in `dir` (a sandbox or image dir is flat), in bytes;
/// with `own_only`, only files no other link holds.
fn allocated_bytes(dir: &std::path::Path, own_only: bool) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .flatten()
        .filter_map(|e| e.metadata().ok())
        .filter(|m| m.is_file() && (!own_only || m.nlink() == 1))
        .map(|m| m.blocks() * 512)
        .sum()
}

/// The kernel command line base snapshots are booted with: the hostname in it is a placeholder,
/// since every clone gets its own over the channel.
fn builder_cmdline() -> String {
    crate::vmm::qemu::kernel_cmdline("sandbox")
}

/// A VM's identity: its hostname is its id, its machine id the one it was given; the entropy
/// and the clock are fresh; `env` (if given) replaces the guest's copy of the sandbox's
/// environment.
fn identity(record: &SandboxRecord, env: Option<&BTreeMap<String, String>>) -> airlock_proto::Identity {
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

/// A sandbox's handle, not yet in any runtime map.
fn sandbox(
    record: SandboxRecord,
    vm: VmHandle,
    net: Option<SandboxLink>,
    client: Option<AgentClient>,
    paused: bool,
) -> Arc<Sandbox> {
    Arc::new(Sandbox {
        record,
        vm,
        net,
        agent: tokio::sync::Mutex::new(client),
        deleting: AtomicBool::new(false),
        paused: AtomicBool::new(paused),
    })
}

/// End the host's session with a VM about to be saved: the guest sees its host leave, so the
/// restored guest serves a new session at once (its processes and their output stay in the
/// guest). Every stream on the session ends.
async fn end_session(sb: &Sandbox) {
    if let Some(client) = sb.agent.lock().await.take() {
        client.close();
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Copy `from` to `to` (sparse; shared extents where the filesystem can).
async fn copy_file(from: &std::path::Path, to: &std::path::Path) -> Result<()> {
    let out = tokio::process::Command::new("cp")
        .args(["--reflink=auto", "--sparse=always"])
        .arg(from)
        .arg(to)
        .output()
        .await
        .map_err(|e| RuntimeError::io(from, e))?;
    if !out.status.success() {
        return Err(RuntimeError::io(
            from,
            std::io::Error::other(String::from_utf8_lossy(&out.stderr).trim().to_string()),
        ));
    }
    Ok(())
}

/// A new file for a VM's saved state: the server's only (it holds the guest's memory).
fn create_state_file(path: &std::path::Path) -> Result<std::fs::File> {
    crate::datadir::create_private(path).map_err(|e| RuntimeError::io(path, e))
}

/// `ready` (its agent answering), unless the VMM exits first; a failure names what the VM was
/// `doing` (boot, restore, resume) and carries the console's tail.
async fn ready_or_died(
    id: &str,
    vm: &VmHandle,
    doing: &str,
    ready: impl std::future::Future<Output = Result<AgentClient>>,
) -> Result<AgentClient> {
    let died = async { while !wait_exit(vm.pid, Duration::from_secs(3600)).await {} };
    let failed = |reason: String| RuntimeError::BootFailed {
        id: id.to_string(),
        reason,
    };
    tokio::select! {
        r = ready => r.map_err(|e| failed(format!("{doing}: {e}; console:\n{}", vm.console_tail(12)))),
        _ = died => Err(failed(format!("the VMM exited during {doing}; console:\n{}", vm.console_tail(12)))),
    }
}

/// `<dir>/held/<name>`, a hard link to `file` (the sandbox's own hold on it), or `file` itself
/// where no link can be made (another filesystem).
fn hold(dir: &std::path::Path, name: &str, file: &std::path::Path) -> PathBuf {
    let held = dir.join("held");
    let link = held.join(name);
    let made = std::fs::create_dir_all(&held).and_then(|()| std::fs::hard_link(file, &link));
    match made {
        Ok(()) => link,
        Err(e) => {
            tracing::debug!("cannot link {} into {}: {e}", file.display(), held.display());
            file.to_path_buf()
        }
    }
}

/// The resources a VM of `template` gets: its disk at least the template's image.
fn shape(template: &Template, resources: Resources) -> Resources {
    let min_disk = template.manifest.rootfs_bytes.div_ceil(1 << 20) as u32;
    Resources {
        disk_mib: resources.disk_mib.max(min_disk),
        ..resources
    }
}
