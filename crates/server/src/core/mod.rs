//! The door-neutral core: typed requests in, typed results out, `CoreError` for every failure.
//! Both doors (native `/v1`, E2B) call these services and only translate wire formats; a rule
//! (auth, admission, timeouts, env names, signals, quotas) lives here once.
//!
//! - `principal`: who is calling (API key, sandbox access token, signed URL)
//! - `sandboxes`: admission and lifecycle (through the operation engine)
//! - `sessions`: every process started through either door, with an id
//! - `files`: file operations inside a running sandbox
//! - `templates`: template names and aliases

pub mod files;
pub mod principal;
pub mod sandboxes;
pub mod sessions;
pub mod templates;

pub use crate::error::{CoreError, CoreResult, Kind};
pub use principal::{Accept, Credentials, Principal, Via};

use crate::engine::Engine;
use crate::nodes::Nodes;
use crate::store::Store;
use std::path::Path;
use std::sync::Arc;

/// Limits the operator sets at start-up.
#[derive(Debug, Clone)]
pub struct Config {
    /// Live sandboxes (creating, running, paused, deleting) one tenant may have at once.
    pub max_sandboxes_per_tenant: u32,
}

/// The core's handle: cheap to clone, shared by every door.
#[derive(Clone)]
pub struct Core {
    pub store: Arc<dyn Store>,
    pub nodes: Arc<dyn Nodes>,
    pub engine: Engine,
    pub config: Arc<Config>,
    /// Derives sandbox access tokens (see `principal`).
    secret: Arc<[u8]>,
}

impl Core {
    pub fn new(store: Arc<dyn Store>, nodes: Arc<dyn Nodes>, config: Config, secret: Vec<u8>) -> Self {
        let engine = Engine::new(store.clone(), nodes.clone());
        Self {
            store,
            nodes,
            engine,
            config: Arc::new(config),
            secret: secret.into(),
        }
    }
}

/// `<data-dir>/server.secret` (0600, 32 random bytes), made on first start.
pub fn load_or_create_secret(data_dir: &Path) -> std::io::Result<Vec<u8>> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let path = data_dir.join("server.secret");
    match std::fs::read(&path) {
        Ok(s) if s.len() >= 32 => return Ok(s),
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    let mut secret = vec![0u8; 32];
    std::fs::File::open("/dev/urandom").and_then(|mut f| std::io::Read::read_exact(&mut f, &mut secret))?;
    // Written under a temporary name and renamed: a crash never leaves half a secret.
    let tmp = data_dir.join(".server.secret.tmp");
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(true)
        .write(true)
        .mode(0o600)
        .open(&tmp)?;
    f.write_all(&secret)?;
    f.sync_all()?;
    std::fs::rename(&tmp, &path)?;
    Ok(secret)
}
