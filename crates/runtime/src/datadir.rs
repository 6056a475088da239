//! Layout of the data dir (`--data-dir`, `AIRLOCK_DATA_DIR`, default `/var/lib/airlock`):
//!
//! ```text
//! templates/<name>.json          manifest of a template (points at a blob by digest)
//! blobs/sha256/<hex>/            kernel, initramfs and rootfs of one built template
//! cache/                         build layers (kernel packages, debootstrap bases)
//! sandboxes/<id>/                one running sandbox: overlay, sockets, pidfile, console log
//! accel.json                     cached verdict of the KVM probe
//! ```

use crate::error::{Result, RuntimeError};
/// Kept here too: callers name ids and tokens by this path.
pub use crate::random::random_hex;
use std::path::{Path, PathBuf};

pub const DEFAULT_DATA_DIR: &str = "/var/lib/airlock";

#[derive(Debug, Clone)]
pub struct DataDir {
    root: PathBuf,
}

impl DataDir {
    /// Create the layout and prove the directory is writable.
    pub fn open(root: impl Into<PathBuf>) -> Result<Self> {
        let root: PathBuf = root.into();
        let root = if root.is_absolute() {
            root
        } else {
            std::env::current_dir()
                .map_err(|e| RuntimeError::io(&root, e))?
                .join(root)
        };
        let not_writable = |e: std::io::Error| RuntimeError::DataDirNotWritable {
            path: root.display().to_string(),
            reason: e.to_string(),
        };
        for sub in ["templates", "blobs/sha256", "cache", "sandboxes"] {
            std::fs::create_dir_all(root.join(sub)).map_err(not_writable)?;
        }
        let probe = root.join(format!(".write-probe-{}", std::process::id()));
        std::fs::write(&probe, b"ok").map_err(not_writable)?;
        let _ = std::fs::remove_file(&probe);
        Ok(Self { root })
    }

    pub fn root(&self) -> &Path {
        &self.root
    }
    pub fn templates(&self) -> PathBuf {
        self.root.join("templates")
    }
    pub fn blobs(&self) -> PathBuf {
        self.root.join("blobs/sha256")
    }
    pub fn cache(&self) -> PathBuf {
        self.root.join("cache")
    }
    pub fn sandboxes(&self) -> PathBuf {
        self.root.join("sandboxes")
    }
    pub fn accel_cache(&self) -> PathBuf {
        self.root.join("accel.json")
    }
}

/// Write a file atomically (temp file + rename), so a crash never leaves half a manifest.
pub fn write_atomic(path: &Path, data: &[u8]) -> Result<()> {
    let tmp = path.with_extension(format!("tmp-{}", std::process::id()));
    std::fs::write(&tmp, data).map_err(|e| RuntimeError::io(&tmp, e))?;
    std::fs::rename(&tmp, path).map_err(|e| RuntimeError::io(path, e))
}

/// An exclusive advisory lock held while the guard lives (e.g. one template build at a time).
pub struct FileLock {
    _lock: nix::fcntl::Flock<std::fs::File>,
}

impl FileLock {
    fn open(path: &Path) -> Result<std::fs::File> {
        std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(path)
            .map_err(|e| RuntimeError::io(path, e))
    }

    /// Wait for the lock.
    pub fn acquire(path: &Path) -> Result<Self> {
        let lock = nix::fcntl::Flock::lock(Self::open(path)?, nix::fcntl::FlockArg::LockExclusive)
            .map_err(|(_, e)| RuntimeError::io(path, e.into()))?;
        Ok(Self { _lock: lock })
    }

    /// Take the lock if free; `None` when someone else holds it.
    pub fn try_acquire(path: &Path) -> Result<Option<Self>> {
        match nix::fcntl::Flock::lock(Self::open(path)?, nix::fcntl::FlockArg::LockExclusiveNonblock) {
            Ok(lock) => Ok(Some(Self { _lock: lock })),
            Err((_, nix::errno::Errno::EWOULDBLOCK)) => Ok(None),
            Err((_, e)) => Err(RuntimeError::io(path, e.into())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn open_creates_layout_and_rejects_unwritable() {
        let d = tempfile::tempdir().unwrap();
        let dd = DataDir::open(d.path().join("x")).unwrap();
        assert!(dd.sandboxes().is_dir() && dd.blobs().is_dir());
        // A path under a regular file can never be created.
        let file = d.path().join("file");
        std::fs::write(&file, b"").unwrap();
        let err = DataDir::open(file.join("sub")).unwrap_err();
        assert!(matches!(err, RuntimeError::DataDirNotWritable { .. }), "{err}");
        assert!(err.to_string().contains("--data-dir"));
    }
}
