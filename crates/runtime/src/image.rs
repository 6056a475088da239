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
    /// The content address (`sha256:<hex>`, see [`Image::content_digest`]), once computed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub digest: Option<String>,
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

    /// The image's content address, `sha256:<hex>`: a digest over the digests of its saved
    /// memory and device state and of its disk, and over what those sit on and need (the
    /// template's own content digest for the disk's lower layers, the resources and the
    /// accelerator). Equal digests restore to the same machine; a changed byte changes it.
    /// Reads both files whole (about a second per 512 MiB here), so it runs off the save's path.
    pub fn content_digest(&self) -> Result<String> {
        let state = crate::template::sha256_file(&self.state())?;
        let disk = crate::template::sha256_file(&self.dir.join("disk.qcow2"))?;
        let m = &self.manifest;
        let canonical = serde_json::json!({
            "format": "airlock-image/1",
            "state": state,
            "disk": disk,
            "template_digest": m.template_digest,
            "resources": m.resources,
            "accel": m.accel,
        });
        use sha2::{Digest, Sha256};
        Ok(format!(
            "sha256:{}",
            hex::encode(Sha256::digest(canonical.to_string().as_bytes()))
        ))
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
        assert!(
            Image::find(root.path(), "whole").is_none(),
            "a manifest that does not parse"
        );
        remove(root.path(), "whole").unwrap();
        assert!(!root.path().join("whole").exists());
        remove(root.path(), "../whole").unwrap();
    }

    fn image_in(dir: &Path, state: &[u8], disk: &[u8]) -> Image {
        std::fs::create_dir_all(dir).unwrap();
        std::fs::write(dir.join("state"), state).unwrap();
        std::fs::write(dir.join("disk.qcow2"), disk).unwrap();
        let manifest = ImageManifest {
            id: "snap_test".into(),
            source: "sb".into(),
            template: "seed".into(),
            template_digest: "sha256:template".into(),
            resources: Resources::default(),
            accel: Accel::Tcg,
            vmm: "qemu".into(),
            machine: ResumeSpec {
                cmdline: String::new(),
                memory_backend: false,
                layers: Vec::new(),
                kernel: dir.join("kernel"),
                initrd: dir.join("initrd"),
                rootfs: dir.join("rootfs"),
            },
            created_at: String::new(),
            state_bytes: state.len() as u64,
            disk_bytes: disk.len() as u64,
            save_ms: 0,
            digest: None,
        };
        Image {
            dir: dir.to_path_buf(),
            manifest,
        }
    }

    #[test]
    fn the_content_digest_follows_the_bytes_and_the_machine_not_the_place_or_time() {
        let root = tempfile::tempdir().unwrap();
        let a = image_in(&root.path().join("a"), b"memory", b"disk");
        let digest = a.content_digest().unwrap();
        assert!(digest.starts_with("sha256:") && digest.len() == 7 + 64, "{digest}");
        let mut same = image_in(&root.path().join("b"), b"memory", b"disk");
        same.manifest.id = "snap_other".into();
        same.manifest.created_at = "later".into();
        same.manifest.save_ms = 5;
        assert_eq!(same.content_digest().unwrap(), digest, "same content elsewhere, later");
        assert_ne!(
            image_in(&root.path().join("c"), b"memorY", b"disk")
                .content_digest()
                .unwrap(),
            digest
        );
        assert_ne!(
            image_in(&root.path().join("d"), b"memory", b"disK")
                .content_digest()
                .unwrap(),
            digest
        );
        // The bytes moved from one file to the other are another machine.
        assert_ne!(
            image_in(&root.path().join("e"), b"memorydisk", b"")
                .content_digest()
                .unwrap(),
            digest
        );
        let mut bigger = image_in(&root.path().join("f"), b"memory", b"disk");
        bigger.manifest.resources.memory_mib *= 2;
        assert_ne!(bigger.content_digest().unwrap(), digest);
        let mut rebased = image_in(&root.path().join("g"), b"memory", b"disk");
        rebased.manifest.template_digest = "sha256:another".into();
        assert_ne!(rebased.content_digest().unwrap(), digest);
    }
}
