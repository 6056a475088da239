//! Base snapshots: for a template and a resource shape, one VM booted to its agent's READY (and
//! its template's start process), then saved: guest RAM in a file, device state, and its disk
//! frozen at that moment. A create of that shape restores instead of booting: RAM mapped
//! privately from the file (clones share every page they have not written), a copy-on-write
//! overlay on the frozen disk, the device state loaded, and then its identity given over the
//! channel (`airlock_proto::Identity`), since everything else in it is the snapshot's.
//!
//! A snapshot is found by a key over everything that makes it restorable: the template's digest
//! (which covers the agent in its image), the shape, the accelerator, the VMM build and the
//! kernel command line; a changed template or agent makes a new key, so a new snapshot.
//!
//! On disk: `<data>/snapshots/<key>/` holds `manifest.json`, `memory` (mode 0644: the jailed
//! VMM reopens it through `/proc/self/fd`, which checks only the file's own mode; the dirs
//! above are 0700, so no other user reaches it), `state` and `disk.qcow2`. A build works in
//! `.build-<id>/` and renames it into place when done; a build a crash interrupted is stopped and
//! removed at the next start.

use crate::datadir::random_hex;
use crate::error::{Result, RuntimeError};
use crate::vmm::{Accel, Resources};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};

/// Bumped when what a snapshot holds, or how it is restored, changes.
pub const FORMAT: u32 = 1;
/// The prefix of a build's working dir.
pub const BUILD_PREFIX: &str = ".build-";

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct SnapshotManifest {
    pub key: String,
    pub template: String,
    pub template_digest: String,
    pub resources: Resources,
    pub accel: Accel,
    /// The VMM build that saved it (and alone can restore it).
    pub vmm: String,
    /// The kernel command line the VM booted with (a restore passes the same).
    pub cmdline: String,
    /// RFC 3339.
    pub created_at: String,
    /// From the VMM's start to the agent's READY (and the template's start process), and the save.
    pub boot_ms: u64,
    pub save_ms: u64,
}

/// A base snapshot on disk.
#[derive(Debug, Clone)]
pub struct BaseSnapshot {
    pub dir: PathBuf,
    pub manifest: SnapshotManifest,
}

impl BaseSnapshot {
    pub fn memory(&self) -> PathBuf {
        memory_path(&self.dir)
    }
    pub fn state(&self) -> PathBuf {
        state_path(&self.dir)
    }
    pub fn disk(&self) -> PathBuf {
        disk_path(&self.dir)
    }

    /// The snapshot under `root` for `key`, if one is complete there.
    pub fn find(root: &Path, key: &str) -> Option<Self> {
        let dir = root.join(key);
        let manifest: SnapshotManifest =
            serde_json::from_slice(&std::fs::read(dir.join("manifest.json")).ok()?).ok()?;
        let snap = Self { dir, manifest };
        (snap.manifest.key == key && snap.memory().is_file() && snap.state().is_file() && snap.disk().is_file())
            .then_some(snap)
    }
}

pub fn memory_path(dir: &Path) -> PathBuf {
    dir.join("memory")
}
pub fn state_path(dir: &Path) -> PathBuf {
    dir.join("state")
}
pub fn disk_path(dir: &Path) -> PathBuf {
    dir.join("disk.qcow2")
}

/// The key of the snapshot that restores as `template_digest` booted with `resources`.
pub fn key(template_digest: &str, resources: &Resources, accel: Accel, vmm: &str, cmdline: &str) -> String {
    let mut h = Sha256::new();
    h.update(format!(
        "format {FORMAT}\ntemplate {template_digest}\nvcpu {}\nmemory {}\ndisk {}\naccel {accel}\nvmm {vmm}\ncmdline {cmdline}\n",
        resources.vcpu, resources.memory_mib, resources.disk_mib
    ));
    hex::encode(&h.finalize()[..12])
}

/// A new build's working dir under `root` (0700), with its id (a valid sandbox id: the build
/// VM's network and cgroups are named by it).
pub fn new_build_dir(root: &Path) -> Result<(String, PathBuf)> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(root)
        .map_err(|e| RuntimeError::io(root, e))?;
    let id = format!("snap{}", random_hex(8));
    let dir = root.join(format!("{BUILD_PREFIX}{id}"));
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(&dir)
        .map_err(|e| RuntimeError::io(&dir, e))?;
    Ok((id, dir))
}

/// The memory file a builder maps shared: `memory_mib` of holes, writable by the builder's own
/// uid (through its reopened fd; the dir keeps everyone else out).
pub fn create_memory_file(dir: &Path, memory_mib: u32) -> Result<PathBuf> {
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let path = memory_path(dir);
    let f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&path)
        .map_err(|e| RuntimeError::io(&path, e))?;
    f.set_len((memory_mib as u64) << 20)
        .map_err(|e| RuntimeError::io(&path, e))?;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o666)).map_err(|e| RuntimeError::io(&path, e))?;
    Ok(path)
}

/// After the save: the memory file read-only for the VMMs that map it, the build's runtime
/// files gone, the manifest written, and the dir renamed to its key. Returns the snapshot.
pub fn seal(root: &Path, build_dir: &Path, manifest: SnapshotManifest) -> Result<BaseSnapshot> {
    use std::os::unix::fs::PermissionsExt;
    let memory = memory_path(build_dir);
    std::fs::set_permissions(&memory, std::fs::Permissions::from_mode(0o644))
        .map_err(|e| RuntimeError::io(&memory, e))?;
    // The clones' VMMs are handed the others as fds: only the server reads them by path.
    for path in [state_path(build_dir), disk_path(build_dir)] {
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))
            .map_err(|e| RuntimeError::io(&path, e))?;
    }
    for entry in std::fs::read_dir(build_dir)
        .map_err(|e| RuntimeError::io(build_dir, e))?
        .flatten()
    {
        let name = entry.file_name().to_string_lossy().to_string();
        if !["memory", "state", "disk.qcow2"].contains(&name.as_str()) {
            let _ = std::fs::remove_file(entry.path());
        }
    }
    crate::datadir::write_atomic(
        &build_dir.join("manifest.json"),
        &serde_json::to_vec_pretty(&manifest).expect("serializable"),
    )?;
    let dir = root.join(&manifest.key);
    // A snapshot of the same key made meanwhile (another server on this data dir) wins.
    if dir.exists() {
        let _ = std::fs::remove_dir_all(build_dir);
    } else {
        std::fs::rename(build_dir, &dir).map_err(|e| RuntimeError::io(&dir, e))?;
    }
    BaseSnapshot::find(root, &manifest.key)
        .ok_or_else(|| RuntimeError::io(&dir, std::io::Error::other("the sealed snapshot is incomplete")))
}

/// The snapshot dirs under `root` that no create restores from: incomplete, of a template digest
/// not in `digests`, or saved by a VMM build other than `vmm` (builds under way are not listed).
pub fn stale(root: &Path, digests: &std::collections::HashSet<String>, vmm: Option<&str>) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(root).into_iter().flatten().flatten() {
        let key = entry.file_name().to_string_lossy().to_string();
        if key.starts_with(BUILD_PREFIX) {
            continue;
        }
        let keep = BaseSnapshot::find(root, &key)
            .is_some_and(|s| digests.contains(&s.manifest.template_digest) && vmm == Some(s.manifest.vmm.as_str()));
        if !keep {
            out.push(entry.path());
        }
    }
    out.sort();
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn snapshot(root: &Path, key: &str, digest: &str, vmm: &str) {
        let dir = root.join(key);
        std::fs::create_dir_all(&dir).unwrap();
        for f in ["memory", "state", "disk.qcow2"] {
            std::fs::write(dir.join(f), b"").unwrap();
        }
        let manifest = SnapshotManifest {
            key: key.into(),
            template: "seed".into(),
            template_digest: digest.into(),
            resources: Resources::default(),
            accel: Accel::Tcg,
            vmm: vmm.into(),
            cmdline: "console=ttyS0".into(),
            created_at: "2026-11-30T00:00:00Z".into(),
            boot_ms: 1,
            save_ms: 1,
        };
        std::fs::write(dir.join("manifest.json"), serde_json::to_vec(&manifest).unwrap()).unwrap();
    }

    #[test]
    fn stale_snapshots_are_those_nothing_restores_from() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        snapshot(root, "current", "sha256:aa", "qemu 10");
        snapshot(root, "old-template", "sha256:bb", "qemu 10");
        snapshot(root, "old-qemu", "sha256:aa", "qemu 9");
        std::fs::create_dir_all(root.join("no-manifest")).unwrap();
        std::fs::create_dir_all(root.join(format!("{BUILD_PREFIX}snap1234"))).unwrap();
        let digests = ["sha256:aa".to_string()].into_iter().collect();
        let names = |v: Vec<PathBuf>| -> Vec<String> {
            v.iter()
                .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
                .collect()
        };
        assert_eq!(
            names(stale(root, &digests, Some("qemu 10"))),
            ["no-manifest", "old-qemu", "old-template"]
        );
        assert!(BaseSnapshot::find(root, "current").is_some());
        // A VMM that cannot restore keeps none.
        assert_eq!(stale(root, &digests, None).len(), 4);
    }

    #[test]
    fn the_key_changes_with_everything_a_restore_depends_on() {
        let r = Resources::default();
        let base = key("sha256:aa", &r, Accel::Tcg, "qemu 10", "c");
        let bigger = Resources { memory_mib: 1024, ..r };
        for other in [
            key("sha256:ab", &r, Accel::Tcg, "qemu 10", "c"),
            key("sha256:aa", &bigger, Accel::Tcg, "qemu 10", "c"),
            key("sha256:aa", &r, Accel::Kvm, "qemu 10", "c"),
            key("sha256:aa", &r, Accel::Tcg, "qemu 9", "c"),
            key("sha256:aa", &r, Accel::Tcg, "qemu 10", "d"),
        ] {
            assert_ne!(base, other);
        }
        assert_eq!(base, key("sha256:aa", &r, Accel::Tcg, "qemu 10", "c"));
    }
}
