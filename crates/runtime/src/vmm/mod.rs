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
use crate::template::Template;
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

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
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

impl Resources {
    /// Check against the host and the template; the message names the field and the bound.
    pub fn validate(&self, template: &Template) -> Result<()> {
        let host_cpus = std::thread::available_parallelism()
            .map(|n| n.get() as u32)
            .unwrap_or(1);
        let host_mem_mib = host_memory_mib();
        let min_disk = template.manifest.rootfs_bytes.div_ceil(1 << 20) as u32;
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
                template.manifest.name, self.disk_mib
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

fn host_memory_mib() -> u32 {
    let info = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    info.lines()
        .find(|l| l.starts_with("MemTotal:"))
        .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        .map(|kib| (kib / 1024) as u32)
        .unwrap_or(u32::MAX)
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
}

impl VmSpec {
    /// Boot `template` with `resources` in `dir`.
    pub fn for_template(id: &str, dir: PathBuf, template: &Template, resources: Resources, accel: Accel) -> Self {
        Self {
            id: id.to_string(),
            dir,
            kernel: template.kernel(),
            initrd: template.initrd(),
            rootfs: template.rootfs(),
            vcpu: resources.vcpu,
            memory_mib: resources.memory_mib,
            disk_mib: resources.disk_mib,
            accel,
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
    /// Last lines of the guest console and of the VMM's own output, for boot failure reports.
    pub fn console_tail(&self, lines: usize) -> String {
        let tail = |p: &Path| {
            let text = std::fs::read_to_string(p).unwrap_or_default();
            let v: Vec<&str> = text.lines().collect();
            v[v.len().saturating_sub(lines)..].join("\n")
        };
        let vmm_log = tail(&self.dir.join("qemu.log"));
        let console = tail(&self.console_log);
        match (vmm_log.is_empty(), console.is_empty()) {
            (true, true) => "(no output)".into(),
            (false, true) => vmm_log,
            (true, false) => console,
            (false, false) => format!("{console}\n{vmm_log}"),
        }
    }
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
