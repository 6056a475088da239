//! The one shape of a saved machine ([`SavedMachine`]): a dir holding the VM's saved state
//! (RAM and devices), its disk, hard links to the files it sits on (`held/`) and a manifest
//! written last (a dir without one is a save that did not finish). Three formats have it: a
//! base snapshot (`base_snapshot.rs`), a suspended VM (`suspend.rs`) and an image (`image.rs`);
//! each says its file names through [`Manifest`]. Saving and loading sit here side by side.
//! Uses only the data dir's helpers.

use crate::datadir::write_atomic;
use crate::error::{Result, RuntimeError};
use serde::de::DeserializeOwned;
use serde::Serialize;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The longest a save of a VM's state, or its load, may take (the state is the guest's RAM in use).
pub const SAVE_LIMIT: Duration = Duration::from_secs(120);

/// A saved-machine format: where its manifest and state are in the dir.
pub trait Manifest: Serialize + DeserializeOwned {
    /// The manifest's file name.
    const FILE: &'static str;
    /// The saved state's file name.
    const STATE: &'static str = "state";
    /// The disk's file name.
    const DISK: &'static str = "disk.qcow2";
    /// Whether `dir` holds everything this manifest needs to load.
    fn complete(&self, dir: &Path) -> bool {
        dir.join(Self::STATE).is_file() && dir.join(Self::DISK).is_file()
    }
}

/// A saved machine on disk.
#[derive(Debug, Clone)]
pub struct SavedMachine<M> {
    pub dir: PathBuf,
    pub manifest: M,
}

impl<M: Manifest> SavedMachine<M> {
    pub fn state(&self) -> PathBuf {
        self.dir.join(M::STATE)
    }

    pub fn disk(&self) -> PathBuf {
        self.dir.join(M::DISK)
    }

    /// The load side: the machine saved in `dir`, if its save finished.
    pub fn load(dir: PathBuf) -> Option<Self> {
        let manifest: M = serde_json::from_slice(&std::fs::read(dir.join(M::FILE)).ok()?).ok()?;
        manifest.complete(&dir).then_some(Self { dir, manifest })
    }

    /// The save side's last step: `manifest` written into `dir`, which then holds a whole save.
    pub fn seal(dir: PathBuf, manifest: M) -> Result<Self> {
        write_atomic(
            &dir.join(M::FILE),
            &serde_json::to_vec_pretty(&manifest).expect("serializable"),
        )?;
        Ok(Self { dir, manifest })
    }

    /// Whether `dir` holds a manifest of this format (finished or not).
    pub fn is_marked(dir: &Path) -> bool {
        dir.join(M::FILE).is_file()
    }
}

/// `<dir>/held/<name>`, a hard link to `file` (the machine's own hold on it), or `file` itself
/// where no link can be made (another filesystem).
pub fn hold(dir: &Path, name: &str, file: &Path) -> PathBuf {
    let held = dir.join("held");
    let link = held.join(name);
    let made = std::fs::create_dir_all(&held).and_then(|()| std::fs::hard_link(file, &link));
    match made {
        Ok(()) => link,
        Err(e) => {
            tracing::debug!("cannot link {} into {}: {e}", file.display(), held.display());
            file.to_path_buf()
        }
    }
}

/// A new file for a VM's saved state: the server's only (it holds the guest's memory).
pub fn create_state_file(path: &Path) -> Result<std::fs::File> {
    crate::datadir::create_private(path).map_err(|e| RuntimeError::io(path, e))
}

/// Copy `from` to `to` (sparse; shared extents where the filesystem can).
pub async fn copy_file(from: &Path, to: &Path) -> Result<()> {
    let out = tokio::process::Command::new("cp")
        .args(["--reflink=auto", "--sparse=always"])
        .arg(from)
        .arg(to)
        .output()
        .await
        .map_err(|e| RuntimeError::io(from, e))?;
    if !out.status.success() {
        return Err(RuntimeError::io(
            from,
            std::io::Error::other(String::from_utf8_lossy(&out.stderr).trim().to_string()),
        ));
    }
    Ok(())
}
