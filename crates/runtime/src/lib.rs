//! airlock's node runtime: templates, the VMM driver, the guest agent client, and sandboxes.
//!
//! The server and the CLI are thin layers over this crate; the integration tests drive it
//! directly against real QEMU VMs.

pub mod agent;
pub mod datadir;
pub mod error;
#[cfg(feature = "fake")]
pub mod fake;
pub mod qemu;
pub mod qmp;
pub mod random;
pub mod sandbox;
pub mod template;
pub mod vmm;

pub use agent::AgentClient;
pub use error::{Result, RuntimeError};
pub use sandbox::{CreateSandbox, Output, Resources, Runtime, RuntimeOptions, Sandbox};
pub use vmm::Accel;
