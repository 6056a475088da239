//! Warm pools: for a template and shape, VMs started ahead of any create (restored from the base
//! snapshot where one is built), sealed (no egress) and never handed a command, so a create
//! claims a running VM instead of starting one. A claim takes the pool VM's id as the sandbox's
//! (its dir, network and jail are named by it), gets the sandbox's egress attached and its
//! identity (clock, entropy) sent again; the pool refills in the background. A VM is claimed at
//! most once: a claimed VM never returns to a pool once handed out.

use crate::vmm::Resources;
use serde::Serialize;

/// A pool's template (as resolved) and shape.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PoolKey {
    pub template: String,
    pub resources: Resources,
}

/// Marks a pool VM's dir (`<dir>/pool.json`): what a restart finds of a pool is removed.
pub const MARKER: &str = "pool.json";

/// A pool as `/v1/system` shows it.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct PoolStatus {
    pub template: String,
    pub resources: Resources,
    /// How many it keeps ready.
    pub size: usize,
    pub ready: usize,
    pub starting: usize,
    /// Creates that claimed one of its VMs, and creates of its shape that found it empty.
    pub hits: u64,
    pub misses: u64,
}
