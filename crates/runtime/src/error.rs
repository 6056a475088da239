use thiserror::Error;

/// Everything the node runtime can fail with. The HTTP layer maps each variant to a status once.
#[derive(Debug, Error)]
pub enum RuntimeError {
    #[error("unknown template {0:?}; `airlock template ls` lists the templates")]
    UnknownTemplate(String),
    #[error("no sandbox with id {0:?}")]
    UnknownSandbox(String),
    #[error("no saved image with id {0:?}")]
    UnknownImage(String),
    /// A volume's id, size or mount this node refuses (the message says which).
    #[error("{0}")]
    InvalidVolume(String),
    #[error("no volume with id {0:?} on this node")]
    UnknownVolume(String),
    /// The volume is held by a VM in a way that refuses this (the message names it).
    #[error("{0}")]
    VolumeBusy(String),
    #[error("invalid resources: {0}")]
    InvalidResources(String),
    #[error("QEMU is not installed ({0} not found); run scripts/install-host-deps as root")]
    QemuMissing(String),
    #[error(
        "data dir {path} is not writable: {reason}; pass --data-dir (or AIRLOCK_DATA_DIR) with a writable directory"
    )]
    DataDirNotWritable { path: String, reason: String },
    #[error("data dir {0} is in use by another airlock process; stop it or pass another --data-dir")]
    DataDirInUse(String),
    #[error("template build failed: {0}")]
    TemplateBuild(#[from] crate::template::TemplateError),
    /// An OCI image could not be made a template (a bad reference, a pull, a layer).
    #[error(transparent)]
    Image(crate::template::ImageError),
    /// The VM did not get to its agent's READY: `stage` is what it was doing (boot, restore,
    /// resume), `console` the tail of its console, `cause` what failed (none: the VMM exited).
    #[error("sandbox {id} failed to {stage}: {}; console:\n{console}", cause.as_ref().map_or_else(|| "the VMM exited".to_string(), |c| c.to_string()))]
    BootFailed {
        id: String,
        stage: &'static str,
        console: String,
        #[source]
        cause: Option<Box<RuntimeError>>,
    },
    #[error("sandbox {0} is not running")]
    NotRunning(String),
    #[error("guest agent: {0}")]
    Agent(#[from] crate::agent::AgentError),
    /// A command on the VMM's control socket (QMP for QEMU) failed or got no answer.
    #[error("VMM control command {command:?} failed: {reason}")]
    ControlCommand { command: String, reason: String },
    /// The sandbox's root disk (the overlay on the template image) could not be made.
    #[error("creating the sandbox disk failed: {0}")]
    DiskCreate(String),
    #[error("invalid sandbox id {0:?}: use 8 to 40 lowercase letters and digits")]
    InvalidSandboxId(String),
    #[error("sandbox id {0:?} is already in use on this node")]
    SandboxIdTaken(String),
    /// The template's start process exited before its port opened.
    #[error("template start process {argv:?} exited before its port opened; its output: {output}")]
    TemplateStart { argv: Vec<String>, output: String },
    /// The template's start process runs, but its port did not accept connections in time.
    #[error("port {port} in the sandbox did not accept connections within {waited_ms} ms")]
    PortNotReady { port: u16, waited_ms: u64 },
    /// The VMM process is still alive after SIGKILL (stuck in the kernel).
    #[error("VMM process {pid} survived SIGKILL")]
    StopFailed { pid: u32 },
    /// The VMM's jail (uid, mount namespace, cgroups) could not be set up.
    #[error("VMM jail: {0}")]
    Jail(#[from] crate::jail::JailError),
    /// The sandbox's network (namespace, tap, veth, nftables, egress hook) could not be made.
    #[error("sandbox network: {0}")]
    Network(#[from] crate::net::NetError),
    #[error("I/O on {path}: {source}")]
    Io { path: String, source: std::io::Error },
}

impl RuntimeError {
    pub fn io(path: impl AsRef<std::path::Path>, source: std::io::Error) -> Self {
        Self::Io {
            path: path.as_ref().display().to_string(),
            source,
        }
    }
}

pub type Result<T, E = RuntimeError> = std::result::Result<T, E>;
