//! Pause (vCPUs frozen in memory), resume, and suspend (the VM's whole state saved into its
//! dir, its VMM ended, its memory and network freed) until a resume starts it again from there,
//! also after a restart (the registry keeps the suspended VMs' records). Uses the facade, its
//! registry, `launch.rs` and `saved.rs` (a suspended VM is a [`SavedMachine`] in its own dir).

use super::launch::ready_or_died;
use super::saved::{create_state_file, Manifest, SavedMachine, SAVE_LIMIT};
use super::vm::{identity, Timing, Vm};
use super::Runtime;
use crate::agent::AgentClient;
use crate::error::{Result, RuntimeError};
use crate::vmm::{SnapshotRole, VmHandle, VmSpec};
use serde::{Deserialize, Serialize};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

/// A suspended VM's marker in its dir ([`SuspendRecord`]); its state is [`SUSPEND_STATE`].
pub const SUSPEND_MARKER: &str = "suspend.json";
pub const SUSPEND_STATE: &str = "suspend.state";

/// A suspended VM's marker (`suspend.json` next to its saved state `suspend.state`; its disk
/// is its own `disk.qcow2`, its files its `held/`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct SuspendRecord {
    /// RFC 3339.
    pub saved_at: String,
    pub state_bytes: u64,
    pub save_ms: u64,
}

impl Manifest for SuspendRecord {
    const FILE: &'static str = SUSPEND_MARKER;
    const STATE: &'static str = SUSPEND_STATE;
}

impl Runtime {
    /// Freeze a VM in memory: its vCPUs stop, its RAM and disk stay. Idempotent.
    pub async fn pause(&self, id: &str) -> Result<()> {
        let vm = self.get(id)?;
        if !vm.is_paused() {
            self.inner.launcher.vmm.pause(&vm.handle).await?;
            vm.set_paused(true);
        }
        Ok(())
    }

    /// Let a paused or suspended VM run again. Idempotent.
    pub async fn resume(&self, id: &str) -> Result<()> {
        if self.is_suspended(id) {
            return self.resume_suspended(id).await.map(drop);
        }
        let vm = self.get(id)?;
        if vm.is_paused() {
            self.inner.launcher.vmm.resume(&vm.handle).await?;
            vm.set_paused(false);
        }
        Ok(())
    }

    pub fn is_suspended(&self, id: &str) -> bool {
        self.inner.registry.is_suspended(id)
    }

    /// Ids of the suspended VMs.
    pub fn suspended(&self) -> Vec<String> {
        self.inner.registry.suspended_ids()
    }

    /// Save a running (or paused) VM's whole state (RAM, devices) into its dir and end its
    /// VMM: its memory, CPU and network are freed, its disk and saved state stay until
    /// [`Runtime::resume`] (also after a restart) or [`Runtime::delete`]. Idempotent.
    pub async fn suspend(&self, id: &str) -> Result<Timing> {
        if self.is_suspended(id) {
            return Ok(Timing { ms: 0 });
        }
        let l = &self.inner.launcher;
        let vm = self.get(id)?;
        let snapshotting = l.snapshotting("suspend")?;
        if vm.record.machine.is_none() {
            return Err(RuntimeError::ControlCommand {
                command: "suspend".into(),
                reason: format!("sandbox {id} was started by an older server that did not record its machine"),
            });
        }
        let started = Instant::now();
        let dir = vm.handle.dir.clone();
        vm.set_deleting(true);
        vm.end_session().await;
        let state = dir.join(SUSPEND_STATE);
        let partial = dir.join(format!("{SUSPEND_STATE}.tmp"));
        let saving = async {
            let to = create_state_file(&partial)?;
            snapshotting.save_state(&vm.handle, to, SAVE_LIMIT).await?;
            std::fs::rename(&partial, &state).map_err(|e| RuntimeError::io(&state, e))?;
            std::fs::metadata(&state).map_err(|e| RuntimeError::io(&state, e))
        };
        let saved = match saving.await {
            Ok(meta) => meta,
            Err(e) => {
                let _ = std::fs::remove_file(&partial);
                if l.vmm.is_running(&vm.handle) {
                    // Not saved: it runs on as it was (`save_state` let it run again).
                    vm.set_deleting(false);
                } else {
                    self.forget_gone(&vm).await;
                }
                return Err(e);
            }
        };
        // Saved: the VMM goes.
        let _ = l.vmm.stop(&vm.handle, Duration::from_secs(5)).await;
        let marker = SavedMachine::seal(
            dir.clone(),
            SuspendRecord {
                saved_at: humantime::format_rfc3339_millis(SystemTime::now()).to_string(),
                state_bytes: saved.len(),
                save_ms: started.elapsed().as_millis() as u64,
            },
        )?
        .manifest;
        // Suspended before it leaves the running ones: it is never seen as gone.
        self.inner.registry.suspend(vm.record_now());
        self.inner.registry.remove(id);
        l.remove_network(vm.net.as_ref()).await;
        l.vmm.release(id);
        tracing::info!(%id, bytes = marker.state_bytes, ms = marker.save_ms, "suspended");
        Ok(Timing { ms: marker.save_ms })
    }

    /// A VM whose VMM is gone while it was meant to keep running: removed, as after a crash.
    async fn forget_gone(&self, vm: &Arc<Vm>) {
        let l = &self.inner.launcher;
        self.inner.registry.remove(vm.id());
        l.remove_network(vm.net.as_ref()).await;
        let _ = l.discard(vm.id(), &vm.handle.dir);
        self.inner.registry.exited(vm.id());
    }

    /// Start a suspended VM again from its saved state, with a new network, and give it its
    /// identity again (the clock moved on). On failure it stays suspended.
    async fn resume_suspended(&self, id: &str) -> Result<Arc<Vm>> {
        let l = &self.inner.launcher;
        let mut record = self
            .inner
            .registry
            .suspended(id)
            .ok_or_else(|| RuntimeError::UnknownSandbox(id.into()))?;
        let machine = record
            .machine
            .clone()
            .ok_or_else(|| RuntimeError::UnknownSandbox(id.into()))?;
        let dir = l.data.sandboxes().join(id);
        let limit = l.boot_timeout;
        let started = Instant::now();
        let mut link = None;
        let files = [machine.kernel.clone(), machine.initrd.clone(), machine.rootfs.clone()];
        let mut spec = VmSpec::new(id, dir.clone(), files, record.resources, record.accel);
        spec.volume_bus = machine.volume_bus;
        // Its volumes in the slots they had: the saved device state expects them there.
        spec.volumes = record.volumes.clone();
        spec.snapshot = Some(SnapshotRole::Resume {
            state: dir.join(SUSPEND_STATE),
            resume: machine,
            new_overlay: false,
        });
        let result = async {
            let vm = l.start_vm(id, &dir, spec, &mut link, false).await?;
            let ready = async {
                l.snapshotting("resume")?.complete_restore(&vm, SAVE_LIMIT).await?;
                let client = AgentClient::connect_within(&vm.agent_socket, limit).await?;
                // Its environment is in its saved memory already.
                client.set_identity(&identity(&record, None)).await?;
                Ok::<_, RuntimeError>(client)
            };
            ready_or_died(id, &vm, "resume", ready).await.map(|client| (vm, client))
        }
        .await;
        match result {
            Ok((vm, client)) => {
                for done in [SUSPEND_MARKER, SUSPEND_STATE] {
                    let _ = std::fs::remove_file(dir.join(done));
                }
                record.start_ms = started.elapsed().as_millis() as u64;
                tracing::info!(%id, ms = record.start_ms, "resumed");
                let vm = self.adopt(record, vm, link, Some(client), false);
                self.inner.registry.unsuspend(id);
                Ok(vm)
            }
            Err(e) => {
                l.stop_if_running(VmHandle::load(&dir)).await;
                l.remove_network(link.as_ref()).await;
                l.vmm.release(id);
                Err(e)
            }
        }
    }
}
