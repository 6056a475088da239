//! What a stopped test server leaves behind by design: VMs outlive the server that started them.

use std::path::Path;

/// End the VMM whose pid a sandbox dir's `vmm.pid` records, if that process still runs for this
/// dir (its command line names the dir: a pid since reused by another process is left alone).
/// Whether one was ended.
pub fn end_vmm_of(sandbox_dir: &Path) -> bool {
    let Some(pid) = std::fs::read_to_string(sandbox_dir.join("vmm.pid"))
        .ok()
        .and_then(|p| p.trim().parse::<i32>().ok())
    else {
        return false;
    };
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    if pid <= 1 || !String::from_utf8_lossy(&cmdline).contains(&*sandbox_dir.to_string_lossy()) {
        return false;
    }
    // SAFETY: kill(2) on a pid checked above to be this dir's VMM.
    unsafe { libc::kill(pid, libc::SIGKILL) == 0 }
}
