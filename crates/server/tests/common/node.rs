//! The test node: a `LocalNode` over the fake VMM behind [`TestNode`], which sets its capacity,
//! can delay creates, hold VMs unsettled and save fake images.

use super::*;

/// A node on `dir` over the fake VMM (its runtime re-attaching in the background if asked),
/// with an egress side under `egress` (the fake VMM has no networks: it keeps specs and
/// counters only), as a [`TestNode`] of `capacity`.
pub async fn test_node(
    dir: &Path,
    egress: &airlock_egress::EgressConfig,
    capacity: Capacity,
    create_delay: Duration,
    hold: Arc<Hold>,
    background: bool,
) -> (Arc<dyn Nodes>, Runtime, Arc<NodeEgress>) {
    let runtime = open_runtime(dir, background).await;
    let node_egress = NodeEgress::new(
        Arc::new(airlock_egress::Resolver::new(
            "127.0.0.1:53".parse().unwrap(),
            Duration::from_secs(1),
        )),
        airlock_egress::ProxyConfig::default(),
        egress.clone(),
        dir.join("egress"),
    )
    .unwrap();
    let local: Arc<dyn Nodes> = Arc::new(LocalNode::new(runtime.clone(), Some(node_egress.clone())));
    let node = Arc::new(TestNode {
        inner: local,
        create_delay,
        capacity,
        hold,
        images: FakeImages::under(dir),
    });
    (node, runtime, node_egress)
}

/// A node as large as no test fills: only what a test sets limits it.
pub const ROOMY: Capacity = Capacity {
    cpus: 1024,
    memory_mib: 1 << 30,
    sandboxes_running: 0,
    disk_free_mib: 1 << 40,
    disk_held_mib: 0,
    vcpu_held: 0,
    memory_held_mib: 0,
};

/// A node that has `capacity`, whose creates start `create_delay` late, which reports the
/// VMs in `hold` settled only once they are released, and which saves images as `images` does
/// (the fake VMM saves none); everything else goes straight to the real one.
pub struct TestNode {
    pub inner: Arc<dyn Nodes>,
    pub create_delay: Duration,
    pub capacity: Capacity,
    pub hold: Arc<Hold>,
    pub images: FakeImages,
}

/// What a test node's image saves write (about what a real save of a small sandbox wrote).
pub const FAKE_IMAGE_BYTES: u64 = 98 << 20;

/// Images "saved" from the fake VMM's sandboxes, for the core's snapshot paths: a dir in the
/// data dir's `images/` with a manifest and a sparse state file of [`FAKE_IMAGE_BYTES`], so
/// the runtime lists and removes it as it would a real one. (A create from it fails: there is
/// nothing to restore.)
pub struct FakeImages {
    pub dir: PathBuf,
}

impl FakeImages {
    pub fn under(data_dir: &Path) -> FakeImages {
        FakeImages {
            dir: data_dir.join("images"),
        }
    }

    fn save(&self, image_id: &str) -> Result<u64, airlock_server::core::NodeError> {
        let dir = self.dir.join(image_id);
        std::fs::create_dir_all(&dir)
            .map_err(|e| airlock_server::core::NodeError::from(airlock_runtime::RuntimeError::io(&dir, e)))?;
        let state = std::fs::File::create(dir.join("state"))
            .map_err(|e| airlock_server::core::NodeError::from(airlock_runtime::RuntimeError::io(&dir, e)))?;
        state
            .set_len(FAKE_IMAGE_BYTES)
            .map_err(|e| airlock_server::core::NodeError::from(airlock_runtime::RuntimeError::io(&dir, e)))?;
        std::fs::write(dir.join(airlock_runtime::sandbox::image::MANIFEST), "{}")
            .map_err(|e| airlock_server::core::NodeError::from(airlock_runtime::RuntimeError::io(&dir, e)))?;
        Ok(FAKE_IMAGE_BYTES)
    }
}

/// Sandboxes whose VM a node has not yet re-attached after a restart, as long as a test holds
/// them.
#[derive(Default)]
pub struct Hold {
    pub held: std::sync::Mutex<std::collections::HashSet<String>>,
    pub released: tokio::sync::Notify,
}

impl Hold {
    pub fn of(ids: &[&str]) -> Arc<Hold> {
        let hold = Hold::default();
        hold.held.lock().unwrap().extend(ids.iter().map(|s| s.to_string()));
        Arc::new(hold)
    }

    pub fn release(&self, id: &str) {
        self.held.lock().unwrap().remove(id);
        self.released.notify_waiters();
    }

    pub async fn settled(&self, id: &str) {
        loop {
            let released = self.released.notified();
            if !self.held.lock().unwrap().contains(id) {
                return;
            }
            released.await;
        }
    }
}

#[async_trait::async_trait]
impl Nodes for TestNode {
    fn runtime_name(&self) -> String {
        self.inner.runtime_name()
    }
    async fn accel(&self) -> String {
        self.inner.accel().await
    }
    fn templates(&self) -> Vec<airlock_runtime::template::TemplateManifest> {
        self.inner.templates()
    }
    fn template(&self, reference: &str) -> Option<airlock_runtime::template::TemplateManifest> {
        self.inner.template(reference)
    }
    async fn create(
        &self,
        sandbox: &airlock_server::nodes::VmRequest,
    ) -> Result<Booted, airlock_server::core::NodeError> {
        tokio::time::sleep(self.create_delay).await;
        self.inner.create(sandbox).await
    }
    async fn delete(&self, id: &str, run: Option<&str>) -> Result<(), airlock_server::core::NodeError> {
        self.inner.delete(id, run).await
    }
    async fn pause(&self, id: &str) -> Result<(), airlock_server::core::NodeError> {
        self.inner.pause(id).await
    }
    async fn suspend(&self, id: &str) -> Result<u64, airlock_server::core::NodeError> {
        self.inner.suspend(id).await
    }
    async fn resume(&self, id: &str) -> Result<(), airlock_server::core::NodeError> {
        self.inner.resume(id).await
    }
    async fn save_image(&self, id: &str, image_id: &str) -> Result<u64, airlock_server::core::NodeError> {
        if self.inner.vm_state(id) != VmState::Running {
            return Err(airlock_server::core::NodeError::NotRunning(id.into()));
        }
        self.images.save(image_id)
    }
    async fn delete_image(&self, image_id: &str) -> Result<(), airlock_server::core::NodeError> {
        self.inner.delete_image(image_id).await
    }
    async fn digest_image(&self, image_id: &str) -> Result<String, airlock_server::core::NodeError> {
        Ok(format!("sha256:{}", airlock_server::store::token_hash(image_id)))
    }
    fn image_ids(&self) -> Vec<String> {
        self.inner.image_ids()
    }
    async fn claim(&self, template: &str, r: &airlock_server::model::Resources) -> Option<String> {
        self.inner.claim(template, r).await
    }
    fn unclaim(&self, id: &str) {
        self.inner.unclaim(id)
    }
    async fn set_pool(
        &self,
        template: &str,
        r: &airlock_server::model::Resources,
        size: usize,
    ) -> Result<(), airlock_server::core::NodeError> {
        self.inner.set_pool(template, r, size).await
    }
    fn pools(&self) -> Vec<airlock_server::model::PoolInfo> {
        self.inner.pools()
    }
    fn vm_state(&self, id: &str) -> VmState {
        self.inner.vm_state(id)
    }
    async fn settled(&self, id: &str) {
        self.inner.settled(id).await;
        self.hold.settled(id).await
    }
    async fn settled_all(&self) {
        self.inner.settled_all().await;
        let held: Vec<String> = self.hold.held.lock().unwrap().iter().cloned().collect();
        for id in held {
            self.hold.settled(&id).await;
        }
    }
    fn vm_ids(&self) -> Vec<String> {
        self.inner.vm_ids()
    }
    fn vm_run(&self, id: &str) -> Option<String> {
        self.inner.vm_run(id)
    }
    async fn agent(&self, id: &str) -> Result<airlock_agent_client::AgentClient, airlock_server::core::NodeError> {
        self.inner.agent(id).await
    }
    fn exits(&self) -> tokio::sync::broadcast::Receiver<String> {
        self.inner.exits()
    }
    async fn egress(&self, id: &str) -> Option<airlock_egress::EgressSnapshot> {
        self.inner.egress(id).await
    }
    async fn watch_start(
        &self,
        id: &str,
        spec: &airlock_server::nodes::WatchSpec,
    ) -> Result<airlock_server::nodes::WatchStart, airlock_server::core::NodeError> {
        self.inner.watch_start(id, spec).await
    }
    async fn watch_take(
        &self,
        id: &str,
        watch: &str,
    ) -> Result<Option<airlock_server::nodes::watches::Taken>, airlock_server::core::NodeError> {
        self.inner.watch_take(id, watch).await
    }
    async fn watch_stop(&self, id: &str, watch: &str) -> Result<bool, airlock_server::core::NodeError> {
        self.inner.watch_stop(id, watch).await
    }
    fn capacity(&self) -> Capacity {
        let inner = self.inner.capacity();
        Capacity {
            sandboxes_running: inner.sandboxes_running,
            vcpu_held: inner.vcpu_held,
            memory_held_mib: inner.memory_held_mib,
            ..self.capacity
        }
    }
}
