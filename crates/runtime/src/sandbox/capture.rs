//! A template build's last step on the node: the build VM's disk becomes a new template. The
//! guest's writes are synced, its VM stopped, its disk (overlay over the parent's image) written
//! out as one raw ext4 image and committed to the template store by content digest beside the
//! parent's kernel and initramfs. The image is never mounted on the host: the guest wrote it.
//! Staging lives in `cache/capture-*`, which a restart removes, so a crash leaves no half template.

use super::Runtime;
use crate::datadir::random_hex;
use crate::error::{Result, RuntimeError};
use crate::template::{Built, StartSpec, TemplateManifest, INITRD_FILE, KERNEL_FILE, ROOTFS_FILE};
use std::time::{Duration, SystemTime};

/// Staging dirs of captures under way, in the cache.
const STAGING_PREFIX: &str = "capture-";

/// What a template built in a VM is called and does (see [`Runtime::capture_template`]).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Capture {
    /// The template's name in this node's store.
    pub name: String,
    /// What identifies the build's content (its cache key), kept as the recipe digest.
    pub key: String,
    pub start: Option<StartSpec>,
    pub built: Built,
}

impl Runtime {
    /// End VM `id` and keep its disk as template `capture.name`, made from the template the VM
    /// started from (its kernel and initramfs). The VM is gone afterwards whatever the outcome.
    pub async fn capture_template(&self, id: &str, capture: Capture) -> Result<TemplateManifest> {
        let l = &self.inner.launcher;
        let vm = self.get(id)?;
        // What the guest wrote is in its page cache until synced: the image must have it.
        let synced = match vm.agent().await {
            Ok(agent) => agent.sync().await.map_err(RuntimeError::from),
            Err(e) => Err(e),
        };
        vm.set_deleting(true);
        let stopped = l.vmm.stop(&vm.handle, Duration::from_secs(5)).await;
        self.inner.registry.remove(id);
        l.remove_network(vm.net.as_ref()).await;
        let staging = l.data.cache().join(format!("{STAGING_PREFIX}{}", random_hex(6)));
        let result: Result<TemplateManifest> = async {
            synced?;
            stopped?;
            let parent = l
                .templates
                .list()
                .into_iter()
                .find(|m| m.digest == vm.record.template_digest)
                .ok_or_else(|| {
                    RuntimeError::UnknownTemplate(format!(
                        "{} ({}), which the build started from, is no longer on this node",
                        vm.record.template, vm.record.template_digest
                    ))
                })?;
            std::fs::create_dir_all(&staging).map_err(|e| RuntimeError::io(&staging, e))?;
            let held = vm.handle.dir.join("held");
            let (layers, rootfs) = match &vm.record.machine {
                Some(m) => (m.layers.clone(), m.rootfs.clone()),
                None => (Vec::new(), held.join("rootfs")),
            };
            l.vmm
                .export_disk(&vm.handle, &layers, &rootfs, &staging.join(ROOTFS_FILE))
                .await?;
            for (held, file) in [("kernel", KERNEL_FILE), ("initrd", INITRD_FILE)] {
                let from = vm.handle.dir.join("held").join(held);
                let to = staging.join(file);
                if std::fs::hard_link(&from, &to).is_err() {
                    std::fs::copy(&from, &to).map_err(|e| RuntimeError::io(&from, e))?;
                }
            }
            // Digesting the image reads all of it: off the async workers.
            let store = crate::template::TemplateStore::new(l.data.clone());
            let (stage, capture) = (staging.clone(), capture.clone());
            let commit = tokio::task::spawn_blocking(move || {
                store.commit(&stage, |digest, size_bytes, rootfs_bytes| {
                    let mut recipe = parent.recipe.clone();
                    recipe.name = capture.name.clone();
                    TemplateManifest {
                        name: capture.name.clone(),
                        digest,
                        kernel_version: parent.kernel_version.clone(),
                        built_at: humantime::format_rfc3339_seconds(SystemTime::now()).to_string(),
                        size_bytes,
                        rootfs_bytes,
                        recipe_digest: capture.key.clone(),
                        recipe,
                        start: capture.start.clone(),
                        built: Some(capture.built.clone()),
                    }
                })
            });
            let (t, _) = commit
                .await
                .map_err(|e| RuntimeError::io(&staging, std::io::Error::other(e.to_string())))??;
            Ok(t.manifest)
        }
        .await;
        // `commit` moved the staging dir into the store, or left it (its blobs were there).
        let _ = std::fs::remove_dir_all(&staging);
        let _ = l.discard(id, &vm.handle.dir);
        let manifest = result?;
        self.snapshot_built(&manifest.name).await;
        Ok(manifest)
    }

    /// The base snapshot a create of built template `name` naming no shape restores
    /// from, made now (a boot, its start command, its ready check): the first sandbox of it
    /// starts restored, as one of `seed` does. A failure is logged: creates then boot.
    async fn snapshot_built(&self, name: &str) {
        let Ok(template) = self.inner.launcher.templates.resolve(name) else {
            return;
        };
        let accel = self.accel().await;
        let resources = crate::Resources::for_template(&template.manifest);
        let snapshots = &self.inner.base_snapshots;
        let Some(key) = snapshots.key_for(&template, &resources, accel) else {
            return;
        };
        if snapshots.find(&key).is_some() {
            return;
        }
        match snapshots.build(&key, &template, resources, accel).await {
            Ok(snap) => tracing::info!(
                template = name, snapshot = %key,
                "base snapshot built: boot {} ms, save {} ms", snap.manifest.boot_ms, snap.manifest.save_ms
            ),
            Err(e) => tracing::warn!(template = name, snapshot = %key, "base snapshot build failed: {e}"),
        }
    }

    /// Remove template `name` from this node's store: its manifest now, its image once nothing
    /// made from it is left (VMs keep their own links to it).
    pub fn remove_template(&self, name: &str) -> Result<()> {
        let path = self.inner.launcher.templates.manifest_path(name);
        match std::fs::remove_file(&path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(RuntimeError::io(&path, e)),
            _ => {
                self.prune_blobs();
                Ok(())
            }
        }
    }

    /// Staging of captures an earlier process did not finish.
    pub(super) fn remove_unfinished_captures(&self) {
        let cache = self.inner.launcher.data.cache();
        for entry in std::fs::read_dir(&cache).into_iter().flatten().flatten() {
            if entry.file_name().to_string_lossy().starts_with(STAGING_PREFIX) {
                tracing::info!(
                    "removing {}: a template capture that did not finish",
                    entry.path().display()
                );
                let _ = std::fs::remove_dir_all(entry.path());
            }
        }
    }
}
