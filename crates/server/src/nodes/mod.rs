//! The node seam: everything that touches a VM (create, delete, pause, resume, agent calls, port
//! tunnels) goes through `Nodes`. `LocalNode` runs VMs on this host with the runtime;
//! `serve::router` is a node's HTTP face over any `Nodes`, and `RemoteNode` the same trait
//! over that face, from another host (`wire.rs`: its messages and tokens). `NodeEgress` serves
//! each VM's egress on the node, from the spec its create carried.

mod admission;
mod cluster;
pub mod discovery;
mod egress;
mod error;
mod expiry;
pub mod kube;
mod local;
mod remote;
pub mod serve;
pub mod tls;
pub mod watches;
pub mod wire;

pub use admission::{Admission, NodeRules, Refusal};
pub use cluster::Cluster;
pub use egress::NodeEgress;
pub use error::NodeError;
pub use expiry::Expiry;
pub use local::LocalNode;
pub use remote::RemoteNode;
pub use tls::NodeLink;
pub use watches::{WatchSpec, WatchStart};

pub use crate::model::PoolInfo;
use airlock_agent_client::AgentClient;
pub use airlock_runtime::template::ImageImport;
use airlock_runtime::template::TemplateManifest;
pub use airlock_runtime::Capture;
use airlock_runtime::Resources;
use async_trait::async_trait;
use tokio::sync::broadcast;

/// What a node knows of a sandbox's VM right now.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum VmState {
    Running,
    Paused,
    /// Saved to disk, no VM process (resume starts it again).
    Suspended,
    /// No VM (never booted, deleted, or exited on its own).
    Gone,
}

pub use crate::model::Booted;

/// Run `run` as a delete names it ([`Nodes::delete`]): '' (a VM an older node started, which
/// has none) names no run.
pub fn named_run(run: &str) -> Option<&str> {
    Some(run).filter(|r| !r.is_empty())
}

/// A VM in a node's report ([`wire::NodeReport::vms`]).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct VmReport {
    pub id: String,
    pub state: VmState,
    /// Which start of the sandbox on that node it is (random, new for every VM the node
    /// starts; kept through pause, suspend and resume). A reaper acting on a report names it,
    /// so its delete cannot end a VM started after the report ([`NodeError::StaleRun`]).
    #[serde(default)]
    pub run: String,
}

/// A VM a node is asked to start: the sandbox's id and what it starts from. Its own type, not
/// the store's record, so a node on another host gets only this.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct VmRequest {
    pub id: String,
    pub template: String,
    pub resources: Resources,
    /// A saved image to start from instead of the template (a snapshot's or a fork's).
    pub image_id: Option<String>,
    pub env: std::collections::BTreeMap<String, String>,
    /// What its network may reach, as the core decided it: the node applies it alone.
    #[serde(default)]
    pub egress: crate::records::EgressSpec,
    /// The member placement chose ([`Member::name`]); a `Cluster` sends the create there.
    #[serde(default)]
    pub node: String,
    /// Set for a VM moving here from another node (`image_id` is the image [`Nodes::park`]
    /// left in object storage): the fingerprint of the machine it was saved on. A node whose
    /// own differs refuses it `incompatible`; one that lacks the image pulls it first.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moved_from: Option<String>,
    /// With `moved_from`: the image is a snapshot's, shared ([`Nodes::share_image`]), not a
    /// parked VM's: the node keeps its copy (the next create from it here pulls nothing) and
    /// object storage keeps the image.
    #[serde(default)]
    pub keep_image: bool,
    /// Volumes (on this node) mounted once the VM runs.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub volumes: Vec<VolumeMountSpec>,
}

/// A volume a VM mounts: the node's disk `volume` at `path` in the guest.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct VolumeMountSpec {
    pub volume: String,
    pub path: String,
    #[serde(default)]
    pub read_only: bool,
    /// Who gets a fresh volume's root directory: the sandbox's default user.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<String>,
}

/// Where file calls on a volume go ([`Nodes::volume_access`]).
pub struct VolumeAccess {
    pub agent: AgentClient,
    /// The volume's root in that guest (it follows no symlink).
    pub root: String,
    /// The sandbox serving the calls, or `None` for the node's helper VM.
    pub sandbox: Option<String>,
}

/// A VM [`Nodes::park`] saved to object storage and ended (or an image
/// [`Nodes::share_image`] put there).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Parked {
    /// The image's bytes (memory and disk) in object storage.
    pub bytes: u64,
    /// The machine it was saved on ([`Nodes::fingerprint`]): only an equal one starts it.
    pub fingerprint: String,
}

/// When a sandbox's timeout passes, and what it does then.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Deadline {
    /// Unix milliseconds.
    pub at_ms: i64,
    /// Suspended (`on_timeout: suspend`) rather than deleted.
    pub suspend: bool,
}

/// A node placement may choose, as [`Nodes::members`] lists it.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Member {
    /// Its name in sandbox records: '' for the one node of single-host mode, else the name the
    /// cluster knows it by.
    pub name: String,
    pub capacity: Capacity,
    /// Why it takes no new sandbox now (it does not answer, it drains), or None.
    pub refuses: Option<String>,
    /// It is stopping: its sandboxes are to be taken off it (`Engine::drain_sweep`).
    #[serde(default)]
    pub draining: bool,
    /// Its machine ([`Nodes::fingerprint`]): a parked VM resumes only on an equal one.
    #[serde(default)]
    pub fingerprint: String,
    /// It can park a VM in object storage ([`Nodes::park`]), for another node to resume.
    #[serde(default)]
    pub parks: bool,
    /// It answered its last report: what each replica records of it (`Engine::observe_nodes`),
    /// from which a node is judged dead.
    #[serde(default)]
    pub answering: bool,
}

/// What a node has, before the operator's overcommit and reserves (`core::Config::budget`).
#[derive(Debug, Clone, Copy, Default, serde::Serialize, serde::Deserialize)]
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
    /// vCPUs and memory its VMs hold now (running or paused; warm pool VMs are already out of
    /// `memory_mib`): what the node's own admission counts.
    #[serde(default)]
    pub vcpu_held: u64,
    #[serde(default)]
    pub memory_held_mib: u64,
}

#[async_trait]
pub trait Nodes: Send + Sync {
    /// The VMM sandboxes run on (`qemu`).
    fn runtime_name(&self) -> String;
    /// `kvm` or `tcg`.
    async fn accel(&self) -> String;
    /// The node's built templates.
    fn templates(&self) -> Vec<TemplateManifest>;
    /// One template by name (`seed`, `seed:latest`) or digest (`sha256:<prefix>`).
    fn template(&self, reference: &str) -> Option<TemplateManifest>;
    /// Start the VM of a recorded sandbox; returns once its agent answers.
    async fn create(&self, vm: &VmRequest) -> Result<Booted, NodeError>;
    /// Stop the VM and remove its disk; a VM that is already gone is not an error. With `run`,
    /// only the VM of that run ([`VmReport::run`]): another run of the id is left as it is and
    /// answers [`NodeError::StaleRun`].
    async fn delete(&self, id: &str, run: Option<&str>) -> Result<(), NodeError>;
    async fn pause(&self, id: &str) -> Result<(), NodeError>;
    /// Save the VM's whole state to disk and end its process; returns how long it took (ms).
    async fn suspend(&self, id: &str) -> Result<u64, NodeError>;
    /// Save the VM as image `image_id` while it runs on (see `Runtime::save_image`); returns
    /// the bytes it holds.
    async fn save_image(&self, id: &str, image_id: &str) -> Result<u64, NodeError>;
    /// Save VM `id` as image `image_id` into object storage and end it here, for a node with
    /// an equal fingerprint to start it again ([`VmRequest::moved_from`]). When it fails the
    /// VM is as it was. A node without object storage answers `Unsupported`.
    async fn park(&self, id: &str, image_id: &str) -> Result<Parked, NodeError> {
        let _ = (id, image_id);
        Err(NodeError::Unsupported("park a VM: it has no object storage".into()))
    }
    /// Put saved image `image_id` into object storage as well (a snapshot's, so that it outlives
    /// this node): any node of an equal fingerprint can then start from it
    /// ([`VmRequest::moved_from`] with [`VmRequest::keep_image`]). A node without object
    /// storage answers `Unsupported`.
    async fn share_image(&self, image_id: &str) -> Result<Parked, NodeError> {
        Err(NodeError::Unsupported(format!(
            "share image {image_id}: it has no object storage"
        )))
    }
    /// Whether it can [`Nodes::park`] VMs (it has object storage).
    fn parks(&self) -> bool {
        false
    }
    /// What a VM saved here needs of the machine that starts it again (see
    /// `Runtime::fingerprint`).
    async fn fingerprint(&self) -> String {
        String::new()
    }
    /// End VM `id` and keep its disk as template `capture.name` on its node
    /// (`Runtime::capture_template`); a node with object storage puts it there too, for the
    /// others to pull at their first create of it. The VM is gone afterwards, whatever the outcome.
    async fn capture_template(&self, id: &str, capture: &Capture) -> Result<TemplateManifest, NodeError> {
        let _ = (id, capture);
        Err(NodeError::Unsupported("build templates".into()))
    }
    /// Make template `import.name` of an OCI image on a node (`TemplateStore::import_image`),
    /// unless it already is the image's current content; a node with object storage puts it
    /// there too, for the others.
    async fn import_image(&self, import: &ImageImport) -> Result<TemplateManifest, NodeError> {
        let _ = import;
        Err(NodeError::Unsupported("import images".into()))
    }
    /// Remove template `name` from every node that has it: sandboxes made from it run on (a
    /// missing one is not an error).
    async fn remove_template(&self, name: &str) -> Result<(), NodeError> {
        let _ = name;
        Ok(())
    }
    /// Remove a saved image (a missing one is not an error).
    async fn delete_image(&self, image_id: &str) -> Result<(), NodeError>;

    /// Make volume `id`'s disk on `node` (a member's name; '' in single-host mode): an empty
    /// filesystem of `size_mib`. Volumes live on one node; its sandboxes are placed there.
    async fn create_volume(&self, node: &str, id: &str, size_mib: u64) -> Result<(), NodeError> {
        let _ = (node, id, size_mib);
        Err(NodeError::Unsupported("keep volumes".into()))
    }
    /// Grow volume `id`'s disk to `size_mib`.
    async fn resize_volume(&self, node: &str, id: &str, size_mib: u64) -> Result<(), NodeError> {
        let _ = (node, id, size_mib);
        Err(NodeError::Unsupported("keep volumes".into()))
    }
    /// Delete volume `id`'s disk; `VolumeBusy` while a VM has it.
    async fn delete_volume(&self, node: &str, id: &str) -> Result<(), NodeError> {
        let _ = (node, id);
        Err(NodeError::Unsupported("keep volumes".into()))
    }
    /// Where file calls on volume `id` go (see `runtime::sandbox::volumes`).
    async fn volume_access(&self, node: &str, id: &str, write: bool) -> Result<VolumeAccess, NodeError> {
        let _ = (node, id, write);
        Err(NodeError::Unsupported("keep volumes".into()))
    }
    /// The bytes volume `id`'s disk takes on `node` now.
    async fn volume_bytes(&self, node: &str, id: &str) -> Option<u64> {
        let _ = (node, id);
        None
    }
    /// Remove an image from object storage: a parked VM's, for a sandbox that ended parked, or
    /// a shared snapshot's (a missing one is not an error).
    async fn delete_parked(&self, image_id: &str) -> Result<(), NodeError> {
        Err(NodeError::Unsupported(format!(
            "delete parked image {image_id}: it has no object storage"
        )))
    }
    /// Image `image_id`'s content address, `sha256:<hex>` (see `Runtime::digest_image`).
    async fn digest_image(&self, image_id: &str) -> Result<String, NodeError>;
    /// Every saved image this node has.
    fn image_ids(&self) -> Vec<String>;
    /// A warm pool VM of `template` with `resources` for a create: its id becomes the
    /// sandbox's, and `create` with that id hands it out. None when the pool is empty or absent.
    async fn claim(&self, template: &str, resources: &Resources) -> Option<String>;
    /// Give back a VM `claim` returned, for a create that did not go ahead.
    fn unclaim(&self, id: &str);
    /// Keep `size` VMs of `template` with `resources` ready.
    async fn set_pool(&self, template: &str, resources: &Resources, size: usize) -> Result<(), NodeError>;
    /// The node's warm pools.
    fn pools(&self) -> Vec<PoolInfo>;
    /// Run a paused VM again, or start a suspended one from its saved state.
    async fn resume(&self, id: &str) -> Result<(), NodeError>;
    fn vm_state(&self, id: &str) -> VmState;
    /// What `id`'s VM is, asked of the node now (a view kept from an earlier report may predate
    /// a VM another replica just made); None when the node cannot say.
    async fn vm_state_now(&self, id: &str) -> Option<VmState> {
        Some(self.vm_state(id))
    }
    /// Whether `id` has no VM, asked of the node now; `false` when the node cannot say.
    async fn vm_gone(&self, id: &str) -> bool {
        self.vm_state_now(id).await == Some(VmState::Gone)
    }
    /// Wait until this node knows whether `id` has a VM: after a restart a node re-attaches
    /// its VMs in the background, and until then `vm_state` says `Gone` for one it will adopt.
    async fn settled(&self, id: &str);
    /// Wait until every VM of the node's earlier life is re-attached or removed.
    async fn settled_all(&self);
    /// Every VM this node has: live, paused or suspended.
    fn vm_ids(&self) -> Vec<String>;
    /// The run of VM `id` ([`VmReport::run`]) as last known; None when it has no VM (or the
    /// node cannot say).
    fn vm_run(&self, id: &str) -> Option<String> {
        let _ = id;
        None
    }
    /// Every VM, with the member that has it ([`Member::name`]): what a reaper compares with
    /// the records.
    fn vm_reports(&self) -> Vec<(String, VmReport)> {
        self.vm_ids()
            .into_iter()
            .map(|id| {
                let vm = VmReport {
                    state: self.vm_state(&id),
                    run: self.vm_run(&id).unwrap_or_default(),
                    id,
                };
                (String::new(), vm)
            })
            .collect()
    }
    /// The guest agent of a running VM (process and file calls, port tunnels).
    async fn agent(&self, id: &str) -> Result<AgentClient, NodeError>;
    /// [`Nodes::agent`] for a sandbox whose record places it on member `node` as run `run`
    /// ('' when not known yet): that member, when its report lists that run of `id`; else
    /// wherever `agent` finds it (a report may predate a move). A leftover VM of the id on
    /// another node is never asked instead.
    async fn agent_of_run(&self, id: &str, node: &str, run: &str) -> Result<AgentClient, NodeError> {
        let _ = (node, run);
        self.agent(id).await
    }
    /// Ids of VMs that exited on their own (crash, `kill -9`, powered off inside).
    fn exits(&self) -> broadcast::Receiver<String>;
    /// VM `id`'s egress counters and recent denials (None when the node lacks it or serves no
    /// egress).
    async fn egress(&self, id: &str) -> Option<airlock_egress::EgressSnapshot>;
    /// Watch `spec` in VM `id`, its events kept on this node until taken (`watches.rs`).
    async fn watch_start(&self, id: &str, spec: &WatchSpec) -> Result<WatchStart, NodeError>;
    /// The events VM `id`'s watch `watch` saw since the last take (and what it watches); None:
    /// it has no such watch.
    async fn watch_take(&self, id: &str, watch: &str) -> Result<Option<watches::Taken>, NodeError>;
    /// Stop VM `id`'s watch `watch`; false: it has no such watch.
    async fn watch_stop(&self, id: &str, watch: &str) -> Result<bool, NodeError>;
    /// When VM `id`'s sandbox times out (None: it does not now), for a node that enforces it
    /// itself while no replica does (`expiry.rs`). A node in the server's own process has no
    /// need: the server's reaper is there whenever the node is.
    async fn set_deadline(&self, id: &str, deadline: Option<Deadline>) -> Result<(), NodeError> {
        let _ = (id, deadline);
        Ok(())
    }
    /// What this node has (admission derives its budgets from it, see `core::Config::budget`).
    fn capacity(&self) -> Capacity;
    /// The nodes placement chooses from: one (this), or a cluster's.
    fn members(&self) -> Vec<Member> {
        vec![Member {
            name: String::new(),
            capacity: self.capacity(),
            refuses: None,
            draining: false,
            fingerprint: String::new(),
            parks: false,
            answering: true,
        }]
    }
    /// The member that has VM, claimed pool VM or saved image `id`, where known.
    fn owner(&self, _id: &str) -> Option<String> {
        Some(String::new())
    }
}
