//! Volumes in VMs: attaching a volume's disk to a running VM (hot-plugged on its volume
//! controller, then mounted by its agent), who holds a volume, and where the host's file calls
//! on a volume go: the agent of the VM that has it mounted, else a helper VM's.
//!
//! Sharing: one VM may have a volume read-write, or any number read-only, never both (ext4 is
//! not a shared filesystem: a reader beside a writer would read a torn tree).
//!
//! The helper: the host never mounts a disk a guest wrote (its bytes are the guest's, and a
//! kernel parsing them is the attack surface), so file calls on a volume no VM has run in a
//! helper VM of `seed`, sealed (no egress), started for the volume (from `seed`'s base snapshot
//! where there is one), ended once idle for [`HELPER_IDLE`] or when a VM mounts the volume.
//! Marked `helper.json`, it is removed like a pool VM after a restart.

use super::launch::Purpose;
use super::{CreateVm, Runtime, Vm};
use crate::agent::AgentClient;
use crate::datadir::random_hex;
use crate::error::{Result, RuntimeError};
use crate::vmm::{Resources, VolumeDisk, MAX_VOLUMES};
use airlock_proto::MountVolume;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long a helper VM stays up after its last call.
pub const HELPER_IDLE: Duration = Duration::from_secs(60);
/// The helpers' template.
const HELPER_TEMPLATE: &str = "seed";

/// A volume to mount in a VM.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeMount {
    pub volume: String,
    /// Absolute path in the guest.
    pub path: String,
    pub read_only: bool,
    /// Who gets a fresh volume's root directory (the sandbox's default user).
    pub owner: Option<String>,
}

/// Where a file call on a volume goes: `agent`, under `root` (the volume's access path there,
/// which follows no symlink).
pub struct VolumeAccess {
    pub agent: AgentClient,
    pub root: String,
    /// The VM serving it: a sandbox's id, or `None` for a helper.
    pub sandbox: Option<String>,
}

/// A VM that has a volume.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeHolder {
    pub sandbox: String,
    pub read_only: bool,
    /// Suspended (its disk attached again when it resumes) or paused: no file calls through it.
    pub asleep: bool,
}

#[derive(Default)]
pub(super) struct Helpers {
    by_volume: tokio::sync::Mutex<HashMap<String, (Arc<Vm>, Instant)>>,
}

impl Runtime {
    /// This node's volumes' disks.
    pub fn volume_disks(&self) -> &crate::volume::VolumeDisks {
        &self.inner.volumes
    }

    /// The VMs that have `volume` (running, paused or suspended), helpers aside.
    pub fn volume_holders(&self, volume: &str) -> Vec<VolumeHolder> {
        let mut out = Vec::new();
        for vm in self.list() {
            if let Some(d) = vm.volumes().into_iter().find(|d| d.serial == volume) {
                out.push(VolumeHolder {
                    sandbox: vm.id().to_string(),
                    read_only: d.read_only,
                    asleep: vm.is_paused(),
                });
            }
        }
        for id in self.inner.registry.suspended_ids() {
            if let Some(record) = self.inner.registry.suspended(&id) {
                if let Some(d) = record.volumes.iter().find(|d| d.serial == volume) {
                    out.push(VolumeHolder {
                        sandbox: id,
                        read_only: d.read_only,
                        asleep: true,
                    });
                }
            }
        }
        out
    }

    /// Attach and mount `mounts` in VM `id`, in order. Refused where a mount would share a
    /// volume with a writer (or make a second writer); a helper holding one is ended first.
    pub async fn attach_volumes(&self, id: &str, mounts: &[VolumeMount]) -> Result<()> {
        let vm = self.get(id)?;
        let hotplug = self.inner.launcher.vmm.hotplug().ok_or_else(|| {
            RuntimeError::InvalidVolume(format!("the {} VMM cannot attach volumes", self.runtime_name()))
        })?;
        for m in mounts {
            if !self.inner.volumes.exists(&m.volume) {
                return Err(RuntimeError::UnknownVolume(m.volume.clone()));
            }
            let holders: Vec<_> = self
                .volume_holders(&m.volume)
                .into_iter()
                .filter(|h| h.sandbox != id)
                .collect();
            if let Some(h) = holders.iter().find(|h| !m.read_only || !h.read_only) {
                return Err(RuntimeError::VolumeBusy(format!(
                    "volume {} is mounted {} by sandbox {}; a volume has one writer or any readers",
                    m.volume,
                    if h.read_only { "read-only" } else { "read-write" },
                    h.sandbox
                )));
            }
            self.end_helper(&m.volume).await;
            let have = vm.volumes();
            if have.len() >= MAX_VOLUMES {
                return Err(RuntimeError::InvalidVolume(format!(
                    "a sandbox has at most {MAX_VOLUMES} volumes"
                )));
            }
            let slot = (0..MAX_VOLUMES as u32)
                .find(|s| have.iter().all(|d| d.slot != *s))
                .expect("a free slot below the cap");
            let disk = VolumeDisk {
                serial: m.volume.clone(),
                path: self.inner.volumes.path(&m.volume),
                read_only: m.read_only,
                slot,
            };
            hotplug.attach_disk(&vm.handle, &disk).await?;
            vm.add_volume(disk)?;
            vm.agent()
                .await?
                .mount_volume(&MountVolume {
                    serial: m.volume.clone(),
                    path: m.path.clone(),
                    read_only: m.read_only,
                    owner: m.owner.clone(),
                })
                .await?;
        }
        Ok(())
    }

    /// Where a file call on `volume` goes: the running VM that has it (read-write for a
    /// `write`), else a helper VM started for it. Refused while a VM that has it sleeps, or
    /// only readers have it and this is a write.
    pub async fn volume_access(&self, volume: &str, write: bool) -> Result<VolumeAccess> {
        if !self.inner.volumes.exists(volume) {
            return Err(RuntimeError::UnknownVolume(volume.to_string()));
        }
        let holders = self.volume_holders(volume);
        if let Some(h) = holders.iter().find(|h| !h.read_only || !write) {
            if h.asleep {
                return Err(RuntimeError::VolumeBusy(format!(
                    "volume {volume} is mounted by sandbox {}, which is paused or suspended; resume it first",
                    h.sandbox
                )));
            }
            let vm = self.get(&h.sandbox)?;
            return Ok(VolumeAccess {
                agent: vm.agent().await?,
                root: MountVolume::access_path(volume),
                sandbox: Some(h.sandbox.clone()),
            });
        }
        if let Some(h) = holders.first() {
            return Err(RuntimeError::VolumeBusy(format!(
                "volume {volume} is mounted read-only by sandbox {}; it takes no writes until they end",
                h.sandbox
            )));
        }
        let mut helpers = self.inner.helpers.by_volume.lock().await;
        if let Some((vm, used)) = helpers.get_mut(volume) {
            if let Ok(agent) = vm.agent().await {
                *used = Instant::now();
                return Ok(VolumeAccess {
                    agent,
                    root: MountVolume::access_path(volume),
                    sandbox: None,
                });
            }
        }
        if let Some((old, _)) = helpers.remove(volume) {
            self.inner.launcher.discard_unadopted(&old).await;
        }
        let vm = self.start_helper(volume).await?;
        let agent = vm.agent().await?;
        helpers.insert(volume.to_string(), (vm, Instant::now()));
        Ok(VolumeAccess {
            agent,
            root: MountVolume::access_path(volume),
            sandbox: None,
        })
    }

    async fn start_helper(&self, volume: &str) -> Result<Arc<Vm>> {
        let req = CreateVm {
            id: None,
            template: HELPER_TEMPLATE.into(),
            resources: Resources::default(),
            image: None,
            env: Default::default(),
            volumes: Vec::new(),
        };
        let started = Instant::now();
        let vm = self
            .start_new(format!("vh{}", random_hex(9)), &req, Purpose::Helper)
            .await?;
        let disk = VolumeDisk {
            serial: volume.to_string(),
            path: self.inner.volumes.path(volume),
            read_only: false,
            slot: 0,
        };
        let attached = async {
            let hotplug = self
                .inner
                .launcher
                .vmm
                .hotplug()
                .ok_or_else(|| RuntimeError::InvalidVolume("this VMM cannot attach volumes".into()))?;
            hotplug.attach_disk(&vm.handle, &disk).await?;
            vm.add_volume(disk)?;
            vm.agent()
                .await?
                .mount_volume(&MountVolume {
                    serial: volume.to_string(),
                    path: format!("/mnt/{volume}"),
                    read_only: false,
                    owner: None,
                })
                .await?;
            Ok::<_, RuntimeError>(())
        }
        .await;
        if let Err(e) = attached {
            self.inner.launcher.discard_unadopted(&vm).await;
            return Err(e);
        }
        tracing::info!(%volume, helper = %vm.id(), ms = started.elapsed().as_millis() as u64, "volume helper up");
        Ok(vm)
    }

    /// End `volume`'s helper, if it has one: its guest syncs first, so what the calls wrote
    /// is on the disk before another VM mounts it.
    pub async fn end_helper(&self, volume: &str) {
        let helper = self.inner.helpers.by_volume.lock().await.remove(volume);
        if let Some((vm, _)) = helper {
            self.sync_and_discard(&vm).await;
        }
    }

    async fn sync_and_discard(&self, vm: &Vm) {
        if let Ok(agent) = vm.agent().await {
            let _ = tokio::time::timeout(Duration::from_secs(30), agent.sync()).await;
        }
        self.inner.launcher.discard_unadopted(vm).await;
    }

    /// End the helpers idle for [`HELPER_IDLE`] (the runtime's idle task calls it).
    pub async fn end_idle_helpers(&self) {
        let idle: Vec<Arc<Vm>> = {
            let mut helpers = self.inner.helpers.by_volume.lock().await;
            let ids: Vec<String> = helpers
                .iter()
                .filter(|(_, (_, used))| used.elapsed() > HELPER_IDLE)
                .map(|(v, _)| v.clone())
                .collect();
            ids.iter().filter_map(|v| helpers.remove(v)).map(|(vm, _)| vm).collect()
        };
        for vm in idle {
            self.sync_and_discard(&vm).await;
        }
    }

    /// Delete a volume's disk; refused while a VM has it.
    pub async fn delete_volume(&self, volume: &str) -> Result<()> {
        if let Some(h) = self.volume_holders(volume).first() {
            return Err(RuntimeError::VolumeBusy(format!(
                "volume {volume} is mounted by sandbox {}",
                h.sandbox
            )));
        }
        self.end_helper(volume).await;
        self.inner.volumes.delete(volume)
    }

    /// Sync the guest of a VM with volumes before it ends, so what it wrote to them stays.
    pub(super) async fn sync_volumes_of(&self, vm: &Vm) {
        if vm.volumes().iter().any(|d| !d.read_only) && !vm.is_paused() {
            if let Ok(agent) = vm.agent().await {
                let _ = tokio::time::timeout(Duration::from_secs(30), agent.sync()).await;
            }
        }
    }
}
