//! Images saved from running sandboxes (a tenant's snapshots, forks): each is a dir under
//! `<data>/images/<id>/` holding the VM's whole saved state (`state`: RAM and devices), its disk
//! at that moment (`disk.qcow2`, a copy of its overlay) and hard links to every file below it
//! (`held/`: the frozen disks it sat on, kernel, initramfs, root filesystem), so an image keeps
//! working after its sandbox, template or base snapshot goes. `image.json` is written last: a dir
//! without one is a save that did not finish.

use crate::error::{Result, RuntimeError};
use crate::vmm::{Accel, Resources, ResumeSpec};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

pub const MANIFEST: &str = "image.json";

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct ImageManifest {
    pub id: String,
    /// The sandbox it was saved from.
    pub source: String,
    pub template: String,
    pub template_digest: String,
    /// Fixed by the saved machine: a sandbox made from it has these.
    pub resources: Resources,
    pub accel: Accel,
    /// The VMM build that saved it (only that one can load it).
    pub vmm: String,
    /// The machine, its files inside this dir.
    pub machine: ResumeSpec,
    /// RFC 3339.
    pub created_at: String,
    pub state_bytes: u64,
    pub disk_bytes: u64,
    /// How long the source was stopped for the save.
    pub save_ms: u64,
}

#[derive(Debug, Clone)]
pub struct Image {
    pub dir: PathBuf,
    pub manifest: ImageManifest,
}

impl Image {
    pub fn state(&self) -> PathBuf {
        self.dir.join("state")
    }

    /// The image `id` under `root`, if its save finished.
    pub fn find(root: &Path, id: &str) -> Option<Self> {
        if !valid_image_id(id) {
            return None;
        }
        let dir = root.join(id);
        let manifest = serde_json::from_slice(&std::fs::read(dir.join(MANIFEST)).ok()?).ok()?;
        Some(Self { dir, manifest })
    }

    pub fn bytes(&self) -> u64 {
        self.manifest.state_bytes + self.manifest.disk_bytes
    }
}

/// Image ids name dirs: lowercase letters, digits, `_` and `-`.
pub fn valid_image_id(id: &str) -> bool {
    (4..=64).contains(&id.len())
        && id
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-')
}

/// Remove image `id`. Sandboxes made from it keep running: they hold their own links to its disk.
pub fn remove(root: &Path, id: &str) -> Result<()> {
    if !valid_image_id(id) {
        return Ok(());
    }
    let dir = root.join(id);
    match std::fs::remove_dir_all(&dir) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(RuntimeError::io(&dir, e)),
        _ => Ok(()),
    }
}

/// Dirs of saves that never finished (a crash): removed at start.
pub fn unfinished(root: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(root)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.is_dir() && !p.join(MANIFEST).exists())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_plain_names() {
        assert!(valid_image_id("snap_0123abcd"));
        for bad in ["", "..", "a/b", "UPPER", "x", "snap 1", "../etc"] {
            assert!(!valid_image_id(bad), "{bad}");
        }
    }

    #[test]
    fn an_unfinished_save_is_found_and_a_finished_one_kept() {
        let root = tempfile::tempdir().unwrap();
        std::fs::create_dir(root.path().join("half")).unwrap();
        std::fs::create_dir(root.path().join("whole")).unwrap();
        std::fs::write(root.path().join("whole").join(MANIFEST), b"{}").unwrap();
        assert_eq!(unfinished(root.path()), vec![root.path().join("half")]);
        assert!(Image::find(root.path(), "whole").is_none(), "a manifest that does not parse");
        remove(root.path(), "whole").unwrap();
        assert!(!root.path().join("whole").exists());
        remove(root.path(), "../whole").unwrap();
    }
}
