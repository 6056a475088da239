//! QEMU `microvm` driver.
//!
//! One QEMU process per sandbox, daemonized so it outlives the airlock process; the guest agent
//! is reached through a virtio-serial port backed by a unix socket in the sandbox dir, and QEMU
//! itself through QMP on another socket there. The root disk is a qcow2 overlay on the
//! template's ext4 image, sized to `disk_mib`.

use super::qmp::Qmp;
use crate::error::{Result, RuntimeError};
use crate::jail::{Jailer, Limits};
use crate::vmm::{
    kill_and_wait, pid_alive, reap, wait_exit, Accel, Hotplug, SnapshotRole, Snapshotting, VmHandle, VmSpec, Vmm,
    VolumeDisk,
};
use async_trait::async_trait;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tokio::process::Command;

pub const QEMU_BINARY: &str = "qemu-system-x86_64";
/// QEMU's `-sandbox` option: its seccomp filter, with every optional deny on. `spawn=deny`
/// forbids fork/exec, which is why QEMU is started directly in its own session rather than with
/// `-daemonize`.
pub const SANDBOX: &str = "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny";
/// Longest unix socket path the kernel accepts (sun_path is 108 bytes with the NUL).
const MAX_SOCKET_PATH: usize = 107;
/// The VM's writable disk in its dir: a qcow2 overlay on the template's image (or a chain).
const OVERLAY_FILE: &str = "disk.qcow2";

#[derive(Debug, Clone)]
pub struct QemuVmm {
    binary: PathBuf,
    /// Every VM's QEMU runs in a jail from here (see `jail.rs`); set by the runtime, which
    /// knows the data dir.
    jailer: Option<Arc<Jailer>>,
}

impl QemuVmm {
    /// Find QEMU on PATH (or `AIRLOCK_QEMU`), with a clear error when it is missing.
    pub fn locate(explicit: Option<&Path>) -> Result<Self> {
        let name = match explicit {
            Some(p) => p.display().to_string(),
            None => std::env::var("AIRLOCK_QEMU").unwrap_or_else(|_| QEMU_BINARY.to_string()),
        };
        let binary = if name.contains('/') {
            Some(PathBuf::from(&name)).filter(|p| p.is_file())
        } else {
            std::env::var_os("PATH")
                .map(|paths| {
                    std::env::split_paths(&paths)
                        .map(|d| d.join(&name))
                        .find(|p| p.is_file())
                })
                .unwrap_or_default()
        };
        binary
            .map(|binary| Self { binary, jailer: None })
            .ok_or(RuntimeError::QemuMissing(name))
    }

    /// Run every VM this driver starts in `jailer`'s jails.
    pub fn with_jailer(self, jailer: Arc<Jailer>) -> Self {
        Self {
            jailer: Some(jailer),
            ..self
        }
    }

    pub fn binary(&self) -> &Path {
        &self.binary
    }

    /// The full QEMU argument list for `spec`, its files reached as `attach` says; shared with
    /// the benchmark so "raw QEMU" boots exactly the same machine.
    pub fn args(spec: &VmSpec, attach: &Attach) -> Vec<String> {
        let (accel, cpu) = match spec.accel {
            Accel::Kvm => ("kvm".to_string(), "host"),
            Accel::Tcg => (format!("tcg,tb-size={}", crate::jail::TCG_TB_MIB), "max"),
        };
        let cmdline = match &spec.snapshot {
            Some(role) => role.cmdline().to_string(),
            None => kernel_cmdline(&spec.id),
        };
        let machine = match &attach.memory {
            Some(_) => "microvm,rtc=on,memory-backend=mem",
            None => "microvm,rtc=on",
        };
        let mut args: Vec<String> = vec![
            "-M".into(),
            machine.into(),
            "-accel".into(),
            accel,
            "-cpu".into(),
            cpu.into(),
            "-smp".into(),
            spec.vcpu.to_string(),
            "-m".into(),
            format!("{}M", spec.memory_mib),
            "-nodefaults".into(),
            "-no-user-config".into(),
            "-display".into(),
            "none".into(),
            "-no-reboot".into(),
            // Names the sandbox dir, so `is_running` can tell this VM from a reused pid.
            "-name".into(),
            vm_name(&spec.dir),
            // QEMU's own seccomp filter (Seccomp: 2 in /proc/<pid>/status): a guest that breaks
            // out into QEMU cannot use obsolete syscalls, setuid, fork/exec, or change
            // scheduling/affinity. airlock needs none of them (no `exec:` migration, no helpers).
            "-sandbox".into(),
            SANDBOX.into(),
        ];
        args.extend(attach.fd_sets.iter().cloned());
        if let Some(memory) = &attach.memory {
            args.extend(["-object".into(), memory.clone()]);
        }
        args.extend([
            "-kernel".into(),
            attach.kernel.clone(),
            "-initrd".into(),
            attach.initrd.clone(),
            "-append".into(),
            cmdline,
            "-drive".into(),
            format!("id=root,{},format=qcow2,if=none,discard=unmap", attach.disk),
            "-device".into(),
            "virtio-blk-device,drive=root".into(),
            "-device".into(),
            "virtio-serial-device".into(),
            "-chardev".into(),
            format!("socket,id=agent,{},server=on,wait=off", attach.agent),
            "-device".into(),
            format!("virtserialport,chardev=agent,name={}", airlock_proto::AGENT_PORT_NAME),
            "-device".into(),
            "virtio-rng-device".into(),
        ]);
        if spec.volume_bus {
            args.extend(["-device".into(), format!("virtio-scsi-device,id={VOLUME_BUS}")]);
        }
        for (disk, file) in spec.volumes.iter().zip(&attach.volumes) {
            args.extend([
                "-blockdev".into(),
                volume_blockdev(disk, file),
                "-device".into(),
                volume_device(disk),
            ]);
        }
        args.extend([
            "-chardev".into(),
            // append=on (O_APPEND): the runtime keeps the log under its cap by truncating it
            // (`vmm::trim_console`), and QEMU's next write then starts the file over.
            format!("file,id=console,path={},append=on", attach.console),
            "-serial".into(),
            "chardev:console".into(),
            "-chardev".into(),
            format!("socket,id=qmp,{},server=on,wait=off", attach.qmp),
            "-mon".into(),
            "chardev=qmp,mode=control".into(),
        ]);
        if let Some(netdev) = &attach.netdev {
            // The NIC: virtio-net on the tap the runtime opened (no vhost-net here).
            let mac = spec
                .network
                .as_ref()
                .map_or(airlock_proto::net::GUEST_MAC, |n| n.mac.as_str());
            args.extend([
                "-netdev".into(),
                format!("{netdev},id=net0"),
                "-device".into(),
                format!("virtio-net-device,netdev=net0,mac={mac}"),
            ]);
        }
        if spec.snapshot.as_ref().is_some_and(SnapshotRole::is_incoming) {
            // Wait for `complete_restore` to load the state (capabilities must be set first).
            args.extend(["-incoming".into(), "defer".into()]);
        }
        args
    }
}

/// How QEMU reaches a VM's files. Jailed, it opens nothing by path that the server has not
/// handed it as an fd ([`Attach::handed`]); the benchmark's raw QEMU uses paths.
#[derive(Debug, Clone)]
pub struct Attach {
    kernel: String,
    initrd: String,
    /// `-drive` options naming the overlay (and its backing image).
    disk: String,
    /// `-chardev socket` options of the agent's channel and of QMP.
    agent: String,
    qmp: String,
    console: String,
    /// `-add-fd` arguments.
    fd_sets: Vec<String>,
    /// The NIC's `-netdev` backend: the tap the runtime made in the sandbox's namespace.
    netdev: Option<String>,
    /// `-object memory-backend-file,...`: guest RAM in a file (base snapshots).
    memory: Option<String>,
    /// Each of the spec's volumes' file, as QEMU reaches it (`/dev/fdset/N` or a path).
    volumes: Vec<String>,
}

/// The id of every VM's volume controller (its SCSI bus is `vols.0`).
const VOLUME_BUS: &str = "vols";

/// A volume's `-blockdev`/`blockdev-add` options, `file` being how QEMU reaches it. Locking
/// is off like the root disk's: the runtime decides who may have a volume, and the fd it hands
/// is the VM's for its life.
fn volume_blockdev(disk: &VolumeDisk, file: &str) -> String {
    format!(
        "driver=raw,node-name=vol{},read-only={},discard=unmap,file.driver=file,file.filename={},file.locking=off",
        disk.slot,
        if disk.read_only { "on" } else { "off" },
        opt_value(file)
    )
}

/// A volume's `scsi-hd`, in its own target; the serial is how the guest's agent finds it.
fn volume_device(disk: &VolumeDisk) -> String {
    format!(
        "scsi-hd,id=vold{slot},drive=vol{slot},bus={VOLUME_BUS}.0,scsi-id={slot},lun=0,serial={}",
        disk.serial,
        slot = disk.slot
    )
}

/// The fd set holding a snapshot's device-state file (`file:/dev/fdset/4` in QMP's migrate).
const STATE_FD_SET: u32 = 4;
/// The fd set holding a snapshot's frozen disk, the backing of a clone's overlay.
const FROZEN_DISK_FD_SET: u32 = 5;
/// The fd set a running VM is handed its save target in (`add-fd`, then `file:/dev/fdset/6`).
const SAVE_FD_SET: u32 = 6;
/// The first fd set of a saved VM's frozen layers below the nearest ([`FROZEN_DISK_FD_SET`]).
const MORE_LAYERS_FD_SET: u32 = 10;
/// The fd set of the volume in slot N is this plus N (on the command line or hot-plugged).
const VOLUME_FD_SET: u32 = 40;

impl Attach {
    /// The same machine with a NIC on `netdev` (a `-netdev` backend without its id): a raw VM
    /// restoring a snapshot saved with a NIC needs one (a tap: the device state has a vnet header).
    pub fn with_netdev(self, netdev: &str) -> Self {
        Self {
            netdev: Some(netdev.to_string()),
            ..self
        }
    }

    /// Every file by its path (a clone's overlay names its backing chain itself; its device
    /// state is loaded by the caller, `migrate-incoming file:<state>`).
    pub fn paths(overlay: &Path, agent: &Path, qmp: &Path, console: &Path, spec: &VmSpec) -> Self {
        let p = |p: &Path| opt_value(&p.display().to_string());
        let memory = match &spec.snapshot {
            Some(SnapshotRole::Clone { memory, .. }) => Some(format!(
                "memory-backend-file,id=mem,size={}M,mem-path={},readonly=on,rom=off,share=off",
                spec.memory_mib,
                p(memory)
            )),
            Some(SnapshotRole::Builder { memory, .. }) => Some(format!(
                "memory-backend-file,id=mem,size={}M,mem-path={},share=on",
                spec.memory_mib,
                p(memory)
            )),
            Some(SnapshotRole::Resume { resume, .. }) => resume.memory_backend.then(|| ram_backend(spec)),
            None => None,
        };
        Self {
            kernel: p(&spec.kernel),
            initrd: p(&spec.initrd),
            disk: format!("file={}", p(overlay)),
            agent: format!("path={}", p(agent)),
            qmp: format!("path={}", p(qmp)),
            console: p(console),
            fd_sets: vec![],
            netdev: None,
            memory,
            volumes: spec.volumes.iter().map(|v| v.path.display().to_string()).collect(),
        }
    }

    /// Every file through an fd the jail hands QEMU: the kernel and initramfs read through
    /// `/proc/self/fd` (world-readable blobs), the disks and console as QEMU fd sets (the
    /// overlay is the server's, 0600), the sockets already bound and listening.
    fn handed(spec: &VmSpec, files: &VmFiles, jail: &mut crate::jail::Prepared) -> Result<Self> {
        let open = |path: &Path, opts: &mut std::fs::OpenOptions| -> Result<std::os::fd::OwnedFd> {
            opts.open(path).map(Into::into).map_err(|e| RuntimeError::io(path, e))
        };
        let ro = || {
            let mut o = std::fs::OpenOptions::new();
            o.read(true);
            o
        };
        let mut rw = std::fs::OpenOptions::new();
        rw.read(true).write(true);
        let mut append = std::fs::OpenOptions::new();
        append.append(true);
        let kernel = jail.pass(open(&spec.kernel, &mut ro())?)?;
        let initrd = jail.pass(open(&spec.initrd, &mut ro())?)?;
        let backing = jail.pass(open(&spec.rootfs, &mut ro())?)?;
        // QEMU opens an image read-only before it reopens it for writing: the set holds both.
        let disk_rw = jail.pass(open(&files.overlay, &mut rw)?)?;
        let disk_ro = jail.pass(open(&files.overlay, &mut ro())?)?;
        let console = jail.pass(open(&files.console, &mut append)?)?;
        let listen = |path: &Path| -> Result<std::os::fd::OwnedFd> {
            std::os::unix::net::UnixListener::bind(path)
                .map(Into::into)
                .map_err(|e| RuntimeError::io(path, e))
        };
        let agent = jail.pass(listen(&files.agent_socket)?)?;
        let qmp = jail.pass(listen(&files.qmp_socket)?)?;
        let netdev = match &spec.network {
            Some(net) => {
                let own = net.tap.try_clone().map_err(|e| RuntimeError::io("tap", e))?;
                Some(format!("tap,fd={},vhost=off", jail.pass(own)?))
            }
            None => None,
        };
        let set = |fd: i32, set: u32| vec!["-add-fd".to_string(), format!("fd={fd},set={set}")];
        let mut fd_sets = [set(backing, 1), set(disk_rw, 2), set(disk_ro, 2), set(console, 3)].concat();
        let mut volumes = Vec::new();
        for v in &spec.volumes {
            let n = VOLUME_FD_SET + v.slot;
            fd_sets.extend(set(jail.pass(open(&v.path, &mut ro())?)?, n));
            if !v.read_only {
                fd_sets.extend(set(jail.pass(open(&v.path, &mut rw.clone())?)?, n));
            }
            volumes.push(format!("/dev/fdset/{n}"));
        }
        // The overlay's header names its backing by path, which the jailed QEMU cannot reach: the
        // chain is given here instead (a clone's: overlay -> frozen snapshot disk -> template).
        let mut disk = disk_chain(&[]);
        // Guest RAM: QEMU opens a memory file only by path; `/proc/self/fd/N` reopens the fd it
        // was handed, checking the file's own mode, never the (private) directories above it.
        let memory = match &spec.snapshot {
            None => None,
            Some(SnapshotRole::Builder { memory, state, .. }) => {
                let mem = jail.pass(open(memory, &mut rw)?)?;
                let mut wo = std::fs::OpenOptions::new();
                // Write-only: QEMU finds the fd in the set by its access mode.
                wo.write(true).create(true).truncate(true);
                fd_sets.extend(set(jail.pass(open(state, &mut wo)?)?, STATE_FD_SET));
                Some(format!(
                    "memory-backend-file,id=mem,size={}M,mem-path=/proc/self/fd/{mem},share=on",
                    spec.memory_mib
                ))
            }
            Some(SnapshotRole::Clone {
                memory,
                state,
                disk: frozen,
                ..
            }) => {
                let mem = jail.pass(open(memory, &mut ro())?)?;
                fd_sets.extend(set(jail.pass(open(state, &mut ro())?)?, STATE_FD_SET));
                fd_sets.extend(set(jail.pass(open(frozen, &mut ro())?)?, FROZEN_DISK_FD_SET));
                disk = disk_chain(&[FROZEN_DISK_FD_SET]);
                // Read-only file, private writable mapping: every clone shares the snapshot's
                // pages until it writes one, and none can change the file.
                Some(format!(
                    "memory-backend-file,id=mem,size={}M,mem-path=/proc/self/fd/{mem},readonly=on,rom=off,share=off",
                    spec.memory_mib
                ))
            }
            Some(SnapshotRole::Resume { state, resume, .. }) => {
                fd_sets.extend(set(jail.pass(open(state, &mut ro())?)?, STATE_FD_SET));
                let mut sets = Vec::new();
                for (i, layer) in resume.layers.iter().enumerate() {
                    let n = if i == 0 {
                        FROZEN_DISK_FD_SET
                    } else {
                        MORE_LAYERS_FD_SET + i as u32 - 1
                    };
                    fd_sets.extend(set(jail.pass(open(layer, &mut ro())?)?, n));
                    sets.push(n);
                }
                disk = disk_chain(&sets);
                // The saved state holds all of RAM: plain anonymous memory takes it.
                resume.memory_backend.then(|| ram_backend(spec))
            }
        };
        Ok(Self {
            kernel: format!("/proc/self/fd/{kernel}"),
            initrd: format!("/proc/self/fd/{initrd}"),
            disk,
            agent: format!("fd={agent}"),
            qmp: format!("fd={qmp}"),
            console: "/dev/fdset/3".into(),
            fd_sets,
            netdev,
            memory,
            volumes,
        })
    }
}

/// The `-drive` file options of the overlay (fd set 2) over the qcow2 `layers` (fd sets,
/// nearest first) over the template's raw image (fd set 1): a jailed QEMU cannot follow the
/// backing paths in the images' headers, so the chain is spelled out.
///
/// Image locking is off: the fds of a set stay open for the VM's life, so the lock of a
/// read-only fd QEMU once used would outlive its use and refuse the write lock when the VM
/// runs again after a save (`cont` after `migrate`). Each overlay is its one VM's by
/// construction (the runtime's dir and jail), which is what the lock would guard.
fn disk_chain(layers: &[u32]) -> String {
    let mut chain = "file.filename=/dev/fdset/2,file.locking=off".to_string();
    let mut at = "backing.".to_string();
    for set in layers {
        chain.push_str(&format!(
            ",{at}driver=qcow2,{at}file.filename=/dev/fdset/{set},{at}file.locking=off"
        ));
        at.push_str("backing.");
    }
    chain.push_str(&format!(
        ",{at}driver=raw,{at}file.filename=/dev/fdset/1,{at}file.locking=off"
    ));
    chain
}

/// Guest RAM as anonymous memory under the name a base snapshot's clone had (`mem`).
fn ram_backend(spec: &VmSpec) -> String {
    format!("memory-backend-ram,id=mem,size={}M", spec.memory_mib)
}

/// A value inside QEMU's comma-separated options (`,` is written `,,`).
fn opt_value(s: &str) -> String {
    s.replace(',', ",,")
}

fn vm_name(dir: &Path) -> String {
    opt_value(&format!("airlock:{}", dir.display()))
}

/// The files of one VM in its sandbox dir.
struct VmFiles {
    overlay: PathBuf,
    agent_socket: PathBuf,
    qmp_socket: PathBuf,
    console: PathBuf,
}

impl QemuVmm {
    async fn qmp(&self, vm: &VmHandle, cmd: &str) -> Result<serde_json::Value> {
        self.qmp_args(vm, cmd, None).await
    }

    async fn qmp_with(&self, vm: &VmHandle, cmd: &str, args: serde_json::Value) -> Result<serde_json::Value> {
        self.qmp_args(vm, cmd, Some(args)).await
    }

    async fn qmp_args(&self, vm: &VmHandle, cmd: &str, args: Option<serde_json::Value>) -> Result<serde_json::Value> {
        let run = async {
            let mut qmp = Qmp::connect(&vm.control_socket).await?;
            qmp.execute(cmd, args).await
        };
        tokio::time::timeout(Duration::from_secs(10), run)
            .await
            .map_err(|_| RuntimeError::ControlCommand {
                command: cmd.into(),
                reason: "QMP gave no answer in 10s".into(),
            })?
            .map_err(|e| RuntimeError::ControlCommand {
                command: cmd.into(),
                reason: format!("QMP: {e}"),
            })
    }
}

/// Supplementary groups the VMM keeps: the accelerator device's (`/dev/kvm` is usually
/// `root:kvm 0660`).
fn device_groups(accel: Accel) -> Vec<u32> {
    match accel {
        Accel::Kvm => std::fs::metadata("/dev/kvm")
            .map(|m| vec![std::os::unix::fs::MetadataExt::gid(&m)])
            .unwrap_or_default(),
        Accel::Tcg => vec![],
    }
}

/// Guest kernel command line. Under TCG, ~45% of boots hang in TSC calibration unless the
/// frequency is given (`tsc_early_khz`) and trusted (`tsc=reliable`).
pub fn kernel_cmdline(hostname: &str) -> String {
    // `cryptomgr.notests`: the crypto self-tests at boot were the slowest initcall under TCG
    // (~170 ms of ~1.1 s of kernel start; `boot-profile`). They test the kernel's own code, not
    // the machine, and the guest's kernel is the template's, unchanged.
    let mut c = String::from("console=ttyS0 quiet reboot=k panic=-1 rdinit=/init cryptomgr.notests");
    if let Some(khz) = host_tsc_khz() {
        c.push_str(&format!(" tsc_early_khz={khz} tsc=reliable"));
    }
    c.push_str(&format!(" airlock.hostname={hostname}"));
    c
}

fn host_tsc_khz() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/cpuinfo").ok()?;
    let mhz: f64 = info
        .lines()
        .find(|l| l.starts_with("cpu MHz"))?
        .split(':')
        .nth(1)?
        .trim()
        .parse()
        .ok()?;
    Some((mhz * 1000.0) as u64)
}

#[async_trait]
impl Vmm for QemuVmm {
    fn name(&self) -> &'static str {
        "qemu"
    }

    async fn start(&self, spec: &VmSpec) -> Result<VmHandle> {
        let jailer = self.jailer.as_ref().ok_or(crate::jail::JailError::NoJailer)?;
        let dir = &spec.dir;
        let files = VmFiles {
            overlay: dir.join(OVERLAY_FILE),
            agent_socket: dir.join("agent.sock"),
            qmp_socket: dir.join("qmp.sock"),
            console: dir.join("console.log"),
        };
        for s in [&files.agent_socket, &files.qmp_socket] {
            if s.as_os_str().len() > MAX_SOCKET_PATH {
                return Err(RuntimeError::DataDirNotWritable {
                    path: dir.display().to_string(),
                    reason: format!("socket path {} is longer than {MAX_SOCKET_PATH} bytes", s.display()),
                });
            }
        }
        // The guest's console can print secrets: only the server's user reads it.
        crate::datadir::create_private(&files.console).map_err(|e| RuntimeError::io(&files.console, e))?;
        for s in [&files.agent_socket, &files.qmp_socket] {
            // An earlier VMM's (a resumed VM is started again in its dir).
            let _ = std::fs::remove_file(s);
        }
        let (backing, backing_format) = match &spec.snapshot {
            Some(SnapshotRole::Clone { disk, .. }) => (disk, "qcow2"),
            Some(SnapshotRole::Resume { resume, .. }) if !resume.layers.is_empty() => (&resume.layers[0], "qcow2"),
            _ => (&spec.rootfs, "raw"),
        };
        let resuming = matches!(spec.snapshot, Some(SnapshotRole::Resume { new_overlay: false, .. }));
        // A resumed VM keeps its overlay: the disk it was suspended with.
        let out = if resuming {
            None
        } else {
            Some(
                Command::new("qemu-img")
                    .args(["create", "-q", "-u", "-f", "qcow2", "-F", backing_format, "-b"])
                    .arg(backing)
                    .arg(&files.overlay)
                    .arg(format!("{}M", spec.disk_mib))
                    .output()
                    .await
                    .map_err(|e| RuntimeError::QemuMissing(format!("qemu-img ({e})")))?,
            )
        };
        if let Some(out) = out.filter(|o| !o.status.success()) {
            return Err(RuntimeError::DiskCreate(format!(
                "qemu-img create: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            )));
        }

        let limits = Limits {
            memory_mib: spec.memory_mib as u64,
            vcpu: spec.vcpu,
        };
        let mut jail = jailer.prepare(&spec.id, dir, limits, device_groups(spec.accel))?;
        if matches!(spec.snapshot, Some(SnapshotRole::Builder { .. })) {
            jail = jail.with_writable_mounts().dying_with_parent();
        }
        let attach = Attach::handed(spec, &files, &mut jail)?;
        let args = Self::args(spec, &attach);
        let log = crate::datadir::create_private(&dir.join("qemu.log")).map_err(|e| RuntimeError::io(dir, e))?;
        let log_err = log.try_clone().map_err(|e| RuntimeError::io(dir, e))?;
        let mut cmd = std::process::Command::new(&self.binary);
        cmd.args(&args)
            .stdin(std::process::Stdio::null())
            .stdout(log)
            .stderr(log_err);
        // Not `-daemonize`: its intermediate processes would be left as zombies, and a direct
        // child can be reaped by pid when it exits. The jail puts it in its own session.
        let child = jail.spawn(cmd).map_err(|source| crate::jail::JailError::Spawn {
            binary: self.binary.clone(),
            source,
        })?;
        let pid = child.id();
        drop(child); // std does not wait on drop; `wait_exit` reaps it
        let handle = VmHandle {
            runtime: self.name().into(),
            pid,
            accel: spec.accel,
            dir: dir.clone(),
            agent_socket: files.agent_socket,
            control_socket: files.qmp_socket,
            console_log: files.console,
        };
        crate::datadir::write_atomic(
            &VmHandle::record_path(dir),
            &serde_json::to_vec_pretty(&handle).expect("serializable"),
        )?;
        Ok(handle)
    }

    async fn stop(&self, vm: &VmHandle, grace: Duration) -> Result<()> {
        if !self.is_running(vm) {
            reap(vm.pid);
            return Ok(());
        }
        let asked = async {
            let mut qmp = Qmp::connect(&vm.control_socket).await?;
            qmp.execute("quit", None).await
        };
        // QEMU may close the socket before answering `quit`; either way, watch the pid.
        let _ = tokio::time::timeout(grace, asked).await;
        if wait_exit(vm.pid, grace).await {
            return Ok(());
        }
        tracing::warn!(pid = vm.pid, "QEMU did not quit within {grace:?}; killing it");
        kill_and_wait(vm.pid).await
    }

    async fn pause(&self, vm: &VmHandle) -> Result<()> {
        self.qmp(vm, "stop").await.map(drop)
    }

    async fn resume(&self, vm: &VmHandle) -> Result<()> {
        self.qmp(vm, "cont").await.map(drop)
    }

    async fn is_paused(&self, vm: &VmHandle) -> Result<bool> {
        let status = self.qmp(vm, "query-status").await?;
        Ok(status["running"] == serde_json::Value::Bool(false))
    }

    fn is_running(&self, vm: &VmHandle) -> bool {
        if !pid_alive(vm.pid) {
            return false;
        }
        // Guard against pid reuse: the process must be QEMU running this sandbox.
        let cmdline = std::fs::read(format!("/proc/{}/cmdline", vm.pid)).unwrap_or_default();
        let name = vm_name(&vm.dir);
        cmdline.split(|b| *b == 0).any(|arg| arg == name.as_bytes())
    }

    fn release(&self, id: &str) {
        if let Some(jailer) = &self.jailer {
            jailer.release(id);
        }
    }

    fn sweep(&self, live: &std::collections::HashSet<String>) {
        if let Some(jailer) = &self.jailer {
            jailer.sweep(live);
        }
    }

    fn isolation(&self) -> Option<crate::jail::Isolation> {
        self.jailer.as_ref().map(|j| j.isolation())
    }

    fn snapshotting(&self) -> Option<&dyn Snapshotting> {
        Some(self)
    }

    fn hotplug(&self) -> Option<&dyn Hotplug> {
        Some(self)
    }

    async fn export_disk(&self, vm: &VmHandle, layers: &[PathBuf], rootfs: &Path, to: &Path) -> Result<()> {
        // The chain spelled out as the VM ran it; zeros stay holes, so the image is as sparse
        // as the disk.
        let overlay = vm.dir.join(OVERLAY_FILE);
        let file = |at: &str, path: &Path| {
            format!(
                "{at}file.driver=file,{at}file.filename={}",
                opt_value(&path.to_string_lossy())
            )
        };
        let mut opts = format!("driver=qcow2,{}", file("", &overlay));
        let mut at = "backing.".to_string();
        for layer in layers {
            opts.push_str(&format!(",{at}driver=qcow2,{}", file(&at, layer)));
            at.push_str("backing.");
        }
        opts.push_str(&format!(",{at}driver=raw,{}", file(&at, rootfs)));
        let out = Command::new("qemu-img")
            .args(["convert", "-q", "--image-opts", "-O", "raw"])
            .arg(&opts)
            .arg(to)
            .output()
            .await
            .map_err(|e| RuntimeError::QemuMissing(format!("qemu-img ({e})")))?;
        if !out.status.success() {
            return Err(RuntimeError::DiskCreate(format!(
                "qemu-img convert {}: {}",
                overlay.display(),
                String::from_utf8_lossy(&out.stderr).trim()
            )));
        }
        Ok(())
    }
}

impl QemuVmm {
    /// Run QMP commands in order on one connection, then wait until the migration they started
    /// (`migrate` or `migrate-incoming`) completes; all within `limit`.
    async fn migrate(&self, vm: &VmHandle, steps: &[(&str, Option<serde_json::Value>)], limit: Duration) -> Result<()> {
        let what = steps.iter().map(|(c, _)| *c).collect::<Vec<_>>().join(", ");
        let fail = |reason: String| RuntimeError::ControlCommand {
            command: what.clone(),
            reason,
        };
        let run = async {
            let mut qmp = Qmp::connect(&vm.control_socket)
                .await
                .map_err(|e| fail(format!("QMP: {e}")))?;
            qmp.execute(
                "migrate-set-capabilities",
                Some(serde_json::json!({"capabilities": [{"capability": "x-ignore-shared", "state": true}]})),
            )
            .await
            .map_err(|e| fail(e.to_string()))?;
            for (cmd, args) in steps {
                qmp.execute(cmd, args.clone()).await.map_err(|e| fail(e.to_string()))?;
            }
            loop {
                let status = qmp
                    .execute("query-migrate", None)
                    .await
                    .map_err(|e| fail(e.to_string()))?;
                match status["status"].as_str() {
                    Some("completed") => return Ok(qmp),
                    Some("failed") | Some("cancelled") => {
                        return Err(fail(format!(
                            "migration {}: {}",
                            status["status"], status["error-desc"]
                        )))
                    }
                    _ => tokio::time::sleep(Duration::from_millis(5)).await,
                }
            }
        };
        let mut qmp = tokio::time::timeout(limit, run)
            .await
            .map_err(|_| fail(format!("not done in {limit:?}")))??;
        if steps.iter().any(|(c, _)| *c == "migrate-incoming") {
            qmp.execute("cont", None)
                .await
                .map_err(|e| fail(format!("cont: {e}")))?;
        }
        Ok(())
    }
}

#[async_trait]
impl Hotplug for QemuVmm {
    async fn attach_disk(&self, vm: &VmHandle, disk: &VolumeDisk) -> Result<()> {
        use std::os::fd::AsFd;
        let fail = |reason: String| RuntimeError::ControlCommand {
            command: format!("attach volume {}", disk.serial),
            reason,
        };
        let mut opts = std::fs::OpenOptions::new();
        opts.read(true).write(!disk.read_only);
        let file = opts.open(&disk.path).map_err(|e| RuntimeError::io(&disk.path, e))?;
        let set = VOLUME_FD_SET + disk.slot;
        let blockdev: serde_json::Value = serde_json::json!({
            "driver": "raw",
            "node-name": format!("vol{}", disk.slot),
            "read-only": disk.read_only,
            "discard": "unmap",
            "file": {"driver": "file", "filename": format!("/dev/fdset/{set}"), "locking": "off"},
        });
        let device = serde_json::json!({
            "driver": "scsi-hd",
            "id": format!("vold{}", disk.slot),
            "drive": format!("vol{}", disk.slot),
            "bus": format!("{VOLUME_BUS}.0"),
            "scsi-id": disk.slot,
            "lun": 0,
            "serial": disk.serial,
        });
        let run = async {
            let mut qmp = Qmp::connect(&vm.control_socket).await?;
            qmp.execute_with_fd("add-fd", Some(serde_json::json!({"fdset-id": set})), file.as_fd())
                .await?;
            qmp.execute("blockdev-add", Some(blockdev)).await?;
            qmp.execute("device_add", Some(device)).await?;
            std::io::Result::Ok(())
        };
        tokio::time::timeout(Duration::from_secs(10), run)
            .await
            .map_err(|_| fail("QMP gave no answer in 10s".into()))?
            .map_err(|e| fail(e.to_string()))
    }
}

#[async_trait]
impl Snapshotting for QemuVmm {
    async fn save(&self, vm: &VmHandle, limit: Duration) -> Result<()> {
        let uri = serde_json::json!({"uri": format!("file:/dev/fdset/{STATE_FD_SET}")});
        self.migrate(vm, &[("stop", None), ("migrate", Some(uri))], limit)
            .await?;
        self.stop(vm, Duration::from_secs(5)).await
    }

    async fn save_state(&self, vm: &VmHandle, to: std::fs::File, limit: Duration) -> Result<bool> {
        use std::os::fd::AsFd;
        let fail = |reason: String| RuntimeError::ControlCommand {
            command: "save".into(),
            reason,
        };
        let handed = async {
            let mut qmp = Qmp::connect(&vm.control_socket).await?;
            let status = qmp.execute("query-status", None).await?;
            let args = serde_json::json!({"fdset-id": SAVE_FD_SET});
            qmp.execute_with_fd("add-fd", Some(args), to.as_fd()).await?;
            std::io::Result::Ok(status["running"] == serde_json::Value::Bool(true))
        };
        let was_running = tokio::time::timeout(Duration::from_secs(10), handed)
            .await
            .map_err(|_| fail("QMP gave no answer in 10s".into()))?
            .map_err(|e| fail(format!("QMP: {e}")))?;
        let uri = serde_json::json!({"uri": format!("file:/dev/fdset/{SAVE_FD_SET}")});
        let saved = self.migrate(vm, &[("stop", None), ("migrate", Some(uri))], limit).await;
        // The target leaves QEMU either way: a later save gets a fresh one.
        let _ = self
            .qmp_with(vm, "remove-fd", serde_json::json!({"fdset-id": SAVE_FD_SET}))
            .await;
        if saved.is_err() && was_running {
            let _ = self.qmp(vm, "cont").await;
        }
        saved.map(|()| was_running)
    }

    async fn complete_restore(&self, vm: &VmHandle, limit: Duration) -> Result<()> {
        let uri = serde_json::json!({"uri": format!("file:/dev/fdset/{STATE_FD_SET}")});
        self.migrate(vm, &[("migrate-incoming", Some(uri))], limit).await
    }

    fn build_id(&self) -> String {
        static VERSION: std::sync::OnceLock<String> = std::sync::OnceLock::new();
        VERSION
            .get_or_init(|| {
                let version = std::process::Command::new(&self.binary)
                    .arg("--version")
                    .output()
                    .map(|o| {
                        String::from_utf8_lossy(&o.stdout)
                            .lines()
                            .next()
                            .unwrap_or_default()
                            .to_string()
                    })
                    .unwrap_or_default();
                let size = std::fs::metadata(&self.binary).map(|m| m.len()).unwrap_or(0);
                format!("{version} ({} bytes)", size)
            })
            .clone()
    }
}
