//! Console logs kept under [`crate::vmm::CONSOLE_CAP`] (see [`crate::vmm::trim_console`]): a guest
//! flooding its serial port fills the host's disk otherwise. Uses only the VMM's trimming.

use std::path::PathBuf;
use std::sync::Weak;
use std::time::Duration;

/// How often console logs are checked against their cap: a log holds at most the cap plus what
/// its guest writes in this long (an emulated UART exits to QEMU for every byte).
const CONSOLE_TRIM_EVERY: Duration = Duration::from_millis(250);

/// One task for the whole data dir, walking the VM dirs under `root` on disk, so VMs still
/// booting and VMs re-attached after a restart are covered alike (while no server runs, nothing
/// trims; the next start does). It ends once `alive` has no strong reference left.
pub fn spawn_trimmer<T: Send + Sync + 'static>(alive: Weak<T>, root: PathBuf) {
    tokio::spawn(async move {
        while alive.strong_count() > 0 {
            let root = root.clone();
            let _ = tokio::task::spawn_blocking(move || {
                for entry in std::fs::read_dir(&root).into_iter().flatten().flatten() {
                    let log = entry.path().join("console.log");
                    match crate::vmm::trim_console(&log) {
                        Ok(true) => tracing::debug!("trimmed {}", log.display()),
                        Ok(false) => {}
                        Err(e) => tracing::warn!("cannot trim {}: {e}", log.display()),
                    }
                }
            })
            .await;
            tokio::time::sleep(CONSOLE_TRIM_EVERY).await;
        }
    });
}
