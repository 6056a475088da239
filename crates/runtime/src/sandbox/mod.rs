//! This node's VMs: the [`Runtime`] facade (open, create, get, list, delete; where a new VM
//! starts from: a saved image, its template's base snapshot, a warm pool or a boot), over parts
//! that each own their state, lowest first:
//!
//! - `vm.rs` (a VM and its record), `saved.rs` (the saved-machine shape), `console.rs`
//!   (console trimming), `launch.rs` (starting one VM), `accel.rs` (the KVM probe);
//! - `registry.rs` (the VMs in use, suspended, unsettled; exits), `pools.rs` (warm pools),
//!   `base_snapshot.rs` (base snapshots and their builds), `image.rs` (saved images);
//! - this file, the facade;
//! - `reconcile.rs` (after a restart), `suspend.rs` (pause, suspend, resume), `disk.rs` (the
//!   node's disk space), each an `impl Runtime` over the parts below.
//!
//! A file uses only those above it in this list (besides: `open` starts the reconcile, which
//! knows a suspended VM by `suspend.rs`'s marker). The launch, registry, probe, reconcile and
//! suspend files are private; what callers need is re-exported here. One runtime per data dir;
//! in the many-hosts layout it is the node daemon's core.

mod accel;
pub mod base_snapshot;
mod capture;
mod console;
mod disk;
pub mod image;
mod launch;
pub mod pools;
mod reconcile;
mod registry;
pub mod saved;
mod suspend;
pub mod vm;
mod volumes;

use crate::datadir::{random_hex, DataDir, FileLock};
use crate::error::{Result, RuntimeError};
use crate::net::{Network, NetworkOptions, SandboxLink};
use crate::template::{Template, TemplateStore};
use crate::vmm::qemu::QemuVmm;
use crate::vmm::{wait_exit, Accel, VmHandle, Vmm};
use accel::AccelProbe;
use base_snapshot::{BaseSnapshot, BaseSnapshots};
use image::{Image, Images};
use launch::{shape, Launcher, Purpose};
use pools::{PoolKey, PoolStarter, PoolStatus, Pools};
use registry::Registry;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Weak};
use std::time::Duration;

pub use crate::vmm::{Resources, MAX_DISK_MIB, MIN_MEMORY_MIB};
pub use capture::Capture;
pub use disk::DiskSpace;
pub use launch::start_template_process;
pub use reconcile::RECONCILE_AT_ONCE;
pub use suspend::{SuspendRecord, SUSPEND_MARKER, SUSPEND_STATE};
pub use vm::{valid_sandbox_id, Output, StartKind, Timing, Vm, VmRecord};
pub use volumes::{VolumeAccess, VolumeHolder, VolumeMount, HELPER_IDLE};

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
    /// Give every VM a network namespace and a NIC (see [`crate::net`]); `None`: no NIC.
    /// On by default; `AIRLOCK_SANDBOX_NETWORK=off` turns it off.
    pub network: Option<NetworkOptions>,
    /// Re-attach to an earlier process's VMs in the background (several at a time) instead of
    /// before `open` returns: a server can listen at once. Until a VM is settled it is not in
    /// `get`/`list`; [`Runtime::settled`] waits for one, [`Runtime::settled_all`] for all.
    pub reconcile_in_background: bool,
    /// Restore creates from base snapshots (see `base_snapshot.rs`), building one in the
    /// background for each template and shape the first time it is created. On by default where
    /// the VMM can; `AIRLOCK_BASE_SNAPSHOTS=off` turns it off.
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

#[derive(Debug, Clone)]
pub struct CreateVm {
    /// Id to give the VM (the API assigns it before the boot starts); random when absent.
    pub id: Option<String>,
    pub template: String,
    pub resources: Resources,
    /// Start from this saved image ([`Runtime::save_image`]) instead: its machine, memory,
    /// processes and disk; `template` and `resources` are then the image's.
    pub image: Option<String>,
    /// The VM's environment variables, handed to the guest with its identity.
    pub env: BTreeMap<String, String>,
    /// Volumes attached and mounted once it runs (after a restore or a pool claim too).
    pub volumes: Vec<VolumeMount>,
}

struct Inner {
    launcher: Arc<Launcher>,
    accel: AccelProbe,
    registry: Registry,
    base_snapshots: Arc<BaseSnapshots>,
    images: Images,
    pools: Arc<Pools>,
    volumes: crate::volume::VolumeDisks,
    helpers: volumes::Helpers,
}

/// The node runtime. Cheap to clone.
#[derive(Clone)]
pub struct Runtime {
    inner: Arc<Inner>,
}

impl Runtime {
    /// Open the data dir, find QEMU (unless `opts.vmm` brings a driver), and re-attach to (or
    /// clean up after) existing VMs.
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
        let net = match opts.network {
            Some(o) => {
                let net = Network::new(data.root(), o)?;
                net.check_tools().await?;
                Some(net)
            }
            None => None,
        };
        let launcher = Arc::new(Launcher {
            lock,
            templates: TemplateStore::new(data.clone()),
            data,
            vmm,
            net,
            boot_timeout: opts.boot_timeout,
        });
        let rt = Self {
            inner: Arc::new(Inner {
                accel: AccelProbe::new(opts.accel),
                registry: Registry::default(),
                base_snapshots: Arc::new(BaseSnapshots::new(launcher.clone(), opts.base_snapshots)),
                images: Images::new(launcher.clone()),
                pools: Arc::new(Pools::new(launcher.clone())),
                volumes: crate::volume::VolumeDisks::open(launcher.data.root())?,
                helpers: Default::default(),
                launcher,
            }),
        };
        rt.inner.base_snapshots.remove_interrupted().await;
        rt.inner.base_snapshots.prune();
        rt.inner.images.remove_unfinished();
        rt.remove_unfinished_captures();
        rt.prune_blobs();
        console::spawn_trimmer(Arc::downgrade(&rt.inner), rt.inner.launcher.data.sandboxes());
        let weak = Arc::downgrade(&rt.inner);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(HELPER_IDLE / 4).await;
                let Some(inner) = weak.upgrade() else { return };
                Runtime { inner }.end_idle_helpers().await;
            }
        });
        let entries = rt.unsettled_entries();
        let weak = Arc::downgrade(&rt.inner);
        if opts.reconcile_in_background {
            tokio::spawn(async move { Self::reconcile(weak, entries).await });
        } else {
            Self::reconcile(weak, entries).await;
        }
        Ok(rt)
    }

    pub fn data_dir(&self) -> &DataDir {
        &self.inner.launcher.data
    }

    pub fn templates(&self) -> &TemplateStore {
        &self.inner.launcher.templates
    }

    /// The VMs' networks, when the runtime makes them.
    pub fn network(&self) -> Option<&Network> {
        self.inner.launcher.net.as_ref()
    }

    pub fn runtime_name(&self) -> &'static str {
        self.inner.launcher.vmm.name()
    }

    /// The isolation VMs run in (uid, filesystem, cgroups), where the driver jails them.
    pub fn isolation(&self) -> Option<crate::jail::Isolation> {
        self.inner.launcher.vmm.isolation()
    }

    /// Ids of VMs whose VMM exited on its own (crash, `kill -9`, power-off from inside), sent
    /// once the VM is gone from this runtime and its dir is removed. Deletes are not reported.
    /// Only exits after this call are seen.
    pub fn exits(&self) -> tokio::sync::broadcast::Receiver<String> {
        self.inner.registry.exits()
    }

    /// Whether this runtime knows what became of VM `id` after a restart (re-attached or
    /// removed); always true for VMs it created itself.
    pub fn is_settled(&self, id: &str) -> bool {
        self.inner.registry.is_settled(id)
    }

    /// Wait until VM `id` is settled (see [`RuntimeOptions::reconcile_in_background`]).
    pub async fn settled(&self, id: &str) {
        self.inner.registry.settled(id).await
    }

    /// Wait until every VM of the earlier process is settled.
    pub async fn settled_all(&self) {
        self.inner.registry.settled_all().await
    }

    /// The accelerator VMs use: forced, cached, or found by booting a KVM probe guest once.
    pub async fn accel(&self) -> Accel {
        self.inner.accel.get(&self.inner.launcher).await
    }

    /// Put `vm` in the map of VMs in use and watch its VMM.
    fn adopt(
        &self,
        record: VmRecord,
        vm: VmHandle,
        net: Option<SandboxLink>,
        client: Option<crate::agent::AgentClient>,
        paused: bool,
    ) -> Arc<Vm> {
        self.adopt_vm(Vm::new(record, vm, net, client, paused))
    }

    fn adopt_vm(&self, vm: Arc<Vm>) -> Arc<Vm> {
        self.inner.registry.insert(vm.clone());
        self.watch_vmm(vm.clone());
        vm
    }

    /// When the VMM dies on its own (crash, `kill -9`), remove everything the VM had and report
    /// it on `exits`. The watcher does not keep the runtime alive: once the runtime is dropped
    /// (a server restart), its VMs are left for the next one to re-attach.
    fn watch_vmm(&self, vm: Arc<Vm>) {
        let rt = Arc::downgrade(&self.inner);
        let (pid, dir) = (vm.handle.pid, vm.handle.dir.clone());
        let vm = Arc::downgrade(&vm);
        tokio::spawn(async move {
            while !wait_exit(pid, Duration::from_secs(3600)).await {}
            let Some(inner) = rt.upgrade() else { return };
            let Some(vm) = vm.upgrade() else { return };
            if vm.is_deleting() {
                return;
            }
            tracing::warn!(id = %vm.id(), pid, "VMM exited on its own; cleaning up the sandbox");
            if inner.registry.remove_if_current(&vm) {
                inner.launcher.remove_network(vm.net.as_ref()).await;
                let _ = inner.launcher.discard(vm.id(), &dir);
                inner.registry.exited(vm.id());
            }
        });
    }

    pub async fn create(&self, req: CreateVm) -> Result<Arc<Vm>> {
        let id = match req.id.clone() {
            Some(id) if !valid_sandbox_id(&id) => return Err(RuntimeError::InvalidSandboxId(id)),
            Some(id) if self.get(&id).is_ok() => return Err(RuntimeError::SandboxIdTaken(id)),
            Some(id) => id,
            None => random_hex(10),
        };
        let mut vm = None;
        if let Some(claimed) = self.inner.pools.take_claimed(&id) {
            match self.inner.pools.hand_out(claimed, &req.env).await {
                Ok(claimed) => vm = Some(self.adopt_vm(claimed)),
                Err(e) => tracing::warn!(%id, "a claimed pool VM could not be handed out ({e}); starting one instead"),
            }
        }
        let vm = match vm {
            Some(vm) => vm,
            None => self.adopt_vm(self.start_new(id.clone(), &req, Purpose::Sandbox).await?),
        };
        if !req.volumes.is_empty() {
            if let Err(e) = self.attach_volumes(&id, &req.volumes).await {
                let _ = self.delete(&id).await;
                return Err(e);
            }
        }
        Ok(vm)
    }

    /// Start a new VM for `id` as `req` asks, for `purpose`: from its image, else from its
    /// template's base snapshot where one is built (wanting one built where not), else a boot.
    /// The VM is in no map yet.
    async fn start_new(&self, id: String, req: &CreateVm, purpose: Purpose) -> Result<Arc<Vm>> {
        let l = &self.inner.launcher;
        if let Some(image) = &req.image {
            let image = self
                .inner
                .images
                .find(image)
                .ok_or_else(|| RuntimeError::UnknownImage(image.clone()))?;
            let accel = image.manifest.accel;
            return l
                .launch(id, image.source(), accel, l.boot_timeout, purpose, &req.env)
                .await;
        }
        let template = l.templates.resolve(&req.template)?;
        req.resources.validate(&template.manifest)?;
        let accel = self.accel().await;
        let resources = shape(&template, req.resources);
        let limit = l.boot_timeout;
        let snapshots = &self.inner.base_snapshots;
        if let Some(key) = snapshots.key_for(&template, &resources, accel) {
            match snapshots.find(&key) {
                Some(snap) => match l
                    .launch(
                        id.clone(),
                        snap.source(&template, resources),
                        accel,
                        limit,
                        purpose,
                        &req.env,
                    )
                    .await
                {
                    Ok(vm) => return Ok(vm),
                    Err(e) => {
                        tracing::warn!(%id, snapshot = %key, "restore failed, booting instead: {e}");
                        // A VM that did not come back from it: the snapshot goes (clones running
                        // from it keep their open files), and the next create builds it again.
                        if matches!(e, RuntimeError::BootFailed { .. } | RuntimeError::ControlCommand { .. }) {
                            let _ = std::fs::remove_dir_all(&snap.dir);
                        }
                    }
                },
                None => snapshots.want(key, template.clone(), resources, accel),
            }
        }
        l.launch(
            id,
            launch::Source::Boot(&template, resources),
            accel,
            limit,
            purpose,
            &req.env,
        )
        .await
    }

    /// The base snapshot for `template` and `resources`, if one is built.
    pub async fn base_snapshot(&self, template: &str, resources: Resources) -> Option<BaseSnapshot> {
        let template = self.inner.launcher.templates.resolve(template).ok()?;
        let snapshots = &self.inner.base_snapshots;
        let key = snapshots.key_for(&template, &shape(&template, resources), self.accel().await)?;
        snapshots.find(&key)
    }

    /// Boot `template` with `resources` once and save it as base snapshot `key`.
    pub async fn build_base_snapshot(
        &self,
        key: &str,
        template: &Template,
        resources: Resources,
        accel: Accel,
    ) -> Result<BaseSnapshot> {
        self.inner.base_snapshots.build(key, template, resources, accel).await
    }

    /// Stop the base-snapshot builds running now (a server shutting down): the build's own
    /// cleanup may not get to run before the exit.
    pub async fn stop_base_snapshot_builds(&self) {
        self.inner.base_snapshots.stop_builds().await;
    }

    /// Template images no template names any more and nothing was made from: every rebuild of a
    /// template leaves the old one behind. A VM or image made from one is counted as using it
    /// (their `held/` links would keep its files anyway); with a dir whose record cannot be
    /// read, nothing is removed.
    fn prune_blobs(&self) {
        let data = &self.inner.launcher.data;
        let mut in_use = std::collections::BTreeSet::new();
        for root in [data.sandboxes(), data.images()] {
            for entry in std::fs::read_dir(&root).into_iter().flatten().flatten() {
                let record = [vm::RECORD, image::MANIFEST]
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
        self.inner.launcher.templates.prune_blobs(&in_use);
    }

    /// VM `id` in use. One of the earlier process is found only once settled: whoever finds it
    /// may rely on it being decided.
    pub fn get(&self, id: &str) -> Result<Arc<Vm>> {
        self.inner.registry.get(id)
    }

    /// The run of VM `id` ([`VmRecord::run`]), live or suspended; None: no such VM.
    pub fn run_of(&self, id: &str) -> Option<String> {
        match self.get(id) {
            Ok(vm) => Some(vm.record.run.clone()),
            Err(_) => self.inner.registry.suspended(id).map(|r| r.run),
        }
    }

    /// The VMs in use, oldest first (those of the earlier process once settled).
    pub fn list(&self) -> Vec<Arc<Vm>> {
        self.inner.registry.list()
    }

    /// Stop the VM and remove its dir (overlay, sockets, logs). Unknown ids are an error.
    pub async fn delete(&self, id: &str) -> Result<()> {
        let l = &self.inner.launcher;
        if self.inner.registry.unsuspend(id).is_some() {
            let dir = l.data.sandboxes().join(id);
            return l.discard(id, &dir).map_err(|e| RuntimeError::io(&dir, e));
        }
        let vm = self.get(id)?;
        self.sync_volumes_of(&vm).await;
        vm.set_deleting(true);
        let stopped = l.vmm.stop(&vm.handle, Duration::from_secs(5)).await;
        self.inner.registry.remove(id);
        l.remove_network(vm.net.as_ref()).await;
        l.discard(id, &vm.handle.dir)
            .map_err(|e| RuntimeError::io(&vm.handle.dir, e))?;
        stopped
    }

    /// The saved image `id`, if it exists and this VMM can load it.
    pub fn image(&self, id: &str) -> Option<Image> {
        self.inner.images.find(id)
    }

    /// Ids of the saved images.
    pub fn images(&self) -> Vec<String> {
        self.inner.images.ids()
    }

    /// Remove image `id` (VMs made from it run on; a missing one is not an error).
    pub fn delete_image(&self, id: &str) -> Result<()> {
        self.inner.images.remove(id)
    }

    /// Save VM `id` as image `image_id` while it runs on (see [`Images::save`]). VMs made from
    /// the image ([`CreateVm::image`]) start with its memory, processes and files at that moment.
    pub async fn save_image(&self, id: &str, image_id: &str) -> Result<Image> {
        let vm = self.get(id)?;
        self.inner.images.save(&vm, image_id, true).await
    }

    /// Save VM `id` as image `image_id` and leave it paused, for it to start again from the
    /// image on another host: nothing it does after the save can be lost, since it does not
    /// run on (a paused one is run for the save). Its caller then deletes it, or resumes it
    /// here if the move does not go ahead. When the save fails the VM is as it was.
    pub async fn save_paused(&self, id: &str, image_id: &str) -> Result<Image> {
        let vm = self.get(id)?;
        let was_paused = vm.is_paused();
        if was_paused {
            self.resume(id).await?;
        }
        let saved = self.inner.images.save(&vm, image_id, false).await;
        // Saved, its VMM stays stopped (`save_state` leaves it so); not saved, it runs on.
        if saved.is_ok() {
            vm.set_paused(true);
        } else if was_paused {
            let _ = self.pause(id).await;
        }
        saved
    }

    /// What a saved VM needs of the machine that starts it again, as one short digest: the
    /// accelerator, the VMM build and, under KVM (the guest sees the host's CPU), the host's
    /// CPU model and flags. Images move only between nodes with equal fingerprints.
    pub async fn fingerprint(&self) -> String {
        let accel = self.accel().await;
        let vmm = match self.inner.launcher.vmm.snapshotting() {
            Some(s) => s.build_id(),
            None => self.runtime_name().to_string(),
        };
        let cpu = match accel {
            crate::vmm::Accel::Kvm => host_cpu(),
            crate::vmm::Accel::Tcg => String::new(),
        };
        fingerprint_of(&accel.to_string(), &vmm, &cpu)
    }

    /// Compute image `image_id`'s content address and record it (see [`Images::digest`]).
    pub async fn digest_image(&self, image_id: &str) -> Result<String> {
        self.inner.images.digest(image_id).await
    }

    /// Keep `size` VMs of `template` with `resources` ready for creates to claim (0 empties the
    /// pool). Filled in the background, one VM at a time.
    pub fn set_pool(&self, template: &str, resources: Resources, size: usize) -> Result<PoolKey> {
        let key = self.inner.pools.key(template, resources)?;
        self.inner.pools.set(key.clone(), size, self.pool_starter());
        Ok(key)
    }

    /// Every pool, as it is now.
    pub fn pools(&self) -> Vec<PoolStatus> {
        self.inner.pools.status()
    }

    /// Memory the pools' VMs hold (ready, starting or claimed), in MiB.
    pub fn pool_memory_mib(&self) -> u64 {
        self.inner.pools.memory_mib()
    }

    /// A ready VM of `template` with `resources` for a create, if the pool has one: its id is
    /// the VM's; [`Runtime::create`] with that id hands it out. [`Runtime::unclaim`] gives it
    /// back when the create does not go ahead.
    pub fn claim(&self, template: &str, resources: Resources) -> Option<String> {
        self.inner.pools.claim(template, resources, self.pool_starter())
    }

    /// Give a claimed VM back to its pool (its create was refused): it was never handed out.
    pub fn unclaim(&self, id: &str) {
        self.inner.pools.unclaim(id)
    }

    /// Stop every pool VM (a server shutting down: they were never handed out).
    pub async fn drain_pools(&self) {
        self.inner.pools.drain().await
    }

    fn pool_starter(&self) -> Arc<dyn PoolStarter> {
        Arc::new(Starter(Arc::downgrade(&self.inner)))
    }
}

/// The host CPU's model and flags (`/proc/cpuinfo`'s first processor), as a KVM guest sees them.
fn host_cpu() -> String {
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let field = |name: &str| {
        info.lines()
            .find(|l| l.split(':').next().is_some_and(|k| k.trim() == name))
            .and_then(|l| l.split_once(':'))
            .map(|(_, v)| v.trim().to_string())
            .unwrap_or_default()
    };
    format!("{}|{}", field("model name"), field("flags"))
}

/// `sha256:` and the first 16 hex digits of the digest over the three parts.
fn fingerprint_of(accel: &str, vmm: &str, cpu: &str) -> String {
    let canonical = serde_json::json!({"accel": accel, "vmm": vmm, "cpu": cpu}).to_string();
    let hex = crate::digest::sha256_hex(canonical.as_bytes());
    format!("{accel}-{}", &hex[..16])
}

/// Starts pool VMs as a create would, without keeping the runtime alive.
struct Starter(Weak<Inner>);

#[async_trait::async_trait]
impl PoolStarter for Starter {
    async fn start_pool_vm(&self, key: &PoolKey) -> Result<Arc<Vm>> {
        let inner = self
            .0
            .upgrade()
            .ok_or_else(|| RuntimeError::NotRunning("the runtime".into()))?;
        let req = CreateVm {
            id: None,
            template: key.template.clone(),
            resources: key.resources,
            image: None,
            env: BTreeMap::new(),
            volumes: Vec::new(),
        };
        Runtime { inner }.start_new(random_hex(10), &req, Purpose::Pool).await
    }
}
