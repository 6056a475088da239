//! QEMU `microvm` driver.
//!
//! One QEMU process per sandbox, daemonized so it outlives the airlock process; the guest agent
//! is reached through a virtio-serial port backed by a unix socket in the sandbox dir, and QEMU
//! itself through QMP on another socket there. The root disk is a qcow2 overlay on the
//! template's ext4 image, sized to `disk_mib`.

use super::qmp::Qmp;
use crate::error::{Result, RuntimeError};
use crate::vmm::{kill_and_wait, pid_alive, reap, wait_exit, Accel, VmHandle, VmSpec, Vmm};
use async_trait::async_trait;
use std::path::{Path, PathBuf};
use std::time::Duration;
use tokio::process::Command;

pub const QEMU_BINARY: &str = "qemu-system-x86_64";
/// QEMU's `-sandbox` option: its seccomp filter, with every optional deny on. `spawn=deny`
/// forbids fork/exec, which is why QEMU is started directly in its own session rather than with
/// `-daemonize`.
pub const SANDBOX: &str = "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny";
/// Longest unix socket path the kernel accepts (sun_path is 108 bytes with the NUL).
const MAX_SOCKET_PATH: usize = 107;

#[derive(Debug, Clone)]
pub struct QemuVmm {
    binary: PathBuf,
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
            .map(|binary| Self { binary })
            .ok_or(RuntimeError::QemuMissing(name))
    }

    pub fn binary(&self) -> &Path {
        &self.binary
    }

    /// The full QEMU argument list for `spec` (without daemonizing), shared with the benchmark
    /// so "raw QEMU" boots exactly the same machine.
    pub fn args(spec: &VmSpec, overlay: &Path, agent_socket: &Path, qmp_socket: &Path, console: &Path) -> Vec<String> {
        let cpu = match spec.accel {
            Accel::Kvm => "host",
            Accel::Tcg => "max",
        };
        let cmdline = kernel_cmdline(&spec.id);
        let p = |p: &Path| p.display().to_string();
        let mut args: Vec<String> = vec![
            "-M".into(),
            "microvm,rtc=on".into(),
            "-accel".into(),
            spec.accel.to_string(),
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
            // QEMU's own seccomp filter (Seccomp: 2 in /proc/<pid>/status): a guest that breaks
            // out into QEMU cannot use obsolete syscalls, setuid, fork/exec, or change
            // scheduling/affinity. airlock needs none of them (no `exec:` migration, no helpers).
            "-sandbox".into(),
            SANDBOX.into(),
            "-kernel".into(),
            p(&spec.kernel),
            "-initrd".into(),
            p(&spec.initrd),
            "-append".into(),
            cmdline,
            "-drive".into(),
            format!("id=root,file={},format=qcow2,if=none,discard=unmap", p(overlay)),
            "-device".into(),
            "virtio-blk-device,drive=root".into(),
            "-device".into(),
            "virtio-serial-device".into(),
            "-chardev".into(),
            format!("socket,id=agent,path={},server=on,wait=off", p(agent_socket)),
            "-device".into(),
            format!("virtserialport,chardev=agent,name={}", airlock_proto::AGENT_PORT_NAME),
            "-device".into(),
            "virtio-rng-device".into(),
            "-chardev".into(),
            // append=on (O_APPEND): the runtime keeps the log under its cap by truncating it
            // (`vmm::trim_console`), and QEMU's next write then starts the file over.
            format!("file,id=console,path={},append=on", p(console)),
            "-serial".into(),
            "chardev:console".into(),
            "-qmp".into(),
            format!("unix:{},server=on,wait=off", p(qmp_socket)),
        ];
        args.extend(net_args(spec));
        args
    }
}

impl QemuVmm {
    async fn qmp(&self, vm: &VmHandle, cmd: &str) -> Result<serde_json::Value> {
        let run = async {
            let mut qmp = Qmp::connect(&vm.control_socket).await?;
            qmp.execute(cmd, None).await
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

/// The NIC: virtio-net on the tap the runtime opened (`fd=`, inherited; no vhost-net here).
fn net_args(spec: &VmSpec) -> Vec<String> {
    use std::os::fd::AsRawFd;
    let Some(net) = &spec.network else { return Vec::new() };
    vec![
        "-netdev".into(),
        format!("tap,id=net0,fd={},vhost=off", net.tap.as_raw_fd()),
        "-device".into(),
        format!("virtio-net-device,netdev=net0,mac={}", net.mac),
    ]
}

/// Guest kernel command line. Under TCG, ~45% of boots hang in TSC calibration unless the
/// frequency is given (`tsc_early_khz`) and trusted (`tsc=reliable`).
pub fn kernel_cmdline(hostname: &str) -> String {
    let mut c = String::from("console=ttyS0 quiet reboot=k panic=-1 rdinit=/init");
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
        let dir = &spec.dir;
        let overlay = dir.join("disk.qcow2");
        let agent_socket = dir.join("agent.sock");
        let qmp_socket = dir.join("qmp.sock");
        let console = dir.join("console.log");
        for s in [&agent_socket, &qmp_socket] {
            if s.as_os_str().len() > MAX_SOCKET_PATH {
                return Err(RuntimeError::DataDirNotWritable {
                    path: dir.display().to_string(),
                    reason: format!("socket path {} is longer than {MAX_SOCKET_PATH} bytes", s.display()),
                });
            }
        }
        // The guest's console can print secrets: only the server's user reads it (QEMU keeps the
        // mode of a file that exists).
        crate::datadir::create_private(&console).map_err(|e| RuntimeError::io(&console, e))?;
        let out = Command::new("qemu-img")
            .args(["create", "-q", "-f", "qcow2", "-F", "raw", "-b"])
            .arg(&spec.rootfs)
            .arg(&overlay)
            .arg(format!("{}M", spec.disk_mib))
            .output()
            .await
            .map_err(|e| RuntimeError::QemuMissing(format!("qemu-img ({e})")))?;
        if !out.status.success() {
            return Err(RuntimeError::DiskCreate(format!(
                "qemu-img create: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            )));
        }

        let args = Self::args(spec, &overlay, &agent_socket, &qmp_socket, &console);
        let log = std::fs::File::create(dir.join("qemu.log")).map_err(|e| RuntimeError::io(dir, e))?;
        let log_err = log.try_clone().map_err(|e| RuntimeError::io(dir, e))?;
        let mut cmd = std::process::Command::new(&self.binary);
        cmd.args(&args)
            .stdin(std::process::Stdio::null())
            .stdout(log)
            .stderr(log_err);
        // Own session: the VM outlives this process (a restarted server re-attaches to it).
        // Not `-daemonize`: its intermediate processes would be left as zombies, and a direct
        // child can be reaped by pid when it exits.
        unsafe {
            std::os::unix::process::CommandExt::pre_exec(&mut cmd, || {
                if libc::setsid() < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        // The tap's fd is close-on-exec in this process (no other child may inherit it); only
        // QEMU's copy of the fd table keeps it across exec.
        if let Some(fd) = spec.network.as_ref().map(|n| std::os::fd::AsRawFd::as_raw_fd(&*n.tap)) {
            unsafe {
                std::os::unix::process::CommandExt::pre_exec(&mut cmd, move || {
                    if libc::fcntl(fd, libc::F_SETFD, 0) < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
        }
        let child = cmd
            .spawn()
            .map_err(|e| RuntimeError::QemuMissing(format!("{} ({e})", self.binary.display())))?;
        let pid = child.id();
        drop(child); // std does not wait on drop; `wait_exit` reaps it
        let handle = VmHandle {
            runtime: self.name().into(),
            pid,
            accel: spec.accel,
            dir: dir.clone(),
            agent_socket,
            control_socket: qmp_socket,
            console_log: console,
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
        // Guard against pid reuse: the process must be QEMU running this sandbox's disk.
        let cmdline = std::fs::read(format!("/proc/{}/cmdline", vm.pid)).unwrap_or_default();
        let needle = vm.dir.join("disk.qcow2").display().to_string();
        cmdline.windows(needle.len()).any(|w| w == needle.as_bytes())
    }
}
