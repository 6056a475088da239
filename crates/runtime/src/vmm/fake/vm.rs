//! The fake VMM: each "VM" a host process (`sh`) in its own session, paused on disk, its agent
//! registered when it starts and stopped when it exits.

use super::agent::{register, registered};
use super::guest::Guest;
use super::*;
use crate::datadir::write_atomic;
use crate::error::{Result, RuntimeError};
use crate::vmm::{kill_and_wait, pid_alive, reap, wait_exit, VmHandle, VmSpec, Vmm};
use async_trait::async_trait;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// A VMM whose VMs are host processes with an in-process fake agent. Stateless: everything it
/// needs is in the sandbox dir, /proc and the process-global agent registry, so a new instance
/// (a restarted runtime) manages the VMs of an earlier one.
#[derive(Debug, Default, Clone)]
pub struct FakeVmm {
    _private: (),
}

impl FakeVmm {
    pub fn new() -> Self {
        Self::default()
    }
}

pub(super) fn vm_marker(dir: &Path) -> PathBuf {
    dir.join("fake-vm")
}

pub(super) fn signal(pid: u32, sig: Signal) {
    let _ = kill(Pid::from_raw(pid as i32), sig);
}

pub(super) fn paused_marker(dir: &Path) -> PathBuf {
    dir.join("fake-paused")
}

#[async_trait]
impl Vmm for FakeVmm {
    fn name(&self) -> &'static str {
        NAME
    }

    async fn start(&self, spec: &VmSpec) -> Result<VmHandle> {
        let dir = &spec.dir;
        let agent_socket = dir.join("agent.sock");
        let console = dir.join("console.log");
        let _ = std::fs::remove_file(&agent_socket);
        // A std listener: the agent runtime adopts it (a tokio one would belong to the caller's).
        let listener =
            std::os::unix::net::UnixListener::bind(&agent_socket).map_err(|e| RuntimeError::io(&agent_socket, e))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| RuntimeError::io(&agent_socket, e))?;
        std::fs::write(&console, format!("fake VM {} booting\n", spec.id))
            .map_err(|e| RuntimeError::io(&console, e))?;

        // The VM's stdin: closing our end (or writing a line) powers it off. std's pipe is
        // close-on-exec, so other children do not inherit our end.
        let (power_rx, power_tx) = std::io::pipe().map_err(|e| RuntimeError::io(dir, e))?;
        let mut cmd = std::process::Command::new("sh");
        cmd.args(["-c", VM_SCRIPT, PROCESS_MARKER])
            .arg(vm_marker(dir))
            .stdin(power_rx)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null());
        // Own session, like QEMU: the VM outlives the runtime that started it.
        unsafe {
            std::os::unix::process::CommandExt::pre_exec(&mut cmd, || {
                if libc::setsid() < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = cmd.spawn().map_err(|e| RuntimeError::io("sh", e))?;
        drop(cmd); // our copy of the pipe's read end
        let pid = child.id();
        drop(child); // `wait_exit` reaps it

        let handle = VmHandle {
            runtime: NAME.into(),
            pid,
            accel: spec.accel,
            dir: dir.clone(),
            agent_socket: agent_socket.clone(),
            control_socket: vm_marker(dir),
            console_log: console,
        };
        let guest = Arc::new(Guest::new(spec, pid, power_tx));
        register(agent_socket, guest, listener);
        write_atomic(
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
        signal(vm.pid, Signal::SIGTERM);
        if wait_exit(vm.pid, grace).await {
            return Ok(());
        }
        kill_and_wait(vm.pid).await
    }

    fn is_running(&self, vm: &VmHandle) -> bool {
        if !pid_alive(vm.pid) {
            return false;
        }
        let cmdline = std::fs::read(format!("/proc/{}/cmdline", vm.pid)).unwrap_or_default();
        let needle = vm_marker(&vm.dir).display().to_string();
        cmdline.split(|b| *b == 0).any(|arg| arg == needle.as_bytes())
    }

    async fn pause(&self, vm: &VmHandle) -> Result<()> {
        if !self.is_running(vm) {
            return Err(control_failed("pause", vm));
        }
        let marker = paused_marker(&vm.dir);
        std::fs::write(&marker, b"").map_err(|e| RuntimeError::io(&marker, e))?;
        if let Some(g) = registered(&vm.agent_socket) {
            g.paused.send_replace(true);
        }
        Ok(())
    }

    async fn resume(&self, vm: &VmHandle) -> Result<()> {
        if !self.is_running(vm) {
            return Err(control_failed("resume", vm));
        }
        let marker = paused_marker(&vm.dir);
        match std::fs::remove_file(&marker) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(RuntimeError::io(&marker, e)),
            _ => {}
        }
        if let Some(g) = registered(&vm.agent_socket) {
            g.paused.send_replace(false);
        }
        Ok(())
    }

    async fn is_paused(&self, vm: &VmHandle) -> Result<bool> {
        if !self.is_running(vm) {
            return Err(control_failed("query-status", vm));
        }
        Ok(paused_marker(&vm.dir).exists())
    }

    /// A fake VM writes nothing to a disk: its disk is its template's image as it was.
    async fn export_disk(&self, _vm: &VmHandle, _layers: &[PathBuf], rootfs: &Path, to: &Path) -> Result<()> {
        std::fs::copy(rootfs, to).map_err(|e| RuntimeError::io(rootfs, e))?;
        Ok(())
    }
}

pub(super) fn control_failed(command: &str, vm: &VmHandle) -> RuntimeError {
    RuntimeError::ControlCommand {
        command: command.into(),
        reason: format!("fake VM pid {} is not running", vm.pid),
    }
}
