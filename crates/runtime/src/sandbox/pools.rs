//! Warm pools: for a template and shape, VMs started ahead of any create (restored from the base
//! snapshot where one is built), sealed (no egress) and never handed a command, so a create
//! claims a running VM instead of starting one. A claim takes the pool VM's id as the VM's (its
//! dir, network and jail are named by it), gets the VM's egress attached and its identity
//! (clock, entropy) sent again; the pool refills in the background. A VM is claimed at most
//! once: a claimed VM never returns to a pool once handed out.
//!
//! [`Pools`] owns the pools and the claimed VMs. It starts VMs through a [`PoolStarter`] (the
//! runtime, which chooses where a VM starts from) and uses `launch.rs` to discard them.

use super::launch::{shape, Launcher};
use super::vm::{identity, StartKind, Vm};
use crate::datadir::write_atomic;
use crate::error::{Result, RuntimeError};
use crate::net::SandboxLink;
use crate::vmm::Resources;
use airlock_proto::ProcessSpec;
use serde::Serialize;
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub use super::launch::POOL_MARKER as MARKER;

/// A pool's template (as resolved) and shape.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PoolKey {
    pub template: String,
    pub resources: Resources,
}

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

/// Starts a pool's VMs (sealed, marked `pool.json`, in no map).
#[async_trait::async_trait]
pub trait PoolStarter: Send + Sync {
    async fn start_pool_vm(&self, key: &PoolKey) -> Result<Arc<Vm>>;
}

/// How long after a claim its pool starts refilling.
const REFILL_DELAY: Duration = Duration::from_secs(2);

/// One warm pool's VMs and counters.
#[derive(Default)]
struct PoolState {
    target: usize,
    ready: Vec<Arc<Vm>>,
    starting: usize,
    filling: bool,
    hits: u64,
    misses: u64,
}

pub struct Pools {
    launcher: Arc<Launcher>,
    pools: Mutex<HashMap<PoolKey, PoolState>>,
    /// Pool VMs claimed for a create not yet handed out.
    claimed: Mutex<HashMap<String, Arc<Vm>>>,
}

impl Pools {
    pub fn new(launcher: Arc<Launcher>) -> Self {
        Self {
            launcher,
            pools: Mutex::default(),
            claimed: Mutex::default(),
        }
    }

    /// The pool a create of `template` with `resources` claims from (the template resolved, the
    /// resources validated and shaped as a create's are).
    pub fn key(&self, template: &str, resources: Resources) -> Result<PoolKey> {
        let t = self.launcher.templates.resolve(template)?;
        resources.validate(&t.manifest)?;
        Ok(PoolKey {
            template: t.manifest.name.clone(),
            resources: shape(&t, resources),
        })
    }

    /// Keep `size` VMs of `key` ready (0 empties the pool). Filled in the background.
    pub fn set(self: &Arc<Self>, key: PoolKey, size: usize, starter: Arc<dyn PoolStarter>) {
        let extra: Vec<Arc<Vm>> = {
            let mut pools = self.pools.lock().unwrap();
            let pool = pools.entry(key.clone()).or_default();
            pool.target = size;
            let keep = size.min(pool.ready.len());
            pool.ready.drain(keep..).collect()
        };
        let launcher = self.launcher.clone();
        tokio::spawn(async move {
            for vm in extra {
                launcher.discard_unadopted(&vm).await;
            }
        });
        self.refill(key, starter);
    }

    /// Every pool, as it is now.
    pub fn status(&self) -> Vec<PoolStatus> {
        let pools = self.pools.lock().unwrap();
        let mut v: Vec<_> = pools
            .iter()
            .map(|(k, p)| PoolStatus {
                template: k.template.clone(),
                resources: k.resources,
                size: p.target,
                ready: p.ready.len(),
                starting: p.starting,
                hits: p.hits,
                misses: p.misses,
            })
            .collect();
        v.sort_by(|a, b| a.template.cmp(&b.template));
        v
    }

    /// Memory the pools' VMs hold (ready, starting or claimed), in MiB.
    pub fn memory_mib(&self) -> u64 {
        let pools = self.pools.lock().unwrap();
        let pooled: u64 = pools
            .iter()
            .map(|(k, p)| (p.ready.len() + p.starting) as u64 * k.resources.memory_mib as u64)
            .sum();
        let claimed: u64 = self
            .claimed
            .lock()
            .unwrap()
            .values()
            .map(|vm| vm.record.resources.memory_mib as u64)
            .sum();
        pooled + claimed
    }

    /// What the pools' VMs (ready, starting or claimed) may still write, in MiB: `unheld` of
    /// each VM, a starting one's whole disk.
    pub fn unheld_disk_mib(&self, unheld: impl Fn(&Vm) -> u64) -> u64 {
        let pools = self.pools.lock().unwrap();
        let claimed = self.claimed.lock().unwrap();
        pools
            .iter()
            .map(|(k, p)| {
                p.ready.iter().map(|vm| unheld(vm)).sum::<u64>() + p.starting as u64 * k.resources.disk_mib as u64
            })
            .sum::<u64>()
            + claimed.values().map(|vm| unheld(vm)).sum::<u64>()
    }

    /// A ready VM of `template` with `resources` for a create, if the pool has one: its id is
    /// the VM's. [`Pools::take_claimed`] takes it for the create; [`Pools::unclaim`] gives it
    /// back when the create does not go ahead.
    pub fn claim(
        self: &Arc<Self>,
        template: &str,
        resources: Resources,
        starter: Arc<dyn PoolStarter>,
    ) -> Option<String> {
        // Every create asks: without pools, nothing is looked up.
        if self.pools.lock().unwrap().is_empty() {
            return None;
        }
        let key = self.key(template, resources).ok()?;
        let got = {
            let mut pools = self.pools.lock().unwrap();
            let pool = pools.get_mut(&key)?;
            let got = loop {
                match pool.ready.pop() {
                    Some(vm) if self.launcher.vmm.is_running(&vm.handle) => break Some(vm),
                    Some(_) => continue,
                    None => break None,
                }
            };
            if got.is_some() {
                pool.hits += 1;
            } else {
                pool.misses += 1;
            }
            got
        };
        // Refilled a little later: the creates claiming now (a burst) get the CPU first.
        let this = self.clone();
        tokio::spawn(async move {
            tokio::time::sleep(REFILL_DELAY).await;
            this.refill(key, starter);
        });
        let vm = got?;
        let id = vm.id().to_string();
        self.claimed.lock().unwrap().insert(id.clone(), vm);
        Some(id)
    }

    /// The VM claimed as `id`, for its create.
    pub fn take_claimed(&self, id: &str) -> Option<Arc<Vm>> {
        self.claimed.lock().unwrap().remove(id)
    }

    /// Give a claimed VM back to its pool (its create was refused): it was never handed out.
    pub fn unclaim(&self, id: &str) {
        let Some(vm) = self.take_claimed(id) else {
            return;
        };
        let key = PoolKey {
            template: vm.record.template.clone(),
            resources: vm.record.resources,
        };
        let back = {
            let mut pools = self.pools.lock().unwrap();
            match pools.get_mut(&key) {
                Some(pool) if pool.ready.len() < pool.target => {
                    pool.ready.push(vm);
                    None
                }
                _ => Some(vm),
            }
        };
        if let Some(vm) = back {
            let launcher = self.launcher.clone();
            tokio::spawn(async move { launcher.discard_unadopted(&vm).await });
        }
    }

    /// A claimed pool VM made ready to be VM `vm.id()`: its network gets egress, its clock and
    /// entropy are set again, its record says it came from a pool. The returned VM is in no map
    /// (the caller adopts it); on failure the pool VM is discarded.
    pub async fn hand_out(&self, vm: Arc<Vm>, env: &BTreeMap<String, String>) -> Result<Arc<Vm>> {
        let started = Instant::now();
        let dir = vm.handle.dir.clone();
        let handed = async {
            let mut link = vm.net.clone();
            if let (Some(net), Some(l)) = (&self.launcher.net, link.as_mut()) {
                net.reattach(l).await?;
                write_atomic(
                    &SandboxLink::record_path(&dir),
                    &serde_json::to_vec_pretty(l).expect("serializable"),
                )?;
            }
            let client = vm.agent().await?;
            client.set_identity(&identity(&vm.record, Some(env))).await?;
            Ok::<_, RuntimeError>((link, client))
        };
        match handed.await {
            Ok((link, client)) => {
                let mut record = vm.record.clone();
                record.start = StartKind::Pool;
                record.start_ms = started.elapsed().as_millis() as u64;
                let _ = record.write(&dir);
                let _ = std::fs::remove_file(dir.join(MARKER));
                Ok(Vm::new(record, vm.handle.clone(), link, Some(client), false))
            }
            Err(e) => {
                self.launcher.discard_unadopted(&vm).await;
                Err(e)
            }
        }
    }

    /// Start pool VMs until `key`'s pool has its size (one filler per pool, one VM at a time).
    fn refill(self: &Arc<Self>, key: PoolKey, starter: Arc<dyn PoolStarter>) {
        {
            let mut pools = self.pools.lock().unwrap();
            let Some(pool) = pools.get_mut(&key) else { return };
            if pool.filling || pool.ready.len() + pool.starting >= pool.target {
                return;
            }
            pool.filling = true;
        }
        let this = self.clone();
        tokio::spawn(async move {
            loop {
                let wanted = {
                    let mut pools = this.pools.lock().unwrap();
                    let Some(pool) = pools.get_mut(&key) else { return };
                    let wanted = pool.ready.len() + pool.starting < pool.target;
                    if wanted {
                        pool.starting += 1;
                    } else {
                        pool.filling = false;
                    }
                    wanted
                };
                if !wanted {
                    return;
                }
                let started = match starter.start_pool_vm(&key).await {
                    // Its first command warms what every first command costs (under TCG, the
                    // translation of the agent's spawn path): the platform's own `true`, which
                    // leaves nothing behind, before any tenant's.
                    Ok(vm) => match vm
                        .run(ProcessSpec {
                            argv: vec!["true".into()],
                            ..Default::default()
                        })
                        .await
                    {
                        Ok(_) => Ok(vm),
                        Err(e) => {
                            this.launcher.discard_unadopted(&vm).await;
                            Err(e)
                        }
                    },
                    Err(e) => Err(e),
                };
                let extra = {
                    let mut pools = this.pools.lock().unwrap();
                    let pool = pools.entry(key.clone()).or_default();
                    pool.starting -= 1;
                    match started {
                        Ok(vm) if pool.ready.len() < pool.target => {
                            pool.ready.push(vm);
                            None
                        }
                        Ok(vm) => Some(Ok(vm)),
                        Err(e) => Some(Err(e)),
                    }
                };
                match extra {
                    None => {}
                    Some(Ok(vm)) => this.launcher.discard_unadopted(&vm).await,
                    Some(Err(e)) => {
                        tracing::warn!(template = %key.template, "a warm pool VM did not start: {e}");
                        // Not a hot loop on a broken template: the next claim tries again.
                        this.pools.lock().unwrap().entry(key.clone()).or_default().filling = false;
                        return;
                    }
                }
            }
        });
    }

    /// Stop every pool VM (a server shutting down: they were never handed out).
    pub async fn drain(&self) {
        let vms: Vec<Arc<Vm>> = {
            let mut pools = self.pools.lock().unwrap();
            let mut v: Vec<_> = pools
                .values_mut()
                .flat_map(|p| {
                    p.target = 0;
                    p.ready.drain(..).collect::<Vec<_>>()
                })
                .collect();
            v.extend(self.claimed.lock().unwrap().drain().map(|(_, vm)| vm));
            v
        };
        for vm in vms {
            self.launcher.discard_unadopted(&vm).await;
        }
    }
}
