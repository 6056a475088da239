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
        // The data dir holds the store (key hashes, access-token hashes), the server secret,
        // the admin key and guests' disks and consoles: only the server's user may enter it.
        // An existing dir is tightened too.
        {
            use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(&root)
                .map_err(not_writable)?;
            std::fs::set_permissions(&root, std::fs::Permissions::from_mode(0o700)).map_err(not_writable)?;
        }
        for sub in ["templates", "blobs/sha256", "cache", "sandboxes", "images"] {
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
    /// Base snapshots, one dir per key (see `sandbox/base_snapshot.rs`); private to the server.
    pub fn base_snapshots(&self) -> PathBuf {
        self.root.join("snapshots")
    }
    /// Images saved from running sandboxes (snapshots a tenant made, forks), one dir per id.
    pub fn images(&self) -> PathBuf {
        self.root.join("images")
    }
    pub fn accel_cache(&self) -> PathBuf {
        self.root.join("accel.json")
    }
}

/// Write a file atomically (temp file + fsync + rename, then the dir's fsync, best effort), so
/// neither a crash nor a power loss leaves half a manifest.
pub fn write_atomic(path: &Path, data: &[u8]) -> Result<()> {
    write_file_atomic(path, data, None).map_err(|(p, e)| RuntimeError::io(&p, e))
}

/// [`write_atomic`] with the file's mode (set on the temp file before any byte is written, so
/// a secret is never readable by others, whatever the umask); errors name the path they hit.
pub fn write_atomic_mode(path: &Path, data: &[u8], mode: u32) -> std::result::Result<(), (PathBuf, std::io::Error)> {
    write_file_atomic(path, data, Some(mode))
}

/// `mode`: exactly this mode; `None`: 0666 less the umask, as `std::fs::write`.
fn write_file_atomic(
    path: &Path,
    data: &[u8],
    mode: Option<u32>,
) -> std::result::Result<(), (PathBuf, std::io::Error)> {
    use std::io::Write;
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let tmp = path.with_extension(format!("tmp-{}-{}", std::process::id(), random_hex(4)));
    let written = (|| {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(mode.unwrap_or(0o666))
            .open(&tmp)?;
        // `mode` above is filtered by the umask; this is not.
        if let Some(mode) = mode {
            f.set_permissions(std::fs::Permissions::from_mode(mode))?;
        }
        f.write_all(data)?;
        f.sync_all()
    })();
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err((tmp, e));
    }
    if let Err(e) = std::fs::rename(&tmp, path) {
        let _ = std::fs::remove_file(&tmp);
        return Err((path.to_path_buf(), e));
    }
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        if let Ok(d) = std::fs::File::open(dir) {
            let _ = d.sync_all();
        }
    }
    Ok(())
}

/// Create `path` empty (or truncate it) with mode 0600 whatever the umask, for files a process
/// then writes that only the server's user may read (a console log).
pub fn create_private(path: &Path) -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)?;
    f.set_permissions(std::fs::Permissions::from_mode(0o600))?;
    Ok(f)
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

    #[test]
    fn the_data_dir_is_private_and_atomic_writes_keep_their_mode() {
        use std::os::unix::fs::PermissionsExt;
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        let d = tempfile::tempdir().unwrap();
        let root = d.path().join("new");
        DataDir::open(&root).unwrap();
        assert_eq!(mode(&root), 0o700);
        // An existing, open dir is tightened.
        let old = d.path().join("old");
        std::fs::create_dir(&old).unwrap();
        std::fs::set_permissions(&old, std::fs::Permissions::from_mode(0o755)).unwrap();
        DataDir::open(&old).unwrap();
        assert_eq!(mode(&old), 0o700);

        let f = root.join("secret");
        write_atomic_mode(&f, b"one", 0o600).unwrap();
        assert_eq!((std::fs::read(&f).unwrap(), mode(&f)), (b"one".to_vec(), 0o600));
        write_atomic_mode(&f, b"two", 0o600).unwrap();
        assert_eq!((std::fs::read(&f).unwrap(), mode(&f)), (b"two".to_vec(), 0o600));
        write_atomic(&root.join("m.json"), b"{}").unwrap();
        assert_eq!(std::fs::read(root.join("m.json")).unwrap(), b"{}");
        // No temp file is left behind.
        let names: Vec<_> = std::fs::read_dir(&root)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|n| n.contains("tmp-"))
            .collect();
        assert!(names.is_empty(), "{names:?}");
        let log = root.join("console.log");
        std::fs::write(&log, b"old").unwrap();
        create_private(&log).unwrap();
        assert_eq!((std::fs::read(&log).unwrap().len(), mode(&log)), (0, 0o600));
    }
}
