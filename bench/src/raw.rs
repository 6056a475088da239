//! Raw QEMU as the benchmarks start it by hand next to airlock: a fresh dir, a qcow2 overlay on
//! the machine's disk, and its sockets and console by path.

use std::path::{Path, PathBuf};

pub struct RawFiles {
    pub overlay: PathBuf,
    pub agent: PathBuf,
    pub qmp: PathBuf,
    pub console: PathBuf,
}

/// Empty `dir` (made anew) with an overlay of `disk_mib` on `backing` (of `format`: `raw` for a
/// template's root filesystem, `qcow2` for a base snapshot's disk).
pub fn prepare(dir: &Path, backing: &Path, format: &str, disk_mib: u32) -> RawFiles {
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir).unwrap();
    let files = RawFiles {
        overlay: dir.join("disk.qcow2"),
        agent: dir.join("agent.sock"),
        qmp: dir.join("qmp.sock"),
        console: dir.join("console.log"),
    };
    let ok = std::process::Command::new("qemu-img")
        .args(["create", "-q", "-f", "qcow2", "-F", format, "-b"])
        .arg(backing)
        .arg(&files.overlay)
        .arg(format!("{disk_mib}M"))
        .status()
        .unwrap();
    assert!(ok.success(), "qemu-img create on {}", backing.display());
    files
}
