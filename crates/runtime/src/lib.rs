//! airlock's node runtime: one host's sandboxes.
//!
//! - `sandbox`: `Runtime` (create, find, re-attach after a restart, pause, suspend, delete), warm
//!   pools, base snapshots and saved images, each in its own file
//! - `vmm`: the `Vmm` trait and its drivers (`qemu`; `fake`, an in-memory one for tests)
//! - `template`: template builds and the content-addressed store
//! - `jail`: what every VMM process runs in (its own uid, read-only mounts, cgroups)
//! - `agent`: the client of the guest agent (HTTP/2 over the VM's channel)
//! - `objects`: templates and saved images in object storage (S3, or a local dir), shared
//!   between hosts
//! - `net`: each sandbox's network namespace, tap, veth and nftables, and the egress hook
//!
//! The server reaches it only through its node seam; the integration tests drive it directly
//! against real QEMU VMs and against the fake VMM.

/// The guest agent's client lives in its own crate (a remote node's callers use it too).
pub use airlock_agent_client as agent;
pub mod datadir;
mod digest;
pub mod error;
pub mod jail;
pub mod net;
pub mod objects;
pub mod random;
pub mod sandbox;
pub mod template;
pub mod vmm;
pub mod volume;

#[cfg(feature = "fake")]
pub use vmm::fake;
pub use vmm::{qemu, qmp};

pub use agent::AgentClient;
pub use error::{Result, RuntimeError};
pub use sandbox::pools::{PoolKey, PoolStatus};
pub use sandbox::{
    start_template_process, Capture, CreateVm, DiskSpace, Output, Resources, Runtime, RuntimeOptions, Vm,
};
pub use vmm::Accel;
