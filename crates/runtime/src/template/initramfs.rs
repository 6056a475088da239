//! The guest agent binary (found, checked static) and the initramfs built around it: the agent
//! as `/init` and the kernel modules it loads.

use super::command::{install_file, run};
use super::error::TemplateError;
use crate::error::{Result, RuntimeError};
use std::path::{Path, PathBuf};
use std::process::Command;

pub(super) fn check_static(agent: &Path) -> Result<()> {
    let bytes = std::fs::read(agent).map_err(|source| TemplateError::AgentUnreadable {
        path: agent.to_path_buf(),
        source,
    })?;
    let head = &bytes[..bytes.len().min(4096)];
    if head.windows(14).any(|w| w == b"/lib64/ld-linu") {
        return Err(TemplateError::AgentNotStatic(agent.to_path_buf()).into());
    }
    Ok(())
}

/// The statically linked guest agent: `AIRLOCK_AGENT_BIN`, or next to this binary, or in the
/// cargo target dir the binary was built in.
pub fn locate_agent() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os("AIRLOCK_AGENT_BIN") {
        return Ok(PathBuf::from(p));
    }
    let exe = std::env::current_exe().map_err(|e| RuntimeError::io("current_exe", e))?;
    let mut candidates = Vec::new();
    for dir in exe.ancestors().skip(1).take(4) {
        candidates.push(dir.join("airlock-agent"));
        candidates.push(dir.join("x86_64-unknown-linux-gnu/release/airlock-agent"));
    }
    candidates.push(PathBuf::from("/usr/lib/airlock/airlock-agent"));
    candidates
        .into_iter()
        .find(|p| p.is_file() && check_static(p).is_ok())
        .ok_or_else(|| TemplateError::AgentNotFound.into())
}

pub(super) fn build_initramfs(agent: &Path, modules: &[PathBuf], staging: &Path, out: &Path) -> Result<()> {
    for d in ["dev", "proc", "sys", "newroot", "lib/modules"] {
        std::fs::create_dir_all(staging.join(d)).map_err(|e| RuntimeError::io(staging, e))?;
    }
    install_file(agent, &staging.join("init"), 0o755)?;
    std::fs::write(staging.join("airlock-initramfs"), b"").map_err(|e| RuntimeError::io(staging, e))?;
    let mut list = String::new();
    for m in modules {
        let name = m.file_name().expect("module file").to_string_lossy().to_string();
        install_file(m, &staging.join("lib/modules").join(&name), 0o644)?;
        list.push_str(&format!("/lib/modules/{name}\n"));
    }
    std::fs::write(staging.join("modules.list"), list).map_err(|e| RuntimeError::io(staging, e))?;
    // Uncompressed: under TCG, decompressing costs more boot time than reading a few MB.
    let script = format!(
        "cd '{}' && find . | LC_ALL=C sort | cpio -o -H newc --quiet > '{}'",
        staging.display(),
        out.display()
    );
    run(Command::new("sh").arg("-c").arg(script), "cpio")
}
