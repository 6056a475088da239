//! `LocalNode`: this host's VMs through the runtime, in the server's process (single-host mode).

use super::{Booted, Capacity, NodeEgress, NodeError, Nodes, PoolInfo, VmRequest, VmState};
use airlock_agent_client::AgentClient;
use airlock_runtime::objects::{Objects, ObjectsError};
use airlock_runtime::sandbox::StartKind;
use airlock_runtime::template::TemplateManifest;
use airlock_runtime::{CreateVm, Resources, Runtime, RuntimeError};
use async_trait::async_trait;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use tokio::sync::broadcast;

/// This host's VMs, through the runtime. Lifecycle changes of one VM run one at a time (a delete
/// waits for its create).
pub struct LocalNode {
    runtime: Runtime,
    /// Its VMs' egress (None without sandbox networks).
    egress: Option<Arc<NodeEgress>>,
    /// Where it parks VMs for other nodes and finds those parked elsewhere (None: it does not).
    objects: Option<Objects>,
    locks: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// Its VMs' polling watches.
    watches: super::watches::Watches,
}

impl LocalNode {
    /// A template this node made, put in object storage (when it has one) for the other nodes
    /// to pull at their first create of it.
    async fn publish(&self, manifest: TemplateManifest) -> Result<TemplateManifest, NodeError> {
        if let Some(objects) = &self.objects {
            let template = self.runtime.templates().resolve(&manifest.name)?;
            objects.push_template(&template).await.map_err(objects_error)?;
        }
        Ok(manifest)
    }

    /// `egress` must be the hook the runtime's networks were opened with.
    pub fn new(runtime: Runtime, egress: Option<Arc<NodeEgress>>) -> Self {
        if let Some(egress) = &egress {
            // Specs left by VMs that are gone (a crash between a spec and its VM, or a VM
            // removed while the node was down), once the last run's VMs are settled.
            let (runtime, egress) = (runtime.clone(), egress.clone());
            let started = std::time::SystemTime::now();
            tokio::spawn(async move {
                runtime.settled_all().await;
                let mut live: Vec<String> = runtime.list().iter().map(|s| s.id().to_string()).collect();
                live.extend(runtime.suspended());
                egress.sweep(&live, started);
            });
        }
        Self {
            runtime,
            egress,
            objects: None,
            locks: Mutex::default(),
            watches: Default::default(),
        }
    }

    /// The same node, parking VMs in `objects` and starting those parked there by other nodes.
    pub fn with_objects(mut self, objects: Objects) -> Self {
        self.objects = Some(objects);
        self
    }

    pub fn runtime(&self) -> &Runtime {
        &self.runtime
    }

    fn lock_for(&self, id: &str) -> Arc<tokio::sync::Mutex<()>> {
        self.locks.lock().unwrap().entry(id.to_string()).or_default().clone()
    }

    /// End VM `id` and what the node keeps for it (its egress, its watches); one already gone
    /// is not an error. The caller holds its lock.
    async fn delete_vm(&self, id: &str) -> Result<(), NodeError> {
        match self.runtime.delete(id).await {
            Err(RuntimeError::UnknownSandbox(_)) | Ok(()) => {
                if let Some(egress) = &self.egress {
                    egress.forget(id);
                }
                self.watches.end_vm(id);
                Ok(())
            }
            Err(e) => Err(NodeError::from(e)),
        }
    }
}

#[async_trait]
impl Nodes for LocalNode {
    fn runtime_name(&self) -> String {
        self.runtime.runtime_name().into()
    }

    async fn accel(&self) -> String {
        self.runtime.accel().await.to_string()
    }

    fn templates(&self) -> Vec<TemplateManifest> {
        self.runtime.templates().list()
    }

    fn template(&self, reference: &str) -> Option<TemplateManifest> {
        self.runtime.templates().resolve(reference).ok().map(|t| t.manifest)
    }

    async fn create(&self, sandbox: &VmRequest) -> Result<Booted, NodeError> {
        let lock = self.lock_for(&sandbox.id);
        let _guard = lock.lock().await;
        // Checked before the spec is written, which would replace that VM's.
        if self.runtime.get(&sandbox.id).is_ok() || self.runtime.is_suspended(&sandbox.id) {
            return Err(NodeError::SandboxIdTaken(sandbox.id.clone()));
        }
        // A template another node built: pulled from object storage (every file checked).
        if sandbox.image_id.is_none() && self.runtime.templates().resolve(&sandbox.template).is_err() {
            if let Some(objects) = &self.objects {
                match objects.pull_template(&sandbox.template, self.runtime.templates()).await {
                    Ok(pulled) => {
                        tracing::info!(template = %sandbox.template, digest = %pulled.template.manifest.digest, bytes = pulled.fetched_bytes, "pulled the template")
                    }
                    // Not there either: the runtime names the unknown template.
                    Err(ObjectsError::NotFound(_) | ObjectsError::BadReference(_)) => {}
                    Err(e) => return Err(objects_error(e)),
                }
            }
        }
        // A VM parked by another node: its image is pulled (every file checked) unless here.
        let moved = match (&sandbox.moved_from, &sandbox.image_id) {
            (Some(_), Some(image)) => Some(image.clone()),
            _ => None,
        };
        if let Some(image) = &moved {
            if self.runtime.image(image).is_none() {
                let objects = self
                    .objects
                    .as_ref()
                    .ok_or_else(|| NodeError::Unsupported("start a parked VM: it has no object storage".into()))?;
                let pulled = objects
                    .pull_image(image, self.runtime.data_dir())
                    .await
                    .map_err(objects_error)?;
                let whose = match sandbox.keep_image {
                    true => "the shared snapshot's",
                    false => "the parked VM's",
                };
                tracing::info!(vm = %sandbox.id, %image, bytes = pulled.fetched_bytes, "pulled {whose} image");
            }
        }
        if let Some(egress) = &self.egress {
            egress
                .prepare(&sandbox.id, &sandbox.egress)
                .map_err(|e| NodeError::Network(Box::new(e)))?;
        }
        let created = self
            .runtime
            .create(CreateVm {
                id: Some(sandbox.id.clone()),
                template: sandbox.template.clone(),
                resources: sandbox.resources,
                image: sandbox.image_id.clone(),
                env: sandbox.env.clone(),
                volumes: sandbox
                    .volumes
                    .iter()
                    .map(|v| airlock_runtime::sandbox::VolumeMount {
                        volume: v.volume.clone(),
                        path: v.path.clone(),
                        read_only: v.read_only,
                        owner: v.owner.clone(),
                    })
                    .collect(),
            })
            .await;
        // A parked VM's image was for this start alone: the VM holds its own links to what it
        // runs on, and the copy would only take disk. A shared snapshot's stays for the next.
        if let Some(image) = moved.as_ref().filter(|_| !sandbox.keep_image) {
            let _ = self.runtime.delete_image(image);
        }
        let sb = match created {
            Ok(sb) => sb,
            Err(e) => {
                if let Some(egress) = &self.egress {
                    egress.forget(&sandbox.id);
                }
                return Err(e.into());
            }
        };
        // Moved: the parked copy (the guest's memory among it) leaves object storage too.
        if let (Some(image), Some(objects), false) = (&moved, &self.objects, sandbox.keep_image) {
            match objects.delete_image(image).await {
                Ok(n) => {
                    tracing::info!(vm = %sandbox.id, %image, objects = n, "deleted the parked image from object storage")
                }
                Err(e) => tracing::warn!(vm = %sandbox.id, %image, "the parked image stays in object storage: {e}"),
            }
        }
        Ok(Booted {
            template_digest: sb.record.template_digest.clone(),
            accel: sb.record.accel.to_string(),
            start: crate::model::SandboxStart {
                from: match sb.record.start {
                    StartKind::Boot => "boot".into(),
                    StartKind::BaseSnapshot => "restore".into(),
                    StartKind::Image => "snapshot".into(),
                    StartKind::Pool => "pool".into(),
                },
                ms: sb.record.start_ms,
            },
            run: sb.record.run.clone(),
        })
    }

    async fn delete(&self, id: &str, run: Option<&str>) -> Result<(), NodeError> {
        // A VM not yet re-attached would look gone, and stay behind.
        self.runtime.settled(id).await;
        let lock = self.lock_for(id);
        let result = {
            let _guard = lock.lock().await;
            // Checked under the VM's lock: no start of the id can come in between.
            let stale = run.is_some_and(|run| self.runtime.run_of(id).is_some_and(|have| have != run));
            match stale {
                true => Err(NodeError::StaleRun(id.into())),
                false => self.delete_vm(id).await,
            }
        };
        // Forget the lock unless another change already waits on it (it must keep excluding).
        let mut locks = self.locks.lock().unwrap();
        if locks.get(id).is_some_and(|l| Arc::strong_count(l) <= 2) {
            locks.remove(id);
        }
        result
    }

    async fn pause(&self, id: &str) -> Result<(), NodeError> {
        self.runtime.settled(id).await;
        let lock = self.lock_for(id);
        let _guard = lock.lock().await;
        Ok(self.runtime.pause(id).await?)
    }

    async fn suspend(&self, id: &str) -> Result<u64, NodeError> {
        self.runtime.settled(id).await;
        let lock = self.lock_for(id);
        let _guard = lock.lock().await;
        Ok(self.runtime.suspend(id).await?.ms)
    }

    async fn save_image(&self, id: &str, image_id: &str) -> Result<u64, NodeError> {
        self.runtime.settled(id).await;
        let lock = self.lock_for(id);
        let _guard = lock.lock().await;
        Ok(self.runtime.save_image(id, image_id).await?.bytes())
    }

    async fn capture_template(&self, id: &str, capture: &super::Capture) -> Result<TemplateManifest, NodeError> {
        self.runtime.settled(id).await;
        let lock = self.lock_for(id);
        let _guard = lock.lock().await;
        let manifest = self.runtime.capture_template(id, capture.clone()).await?;
        self.publish(manifest).await
    }

    async fn import_image(&self, import: &super::ImageImport) -> Result<TemplateManifest, NodeError> {
        // The pull's dials are held to this node's platform denies (a node without sandbox
        // networks: the built-in ranges).
        let mut import = import.clone();
        import.registries.denied = match &self.egress {
            Some(e) => e.denied_networks(),
            None => airlock_egress::PlatformDenies::new([]).networks(),
        };
        let manifest = self.runtime.templates().import_image(&import).await?;
        self.publish(manifest).await
    }

    async fn remove_template(&self, name: &str) -> Result<(), NodeError> {
        Ok(self.runtime.remove_template(name)?)
    }

    async fn park(&self, id: &str, image_id: &str) -> Result<super::Parked, NodeError> {
        let objects = self
            .objects
            .as_ref()
            .ok_or_else(|| NodeError::Unsupported("park a VM: it has no object storage".into()))?;
        self.runtime.settled(id).await;
        let lock = self.lock_for(id);
        let _guard = lock.lock().await;
        let was_paused = self.vm_state(id) == VmState::Paused;
        let image = self.runtime.save_paused(id, image_id).await?;
        let pushed = objects.push_image(&image).await;
        // The local copy goes either way: the pushed one is the image now.
        let _ = self.runtime.delete_image(image_id);
        match pushed {
            Ok(p) => {
                tracing::info!(vm = %id, image = %image_id, uploaded = p.uploaded_bytes, "parked in object storage");
                self.delete_vm(id).await?;
                Ok(super::Parked {
                    bytes: image.bytes(),
                    fingerprint: self.runtime.fingerprint().await,
                })
            }
            Err(e) => {
                // Not moved: it runs on here as it was.
                if !was_paused {
                    let _ = self.runtime.resume(id).await;
                }
                Err(objects_error(e))
            }
        }
    }

    async fn fingerprint(&self) -> String {
        self.runtime.fingerprint().await
    }

    fn parks(&self) -> bool {
        self.objects.is_some()
    }

    async fn share_image(&self, image_id: &str) -> Result<super::Parked, NodeError> {
        let objects = self
            .objects
            .as_ref()
            .ok_or_else(|| NodeError::Unsupported(format!("share image {image_id}: it has no object storage")))?;
        let image = self
            .runtime
            .image(image_id)
            .ok_or_else(|| NodeError::UnknownImage(image_id.into()))?;
        let pushed = objects.push_image(&image).await.map_err(objects_error)?;
        tracing::info!(image = %image_id, uploaded = pushed.uploaded_bytes, "shared in object storage");
        Ok(super::Parked {
            bytes: image.bytes(),
            fingerprint: self.runtime.fingerprint().await,
        })
    }

    async fn delete_image(&self, image_id: &str) -> Result<(), NodeError> {
        Ok(self.runtime.delete_image(image_id)?)
    }

    async fn create_volume(&self, _node: &str, id: &str, size_mib: u64) -> Result<(), NodeError> {
        let disks = self.runtime.volume_disks().clone();
        let id = id.to_string();
        tokio::task::spawn_blocking(move || disks.create(&id, size_mib))
            .await
            .map_err(|e| NodeError::Failed(Box::new(e)))??;
        Ok(())
    }

    async fn resize_volume(&self, _node: &str, id: &str, size_mib: u64) -> Result<(), NodeError> {
        if !self.runtime.volume_disks().exists(id) {
            return Err(NodeError::UnknownVolume(id.into()));
        }
        Ok(self.runtime.volume_disks().grow(id, size_mib)?)
    }

    async fn delete_volume(&self, _node: &str, id: &str) -> Result<(), NodeError> {
        Ok(self.runtime.delete_volume(id).await?)
    }

    async fn volume_access(&self, _node: &str, id: &str, write: bool) -> Result<super::VolumeAccess, NodeError> {
        let a = self.runtime.volume_access(id, write).await?;
        Ok(super::VolumeAccess {
            agent: a.agent,
            root: a.root,
            sandbox: a.sandbox,
        })
    }

    async fn volume_bytes(&self, _node: &str, id: &str) -> Option<u64> {
        let disks = self.runtime.volume_disks();
        disks.exists(id).then(|| disks.allocated(id))
    }

    async fn delete_parked(&self, image_id: &str) -> Result<(), NodeError> {
        let objects = self
            .objects
            .as_ref()
            .ok_or_else(|| NodeError::Unsupported("delete a parked image: it has no object storage".into()))?;
        let gone = objects.delete_image(image_id).await.map_err(objects_error)?;
        tracing::info!(
            image = image_id,
            objects = gone,
            "deleted a parked image from object storage"
        );
        Ok(())
    }

    async fn digest_image(&self, image_id: &str) -> Result<String, NodeError> {
        Ok(self.runtime.digest_image(image_id).await?)
    }

    fn image_ids(&self) -> Vec<String> {
        self.runtime.images()
    }

    async fn claim(&self, template: &str, r: &Resources) -> Option<String> {
        self.runtime.claim(template, *r)
    }

    fn unclaim(&self, id: &str) {
        self.runtime.unclaim(id)
    }

    async fn set_pool(&self, template: &str, r: &Resources, size: usize) -> Result<(), NodeError> {
        self.runtime.set_pool(template, *r, size)?;
        Ok(())
    }

    fn pools(&self) -> Vec<PoolInfo> {
        self.runtime
            .pools()
            .into_iter()
            .map(|p| PoolInfo {
                template: p.template,
                resources: p.resources,
                size: p.size,
                ready: p.ready,
                starting: p.starting,
                hits: p.hits,
                misses: p.misses,
            })
            .collect()
    }

    async fn resume(&self, id: &str) -> Result<(), NodeError> {
        self.runtime.settled(id).await;
        let lock = self.lock_for(id);
        let _guard = lock.lock().await;
        Ok(self.runtime.resume(id).await?)
    }

    fn vm_state(&self, id: &str) -> VmState {
        match self.runtime.get(id) {
            Ok(sb) if sb.is_paused() => VmState::Paused,
            Ok(_) => VmState::Running,
            Err(_) if self.runtime.is_suspended(id) => VmState::Suspended,
            Err(_) => VmState::Gone,
        }
    }

    async fn settled(&self, id: &str) {
        self.runtime.settled(id).await
    }

    async fn settled_all(&self) {
        self.runtime.settled_all().await
    }

    fn vm_run(&self, id: &str) -> Option<String> {
        self.runtime.run_of(id)
    }

    fn vm_ids(&self) -> Vec<String> {
        let mut ids: Vec<String> = self.runtime.list().iter().map(|s| s.id().to_string()).collect();
        ids.extend(self.runtime.suspended());
        ids
    }

    async fn agent(&self, id: &str) -> Result<AgentClient, NodeError> {
        self.runtime.settled(id).await;
        Ok(self.runtime.get(id)?.agent().await?)
    }

    fn exits(&self) -> broadcast::Receiver<String> {
        self.runtime.exits()
    }

    async fn egress(&self, id: &str) -> Option<airlock_egress::EgressSnapshot> {
        self.egress.as_ref()?.report(id)
    }

    async fn watch_start(&self, id: &str, spec: &super::WatchSpec) -> Result<super::WatchStart, NodeError> {
        let agent = self.agent(id).await?;
        self.watches.start(id, &agent, spec).await
    }

    async fn watch_take(&self, id: &str, watch: &str) -> Result<Option<super::watches::Taken>, NodeError> {
        Ok(self.watches.take(id, watch))
    }

    async fn watch_stop(&self, id: &str, watch: &str) -> Result<bool, NodeError> {
        Ok(self.watches.stop(id, watch))
    }

    fn capacity(&self) -> Capacity {
        let disk = self.runtime.disk_space();
        let vms = self.runtime.list();
        Capacity {
            cpus: std::thread::available_parallelism()
                .map(|n| n.get() as u32)
                .unwrap_or(1),
            // Pool VMs hold memory no sandbox record counts.
            memory_mib: airlock_runtime::vmm::host_memory_mib()
                .unwrap_or(0)
                .saturating_sub(self.runtime.pool_memory_mib()),
            sandboxes_running: vms.len() as u32,
            disk_free_mib: disk.free_mib.saturating_sub(disk.pool_unheld_mib),
            disk_held_mib: disk.held_by_sandboxes_mib + disk.held_by_images_mib,
            vcpu_held: vms.iter().map(|vm| u64::from(vm.record.resources.vcpu)).sum(),
            memory_held_mib: vms.iter().map(|vm| u64::from(vm.record.resources.memory_mib)).sum(),
        }
    }
}

/// Object storage's failure as the node's: a missing image is one, the rest the node's own.
fn objects_error(e: ObjectsError) -> NodeError {
    match e {
        ObjectsError::NotFound(id) => NodeError::UnknownImage(id),
        ObjectsError::Local(e) => e.into(),
        e => NodeError::Failed(Box::new(e)),
    }
}
