//! The node seam: everything that touches a VM (create, delete, pause, resume, agent calls, port
//! tunnels) goes through `Nodes`. `LocalNode` runs VMs on this host with the runtime; a remote
//! implementation (many hosts) will sit behind the same trait.

use airlock_runtime::sandbox::StartKind;
use airlock_runtime::template::TemplateManifest;
use airlock_runtime::{AgentClient, CreateVm, Resources, Runtime, RuntimeError};
use async_trait::async_trait;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use tokio::sync::broadcast;

/// What a node knows of a sandbox's VM right now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VmState {
    Running,
    Paused,
    /// Saved to disk, no VM process (resume starts it again).
    Suspended,
    /// No VM (never booted, deleted, or exited on its own).
    Gone,
}

pub use crate::model::Booted;

/// A VM a node is asked to start: the sandbox's id and what it starts from. Its own type, not
/// the store's record, so a node on another host gets only this.
#[derive(Debug, Clone)]
pub struct VmRequest {
    pub id: String,
    pub template: String,
    pub resources: Resources,
    /// A saved image to start from instead of the template (a snapshot's or a fork's).
    pub image_id: Option<String>,
    pub env: std::collections::BTreeMap<String, String>,
}

/// What a node has, before the operator's overcommit and reserves (`core::Config::budget`).
#[derive(Debug, Clone, Copy)]
pub struct Capacity {
    pub cpus: u32,
    pub memory_mib: u64,
    pub sandboxes_running: u32,
    /// Free space of the filesystem sandbox disks live on (statvfs, unprivileged), less what
    /// warm pool VMs may still write (no record counts them).
    pub disk_free_mib: u64,
    /// Space the node's sandboxes and saved images already hold on it (their records count them
    /// at full size; their files grow into the rest).
    pub disk_held_mib: u64,
}

#[async_trait]
pub trait Nodes: Send + Sync {
    /// The VMM sandboxes run on (`qemu`).
    fn runtime_name(&self) -> &'static str;
    /// `kvm` or `tcg`.
    async fn accel(&self) -> String;
    /// The node's built templates.
    fn templates(&self) -> Vec<TemplateManifest>;
    /// One template by name (`seed`, `seed:latest`) or digest (`sha256:<prefix>`).
    fn template(&self, reference: &str) -> Option<TemplateManifest>;
    /// Start the VM of a recorded sandbox; returns once its agent answers.
    async fn create(&self, vm: &VmRequest) -> Result<Booted, RuntimeError>;
    /// Stop the VM and remove its disk; a VM that is already gone is not an error.
    async fn delete(&self, id: &str) -> Result<(), RuntimeError>;
    async fn pause(&self, id: &str) -> Result<(), RuntimeError>;
    /// Save the VM's whole state to disk and end its process; returns how long it took (ms).
    async fn suspend(&self, id: &str) -> Result<u64, RuntimeError>;
    /// Save the VM as image `image_id` while it runs on (see `Runtime::save_image`); returns
    /// the bytes it holds.
    async fn save_image(&self, id: &str, image_id: &str) -> Result<u64, RuntimeError>;
    /// Remove a saved image (a missing one is not an error).
    async fn delete_image(&self, image_id: &str) -> Result<(), RuntimeError>;
    /// Image `image_id`'s content address, `sha256:<hex>` (see `Runtime::digest_image`).
    async fn digest_image(&self, image_id: &str) -> Result<String, RuntimeError>;
    /// Every saved image this node has.
    fn image_ids(&self) -> Vec<String>;
    /// A warm pool VM of `template` with `resources` for a create: its id becomes the
    /// sandbox's, and `create` with that id hands it out. None when the pool is empty or absent.
    fn claim(&self, template: &str, resources: &Resources) -> Option<String>;
    /// Give back a VM `claim` returned, for a create that did not go ahead.
    fn unclaim(&self, id: &str);
    /// Keep `size` VMs of `template` with `resources` ready.
    fn set_pool(&self, template: &str, resources: &Resources, size: usize) -> Result<(), RuntimeError>;
    fn pools(&self) -> Vec<airlock_runtime::PoolStatus>;
    /// Run a paused VM again, or start a suspended one from its saved state.
    async fn resume(&self, id: &str) -> Result<(), RuntimeError>;
    fn vm_state(&self, id: &str) -> VmState;
    /// Wait until this node knows whether `id` has a VM: after a restart a node re-attaches
    /// its VMs in the background, and until then `vm_state` says `Gone` for one it will adopt.
    async fn settled(&self, id: &str);
    /// Wait until every VM of the node's earlier life is re-attached or removed.
    async fn settled_all(&self);
    /// Every VM this node has: live, paused or suspended.
    fn vm_ids(&self) -> Vec<String>;
    /// The guest agent of a running VM (process and file calls, port tunnels).
    async fn agent(&self, id: &str) -> Result<AgentClient, RuntimeError>;
    /// Ids of VMs that exited on their own (crash, `kill -9`, powered off inside).
    fn exits(&self) -> broadcast::Receiver<String>;
    /// What this node has (admission derives its budgets from it, see `core::Config::budget`).
    fn capacity(&self) -> Capacity;
}

/// This host's VMs, through the runtime. Lifecycle changes of one VM run one at a time (a delete
/// waits for its create).
pub struct LocalNode {
    runtime: Runtime,
    locks: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
}

impl LocalNode {
    pub fn new(runtime: Runtime) -> Self {
        Self {
            runtime,
            locks: Mutex::default(),
        }
    }

    pub fn runtime(&self) -> &Runtime {
        &self.runtime
    }

    fn lock_for(&self, id: &str) -> Arc<tokio::sync::Mutex<()>> {
        self.locks.lock().unwrap().entry(id.to_string()).or_default().clone()
    }
}

#[async_trait]
impl Nodes for LocalNode {
    fn runtime_name(&self) -> &'static str {
        self.runtime.runtime_name()
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

    async fn create(&self, sandbox: &VmRequest) -> Result<Booted, RuntimeError> {
        let lock = self.lock_for(&sandbox.id);
        let _guard = lock.lock().await;
        let sb = self
            .runtime
            .create(CreateVm {
                id: Some(sandbox.id.clone()),
                template: sandbox.template.clone(),
                resources: sandbox.resources,
                image: sandbox.image_id.clone(),
                env: sandbox.env.clone(),
            })
            .await?;
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
        })
    }

    async fn delete(&self, id: &str) -> Result<(), RuntimeError> {
        // A VM not yet re-attached would look gone, and stay behind.
        self.runtime.settled(id).await;
        let lock = self.lock_for(id);
        let result = {
            let _guard = lock.lock().await;
            match self.runtime.delete(id).await {
                Err(RuntimeError::UnknownSandbox(_)) => Ok(()),
                other => other,
            }
        };
        // Forget the lock unless another change already waits on it (it must keep excluding).
        let mut locks = self.locks.lock().unwrap();
        if locks.get(id).is_some_and(|l| Arc::strong_count(l) <= 2) {
            locks.remove(id);
        }
        result
    }

    async fn pause(&self, id: &str) -> Result<(), RuntimeError> {
        self.runtime.settled(id).await;
        let lock = self.lock_for(id);
        let _guard = lock.lock().await;
        self.runtime.pause(id).await
    }

    async fn suspend(&self, id: &str) -> Result<u64, RuntimeError> {
        self.runtime.settled(id).await;
        let lock = self.lock_for(id);
        let _guard = lock.lock().await;
        self.runtime.suspend(id).await.map(|t| t.ms)
    }

    async fn save_image(&self, id: &str, image_id: &str) -> Result<u64, RuntimeError> {
        self.runtime.settled(id).await;
        let lock = self.lock_for(id);
        let _guard = lock.lock().await;
        self.runtime.save_image(id, image_id).await.map(|i| i.bytes())
    }

    async fn delete_image(&self, image_id: &str) -> Result<(), RuntimeError> {
        self.runtime.delete_image(image_id)
    }

    async fn digest_image(&self, image_id: &str) -> Result<String, RuntimeError> {
        self.runtime.digest_image(image_id).await
    }

    fn image_ids(&self) -> Vec<String> {
        self.runtime.images()
    }

    fn claim(&self, template: &str, r: &Resources) -> Option<String> {
        self.runtime.claim(template, *r)
    }

    fn unclaim(&self, id: &str) {
        self.runtime.unclaim(id)
    }

    fn set_pool(&self, template: &str, r: &Resources, size: usize) -> Result<(), RuntimeError> {
        self.runtime.set_pool(template, *r, size).map(drop)
    }

    fn pools(&self) -> Vec<airlock_runtime::PoolStatus> {
        self.runtime.pools()
    }

    async fn resume(&self, id: &str) -> Result<(), RuntimeError> {
        self.runtime.settled(id).await;
        let lock = self.lock_for(id);
        let _guard = lock.lock().await;
        self.runtime.resume(id).await
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

    fn vm_ids(&self) -> Vec<String> {
        let mut ids: Vec<String> = self.runtime.list().iter().map(|s| s.id().to_string()).collect();
        ids.extend(self.runtime.suspended());
        ids
    }

    async fn agent(&self, id: &str) -> Result<AgentClient, RuntimeError> {
        self.runtime.settled(id).await;
        self.runtime.get(id)?.agent().await
    }

    fn exits(&self) -> broadcast::Receiver<String> {
        self.runtime.exits()
    }

    fn capacity(&self) -> Capacity {
        let disk = self.runtime.disk_space();
        Capacity {
            cpus: std::thread::available_parallelism()
                .map(|n| n.get() as u32)
                .unwrap_or(1),
            // Pool VMs hold memory no sandbox record counts.
            memory_mib: airlock_runtime::vmm::host_memory_mib()
                .unwrap_or(0)
                .saturating_sub(self.runtime.pool_memory_mib()),
            sandboxes_running: self.runtime.list().len() as u32,
            disk_free_mib: disk.free_mib.saturating_sub(disk.pool_unheld_mib),
            disk_held_mib: disk.held_by_sandboxes_mib + disk.held_by_images_mib,
        }
    }
}
