use thiserror::Error;

/// Everything the node runtime can fail with. The HTTP layer maps each variant to a status once.
#[derive(Debug, Error)]
pub enum RuntimeError {
    #[error("unknown template {0:?}; `airlock template ls` lists the templates")]
    UnknownTemplate(String),
    #[error("no sandbox with id {0:?}")]
    UnknownSandbox(String),
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
    TemplateBuild(String),
    #[error("sandbox {id} failed to boot: {reason}")]
    BootFailed { id: String, reason: String },
    #[error("sandbox {0} is not running")]
    NotRunning(String),
    #[error("guest agent: {0}")]
    Agent(#[from] crate::agent::AgentError),
    #[error("VMM: {0}")]
    Vmm(String),
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
