//! What a node can fail with, in the seam's own terms: the conditions a caller acts on are
//! variants; the node's own failure is kept whole as the cause, whatever the node's type (a
//! local runtime's `RuntimeError` today, a remote node's reply tomorrow).

use airlock_runtime::net::NetError;
use airlock_runtime::RuntimeError;

/// A node's failure, kept as the source of the variants that wrap one.
pub type Cause = Box<dyn std::error::Error + Send + Sync>;

#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    #[error("unknown template {0:?}; `airlock template ls` lists the templates")]
    UnknownTemplate(String),
    #[error("no sandbox with id {0:?} on this node")]
    UnknownSandbox(String),
    #[error("no saved image with id {0:?}")]
    UnknownImage(String),
    #[error("invalid resources: {0}")]
    InvalidResources(String),
    #[error("invalid sandbox id {0:?}: use 8 to 40 lowercase letters and digits")]
    InvalidSandboxId(String),
    #[error("sandbox id {0:?} is already in use on this node")]
    SandboxIdTaken(String),
    #[error("sandbox {0} is not running")]
    NotRunning(String),
    /// The change named a run of the sandbox ([`crate::nodes::VmReport::run`]) other than the
    /// one this node has: it was meant for an earlier run, and the VM is left as it is.
    #[error("sandbox {0}'s VM on this node is another run than the one named; it is left as it is")]
    StaleRun(String),
    /// The change was sent for an operation that another caller has since taken over (its
    /// lease epoch is older than one this node has seen): the caller no longer holds it.
    #[error("operation {0} has been taken over by another replica; this call is refused")]
    Fenced(String),
    /// The VM did not come up: its boot or restore failed, or the template's start process did.
    #[error(transparent)]
    BootFailed(Cause),
    /// The node has no room for another VM now (no network slot left): later, or elsewhere.
    #[error(transparent)]
    Exhausted(Cause),
    /// The sandbox's network (namespace, tap, nftables, egress hook) could not be made.
    #[error(transparent)]
    Network(Cause),
    /// The node turned the VM away by its own admission (see `admission.rs`): place it elsewhere.
    #[error("{1}")]
    Refused(super::Refusal, String),
    /// The node cannot do this at all (how it was set up): ask another.
    #[error("this node cannot {0}")]
    Unsupported(String),
    /// An OCI image could not be made a template: the message names the image and why.
    #[error("{0}")]
    BadImage(String),
    /// A volume's id, size or mount the node refuses.
    #[error("{0}")]
    InvalidVolume(String),
    #[error("no volume {0:?} on this node")]
    UnknownVolume(String),
    /// A VM holds the volume in a way that refuses this (the message names it).
    #[error("{0}")]
    VolumeBusy(String),
    /// The node did not answer (down, cut off, or past the call's deadline): the VM's fate is
    /// unknown, not failed.
    #[error(transparent)]
    Unreachable(Cause),
    /// Anything else the node failed at (its VMM, jail, disk, agent).
    #[error(transparent)]
    Failed(Cause),
}

impl From<RuntimeError> for NodeError {
    fn from(e: RuntimeError) -> Self {
        match e {
            RuntimeError::UnknownTemplate(t) => NodeError::UnknownTemplate(t),
            RuntimeError::UnknownSandbox(id) => NodeError::UnknownSandbox(id),
            RuntimeError::UnknownImage(id) => NodeError::UnknownImage(id),
            RuntimeError::InvalidResources(m) => NodeError::InvalidResources(m),
            RuntimeError::InvalidSandboxId(id) => NodeError::InvalidSandboxId(id),
            RuntimeError::SandboxIdTaken(id) => NodeError::SandboxIdTaken(id),
            RuntimeError::NotRunning(id) => NodeError::NotRunning(id),
            RuntimeError::Image(e) => NodeError::BadImage(e.to_string()),
            RuntimeError::InvalidVolume(m) => NodeError::InvalidVolume(m),
            RuntimeError::UnknownVolume(v) => NodeError::UnknownVolume(v),
            RuntimeError::VolumeBusy(m) => NodeError::VolumeBusy(m),
            e @ (RuntimeError::BootFailed { .. }
            | RuntimeError::TemplateStart { .. }
            | RuntimeError::PortNotReady { .. }) => NodeError::BootFailed(Box::new(e)),
            e @ RuntimeError::Network(NetError::PoolExhausted(_)) => NodeError::Exhausted(Box::new(e)),
            e @ RuntimeError::Network(_) => NodeError::Network(Box::new(e)),
            // Every variant is named: a new one must be placed here deliberately.
            e @ (RuntimeError::Agent(_)
            | RuntimeError::QemuMissing(_)
            | RuntimeError::DataDirNotWritable { .. }
            | RuntimeError::DataDirInUse(_)
            | RuntimeError::TemplateBuild(_)
            | RuntimeError::ControlCommand { .. }
            | RuntimeError::DiskCreate(_)
            | RuntimeError::StopFailed { .. }
            | RuntimeError::Jail(_)
            | RuntimeError::Io { .. }) => NodeError::Failed(Box::new(e)),
        }
    }
}
