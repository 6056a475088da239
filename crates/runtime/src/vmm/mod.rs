//! The VMM driver boundary: what the sandbox layer needs from a hypervisor.
//!
//! `qemu` (the `microvm` machine) is the driver today and `fake` (feature `fake`) an in-memory
//! test double; Firecracker plugs in behind the same trait. A driver starts a VM that outlives
//! the airlock process (so a restarted server can re-attach), and records what it needs to find
//! it again in the sandbox dir.

#[cfg(feature = "fake")]
pub mod fake;
pub mod qemu;
pub mod qmp;

use crate::error::{Result, RuntimeError};
use crate::template::{Template, TemplateManifest};
use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::time::Duration;

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Accel {
    Kvm,
    Tcg,
}

impl std::fmt::Display for Accel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Accel::Kvm => "kvm",
            Accel::Tcg => "tcg",
        })
    }
}

pub const MIN_MEMORY_MIB: u32 = 128;
pub const MAX_DISK_MIB: u32 = 1 << 20;

// A VM's shape; also the /v1 API's `Resources` (feature `openapi`; a doc comment here would
// become its schema's description).
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Resources {
    pub vcpu: u32,
    pub memory_mib: u32,
    pub disk_mib: u32,
}

impl Default for Resources {
    fn default() -> Self {
        Self {
            vcpu: 1,
            memory_mib: 512,
            disk_mib: 2048,
        }
    }
}

/// Free room past its template's image a sandbox's disk has when the create names no size.
pub const DISK_HEADROOM_MIB: u32 = 1024;

impl Resources {
    /// What a sandbox of `template` gets when the create names no shape: the defaults, with
    /// the template's own memory if it names one, and a disk past the template's image by
    /// [`DISK_HEADROOM_MIB`] where the default disk is too small for that (a 2.3 GiB code
    /// interpreter must not start full, or not at all).
    pub fn for_template(template: &TemplateManifest) -> Self {
        let defaults = Self::default();
        let image_mib = template.rootfs_bytes.div_ceil(1 << 20) as u32;
        Self {
            vcpu: defaults.vcpu,
            memory_mib: template.recipe.memory_mib.unwrap_or(defaults.memory_mib),
            disk_mib: defaults.disk_mib.max(image_mib.saturating_add(DISK_HEADROOM_MIB)),
        }
    }

    /// Check against the host and the template; the message names the field and the bound.
    pub fn validate(&self, template: &TemplateManifest) -> Result<()> {
        let host_cpus = std::thread::available_parallelism()
            .map(|n| n.get() as u32)
            .unwrap_or(1);
        let host_mem_mib = host_memory_mib().map_or(u32::MAX, |m| m as u32);
        let min_disk = template.rootfs_bytes.div_ceil(1 << 20) as u32;
        let bad = |m: String| Err(RuntimeError::InvalidResources(m));
        if self.vcpu == 0 || self.vcpu > host_cpus {
            return bad(format!(
                "vcpu must be between 1 and {host_cpus} (this host's CPUs), got {}",
                self.vcpu
            ));
        }
        if self.memory_mib < MIN_MEMORY_MIB {
            return bad(format!(
                "memory_mib must be at least {MIN_MEMORY_MIB} (the guest kernel needs it), got {}",
                self.memory_mib
            ));
        }
        if self.memory_mib > host_mem_mib {
            return bad(format!(
                "memory_mib must be at most {host_mem_mib} (this host's memory), got {}",
                self.memory_mib
            ));
        }
        if self.disk_mib < min_disk {
            return bad(format!(
                "disk_mib must be at least {min_disk} (the size of template {}'s image), got {}",
                template.name, self.disk_mib
            ));
        }
        if self.disk_mib > MAX_DISK_MIB {
            return bad(format!(
                "disk_mib must be at most {MAX_DISK_MIB}, got {}",
                self.disk_mib
            ));
        }
        Ok(())
    }
}

/// The host's memory (`MemTotal`), if /proc tells it.
pub fn host_memory_mib() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    info.lines()
        .find(|l| l.starts_with("MemTotal:"))
        .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        .map(|kib| kib / 1024)
}

/// What to boot.
#[derive(Debug, Clone)]
pub struct VmSpec {
    pub id: String,
    /// Sandbox dir: the overlay, sockets, pidfile and console log live here, and nowhere else.
    pub dir: PathBuf,
    pub kernel: PathBuf,
    pub initrd: PathBuf,
    /// Template root filesystem (read-only backing of the per-sandbox overlay).
    pub rootfs: PathBuf,
    pub vcpu: u32,
    pub memory_mib: u32,
    pub disk_mib: u32,
    pub accel: Accel,
    /// The VM's NIC, if it has one.
    pub network: Option<NetAttach>,
    /// Base snapshots (see `sandbox/base_snapshot.rs`): what makes this VM a snapshot's builder or clone.
    pub snapshot: Option<SnapshotRole>,
    /// The controller volumes are hot-plugged on ([`Hotplug`]). Every new machine has one; a
    /// machine saved before volumes existed resumes without.
    pub volume_bus: bool,
    /// Volumes attached from the start (a suspended VM's, resumed): on the controller in the
    /// slots they had.
    pub volumes: Vec<VolumeDisk>,
}

/// A volume's disk as a VM has it: a raw ext4 image on the host, a `scsi-hd` in the guest whose
/// serial is the volume's id (how the agent finds it), in its own SCSI target (`slot`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct VolumeDisk {
    pub serial: String,
    pub path: PathBuf,
    pub read_only: bool,
    pub slot: u32,
}

/// The most volumes one VM has (SCSI targets on its controller).
pub const MAX_VOLUMES: usize = 8;

/// What a VMM that can attach disks to a running VM offers (`Vmm::hotplug`).
#[async_trait]
pub trait Hotplug: Send + Sync {
    /// Attach `disk` to a running VM's volume controller; the guest sees a new disk.
    async fn attach_disk(&self, vm: &VmHandle, disk: &VolumeDisk) -> Result<()>;
}

/// A VM's part in a base snapshot. Builder and clones share every argument (a restore needs the
/// machine it was saved from), so both carry the snapshot's kernel command line.
#[derive(Debug, Clone)]
pub enum SnapshotRole {
    /// Boot with guest RAM in `memory` (shared, written through), ready for [`Snapshotting::save`]
    /// to write the device state to `state`.
    Builder {
        memory: PathBuf,
        state: PathBuf,
        cmdline: String,
    },
    /// Restore: RAM mapped privately (copy-on-write) from `memory`, the device state read from
    /// `state`, the disk an overlay on `disk` (the builder's, frozen at the save); then
    /// [`Snapshotting::complete_restore`].
    Clone {
        memory: PathBuf,
        state: PathBuf,
        disk: PathBuf,
        cmdline: String,
    },
    /// Start a saved VM again: the same machine (`resume.cmdline`, RAM in a memory backend when
    /// it had one), everything (RAM included) loaded from `state`, on its overlay as it was
    /// (a resume), or on a new overlay over `resume.layers` (a sandbox made from a saved image);
    /// then [`Snapshotting::complete_restore`].
    Resume {
        state: PathBuf,
        resume: ResumeSpec,
        new_overlay: bool,
    },
}

impl SnapshotRole {
    pub fn cmdline(&self) -> &str {
        match self {
            SnapshotRole::Builder { cmdline, .. } | SnapshotRole::Clone { cmdline, .. } => cmdline,
            SnapshotRole::Resume { resume, .. } => &resume.cmdline,
        }
    }

    /// Whether the VMM waits for a saved state before it runs (`-incoming`).
    pub fn is_incoming(&self) -> bool {
        matches!(self, SnapshotRole::Clone { .. } | SnapshotRole::Resume { .. })
    }
}

/// What a suspended VM needs to be started again as the same machine: recorded with its saved
/// state (`suspend.json` in its dir), so a resume also works after a server restart.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct ResumeSpec {
    pub cmdline: String,
    /// Its RAM was a memory backend (`id=mem`, a clone of a base snapshot): the saved RAM
    /// block has that name, so the resumed VM needs one too.
    pub memory_backend: bool,
    /// The frozen qcow2 disks its overlay sits on, nearest first (a base snapshot's, a saved
    /// image's), above the template's raw root filesystem.
    #[serde(default)]
    pub layers: Vec<PathBuf>,
    pub kernel: PathBuf,
    pub initrd: PathBuf,
    pub rootfs: PathBuf,
    /// It has a volume controller ([`VmSpec::volume_bus`]); false in machines saved before.
    #[serde(default)]
    pub volume_bus: bool,
}

/// What a VMM that can save and restore VMs offers (`Vmm::snapshotting`).
#[async_trait]
pub trait Snapshotting: Send + Sync {
    /// Stop a VM started as a [`SnapshotRole::Builder`], write its device state, and end it. Its
    /// memory file and disk are the rest of the snapshot.
    async fn save(&self, vm: &VmHandle, limit: Duration) -> Result<()>;
    /// Load the device state into a VM started as a [`SnapshotRole::Clone`] (or its whole
    /// state, started as [`SnapshotRole::Resume`]) and let it run.
    async fn complete_restore(&self, vm: &VmHandle, limit: Duration) -> Result<()>;
    /// Stop a running (or paused) VM (not a builder) and write its whole state (RAM, devices)
    /// to `to`, handed to the VMM now. The VM is left stopped, its disk images flushed, for the
    /// caller to copy them and then end it or let it go on ([`Vmm::resume`]). Returns whether it
    /// was running before.
    async fn save_state(&self, vm: &VmHandle, to: std::fs::File, limit: Duration) -> Result<bool>;
    /// Identifies the VMM build: a snapshot restores only into the VMM that saved it.
    fn build_id(&self) -> String;
}

/// A VM's NIC: a tap the runtime opened in the sandbox's network namespace, handed to the VMM
/// as an open fd (inherited at the same number), so the VMM needs neither the namespace nor
/// the privilege to open it.
#[derive(Debug, Clone)]
pub struct NetAttach {
    pub tap: std::sync::Arc<std::os::fd::OwnedFd>,
    /// The guest NIC's MAC.
    pub mac: String,
}

impl VmSpec {
    /// Boot `template` with `resources` in `dir`.
    pub fn for_template(id: &str, dir: PathBuf, template: &Template, resources: Resources, accel: Accel) -> Self {
        Self::new(
            id,
            dir,
            [template.kernel(), template.initrd(), template.rootfs()],
            resources,
            accel,
        )
    }

    /// A plain boot of `[kernel, initramfs, root filesystem]` with `resources` in `dir`.
    pub fn new(
        id: &str,
        dir: PathBuf,
        [kernel, initrd, rootfs]: [PathBuf; 3],
        resources: Resources,
        accel: Accel,
    ) -> Self {
        Self {
            id: id.to_string(),
            dir,
            kernel,
            initrd,
            rootfs,
            vcpu: resources.vcpu,
            memory_mib: resources.memory_mib,
            disk_mib: resources.disk_mib,
            accel,
            network: None,
            snapshot: None,
            volume_bus: true,
            volumes: Vec::new(),
        }
    }
}

/// A started VM, as recorded in `<dir>/vm.json`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct VmHandle {
    pub runtime: String,
    pub pid: u32,
    pub accel: Accel,
    pub dir: PathBuf,
    /// Byte stream to the guest agent.
    pub agent_socket: PathBuf,
    /// The VMM's own control socket (QMP for QEMU).
    pub control_socket: PathBuf,
    pub console_log: PathBuf,
}

impl VmHandle {
    pub fn record_path(dir: &Path) -> PathBuf {
        dir.join("vm.json")
    }
    pub fn load(dir: &Path) -> Option<Self> {
        serde_json::from_slice(&std::fs::read(Self::record_path(dir)).ok()?).ok()
    }
    /// A handle good enough to find and stop a VMM whose record was never written: from the
    /// pid its jailed child wrote before exec ([`crate::jail::PID_FILE`]).
    pub fn orphan(dir: &Path, runtime: &str) -> Option<Self> {
        let pid = std::fs::read_to_string(dir.join(crate::jail::PID_FILE))
            .ok()?
            .trim()
            .parse()
            .ok()?;
        Some(Self {
            runtime: runtime.into(),
            pid,
            accel: Accel::Tcg,
            dir: dir.to_path_buf(),
            agent_socket: dir.join("agent.sock"),
            control_socket: dir.join("qmp.sock"),
            console_log: dir.join("console.log"),
        })
    }
    /// Last lines of the guest console (its kept tail, `console.log.1`, then `console.log`, see
    /// [`trim_console`]) and of the VMM's own output, for boot failure reports.
    pub fn console_tail(&self, lines: usize) -> String {
        let last = |text: String| {
            let v: Vec<&str> = text.lines().collect();
            v[v.len().saturating_sub(lines)..].join("\n")
        };
        let vmm_log = last(read_tail(&self.dir.join("qemu.log"), CONSOLE_KEEP));
        let mut console = read_tail(&rotated(&self.console_log), CONSOLE_KEEP);
        console.push_str(&read_tail(&self.console_log, CONSOLE_KEEP));
        let console = last(console);
        match (vmm_log.is_empty(), console.is_empty()) {
            (true, true) => "(no output)".into(),
            (false, true) => vmm_log,
            (true, false) => console,
            (false, false) => format!("{console}\n{vmm_log}"),
        }
    }
}

/// The most a guest console log may hold on the host: a guest writing to its serial port forever
/// must not fill the host's disk.
pub const CONSOLE_CAP: u64 = 1 << 20;
/// What of a console log past its cap is kept (in `console.log.1`).
pub const CONSOLE_KEEP: u64 = 64 << 10;

/// `<path>.1`: where [`trim_console`] keeps the tail of a console log.
pub fn rotated(path: &Path) -> PathBuf {
    let mut p = path.as_os_str().to_owned();
    p.push(".1");
    PathBuf::from(p)
}

/// Keep a console log under [`CONSOLE_CAP`] while the VMM writes it: once past the cap, its last
/// [`CONSOLE_KEEP`] bytes replace `<path>.1` and the log is truncated to nothing. The VMM opens
/// it with `O_APPEND` (QEMU's `append=on`), so its next write lands at the new end, offset 0; a
/// writer without `O_APPEND` would go on at its old offset, leaving a sparse file whose hole holds
/// no disk blocks (bounded too, only `ls -l` lies). Bytes written between the copy and the
/// truncation are lost: a guest flooding its console loses most of it anyway. Returns whether
/// it trimmed.
pub fn trim_console(path: &Path) -> std::io::Result<bool> {
    let len = match std::fs::metadata(path) {
        Ok(m) => m.len(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(e),
    };
    if len <= CONSOLE_CAP {
        return Ok(false);
    }
    let tail = read_tail(path, CONSOLE_KEEP);
    crate::datadir::write_atomic_mode(&rotated(path), tail.as_bytes(), 0o600).map_err(|(_, e)| e)?;
    std::fs::OpenOptions::new().write(true).open(path)?.set_len(0)?;
    Ok(true)
}

/// The last `max` bytes of a file as text (lossy; the NULs of a sparse hole dropped), starting
/// at a line boundary when there is one; empty if it cannot be read.
fn read_tail(path: &Path, max: u64) -> String {
    use std::io::{Read, Seek, SeekFrom};
    let Ok(mut f) = std::fs::File::open(path) else {
        return String::new();
    };
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    let start = len.saturating_sub(max);
    let mut buf = Vec::new();
    if f.seek(SeekFrom::Start(start)).is_err() || f.take(max).read_to_end(&mut buf).is_err() {
        return String::new();
    }
    buf.retain(|&b| b != 0);
    let mut text = String::from_utf8_lossy(&buf).into_owned();
    if start > 0 {
        if let Some(i) = text.find('\n') {
            text.drain(..=i);
        }
    }
    text
}

#[async_trait]
pub trait Vmm: Send + Sync {
    /// `qemu` or `fc`.
    fn name(&self) -> &'static str;
    /// Boot a VM; returns once the VMM process runs (not when the guest is ready).
    async fn start(&self, spec: &VmSpec) -> Result<VmHandle>;
    /// Stop the VM: ask the VMM to quit, and kill it if it has not exited after `grace`.
    async fn stop(&self, vm: &VmHandle, grace: Duration) -> Result<()>;
    /// Whether this VM's VMM process still runs (and is really ours, not a reused pid).
    fn is_running(&self, vm: &VmHandle) -> bool;
    /// Freeze the guest's vCPUs in memory (the VM keeps its RAM; nothing runs).
    async fn pause(&self, vm: &VmHandle) -> Result<()>;
    async fn resume(&self, vm: &VmHandle) -> Result<()>;
    /// Whether the guest's vCPUs are frozen.
    async fn is_paused(&self, vm: &VmHandle) -> Result<bool>;
    /// Free what the driver holds for VM `id` (the id its [`VmSpec`] was started with) outside
    /// its dir (the jail's cgroups), once its VMM process is gone.
    fn release(&self, _id: &str) {}
    /// Free such leftovers of VMs not in `live` (after a crash), at start-up.
    fn sweep(&self, _live: &std::collections::HashSet<String>) {}
    /// The isolation its VMs run in, where the driver jails them.
    fn isolation(&self) -> Option<crate::jail::Isolation> {
        None
    }
    /// Attaching volumes to running VMs, where this VMM can.
    fn hotplug(&self) -> Option<&dyn Hotplug> {
        None
    }
    /// Saving and restoring VMs, where the driver can.
    fn snapshotting(&self) -> Option<&dyn Snapshotting> {
        None
    }
    /// Write a stopped VM's whole disk (its overlay over the frozen qcow2 `layers`, nearest
    /// first, over the template's raw `rootfs`) as one raw image at `to`: what a template build
    /// keeps (`Runtime::capture_template`). The chain is given: the images' headers may name
    /// paths of VMs long gone (an image saved from one).
    async fn export_disk(&self, vm: &VmHandle, layers: &[PathBuf], rootfs: &Path, to: &Path) -> Result<()> {
        let _ = (layers, rootfs, to);
        Err(RuntimeError::DiskCreate(format!(
            "the {} VMM cannot export VM {}'s disk",
            self.name(),
            vm.dir.display()
        )))
    }
}

/// The last step of every driver's `stop`: SIGKILL, then wait for the exit.
pub async fn kill_and_wait(pid: u32) -> Result<()> {
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::Signal::SIGKILL,
    );
    if wait_exit(pid, Duration::from_secs(5)).await {
        Ok(())
    } else {
        Err(RuntimeError::StopFailed { pid })
    }
}

/// True when `pid` is alive and not a zombie.
pub fn pid_alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // state is the field after the parenthesised command name
        Ok(stat) => stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_some_and(|s| s != "Z" && s != "X"),
        Err(_) => false,
    }
}

/// Collect the exit status of `pid` if it is our (zombie) child; harmless otherwise.
pub fn reap(pid: u32) {
    let _ = nix::sys::wait::waitpid(
        nix::unistd::Pid::from_raw(pid as i32),
        Some(nix::sys::wait::WaitPidFlag::WNOHANG),
    );
}

/// Wait until `pid` exits (pidfd, so it works for processes that are not our children).
pub async fn wait_exit(pid: u32, limit: Duration) -> bool {
    let deadline = tokio::time::Instant::now() + limit;
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::c_int, 0) };
    if fd >= 0 {
        use std::os::fd::FromRawFd;
        let owned = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd as i32) };
        // SAFETY: the AsyncFd owns the pidfd for its whole life.
        if let Ok(afd) =
            unsafe { tokio::io::unix::AsyncFd::register_with_interest(owned, tokio::io::Interest::READABLE) }
        {
            let exited = tokio::time::timeout_at(deadline, afd.readable()).await.is_ok();
            reap(pid);
            return exited || !pid_alive(pid);
        }
    }
    while tokio::time::Instant::now() < deadline {
        reap(pid);
        if !pid_alive(pid) {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    !pid_alive(pid)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    /// Disk actually allocated to a file (`du`), as opposed to its length (`ls -l`).
    fn allocated(p: &Path) -> u64 {
        std::fs::metadata(p).map(|m| m.blocks() * 512).unwrap_or(0)
    }

    /// A shell writing to `log` forever, as a guest flooding its console makes QEMU do;
    /// `append` is QEMU's `append=on` (`>>` opens with O_APPEND).
    fn flood(log: &Path, append: bool) -> std::process::Child {
        let redirect = if append { ">>" } else { ">" };
        std::process::Command::new("sh")
            .arg("-c")
            .arg(format!(
                "while :; do echo 'console line, the same again and again, as a looping guest prints it'; done {redirect} '{}'",
                log.display()
            ))
            .spawn()
            .unwrap()
    }

    /// Trim `log` every 20 ms while it is flooded, until `total` bytes went through it (or 20 s
    /// passed); returns the most disk the log held (`du`), its greatest length (`ls
    /// -l`) and how many trims there were.
    fn trim_while_flooded(log: &Path, append: bool, total: u64) -> (u64, u64, u32) {
        let mut child = flood(log, append);
        let (mut written, mut worst, mut longest, mut trims) = (0u64, 0u64, 0u64, 0u32);
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while written < total && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
            let before = allocated(log);
            longest = longest.max(std::fs::metadata(log).map(|m| m.len()).unwrap_or(0));
            if trim_console(log).unwrap() {
                written += before;
                trims += 1;
            }
            worst = worst.max(before).max(allocated(log));
        }
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(written >= total, "the writer wrote only {written} bytes in 20 s");
        eprintln!(
            "append={append}: {written} bytes written, {trims} trims, at most {worst} bytes held, longest {longest}"
        );
        (worst, longest, trims)
    }

    #[test]
    fn a_flooded_console_log_stays_under_its_cap() {
        let tmp = tempfile::tempdir().unwrap();
        let log = tmp.path().join("console.log");
        crate::datadir::create_private(&log).unwrap();
        let (worst, _, trims) = trim_while_flooded(&log, true, 8 * CONSOLE_CAP);
        // Past the cap, the log starts over: it holds at most the cap plus what one period of
        // writing adds (slack for a loaded machine).
        assert!(trims >= 2, "trimmed {trims} times");
        assert!(worst <= CONSOLE_CAP + (8 << 20), "held {worst} bytes");
        trim_console(&log).unwrap();
        assert!(allocated(&log) <= CONSOLE_CAP + (64 << 10));
        assert!(std::fs::metadata(&log).unwrap().len() <= CONSOLE_CAP);
        // What was kept: the end, from a line's start, private like the log. (Its last line may be
        // cut: the copy can read a line the killed writer was still appending.)
        let kept = std::fs::read_to_string(rotated(&log)).unwrap();
        assert!(kept.len() as u64 <= CONSOLE_KEEP && kept.len() > 1000, "{}", kept.len());
        assert!(
            kept.starts_with("console line") && kept.contains("prints it\n"),
            "{kept:.200}"
        );
        let mode = std::fs::metadata(rotated(&log)).unwrap().mode() & 0o777;
        assert_eq!(mode, 0o600);
    }

    #[test]
    fn a_writer_without_append_leaves_a_sparse_log_that_holds_no_more() {
        let tmp = tempfile::tempdir().unwrap();
        let log = tmp.path().join("console.log");
        let (worst, longest, _) = trim_while_flooded(&log, false, 8 * CONSOLE_CAP);
        // `ls -l` says the file grew past the cap many times over; `du` says its hole holds
        // nothing, only what was written since the last trim.
        assert!(longest > 4 * CONSOLE_CAP, "length {longest}");
        assert!(worst <= CONSOLE_CAP + (8 << 20), "held {worst} bytes");
        // The tail of a sparse log reads past the hole.
        std::fs::write(&log, b"").unwrap();
        let f = std::fs::OpenOptions::new().write(true).open(&log).unwrap();
        f.set_len(4 * CONSOLE_CAP).unwrap();
        drop(f);
        let mut f = std::fs::OpenOptions::new().append(true).open(&log).unwrap();
        std::io::Write::write_all(&mut f, b"console line\nthe end\n").unwrap();
        assert!(allocated(&log) < CONSOLE_CAP);
        assert_eq!(read_tail(&log, CONSOLE_KEEP), "the end\n");
    }

    #[test]
    fn console_tail_reads_the_kept_tail_and_the_new_log() {
        let tmp = tempfile::tempdir().unwrap();
        let log = tmp.path().join("console.log");
        let mut text = String::new();
        let mut n = 0;
        while text.len() as u64 <= CONSOLE_CAP {
            text.push_str(&format!("line {n}\n"));
            n += 1;
        }
        std::fs::write(&log, &text).unwrap();
        assert!(trim_console(&log).unwrap());
        assert_eq!(std::fs::metadata(&log).unwrap().len(), 0);
        std::fs::write(&log, "after 1\nafter 2\n").unwrap();
        let vm = VmHandle {
            runtime: "qemu".into(),
            pid: 0,
            accel: Accel::Tcg,
            dir: tmp.path().into(),
            agent_socket: tmp.path().join("agent.sock"),
            control_socket: tmp.path().join("qmp.sock"),
            console_log: log,
        };
        let last = n - 1;
        assert_eq!(
            vm.console_tail(3),
            format!("line {last}\nafter 1\nafter 2"),
            "the kept tail comes first"
        );
        // Nothing past the cap: a log under it is left alone.
        assert!(!trim_console(&vm.console_log).unwrap());
    }
}
