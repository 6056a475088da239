//! Images saved from running sandboxes (a tenant's snapshots, forks): each is a dir under
//! `<data>/images/<id>/` holding the VM's whole saved state (`state`: RAM and devices), its disk
//! at that moment (`disk.qcow2`, a copy of its overlay) and hard links to every file below it
//! (`held/`: the frozen disks it sat on, kernel, initramfs, root filesystem), so an image keeps
//! working after its sandbox, template or base snapshot goes. `image.json` is written last: a dir
//! without one is a save that did not finish.
//!
//! [`Images`] owns the images dir: saving one from a running VM, digesting, finding, listing
//! and removing them (a create from one is the facade's). Uses `launch.rs`, `vm.rs` and
//! `saved.rs` for the format.

use super::launch::{Launcher, Source};
use super::saved::{copy_file, create_state_file, hold, Manifest, SavedMachine, SAVE_LIMIT};
use super::vm::Vm;
use crate::datadir::write_atomic;
use crate::error::{Result, RuntimeError};
use crate::vmm::{Accel, Resources, ResumeSpec};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Instant, SystemTime};

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

impl Manifest for ImageManifest {
    const FILE: &'static str = MANIFEST;
    /// A parsed manifest is a finished save (it is written last).
    fn complete(&self, _dir: &Path) -> bool {
        true
    }
}

/// A saved image on disk.
pub type Image = SavedMachine<ImageManifest>;

impl SavedMachine<ImageManifest> {
    /// The image `id` under `root`, if its save finished.
    pub fn find(root: &Path, id: &str) -> Option<Self> {
        if !valid_image_id(id) {
            return None;
        }
        Self::load(root.join(id))
    }

    /// A VM started from it, as a launch's source.
    pub(crate) fn source(&self) -> Source<'_> {
        let m = &self.manifest;
        Source::Image {
            template: &m.template,
            template_digest: &m.template_digest,
            resources: m.resources,
            machine: &m.machine,
            state: self.state(),
        }
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
        let state = crate::digest::sha256_file(&self.state())?;
        let disk = crate::digest::sha256_file(&self.disk())?;
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

/// This node's saved images.
pub struct Images {
    launcher: Arc<Launcher>,
}

impl Images {
    pub fn new(launcher: Arc<Launcher>) -> Self {
        Self { launcher }
    }

    /// Remove the saves an earlier process did not finish.
    pub fn remove_unfinished(&self) {
        for dir in unfinished(&self.launcher.data.images()) {
            tracing::info!("removing an unfinished image {}", dir.display());
            let _ = std::fs::remove_dir_all(dir);
        }
    }

    /// The saved image `id`, if it exists and this VMM can load it.
    pub fn find(&self, id: &str) -> Option<Image> {
        let image = Image::find(&self.launcher.data.images(), id)?;
        let vmm = self.launcher.vmm.snapshotting()?.build_id();
        (image.manifest.vmm == vmm).then_some(image)
    }

    /// Ids of the saved images.
    pub fn ids(&self) -> Vec<String> {
        std::fs::read_dir(self.launcher.data.images())
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect()
    }

    /// Remove image `id` (VMs made from it run on; a missing one is not an error).
    pub fn remove(&self, id: &str) -> Result<()> {
        remove(&self.launcher.data.images(), id)
    }

    /// Save `sb` as image `image_id`: it is stopped only while its memory is written and its
    /// disk copied, then runs again if `run_on` (with its sessions intact), else stays stopped
    /// for its caller to end it (a VM moving to another host: nothing it does after the save
    /// may be lost). VMs made from the image ([`super::CreateVm::image`]) start with its
    /// memory, processes and files at that moment.
    pub async fn save(&self, sb: &Vm, image_id: &str, run_on: bool) -> Result<Image> {
        if !valid_image_id(image_id) {
            return Err(RuntimeError::InvalidSandboxId(image_id.into()));
        }
        let l = &self.launcher;
        let id = sb.id();
        if sb.is_paused() {
            return Err(RuntimeError::NotRunning(format!("{id} (paused; resume it first)")));
        }
        if let Some(v) = sb.volumes().first() {
            // Its saved devices would name a disk no restored VM has: refused, never dropped.
            return Err(RuntimeError::VolumeBusy(format!(
                "sandbox {id} has volume {} mounted; a sandbox with volumes cannot be snapshotted or forked",
                v.serial
            )));
        }
        let snapshotting = l.snapshotting("snapshot")?;
        let machine = sb.record.machine.clone().ok_or_else(|| RuntimeError::ControlCommand {
            command: "snapshot".into(),
            reason: format!("sandbox {id} was started by an older server that did not record its machine"),
        })?;
        let dir = l.data.images().join(image_id);
        std::fs::create_dir(&dir).map_err(|e| RuntimeError::io(&dir, e))?;
        let disk = dir.join(<ImageManifest as Manifest>::DISK);
        let saved = async {
            let layers: Vec<PathBuf> = std::iter::once(disk.clone())
                .chain(
                    machine
                        .layers
                        .iter()
                        .enumerate()
                        .map(|(n, layer)| hold(&dir, &format!("layer-{n}.qcow2"), layer)),
                )
                .collect();
            let image_machine = ResumeSpec {
                layers,
                kernel: hold(&dir, "kernel", &machine.kernel),
                initrd: hold(&dir, "initrd", &machine.initrd),
                rootfs: hold(&dir, "rootfs", &machine.rootfs),
                ..machine.clone()
            };
            let started = Instant::now();
            let state = dir.join(<ImageManifest as Manifest>::STATE);
            let to = create_state_file(&state)?;
            let was_running = snapshotting.save_state(&sb.handle, to, SAVE_LIMIT).await?;
            // Stopped, its images flushed: the overlay as it is now is the image's disk.
            let copied = copy_file(&sb.handle.dir.join("disk.qcow2"), &disk).await;
            if was_running && (run_on || copied.is_err()) {
                l.vmm.resume(&sb.handle).await?;
            }
            copied?;
            let size = |p: &Path| std::fs::metadata(p).map(|m| m.len()).unwrap_or(0);
            let manifest = ImageManifest {
                id: image_id.to_string(),
                source: id.to_string(),
                template: sb.record.template.clone(),
                template_digest: sb.record.template_digest.clone(),
                resources: sb.record.resources,
                accel: sb.record.accel,
                vmm: snapshotting.build_id(),
                machine: image_machine,
                created_at: humantime::format_rfc3339_millis(SystemTime::now()).to_string(),
                state_bytes: size(&state),
                disk_bytes: size(&disk),
                save_ms: started.elapsed().as_millis() as u64,
                digest: None,
            };
            Image::seal(dir.clone(), manifest)
        }
        .await;
        if saved.is_err() {
            let _ = std::fs::remove_dir_all(&dir);
        }
        let image = saved?;
        tracing::info!(%id, image = %image_id, ms = image.manifest.save_ms, bytes = image.bytes(), "image saved");
        Ok(image)
    }

    /// Compute image `image_id`'s content address ([`Image::content_digest`]) and record it in
    /// its manifest; a digest recorded before is returned as it is. Off the save's path: the VM
    /// it came from runs meanwhile, and forks' images need none.
    pub async fn digest(&self, image_id: &str) -> Result<String> {
        let root = self.launcher.data.images();
        let image = Image::find(&root, image_id).ok_or_else(|| RuntimeError::UnknownImage(image_id.into()))?;
        if let Some(d) = &image.manifest.digest {
            return Ok(d.clone());
        }
        tokio::task::spawn_blocking(move || {
            let started = Instant::now();
            let digest = image.content_digest()?;
            let manifest = ImageManifest {
                digest: Some(digest.clone()),
                ..image.manifest.clone()
            };
            write_atomic(
                &image.dir.join(MANIFEST),
                &serde_json::to_vec_pretty(&manifest).expect("serializable"),
            )?;
            tracing::info!(image = %manifest.id, %digest, ms = started.elapsed().as_millis() as u64, "image digested");
            Ok(digest)
        })
        .await
        .map_err(|e| RuntimeError::io(&root, std::io::Error::other(e.to_string())))?
    }
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
                volume_bus: true,
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
