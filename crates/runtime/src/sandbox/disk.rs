//! The node's disk space as the runtime sees it: free, held by its VMs and images, and what
//! warm pool VMs may still write. Reads only, through the facade and the pools.

use super::Runtime;
use std::path::Path;

impl Runtime {
    /// The data dir filesystem's space: what is free (for an unprivileged writer, as statvfs
    /// reports it), what this runtime's VMs already hold in it (allocated blocks of their dirs:
    /// overlays, console logs, a suspended one's saved memory) and what saved images hold, and
    /// what warm pool VMs may still write. A node's disk budget is the sum of the first three
    /// less the last, since the VMs' and images' own growth comes out of what they hold plus
    /// what is free, and a pool VM's disk grows to its full size before any record counts it.
    pub fn disk_space(&self) -> DiskSpace {
        let data = &self.inner.launcher.data;
        let free_bytes = nix::sys::statvfs::statvfs(data.root())
            .map(|s| s.blocks_available() * s.fragment_size())
            .unwrap_or(0);
        let root = data.sandboxes();
        let held_bytes = self
            .list()
            .iter()
            .map(|vm| vm.id().to_string())
            .chain(self.suspended())
            .map(|id| allocated_bytes(&root.join(id), false))
            .sum::<u64>();
        // An image's links to its template's files (and a VM's links to the image) are counted
        // by no one: only files no other name holds are the image's own.
        let images = data.images();
        let image_bytes = self
            .images()
            .iter()
            .map(|id| allocated_bytes(&images.join(id), true))
            .sum::<u64>();
        let pool_mib = self.inner.pools.unheld_disk_mib(|vm| {
            (vm.record.resources.disk_mib as u64).saturating_sub(allocated_bytes(&vm.handle.dir, false) >> 20)
        });
        DiskSpace {
            free_mib: free_bytes >> 20,
            held_by_sandboxes_mib: held_bytes >> 20,
            held_by_images_mib: image_bytes >> 20,
            pool_unheld_mib: pool_mib,
        }
    }
}

/// See [`Runtime::disk_space`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DiskSpace {
    pub free_mib: u64,
    pub held_by_sandboxes_mib: u64,
    /// Saved images' own files (their memory and disk), not their links to templates' files.
    pub held_by_images_mib: u64,
    /// What warm pool VMs (ready, starting or claimed) may still write: each one's full disk
    /// less what its dir holds.
    pub pool_unheld_mib: u64,
}

/// Blocks allocated to the files directly in `dir` (a VM or image dir is flat), in bytes; with
/// `own_only`, only files no other link holds.
fn allocated_bytes(dir: &Path, own_only: bool) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .flatten()
        .filter_map(|e| e.metadata().ok())
        .filter(|m| m.is_file() && (!own_only || m.nlink() == 1))
        .map(|m| m.blocks() * 512)
        .sum()
}
