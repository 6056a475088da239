//! This node's volumes' disks: `<data dir>/volumes/<id>.ext4`, a sparse raw file the host made
//! (`mkfs.ext4` on a file nobody else wrote yet, its root uid 1000's) and afterwards only grows, moves or deletes:
//! once a guest wrote it, its bytes are the guest's, so the host never mounts or reads them
//! (file calls on a volume go through a guest that has it mounted: `sandbox/volumes.rs`).

use crate::error::{Result, RuntimeError};
use std::path::{Path, PathBuf};
use std::process::Command;

/// The smallest volume: ext4 with a journal needs a few MiB to be useful.
pub const MIN_VOLUME_MIB: u64 = 16;
/// The largest (a sparse file: only what is written takes space).
pub const MAX_VOLUME_MIB: u64 = 1024 * 1024;

#[derive(Debug, Clone)]
pub struct VolumeDisks {
    dir: PathBuf,
}

/// A volume id both ends accept: the guest finds its disk by it (the SCSI serial).
pub fn valid_volume_id(id: &str) -> bool {
    airlock_proto::MountVolume::valid_serial(id) && id.bytes().all(|b| b != b'.')
}

impl VolumeDisks {
    pub fn open(data_root: &Path) -> Result<Self> {
        let dir = data_root.join("volumes");
        std::fs::create_dir_all(&dir).map_err(|e| RuntimeError::io(&dir, e))?;
        // Staging files of a create that did not finish.
        for e in std::fs::read_dir(&dir)
            .map_err(|e| RuntimeError::io(&dir, e))?
            .flatten()
        {
            if e.file_name().to_string_lossy().ends_with(".new") {
                let _ = std::fs::remove_file(e.path());
            }
        }
        Ok(Self { dir })
    }

    pub fn path(&self, id: &str) -> PathBuf {
        self.dir.join(format!("{id}.ext4"))
    }

    pub fn exists(&self, id: &str) -> bool {
        valid_volume_id(id) && self.path(id).is_file()
    }

    /// A new empty ext4 of `size_mib`; an existing one of that id is left as it is (a retried
    /// create).
    pub fn create(&self, id: &str, size_mib: u64) -> Result<PathBuf> {
        check(id, size_mib)?;
        let path = self.path(id);
        if path.is_file() {
            return Ok(path);
        }
        let staging = self.dir.join(format!("{id}.ext4.new"));
        let made = (|| {
            let f = std::fs::File::create(&staging).map_err(|e| RuntimeError::io(&staging, e))?;
            f.set_len(size_mib << 20).map_err(|e| RuntimeError::io(&staging, e))?;
            drop(f);
            // Its root is uid 1000's (`user` in airlock's and E2B's templates): files the
            // content API writes before any sandbox mounts it are the sandboxes' user's.
            let out = Command::new("mkfs.ext4")
                .args([
                    "-q",
                    "-F",
                    "-m",
                    "0",
                    "-E",
                    "lazy_itable_init=1,lazy_journal_init=1,discard,root_owner=1000:1000",
                ])
                .arg("-L")
                .arg(&id[..id.len().min(16)])
                .arg(&staging)
                .output()
                .map_err(|e| RuntimeError::io("mkfs.ext4", e))?;
            if !out.status.success() {
                return Err(RuntimeError::DiskCreate(format!(
                    "mkfs.ext4 for volume {id}: {}",
                    String::from_utf8_lossy(&out.stderr).trim()
                )));
            }
            std::fs::rename(&staging, &path).map_err(|e| RuntimeError::io(&path, e))
        })();
        if made.is_err() {
            let _ = std::fs::remove_file(&staging);
        }
        made.map(|()| path)
    }

    /// Grow the disk to `size_mib` (never shrinks: the filesystem inside is the guest's). The
    /// next guest that mounts it grows its filesystem to the disk.
    pub fn grow(&self, id: &str, size_mib: u64) -> Result<()> {
        check(id, size_mib)?;
        let path = self.path(id);
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .map_err(|e| RuntimeError::io(&path, e))?;
        let now = f.metadata().map_err(|e| RuntimeError::io(&path, e))?.len();
        if size_mib << 20 > now {
            f.set_len(size_mib << 20).map_err(|e| RuntimeError::io(&path, e))?;
        }
        Ok(())
    }

    pub fn delete(&self, id: &str) -> Result<()> {
        if !valid_volume_id(id) {
            return Ok(());
        }
        match std::fs::remove_file(self.path(id)) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(RuntimeError::io(self.path(id), e)),
            _ => Ok(()),
        }
    }

    /// The bytes the node's disk holds for the volume (a sparse file's allocated blocks).
    pub fn allocated(&self, id: &str) -> u64 {
        use std::os::unix::fs::MetadataExt;
        std::fs::metadata(self.path(id)).map(|m| m.blocks() * 512).unwrap_or(0)
    }

    /// The ids of the volumes here.
    pub fn list(&self) -> Vec<String> {
        std::fs::read_dir(&self.dir)
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.strip_suffix(".ext4").map(str::to_string))
            .filter(|id| valid_volume_id(id))
            .collect()
    }
}

fn check(id: &str, size_mib: u64) -> Result<()> {
    if !valid_volume_id(id) {
        return Err(RuntimeError::InvalidVolume(format!("bad volume id {id:?}")));
    }
    if !(MIN_VOLUME_MIB..=MAX_VOLUME_MIB).contains(&size_mib) {
        return Err(RuntimeError::InvalidVolume(format!(
            "a volume's size is {MIN_VOLUME_MIB}..={MAX_VOLUME_MIB} MiB, not {size_mib}"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_volume_is_made_grown_and_deleted() {
        let d = tempfile::tempdir().unwrap();
        let v = VolumeDisks::open(d.path()).unwrap();
        let p = v.create("vol-test1", 32).unwrap();
        assert_eq!(std::fs::metadata(&p).unwrap().len(), 32 << 20);
        // Sparse: a fresh ext4 holds far less than its size.
        assert!(v.allocated("vol-test1") < 16 << 20, "{}", v.allocated("vol-test1"));
        v.grow("vol-test1", 64).unwrap();
        v.grow("vol-test1", 48).unwrap();
        assert_eq!(std::fs::metadata(&p).unwrap().len(), 64 << 20);
        assert_eq!(v.list(), vec!["vol-test1".to_string()]);
        assert!(v.create("../x", 32).is_err());
        assert!(v.create("vol-x", 1).is_err());
        v.delete("vol-test1").unwrap();
        assert!(!v.exists("vol-test1"));
    }
}
