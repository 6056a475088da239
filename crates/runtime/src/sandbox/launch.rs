//! Launching a VM, the bottom of the runtime: its dir and record, the machine it runs as (with
//! its own links to the files it sits on), its network, its VMM, and its agent's READY with its
//! identity given; on failure everything it had is removed again. [`Launcher`] owns what every
//! launch needs (data dir, templates, VMM driver, networks). Uses `vm.rs` and `saved.rs`; knows
//! nothing of pools, base snapshots, images or the runtime's maps.

use super::saved::{hold, SAVE_LIMIT};
use super::vm::{identity, StartKind, Vm, VmRecord};
use crate::agent::AgentClient;
use crate::datadir::{random_hex, write_atomic, DataDir, FileLock};
use crate::error::{Result, RuntimeError};
use crate::net::{Network, SandboxLink};
use crate::template::{StartSpec, Template, TemplateStore};
use crate::vmm::{
    wait_exit, Accel, NetAttach, Resources, ResumeSpec, SnapshotRole, Snapshotting, VmHandle, VmSpec, Vmm,
};
use airlock_proto::frame::EventKind;
use airlock_proto::ProcessSpec;
use futures_util::StreamExt;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

/// Marks a warm pool VM's dir (`<dir>/pool.json`): what a restart finds of a pool is removed.
pub const POOL_MARKER: &str = "pool.json";
/// Marks a volume helper VM's dir: a restart removes it like a pool VM.
pub const HELPER_MARKER: &str = "helper.json";

/// How long a template's own process (e.g. the code interpreter with its Jupyter kernel) may take
/// to answer on its port, at least: far longer than the agent's boot under TCG on a busy host.
const TEMPLATE_START_LIMIT: Duration = Duration::from_secs(300);

/// What a launched VM is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Purpose {
    /// A tenant's sandbox: its network gets egress, and the runtime adopts it.
    Sandbox,
    /// A warm pool's VM: sealed (no egress until a claim attaches it), marked `pool.json`, kept
    /// out of the runtime's VMs.
    Pool,
    /// A volume's helper VM (`sandbox/volumes.rs`): sealed, marked `helper.json`, kept out of
    /// the runtime's VMs.
    Helper,
    /// The KVM probe at start: sealed, since the server's egress side is not up yet (and a probe
    /// needs none), and discarded once it answered.
    Probe,
}

/// Where a new VM comes from.
pub enum Source<'a> {
    Boot(&'a Template, Resources),
    /// A clone of a base snapshot of the template: its memory mapped privately, its frozen disk
    /// under a new overlay.
    BaseSnapshot {
        template: &'a Template,
        resources: Resources,
        memory: PathBuf,
        state: PathBuf,
        disk: PathBuf,
        cmdline: String,
    },
    /// A saved image's machine, as it was saved.
    Image {
        template: &'a str,
        template_digest: &'a str,
        resources: Resources,
        machine: &'a ResumeSpec,
        state: PathBuf,
    },
}

impl Source<'_> {
    fn doing(&self) -> &'static str {
        match self {
            Source::Boot(..) => "boot",
            _ => "restore",
        }
    }
}

/// What every launch needs. Shared (an `Arc`) by the layers above: whatever still runs in the
/// background (a base-snapshot build, a pool's refill) holds the data dir's lock through it.
pub struct Launcher {
    /// One runtime per data dir: a second one would adopt (and fight over) the same VMs.
    pub lock: FileLock,
    pub data: DataDir,
    pub templates: TemplateStore,
    pub vmm: Arc<dyn Vmm>,
    pub net: Option<Network>,
    pub boot_timeout: Duration,
}

impl Launcher {
    /// Start a VM for `id` from `source` (a boot, a base snapshot's restore, a saved image's
    /// restore) and give it its identity once the agent answers. The VM is in no map.
    pub async fn launch(
        &self,
        id: String,
        source: Source<'_>,
        accel: Accel,
        limit: Duration,
        purpose: Purpose,
        env: &BTreeMap<String, String>,
    ) -> Result<Arc<Vm>> {
        let dir = self.data.sandboxes().join(&id);
        // Not `create_dir_all`: an existing dir is a VM with this id still booting.
        std::fs::create_dir(&dir).map_err(|e| match e.kind() {
            std::io::ErrorKind::AlreadyExists => RuntimeError::SandboxIdTaken(id.clone()),
            _ => RuntimeError::io(&dir, e),
        })?;
        let (template, template_digest, resources, start) = match &source {
            Source::Boot(t, r) => (&*t.manifest.name, &*t.manifest.digest, *r, StartKind::Boot),
            Source::BaseSnapshot {
                template: t, resources, ..
            } => (
                &*t.manifest.name,
                &*t.manifest.digest,
                *resources,
                StartKind::BaseSnapshot,
            ),
            Source::Image {
                template,
                template_digest,
                resources,
                ..
            } => (*template, *template_digest, *resources, StartKind::Image),
        };
        let mut record = VmRecord {
            id: id.clone(),
            template: template.to_string(),
            template_digest: template_digest.to_string(),
            runtime: self.vmm.name().into(),
            accel,
            resources,
            created_at: humantime::format_rfc3339_millis(SystemTime::now()).to_string(),
            start,
            start_ms: 0,
            machine_id: random_hex(16),
            machine: None,
            run: random_hex(8),
            volumes: Vec::new(),
        };
        let mut link = None;
        let started = Instant::now();
        let result = async {
            let spec = machine(&id, &dir, &source, accel, &mut record);
            match purpose {
                Purpose::Pool => write_atomic(&dir.join(POOL_MARKER), b"{}")?,
                Purpose::Helper => write_atomic(&dir.join(HELPER_MARKER), b"{}")?,
                Purpose::Sandbox | Purpose::Probe => {}
            }
            record.write(&dir)?;
            let vm = self.start_vm(&id, &dir, spec, &mut link, purpose != Purpose::Sandbox).await?;
            let vmm_ms = started.elapsed().as_millis();
            let ready = async {
                if !matches!(source, Source::Boot(..)) {
                    self.snapshotting("restore")?.complete_restore(&vm, SAVE_LIMIT).await?;
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
            ready_or_died(&id, &vm, source.doing(), ready)
                .await
                .map(|client| (vm, client))
        }
        .await;
        match result {
            Ok((vm, client)) => {
                record.start_ms = started.elapsed().as_millis() as u64;
                let _ = record.write(&dir);
                Ok(Vm::new(record, vm, link, Some(client), false))
            }
            Err(e) => {
                if let Some(vm) = VmHandle::load(&dir) {
                    let _ = self.vmm.stop(&vm, Duration::from_secs(2)).await;
                }
                self.remove_network(link.as_ref()).await;
                let _ = self.discard(&id, &dir);
                Err(e)
            }
        }
    }

    /// Give `spec` its network (recorded in `dir`) and start its VMM. A sealed VM (a pool's, a
    /// probe, a base snapshot's builder) gets the NIC but no egress.
    pub async fn start_vm(
        &self,
        id: &str,
        dir: &Path,
        mut spec: VmSpec,
        link: &mut Option<SandboxLink>,
        sealed: bool,
    ) -> Result<VmHandle> {
        if let Some(net) = &self.net {
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
        self.vmm.start(&spec).await
    }

    /// The VMM's snapshot capability, for `what` (an error naming it where the VMM has none).
    pub fn snapshotting(&self, what: &str) -> Result<&dyn Snapshotting> {
        self.vmm.snapshotting().ok_or_else(|| RuntimeError::ControlCommand {
            command: what.into(),
            reason: format!("this VMM cannot {what}"),
        })
    }

    /// Remove VM `id` whose VMM is gone: its dir, and what the driver held for it outside.
    pub fn discard(&self, id: &str, dir: &Path) -> std::io::Result<()> {
        self.vmm.release(id);
        match std::fs::remove_dir_all(dir) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        }
    }

    pub async fn remove_network(&self, link: Option<&SandboxLink>) {
        if let (Some(net), Some(link)) = (&self.net, link) {
            net.remove(link).await;
        }
    }

    /// Stop `vm` if it still runs (a leftover: not asked to wait long).
    pub async fn stop_if_running(&self, vm: Option<VmHandle>) {
        if let Some(vm) = vm.filter(|vm| self.vmm.is_running(vm)) {
            let _ = self.vmm.stop(&vm, Duration::from_secs(2)).await;
        }
    }

    /// Stop a VM that never became a sandbox (a pool VM, a probe) and remove all it had.
    pub async fn discard_unadopted(&self, vm: &Vm) {
        let _ = self.vmm.stop(&vm.handle, Duration::from_secs(2)).await;
        self.remove_network(vm.net.as_ref()).await;
        let _ = self.discard(vm.id(), &vm.handle.dir);
    }
}

/// The machine VM `id` runs as when started from `source`, recorded in `record` (what a resume
/// starts again). Its own links to the files it runs on (`held/`): a suspended VM resumes on
/// them even after its template is rebuilt, its base snapshot pruned or its image deleted.
fn machine(id: &str, dir: &Path, source: &Source<'_>, accel: Accel, record: &mut VmRecord) -> VmSpec {
    let (kernel, initrd, rootfs) = match source {
        Source::Boot(t, _) | Source::BaseSnapshot { template: t, .. } => (t.kernel(), t.initrd(), t.rootfs()),
        Source::Image { machine: m, .. } => (m.kernel.clone(), m.initrd.clone(), m.rootfs.clone()),
    };
    let files = [
        hold(dir, "kernel", &kernel),
        hold(dir, "initrd", &initrd),
        hold(dir, "rootfs", &rootfs),
    ];
    let mut spec = VmSpec::new(id, dir.to_path_buf(), files, record.resources, accel);
    // A machine saved before volumes existed resumes as it was: without their controller.
    spec.volume_bus = match source {
        Source::Image { machine: m, .. } => m.volume_bus,
        _ => true,
    };
    let (cmdline, memory_backend, layers) = match source {
        Source::Boot(..) => (crate::vmm::qemu::kernel_cmdline(id), false, vec![]),
        Source::BaseSnapshot {
            memory,
            state,
            disk,
            cmdline,
            ..
        } => {
            let disk = hold(dir, "frozen-disk.qcow2", disk);
            spec.snapshot = Some(SnapshotRole::Clone {
                memory: memory.clone(),
                state: state.clone(),
                disk: disk.clone(),
                cmdline: cmdline.clone(),
            });
            (cmdline.clone(), true, vec![disk])
        }
        Source::Image { machine: m, .. } => {
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
        volume_bus: spec.volume_bus,
    };
    if let Source::Image { state, .. } = source {
        spec.snapshot = Some(SnapshotRole::Resume {
            state: state.clone(),
            resume: machine.clone(),
            new_overlay: true,
        });
    }
    record.machine = Some(machine);
    spec
}

/// `ready` (its agent answering), unless the VMM exits first; a failure names the `stage` the
/// VM was at (boot, restore, resume) and carries the console's tail and the cause.
pub async fn ready_or_died(
    id: &str,
    vm: &VmHandle,
    stage: &'static str,
    ready: impl std::future::Future<Output = Result<AgentClient>>,
) -> Result<AgentClient> {
    let died = async { while !wait_exit(vm.pid, Duration::from_secs(3600)).await {} };
    let failed = |cause: Option<RuntimeError>| RuntimeError::BootFailed {
        id: id.to_string(),
        stage,
        console: vm.console_tail(12),
        cause: cause.map(Box::new),
    };
    tokio::select! {
        r = ready => r.map_err(|e| failed(Some(e))),
        _ = died => Err(failed(None)),
    }
}

/// Run a template's start process and wait until it is ready: its port accepts connections,
/// or its ready command exits 0 (polled every second, as a built template's check is).
pub async fn start_template_process(client: &AgentClient, start: &StartSpec, limit: Duration) -> Result<()> {
    let limit = limit.max(TEMPLATE_START_LIMIT);
    let spec = ProcessSpec {
        argv: start.argv.clone(),
        user: Some(start.user.clone()),
        cwd: start.cwd.clone(),
        env: start.env.clone(),
        tag: Some("airlock-template-start".into()),
        ..Default::default()
    };
    let info = client.spawn(&spec).await?;
    let deadline = Instant::now() + limit;
    loop {
        if ready(client, start).await {
            return Ok(());
        }
        let p = client.process(info.id).await?;
        // A start command that ends well (`echo`) leaves the ready check to decide.
        let failed =
            p.state == airlock_proto::ProcessState::Exited && p.exit.as_ref().is_none_or(|e| e.exit_code != Some(0));
        if failed || (p.state == airlock_proto::ProcessState::Exited && start.ready_cmd.is_none()) {
            let out = process_output(client, info.id).await;
            return Err(RuntimeError::TemplateStart {
                argv: start.argv.clone(),
                output: out,
            });
        }
        if Instant::now() > deadline {
            return Err(match &start.ready_cmd {
                Some(cmd) => RuntimeError::TemplateStart {
                    argv: start.argv.clone(),
                    output: format!("the ready command {cmd:?} did not succeed within {} s", limit.as_secs()),
                },
                None => RuntimeError::PortNotReady {
                    port: start.ready_port,
                    waited_ms: limit.as_millis() as u64,
                },
            });
        }
        let pause = if start.ready_cmd.is_some() { 1000 } else { 100 };
        tokio::time::sleep(Duration::from_millis(pause)).await;
    }
}

/// Run, once before a base snapshot is saved, what a sandbox's first terminal and command run:
/// a login shell of `user` on a PTY. What it reads (bash, its libraries, the profile scripts) is
/// then in the snapshot's page cache rather than on the disk: under TCG a restored sandbox's
/// first PTY printed its prompt 0.50 s after the create call without this, 0.33 s with (a later
/// PTY: 0.08 s). Best effort: a template without bash or `user` goes without.
pub async fn warm_first_shell(client: &AgentClient) {
    let spec = ProcessSpec {
        argv: ["/bin/bash", "-i", "-l", "-c", "true"].map(String::from).to_vec(),
        user: Some("user".into()),
        pty: Some(airlock_proto::PtySize { cols: 80, rows: 24 }),
        timeout_ms: Some(WARM_UP_LIMIT.as_millis() as u64),
        tag: Some("airlock-warm-up".into()),
        ..Default::default()
    };
    let Ok(info) = client.spawn(&spec).await else {
        return;
    };
    let _ = tokio::time::timeout(WARM_UP_LIMIT, exit_of(client, info.id)).await;
}

/// How long the warm-up shell may take before the snapshot is saved without it done.
const WARM_UP_LIMIT: Duration = Duration::from_secs(10);

/// Whether `start`'s ready check passes now.
async fn ready(client: &AgentClient, start: &StartSpec) -> bool {
    let Some(cmd) = &start.ready_cmd else {
        return start.ready_port == 0 || client.tunnel(start.ready_port).await.is_ok();
    };
    let spec = ProcessSpec {
        argv: vec!["/bin/bash".into(), "-l".into(), "-c".into(), cmd.clone()],
        user: Some(start.user.clone()),
        cwd: start.cwd.clone(),
        env: start.env.clone(),
        timeout_ms: Some(30_000),
        ..Default::default()
    };
    let Ok(info) = client.spawn(&spec).await else {
        return false;
    };
    exit_of(client, info.id)
        .await
        .is_some_and(|status| status.exit_code == Some(0))
}

/// How process `id` ended, read from its events; none when they break off first.
async fn exit_of(client: &AgentClient, id: u64) -> Option<airlock_proto::ExitStatus> {
    let mut events = Box::pin(client.events(id, 0).await.ok()?);
    while let Some(Ok(ev)) = events.next().await {
        if let EventKind::Exit(status) = ev.kind {
            return Some(status);
        }
    }
    None
}

/// The last 2000 bytes process `id` wrote.
async fn process_output(client: &AgentClient, id: u64) -> String {
    let mut out = Vec::new();
    if let Ok(events) = client.events(id, 0).await {
        let mut events = Box::pin(events);
        while let Some(Ok(ev)) = events.next().await {
            if let EventKind::Stdout(b) | EventKind::Stderr(b) = ev.kind {
                out.extend_from_slice(&b);
                if out.len() > 64 * 1024 {
                    out.drain(..out.len() - 2000);
                }
            }
        }
    }
    String::from_utf8_lossy(&out[out.len().saturating_sub(2000)..]).to_string()
}

/// The resources a VM of `template` gets: its disk at least the template's image.
pub fn shape(template: &Template, resources: Resources) -> Resources {
    let min_disk = template.manifest.rootfs_bytes.div_ceil(1 << 20) as u32;
    Resources {
        disk_mib: resources.disk_mib.max(min_disk),
        ..resources
    }
}
