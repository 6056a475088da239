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
//!
//! [`BaseSnapshots`] owns the builds (which keys are being built or failed, the builder VMs
//! running now). Uses `launch.rs` to boot a builder and `saved.rs` for the format.

use super::launch::{start_template_process, warm_first_shell, Launcher, Source};
use super::saved::{Manifest, SavedMachine, SAVE_LIMIT};
use crate::agent::AgentClient;
use crate::datadir::random_hex;
use crate::error::{Result, RuntimeError};
use crate::net::SandboxLink;
use crate::template::Template;
use crate::vmm::{Accel, Resources, SnapshotRole, VmHandle, VmSpec};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

/// Bumped when what a snapshot holds, or how it is restored, changes (2: a login shell has run).
pub const FORMAT: u32 = 2;
/// The prefix of a build's working dir.
pub const BUILD_PREFIX: &str = ".build-";

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct BaseSnapshotManifest {
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

impl Manifest for BaseSnapshotManifest {
    const FILE: &'static str = "manifest.json";
    fn complete(&self, dir: &Path) -> bool {
        [memory_path(dir), state_path(dir), disk_path(dir)]
            .iter()
            .all(|p| p.is_file())
    }
}

/// A base snapshot on disk.
pub type BaseSnapshot = SavedMachine<BaseSnapshotManifest>;

impl SavedMachine<BaseSnapshotManifest> {
    pub fn memory(&self) -> PathBuf {
        memory_path(&self.dir)
    }

    /// The snapshot under `root` for `key`, if one is complete there.
    pub fn find(root: &Path, key: &str) -> Option<Self> {
        Self::load(root.join(key)).filter(|s| s.manifest.key == key)
    }

    /// A clone of it, as a launch's source.
    pub(crate) fn source<'a>(&self, template: &'a Template, resources: Resources) -> Source<'a> {
        Source::BaseSnapshot {
            template,
            resources,
            memory: self.memory(),
            state: self.state(),
            disk: self.disk(),
            cmdline: self.manifest.cmdline.clone(),
        }
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
pub fn seal(root: &Path, build_dir: &Path, manifest: BaseSnapshotManifest) -> Result<BaseSnapshot> {
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
    let key = manifest.key.clone();
    BaseSnapshot::seal(build_dir.to_path_buf(), manifest)?;
    let dir = root.join(&key);
    // A snapshot of the same key made meanwhile (another server on this data dir) wins.
    if dir.exists() {
        let _ = std::fs::remove_dir_all(build_dir);
    } else {
        std::fs::rename(build_dir, &dir).map_err(|e| RuntimeError::io(&dir, e))?;
    }
    BaseSnapshot::find(root, &key)
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

/// The kernel command line base snapshots are booted with: the hostname in it is a placeholder,
/// since every clone gets its own over the channel.
pub fn builder_cmdline() -> String {
    crate::vmm::qemu::kernel_cmdline("sandbox")
}

/// This node's base snapshots: which are wanted, built in the background one at a time, and
/// the builder VMs running now.
pub struct BaseSnapshots {
    launcher: Arc<Launcher>,
    enabled: bool,
    /// Keys of base snapshots being built, or whose build failed (not tried again by this process).
    builds: Mutex<HashSet<String>>,
    /// Builder VMs running now, by build id (stopped by [`BaseSnapshots::stop_builds`]).
    builders: Mutex<HashMap<String, VmHandle>>,
}

impl BaseSnapshots {
    pub fn new(launcher: Arc<Launcher>, enabled: bool) -> Self {
        Self {
            launcher,
            enabled,
            builds: Mutex::default(),
            builders: Mutex::default(),
        }
    }

    /// The key of the base snapshot a create of `template` with `resources` restores from, where
    /// base snapshots are on and the VMM can restore.
    pub fn key_for(&self, template: &Template, resources: &Resources, accel: Accel) -> Option<String> {
        if !self.enabled {
            return None;
        }
        let vmm = self.launcher.vmm.snapshotting()?.build_id();
        Some(key(
            &template.manifest.digest,
            resources,
            accel,
            &vmm,
            &builder_cmdline(),
        ))
    }

    /// The base snapshot `key`, if it is built.
    pub fn find(&self, key: &str) -> Option<BaseSnapshot> {
        BaseSnapshot::find(&self.launcher.data.base_snapshots(), key)
    }

    /// Ids of the builder VMs running now (their networks and jails are live).
    pub fn builder_ids(&self) -> Vec<String> {
        self.builders.lock().unwrap().keys().cloned().collect()
    }

    /// Build the base snapshot `key` in the background, unless it is being built or failed.
    pub fn want(self: &Arc<Self>, key: String, template: Template, resources: Resources, accel: Accel) {
        if !self.builds.lock().unwrap().insert(key.clone()) {
            return;
        }
        let this = self.clone();
        tokio::spawn(async move {
            // One build at a time: each is a whole boot.
            static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
            let _turn = ONE_AT_A_TIME.lock().await;
            match this.build(&key, &template, resources, accel).await {
                Ok(snap) => {
                    tracing::info!(
                        template = %template.manifest.name, snapshot = %key,
                        "base snapshot built: boot {} ms, save {} ms", snap.manifest.boot_ms, snap.manifest.save_ms
                    );
                    this.builds.lock().unwrap().remove(&key);
                }
                Err(e) => {
                    tracing::warn!(template = %template.manifest.name, snapshot = %key, "base snapshot build failed: {e}")
                }
            }
        });
    }

    /// Boot `template` with `resources` once, wait for its agent (and start process), and save it
    /// as base snapshot `key`.
    pub async fn build(
        &self,
        key: &str,
        template: &Template,
        resources: Resources,
        accel: Accel,
    ) -> Result<BaseSnapshot> {
        let l = &self.launcher;
        let root = l.data.base_snapshots();
        let (id, dir) = new_build_dir(&root)?;
        let mut link = None;
        let started = Instant::now();
        let result = async {
            let snapshotting = l.snapshotting("save")?;
            let memory = create_memory_file(&dir, resources.memory_mib)?;
            let cmdline = builder_cmdline();
            let mut spec = VmSpec::for_template(&id, dir.clone(), template, resources, accel);
            spec.snapshot = Some(SnapshotRole::Builder {
                memory,
                state: state_path(&dir),
                cmdline: cmdline.clone(),
            });
            let vm = l.start_vm(&id, &dir, spec, &mut link, true).await?;
            self.builders.lock().unwrap().insert(id.clone(), vm.clone());
            let limit = l.boot_timeout;
            let (client, _) = AgentClient::connect_ready(&vm.agent_socket, limit).await?;
            if let Some(start) = &template.manifest.start {
                start_template_process(&client, start, limit).await?;
            }
            warm_first_shell(&client).await;
            // Saved between sessions: a clone's host starts a new one.
            drop(client);
            tokio::time::sleep(Duration::from_millis(300)).await;
            let boot_ms = started.elapsed().as_millis() as u64;
            let saving = Instant::now();
            snapshotting.save(&vm, SAVE_LIMIT).await?;
            Ok::<_, RuntimeError>(BaseSnapshotManifest {
                key: key.to_string(),
                template: template.manifest.name.clone(),
                template_digest: template.manifest.digest.clone(),
                resources,
                accel,
                vmm: snapshotting.build_id(),
                cmdline,
                created_at: humantime::format_rfc3339_seconds(SystemTime::now()).to_string(),
                boot_ms,
                save_ms: saving.elapsed().as_millis() as u64,
            })
        }
        .await;
        let builder = self.builders.lock().unwrap().remove(&id);
        match result {
            Ok(manifest) => {
                self.end_build(&id, &dir, builder, false).await;
                seal(&root, &dir, manifest)
            }
            Err(e) => {
                self.end_build(&id, &dir, builder, true).await;
                Err(e)
            }
        }
    }

    /// What build `id` in `dir` had outside its files: its VM (if it still runs), its network
    /// (as recorded in `dir`), its jail (by the id it was taken with, not by the dir's name);
    /// and, with `remove_dir`, the dir itself.
    async fn end_build(&self, id: &str, dir: &Path, vm: Option<VmHandle>, remove_dir: bool) {
        let l = &self.launcher;
        let vm = vm
            .or_else(|| VmHandle::load(dir))
            .or_else(|| VmHandle::orphan(dir, l.vmm.name()));
        l.stop_if_running(vm).await;
        l.remove_network(SandboxLink::load(dir).as_ref()).await;
        l.vmm.release(id);
        if remove_dir {
            let _ = std::fs::remove_dir_all(dir);
        }
    }

    /// Stop the builds running now (a server shutting down): the build's own cleanup may not get
    /// to run before the exit.
    pub async fn stop_builds(&self) {
        let builders: Vec<(String, VmHandle)> = self.builders.lock().unwrap().drain().collect();
        for (id, vm) in builders {
            let dir = vm.dir.clone();
            self.end_build(&id, &dir, Some(vm), true).await;
        }
    }

    /// Builds an earlier process left unfinished (it crashed or was stopped): their VMs stopped,
    /// their networks, jails and dirs removed.
    pub async fn remove_interrupted(&self) {
        let root = self.launcher.data.base_snapshots();
        for entry in std::fs::read_dir(&root).into_iter().flatten().flatten() {
            let name = entry.file_name().to_string_lossy().to_string();
            let Some(id) = name.strip_prefix(BUILD_PREFIX) else {
                continue;
            };
            tracing::info!("removing an interrupted base snapshot build {}", entry.path().display());
            self.end_build(id, &entry.path(), None, true).await;
        }
    }

    /// Remove base snapshots no create can restore from any more: of a template digest no
    /// template has now (rebuilt or removed), or saved by another VMM build. Clones running from
    /// one keep its files open, so they run on.
    pub fn prune(&self) {
        let l = &self.launcher;
        let digests: HashSet<String> = l.templates.list().into_iter().map(|m| m.digest).collect();
        let vmm = l.vmm.snapshotting().map(|s| s.build_id());
        for dir in stale(&l.data.base_snapshots(), &digests, vmm.as_deref()) {
            tracing::info!(
                "removing base snapshot {}: nothing restores from it any more",
                dir.display()
            );
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A VMM that runs nothing and records what it is asked to release.
    #[derive(Default)]
    struct Releases(Mutex<Vec<String>>);

    #[async_trait::async_trait]
    impl crate::vmm::Vmm for Releases {
        fn name(&self) -> &'static str {
            "none"
        }
        async fn start(&self, _: &VmSpec) -> Result<VmHandle> {
            unreachable!("nothing starts")
        }
        async fn stop(&self, _: &VmHandle, _: Duration) -> Result<()> {
            Ok(())
        }
        fn is_running(&self, _: &VmHandle) -> bool {
            false
        }
        async fn pause(&self, _: &VmHandle) -> Result<()> {
            Ok(())
        }
        async fn resume(&self, _: &VmHandle) -> Result<()> {
            Ok(())
        }
        async fn is_paused(&self, _: &VmHandle) -> Result<bool> {
            Ok(false)
        }
        fn release(&self, id: &str) {
            self.0.lock().unwrap().push(id.to_string());
        }
    }

    #[tokio::test]
    async fn an_interrupted_build_releases_the_jail_it_took_not_its_dir_name() {
        let tmp = tempfile::tempdir().unwrap();
        let data = crate::datadir::DataDir::open(tmp.path()).unwrap();
        let vmm = Arc::new(Releases::default());
        let launcher = Arc::new(Launcher {
            lock: crate::datadir::FileLock::try_acquire(&tmp.path().join("runtime.lock"))
                .unwrap()
                .unwrap(),
            templates: crate::template::TemplateStore::new(data.clone()),
            data,
            vmm: vmm.clone(),
            net: None,
            boot_timeout: Duration::from_secs(1),
        });
        let (id, dir) = new_build_dir(&launcher.data.base_snapshots()).unwrap();
        BaseSnapshots::new(launcher, true).remove_interrupted().await;
        assert_eq!(*vmm.0.lock().unwrap(), [id]);
        assert!(!dir.exists());
    }

    fn snapshot(root: &Path, key: &str, digest: &str, vmm: &str) {
        let dir = root.join(key);
        std::fs::create_dir_all(&dir).unwrap();
        for f in ["memory", "state", "disk.qcow2"] {
            std::fs::write(dir.join(f), b"").unwrap();
        }
        let manifest = BaseSnapshotManifest {
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
