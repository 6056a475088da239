//! After a restart: the VM dirs an earlier process left, each re-attached (a live VM, its
//! network served again), kept as suspended, or removed; then the networks and jails a crash
//! left without a VM. Each dir is recorded unsettled in the registry until it is decided (a VM
//! of the earlier process is hidden from `get`/`list` until then). Uses the facade, its
//! registry and `launch.rs`.

use super::suspend::SuspendRecord;
use super::vm::VmRecord;
use super::{Inner, Runtime};
use crate::agent::AgentClient;
use crate::datadir::write_atomic;
use crate::error::Result;
use crate::net::SandboxLink;
use crate::vmm::VmHandle;
use futures_util::StreamExt;
use std::collections::HashSet;
use std::path::Path;
use std::sync::Weak;
use std::time::Duration;

/// VMs of an earlier process reconciled at once after a restart.
pub const RECONCILE_AT_ONCE: usize = 8;

impl Runtime {
    /// The VM dirs an earlier process left, each recorded as not yet settled.
    pub(super) fn unsettled_entries(&self) -> Vec<std::fs::DirEntry> {
        let entries: Vec<_> = std::fs::read_dir(self.inner.launcher.data.sandboxes())
            .into_iter()
            .flatten()
            .flatten()
            .collect();
        self.inner
            .registry
            .unsettle(entries.iter().map(|e| e.file_name().to_string_lossy().into_owned()));
        entries
    }

    /// VM dirs left from an earlier process: re-attach live VMs, remove the rest, up to
    /// [`RECONCILE_AT_ONCE`] at a time (an agent that does not answer costs its 10 s only to
    /// its own VM). Each is marked settled when done. Stops early if the runtime goes.
    pub(super) async fn reconcile(inner: Weak<Inner>, entries: Vec<std::fs::DirEntry>) {
        futures_util::stream::iter(entries)
            .for_each_concurrent(RECONCILE_AT_ONCE, |entry| {
                let inner = inner.clone();
                async move {
                    let Some(inner) = inner.upgrade() else { return };
                    let rt = Runtime { inner };
                    rt.reconcile_dir(&entry).await;
                    rt.inner.registry.settle(&entry.file_name().to_string_lossy());
                }
            })
            .await;
        // Networks and jails a crash left without a VM (or whose dir is gone), once every dir
        // is settled. A VM dir still there is live or booting (a create may already run): its
        // network and jail stay.
        let Some(inner) = inner.upgrade() else { return };
        let mut live: HashSet<String> = inner.registry.ids().into_iter().collect();
        live.extend(inner.base_snapshots.builder_ids());
        live.extend(
            std::fs::read_dir(inner.launcher.data.sandboxes())
                .into_iter()
                .flatten()
                .flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned()),
        );
        if let Some(net) = &inner.launcher.net {
            net.sweep(&live).await;
        }
        inner.launcher.vmm.sweep(&live);
    }

    /// One VM dir left from an earlier process: re-attach its live VM, or remove it.
    async fn reconcile_dir(&self, entry: &std::fs::DirEntry) {
        let l = &self.inner.launcher;
        let dir = entry.path();
        let id = entry.file_name().to_string_lossy().into_owned();
        let record = VmRecord::load(&dir);
        let vm = VmHandle::load(&dir);
        let link = SandboxLink::load(&dir);
        if dir.join(super::pools::MARKER).is_file() || dir.join(super::launch::HELPER_MARKER).is_file() {
            // A pool VM of the earlier process, never handed out, or a volume's helper: it
            // just goes (a helper's guest wrote nothing it was not asked to).
            l.stop_if_running(vm.or_else(|| VmHandle::orphan(&dir, l.vmm.name())))
                .await;
            l.remove_network(link.as_ref()).await;
            let _ = l.discard(&id, &dir);
            return;
        }
        if let (Some(record), true) = (&record, super::saved::SavedMachine::<SuspendRecord>::is_marked(&dir)) {
            // Suspended (or interrupted while it resumed: the saved state is still whole).
            l.stop_if_running(vm).await;
            l.remove_network(link.as_ref()).await;
            l.vmm.release(&id);
            tracing::info!(id = %record.id, "found suspended");
            self.inner.registry.suspend(record.clone());
            return;
        }
        match (record, vm) {
            (Some(record), Some(vm)) if l.vmm.is_running(&vm) => {
                let net = match self.reattach_network(link, &dir).await {
                    Ok(net) => net,
                    Err(e) => {
                        tracing::warn!(id = %record.id, "its network cannot be restored ({e}); removing it");
                        let _ = l.vmm.stop(&vm, Duration::from_secs(2)).await;
                        l.remove_network(SandboxLink::load(&dir).as_ref()).await;
                        let _ = l.discard(&id, &dir);
                        return;
                    }
                };
                if l.vmm.is_paused(&vm).await.unwrap_or(false) {
                    tracing::info!(id = %record.id, pid = vm.pid, "re-attached to paused sandbox");
                    self.adopt(record, vm, net, None, true);
                    return;
                }
                match AgentClient::connect_ready(&vm.agent_socket, Duration::from_secs(10)).await {
                    Ok((client, _)) => {
                        tracing::info!(id = %record.id, pid = vm.pid, "re-attached to running sandbox");
                        self.adopt(record, vm, net, Some(client), false);
                    }
                    Err(e) => {
                        tracing::warn!(id = %record.id, "running VM's agent does not answer ({e}); removing it");
                        let _ = l.vmm.stop(&vm, Duration::from_secs(2)).await;
                        l.remove_network(net.as_ref()).await;
                        let _ = l.discard(&id, &dir);
                    }
                }
            }
            (_, vm) => {
                // No VM record but a pid file: the server died between spawning the VMM and
                // recording it; the pid (checked against the VM dir) finds it.
                l.stop_if_running(vm.or_else(|| VmHandle::orphan(&dir, l.vmm.name())))
                    .await;
                tracing::info!("removing leftovers of sandbox {}", dir.display());
                l.remove_network(link.as_ref()).await;
                let _ = l.discard(&id, &dir);
            }
        }
    }

    /// The network of a VM found running: its recorded link, served again. A VM without a
    /// record when the runtime makes networks was started without one: it keeps none.
    async fn reattach_network(&self, link: Option<SandboxLink>, dir: &Path) -> Result<Option<SandboxLink>> {
        let (Some(net), Some(mut link)) = (&self.inner.launcher.net, link) else {
            return Ok(None);
        };
        net.reattach(&mut link).await?;
        write_atomic(
            &SandboxLink::record_path(dir),
            &serde_json::to_vec_pretty(&link).expect("serializable"),
        )?;
        Ok(Some(link))
    }
}
