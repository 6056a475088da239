//! Raw QEMU as the benchmarks start it by hand next to airlock: a fresh dir, a qcow2 overlay on
//! the machine's disk, and its sockets and console by path.
// Each bench binary compiles this for itself and uses part of it.
#![allow(dead_code)]

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

/// A raw VMM that is killed and reaped when this goes, also when a measurement panics.
pub struct KillOnDrop(pub std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A network namespace of the bench's own (where raw QEMU makes its tap), removed when this goes.
pub struct Netns(pub String);

impl Netns {
    pub fn add(name: String) -> Netns {
        let ok = std::process::Command::new("ip")
            .args(["netns", "add", &name])
            .status()
            .unwrap();
        assert!(ok.success(), "ip netns add {name} (the bench runs as root)");
        Netns(name)
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = std::process::Command::new("ip")
            .args(["netns", "del", &self.0])
            .status();
    }
}
