//! What a template build fails with: each variant says what to do about it (install a tool, fix
//! the host's apt sources, build the agent, retry a flaky mirror), keeping the cause.

use std::path::PathBuf;
use thiserror::Error;

#[derive(Debug, Error)]
pub enum TemplateError {
    #[error("no recipe for template {name:?}; buildable: {}", super::BUILDABLE.join(", "))]
    NoRecipe { name: String },
    /// A command the build runs is not installed on the host.
    #[error("{what}: command not found; run scripts/install-host-deps as root")]
    ToolMissing {
        what: String,
        #[source]
        source: std::io::Error,
    },
    /// A command could not be started or waited for.
    #[error("{what}: {source}")]
    Spawn {
        what: String,
        #[source]
        source: std::io::Error,
    },
    /// A command ran and failed (a mirror's hiccup is worth a retry): its last lines of output.
    #[error("{what} failed ({status}): {tail}{}", log_suffix(.log))]
    Failed {
        what: String,
        status: std::process::ExitStatus,
        tail: String,
        /// The whole output, for the long steps that keep it.
        log: Option<PathBuf>,
    },
    #[error("du -sb {} failed", .0.display())]
    DiskUsage(PathBuf),
    #[error("apt-get download {package} produced no .deb")]
    NoDeb { package: String },
    /// A downloaded file is not what the recipe pins.
    #[error("{file}: sha256 {got}, expected {expected}")]
    DigestMismatch {
        file: String,
        got: String,
        expected: String,
    },
    /// A package from the npm registry is not what the recipe pins.
    #[error("{package}: integrity {got}, expected {expected}")]
    IntegrityMismatch {
        package: String,
        got: String,
        expected: String,
    },
    #[error("npm pack {package} produced no tarball")]
    NoTarball { package: String },
    #[error("{package} has no {entry}")]
    NpmEntryMissing { package: String, entry: String },
    #[error("no Debian mirror in /etc/apt/sources.list.d/debian.sources; pass --mirror or set AIRLOCK_DEBIAN_MIRROR")]
    NoMirror,
    #[error("apt knows no {meta_package}; run `apt-get update` (scripts/install-host-deps does)")]
    NoKernelPackage { meta_package: &'static str },
    #[error("no candidate version of {package}")]
    NoKernelVersion { package: String },
    #[error("no modules in {}", .0.display())]
    NoKernelModules(PathBuf),
    #[error("kernel module {0} not found")]
    ModuleMissing(String),
    #[error("guest agent {}: {source}; build it with scripts/build", .path.display())]
    AgentUnreadable {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("guest agent {} is dynamically linked; build it with scripts/build (static)", .0.display())]
    AgentNotStatic(PathBuf),
    #[error("guest agent binary not found; build it with scripts/build or set AIRLOCK_AGENT_BIN")]
    AgentNotFound,
    #[error(transparent)]
    Confine(#[from] super::confine::ConfineError),
}

fn log_suffix(log: &Option<PathBuf>) -> String {
    log.as_ref()
        .map(|l| format!(" (log: {})", l.display()))
        .unwrap_or_default()
}

impl TemplateError {
    /// A command that could not be started: missing, or another I/O error.
    pub(super) fn spawn(what: &str, source: std::io::Error) -> Self {
        let what = what.to_string();
        match source.kind() {
            std::io::ErrorKind::NotFound => Self::ToolMissing { what, source },
            _ => Self::Spawn { what, source },
        }
    }
}
