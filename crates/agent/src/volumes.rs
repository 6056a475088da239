//! Volumes: a disk the host hot-plugged (`scsi-hd`, its serial the volume's id) mounted where
//! the sandbox asked, and bound a second time under [`VOLUME_ACCESS_DIR`] without symlink
//! following, where the host's file calls on the volume land (see `airlock_proto::MountVolume`).

use crate::error::AgentError;
use crate::{files, users};
use airlock_proto::{MountVolume, VOLUME_ACCESS_DIR};
use nix::mount::{mount, MsFlags};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// How long a hot-plugged disk may take to show up (the guest's SCSI scan after the event).
const FIND_DISK: Duration = Duration::from_secs(20);

/// Where a sandbox may not mount a volume: the agent's and the kernel's own trees.
const RESERVED: &[&str] = &["/", "/proc", "/sys", "/dev", "/run/airlock", "/usr/sbin"];

// `EXT4_IOC_RESIZE_FS`: grow a mounted ext4 to the given block count.
nix::ioctl_write_ptr!(ext4_resize_fs, b'f', 16, u64);
// `BLKGETSIZE64`: a block device's size in bytes.
nix::ioctl_read!(blk_size_bytes, 0x12, 114, u64);

pub fn mount_volume(req: &MountVolume) -> Result<(), AgentError> {
    if !MountVolume::valid_serial(&req.serial) {
        return Err(AgentError::invalid(format!("bad volume serial {:?}", req.serial)));
    }
    let path = files::clean_path(&req.path)?;
    if RESERVED
        .iter()
        .any(|r| path == Path::new(r) || (*r != "/" && path.starts_with(r)))
    {
        return Err(AgentError::invalid(format!(
            "a volume cannot be mounted at {}",
            path.display()
        )));
    }
    let device = find_disk(&req.serial)?;
    let dev = device.display().to_string();
    let p = path.display().to_string();
    std::fs::create_dir_all(&path).map_err(|e| AgentError::io(&p, e))?;
    // A guest's own files never become setuid or device nodes through a volume.
    let mut flags = MsFlags::MS_NOSUID | MsFlags::MS_NODEV;
    // Read-only: the disk is read-only too, so the journal is not replayed (`noload`).
    let data = if req.read_only {
        flags |= MsFlags::MS_RDONLY;
        Some("noload")
    } else {
        None
    };
    mount_settled(&dev, &path, flags, data)
        .map_err(|e| AgentError::internal(format!("mount {dev} (volume {}) on {p}: {e}", req.serial)))?;
    if !req.read_only {
        grow(&device, &path)?;
        if let Some(owner) = &req.owner {
            give_fresh_root(&path, owner)?;
        }
    }
    let access = PathBuf::from(MountVolume::access_path(&req.serial));
    let a = access.display().to_string();
    std::fs::create_dir_all(VOLUME_ACCESS_DIR).map_err(|e| AgentError::io(VOLUME_ACCESS_DIR, e))?;
    use std::os::unix::fs::PermissionsExt;
    let _ = std::fs::set_permissions(VOLUME_ACCESS_DIR, std::fs::Permissions::from_mode(0o700));
    std::fs::create_dir_all(&access).map_err(|e| AgentError::io(&a, e))?;
    mount(Some(&path), &access, None::<&str>, MsFlags::MS_BIND, None::<&str>)
        .map_err(|e| AgentError::internal(format!("bind {p} on {a}: {e}")))?;
    let mut bind = MsFlags::MS_BIND | MsFlags::MS_REMOUNT | MsFlags::MS_NOSUID | MsFlags::MS_NODEV;
    // MS_NOSYMFOLLOW (Linux 5.10), not named by this nix.
    bind |= MsFlags::from_bits_retain(libc::MS_NOSYMFOLLOW);
    if req.read_only {
        bind |= MsFlags::MS_RDONLY;
    }
    mount(None::<&str>, &access, None::<&str>, bind, None::<&str>)
        .map_err(|e| AgentError::internal(format!("remount {a} nosymfollow: {e}")))?;
    crate::boot::log(&format!("volume {} ({dev}) mounted on {p}", req.serial));
    Ok(())
}

/// Mount `dev`, waiting out a disk the SCSI scan has named but not yet brought up: its node and
/// serial show before the disk opens, and an open in between is ENXIO (seen under TCG).
fn mount_settled(dev: &str, path: &Path, flags: MsFlags, data: Option<&str>) -> nix::Result<()> {
    let start = Instant::now();
    loop {
        match mount(Some(dev), path, Some("ext4"), flags, data) {
            Err(nix::errno::Errno::ENXIO | nix::errno::Errno::ENOMEDIUM) if start.elapsed() < FIND_DISK => {
                std::thread::sleep(Duration::from_millis(50))
            }
            other => return other,
        }
    }
}

/// The `/dev/sdX` whose SCSI serial (VPD page 0x80) is `serial`, waiting for the scan.
fn find_disk(serial: &str) -> Result<PathBuf, AgentError> {
    let start = Instant::now();
    loop {
        if let Ok(dir) = std::fs::read_dir("/sys/block") {
            for e in dir.flatten() {
                let name = e.file_name().to_string_lossy().to_string();
                let Ok(page) = std::fs::read(e.path().join("device/vpd_pg80")) else {
                    continue;
                };
                // Header: qualifier, page code, two length bytes; then the serial.
                if page.len() > 4 && page[4..].trim_ascii() == serial.as_bytes() {
                    let dev = PathBuf::from(format!("/dev/{name}"));
                    if dev.exists() {
                        return Ok(dev);
                    }
                }
            }
        }
        if start.elapsed() > FIND_DISK {
            return Err(AgentError::not_found(format!(
                "no disk with serial {serial} appeared within {FIND_DISK:?}"
            )));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Grow the filesystem to its disk (the host grows a volume's file; the guest grows ext4 on it,
/// online: the host never touches what is inside).
fn grow(device: &Path, mounted: &Path) -> Result<(), AgentError> {
    let dev = std::fs::File::open(device).map_err(|e| AgentError::io(&device.display().to_string(), e))?;
    let mut bytes = 0u64;
    use std::os::fd::AsRawFd;
    unsafe { blk_size_bytes(dev.as_raw_fd(), &mut bytes) }
        .map_err(|e| AgentError::internal(format!("size of {}: {e}", device.display())))?;
    let vfs = nix::sys::statvfs::statvfs(mounted)
        .map_err(|e| AgentError::internal(format!("statvfs {}: {e}", mounted.display())))?;
    let block = vfs.fragment_size().max(1);
    let want = bytes / block;
    let dir = std::fs::File::open(mounted).map_err(|e| AgentError::io(&mounted.display().to_string(), e))?;
    match unsafe { ext4_resize_fs(dir.as_raw_fd(), &want) } {
        Ok(_) => Ok(()),
        // Already this size (or a kernel that says so by refusing).
        Err(nix::errno::Errno::EINVAL) if want <= vfs.blocks() => Ok(()),
        Err(e) => Err(AgentError::internal(format!(
            "growing the volume on {} to {want} blocks: {e}",
            mounted.display()
        ))),
    }
}

/// A volume nobody wrote yet (its root holding only `lost+found`) becomes `owner`'s, once. A
/// volume in use keeps whatever owner its users gave it.
fn give_fresh_root(root: &Path, owner: &str) -> Result<(), AgentError> {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::metadata(root).map_err(|e| AgentError::io(&root.display().to_string(), e))?;
    let fresh = std::fs::read_dir(root)
        .map(|d| d.flatten().all(|e| e.file_name() == "lost+found"))
        .unwrap_or(false);
    let Some(user) = users::lookup(owner) else {
        return Ok(());
    };
    if fresh && user.uid != 0 && (meta.uid(), meta.gid()) != (user.uid, user.gid) {
        nix::unistd::chown(
            root,
            Some(nix::unistd::Uid::from_raw(user.uid)),
            Some(nix::unistd::Gid::from_raw(user.gid)),
        )
        .map_err(|e| AgentError::internal(format!("chown {}: {e}", root.display())))?;
    }
    Ok(())
}
