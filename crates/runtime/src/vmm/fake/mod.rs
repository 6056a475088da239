//! Test doubles for the VMM and the guest agent (cargo feature `fake`): a sandbox whose "VM" is a
//! cheap host process and whose agent is a tokio task in this process, so the runtime, the
//! server's engine and their crash recovery can be tested in milliseconds, without KVM or QEMU.
//!
//! - The fake VM is `sh -c 'read line; exit 0' airlock-fake-vm <dir>/fake-vm`, started in its own
//!   session like QEMU. Its pid is real: `kill -9`, pidfd exit watching and the pid-reuse guard
//!   of `is_running` (its command line names the sandbox dir) work as with QEMU. Its stdin is a
//!   pipe whose write end this process keeps: closing it is a clean power-off from inside (the
//!   shell exits 0), and when the test process ends, every fake VM it started ends with it.
//! - Pause is recorded on disk (`<dir>/fake-paused`), so a new `FakeVmm` after a simulated
//!   restart sees it; a paused VM's agent does not answer (no READY, no responses, no events)
//!   until it resumes. The process itself is not SIGSTOPped: a stopped process would not see its
//!   stdin close, and would outlive the test process.
//! - The fake agent serves the real protocol (HELLO/READY, then HTTP/2) on `<dir>/agent.sock`
//!   with a scripted process model and an in-memory file system (an upload to `/dev/null` is
//!   counted and dropped, [`uploaded_bytes`]); it never runs host commands.
//!   Agents live in a process-global registry keyed by socket path and run on their own tokio
//!   runtime (one background thread), so they outlive a dropped `Runtime` and even the tokio
//!   runtime of the test that made them (a restarted runtime re-attaches and finds them
//!   answering); an agent stops when its fake VM process exits.
//!
//! Programs the fake agent knows: `echo ARGS..` (prints them, exit 0), `true`, `false`,
//! `sleep SECS|infinity` (until the time passes or a signal ends it), `cat` (stdin to stdout until
//! stdin closes), `sh -c 'exit N'` (exit N), `poweroff` (exit 0, then the VM powers off); anything
//! else exits 127 with `<name>: command not found` on stderr. `timeout_ms` kills with SIGKILL.
//!
//! A fake agent can be switched to misbehave as a hostile guest's own agent would
//! ([`set_hostile`], [`Hostile`]), to test that the host's client bounds what it reads.

mod agent;
mod guest;
mod process;
mod reply;
mod routes;
mod vm;

pub use vm::FakeVmm;

use agent::registered;

use crate::datadir::DataDir;
use crate::error::{Result, RuntimeError};
use crate::sandbox::RuntimeOptions;
use crate::template::{SeedRecipe, TemplateManifest};
use crate::vmm::{pid_alive, Accel, VmHandle};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

/// `VmHandle::runtime` and `Vmm::name` of fake VMs.
pub const NAME: &str = "fake";
/// Output a fake process keeps for late readers (the real agent keeps 32 MiB); older events are
/// dropped first, and their sequence numbers are skipped, as the real agent does.
pub const RETAINED_OUTPUT: usize = 1 << 20;
/// `argv[0]` of every fake VM process (`pgrep -f airlock-fake-vm` finds them).
pub const PROCESS_MARKER: &str = "airlock-fake-vm";
/// What the fake VM process runs: it ends cleanly once its stdin reaches EOF or a line.
const VM_SCRIPT: &str = "read line; exit 0";

// ---------------------------------------------------------------------------------------------
// Test setup helpers

/// Install template `name` in `data_dir` with tiny dummy kernel/initrd/rootfs blobs, so
/// `TemplateStore::resolve(name)` works and fake sandboxes can be created from it.
pub fn install_template(data_dir: &Path, name: &str) -> Result<TemplateManifest> {
    let (parsed, _) = crate::template::parse_reference(name)?;
    let data = DataDir::open(data_dir)?;
    let rootfs = vec![0u8; 64 << 10];
    let kernel = format!("fake kernel of {parsed}\n");
    let blobs: [(&str, &[u8]); 3] = [
        ("vmlinuz", kernel.as_bytes()),
        ("initrd.img", b"fake initrd\n"),
        ("rootfs.ext4", &rootfs),
    ];
    // Committed as a build commits a real one (its digest made from its files), so object
    // storage takes and checks it as one.
    let out = data
        .cache()
        .join(format!("fake-template-{parsed}-{}", crate::datadir::random_hex(4)));
    std::fs::create_dir_all(&out).map_err(|e| RuntimeError::io(&out, e))?;
    for (file, content) in blobs {
        std::fs::write(out.join(file), content).map_err(|e| RuntimeError::io(out.join(file), e))?;
    }
    let committed =
        crate::template::TemplateStore::new(data).commit(&out, |digest, size_bytes, rootfs_bytes| TemplateManifest {
            name: parsed.clone(),
            digest,
            kernel_version: "fake".into(),
            built_at: humantime::format_rfc3339_millis(SystemTime::now()).to_string(),
            size_bytes,
            rootfs_bytes,
            recipe_digest: "fake".into(),
            recipe: SeedRecipe {
                name: parsed.clone(),
                suite: "fake".into(),
                variant: "fake".into(),
                packages: Vec::new(),
                mirror: String::new(),
                kernel_package: "fake".into(),
                modules: Vec::new(),
                agent_sha256: String::new(),
                files_sha256: String::new(),
                wheels: Vec::new(),
                apt: Vec::new(),
                npm: Vec::new(),
                start: None,
                memory_mib: None,
                builder_version: 0,
            },
            start: None,
            built: None,
        });
    // An install of blobs already there leaves its own copy behind.
    let _ = std::fs::remove_dir_all(&out);
    let (template, _) = committed?;
    Ok(template.manifest)
}

/// Runtime options for a fake node on `data_dir`: a new `FakeVmm`, TCG forced (no KVM probe),
/// a short boot timeout.
pub fn options(data_dir: impl Into<PathBuf>) -> RuntimeOptions {
    RuntimeOptions {
        accel: Some(Accel::Tcg),
        boot_timeout: Duration::from_secs(10),
        vmm: Some(Arc::new(FakeVmm::new())),
        // The fake VM has no NIC.
        network: None,
        ..RuntimeOptions::new(data_dir)
    }
}

// ---------------------------------------------------------------------------------------------
// Test controls

/// SIGKILL a fake VM (what `kill -9 <pid>` does to a QEMU).
pub fn kill_vm(pid: u32) {
    let _ = kill(Pid::from_raw(pid as i32), Signal::SIGKILL);
}

/// Power the VM off from inside: its process exits cleanly (status 0). False when this process
/// has no fake agent for it. (Spawning `["poweroff"]` through the agent does the same.)
pub fn power_off(vm: &VmHandle) -> bool {
    match registered(&vm.agent_socket) {
        Some(g) => {
            g.power_off();
            true
        }
        None => false,
    }
}

/// Ways a fake agent misbehaves, as an agent replaced by root in a hostile guest could.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hostile {
    /// Every call is answered with `status` and a body that never ends.
    EndlessBody { status: u16 },
    /// Streams send one 100 MiB item: a watch line without a newline, and an event frame whose
    /// length prefix says 100 MiB (followed by that much payload). Other calls behave.
    HugeLine,
    /// Calls are never answered (the connection stays up, the handshake still works).
    Silent,
    /// New sessions get `READY`, then garbage instead of HTTP/2.
    Garbage,
}

/// Switch the VM's agent to misbehave (`None`: behave again), for new calls and sessions.
/// False when this process has no fake agent for it.
pub fn set_hostile(vm: &VmHandle, mode: Option<Hostile>) -> bool {
    match registered(&vm.agent_socket) {
        Some(g) => {
            *g.hostile.lock().unwrap() = mode;
            true
        }
        None => false,
    }
}

/// The file bytes the VM's agent has received in uploads so far, counted as they arrive (before
/// an upload has ended), metadata included. `None` when this process has no fake agent for it.
pub fn uploaded_bytes(vm: &VmHandle) -> Option<u64> {
    registered(&vm.agent_socket).map(|g| g.uploaded.load(Ordering::Relaxed))
}

/// Pids of live fake VM processes whose sandbox dir is under `root` (e.g. a test's data dir).
pub fn live_vms(root: &Path) -> Vec<u32> {
    let needle = root.display().to_string();
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let cmdline = String::from_utf8_lossy(&cmdline);
            cmdline.contains(PROCESS_MARKER) && cmdline.contains(&needle) && pid_alive(*pid)
        })
        .collect()
}
