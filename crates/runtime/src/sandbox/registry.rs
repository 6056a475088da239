//! Which VMs this node has: those in use (running or paused), the suspended ones (their
//! records; their dirs hold the saved state), which of an earlier process are not yet settled
//! (hidden from [`Registry::get`]/[`Registry::list`] until they are), and the exits of VMMs that
//! died on their own. Each behind its own lock. Uses only `vm.rs`.

use super::vm::{Vm, VmRecord};
use crate::error::{Result, RuntimeError};
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

pub struct Registry {
    vms: Mutex<HashMap<String, Arc<Vm>>>,
    suspended: Mutex<HashMap<String, VmRecord>>,
    /// VM dirs of an earlier process not yet reconciled (re-attached or removed).
    unsettled: Mutex<HashSet<String>>,
    /// Bumped whenever one of them is settled.
    settled: tokio::sync::watch::Sender<u64>,
    /// Ids of VMs whose VMM exited on its own (not through a delete), after their cleanup.
    exits: tokio::sync::broadcast::Sender<String>,
}

impl Default for Registry {
    fn default() -> Self {
        Self {
            vms: Mutex::default(),
            suspended: Mutex::default(),
            unsettled: Mutex::default(),
            settled: tokio::sync::watch::channel(0).0,
            exits: tokio::sync::broadcast::channel(256).0,
        }
    }
}

impl Registry {
    pub fn insert(&self, vm: Arc<Vm>) {
        self.vms.lock().unwrap().insert(vm.id().to_string(), vm);
    }

    /// VM `id` in use, once settled: whoever finds one of the earlier process may rely on it
    /// being decided (it is put in the map before it is marked settled).
    pub fn get(&self, id: &str) -> Result<Arc<Vm>> {
        if !self.is_settled(id) {
            return Err(RuntimeError::UnknownSandbox(id.into()));
        }
        self.vms
            .lock()
            .unwrap()
            .get(id)
            .cloned()
            .ok_or_else(|| RuntimeError::UnknownSandbox(id.into()))
    }

    /// The settled VMs in use, oldest first.
    pub fn list(&self) -> Vec<Arc<Vm>> {
        let unsettled = self.unsettled.lock().unwrap().clone();
        let mut v: Vec<_> = (self.vms.lock().unwrap().values())
            .filter(|vm| !unsettled.contains(vm.id()))
            .cloned()
            .collect();
        v.sort_by(|a, b| a.record.created_at.cmp(&b.record.created_at));
        v
    }

    /// Ids of every VM in use, settled or not.
    pub fn ids(&self) -> Vec<String> {
        self.vms.lock().unwrap().keys().cloned().collect()
    }

    pub fn remove(&self, id: &str) -> Option<Arc<Vm>> {
        self.vms.lock().unwrap().remove(id)
    }

    /// Remove `vm` if it is still the one in use under its id.
    pub fn remove_if_current(&self, vm: &Arc<Vm>) -> bool {
        let mut map = self.vms.lock().unwrap();
        match map.get(vm.id()) {
            Some(cur) if Arc::ptr_eq(cur, vm) => map.remove(vm.id()).is_some(),
            _ => false,
        }
    }

    pub fn exited(&self, id: &str) {
        let _ = self.exits.send(id.to_string());
    }

    pub fn exits(&self) -> tokio::sync::broadcast::Receiver<String> {
        self.exits.subscribe()
    }

    pub fn suspend(&self, record: VmRecord) {
        self.suspended.lock().unwrap().insert(record.id.clone(), record);
    }

    pub fn is_suspended(&self, id: &str) -> bool {
        self.suspended.lock().unwrap().contains_key(id)
    }

    pub fn suspended(&self, id: &str) -> Option<VmRecord> {
        self.suspended.lock().unwrap().get(id).cloned()
    }

    pub fn unsuspend(&self, id: &str) -> Option<VmRecord> {
        self.suspended.lock().unwrap().remove(id)
    }

    pub fn suspended_ids(&self) -> Vec<String> {
        self.suspended.lock().unwrap().keys().cloned().collect()
    }

    /// Record `ids` (dirs an earlier process left) as not yet settled.
    pub fn unsettle(&self, ids: impl IntoIterator<Item = String>) {
        self.unsettled.lock().unwrap().extend(ids);
    }

    pub fn settle(&self, id: &str) {
        self.unsettled.lock().unwrap().remove(id);
        self.settled.send_modify(|n| *n += 1);
    }

    pub fn is_settled(&self, id: &str) -> bool {
        !self.unsettled.lock().unwrap().contains(id)
    }

    /// Wait until VM `id` is settled.
    pub async fn settled(&self, id: &str) {
        let mut news = self.settled.subscribe();
        while !self.is_settled(id) {
            if news.changed().await.is_err() {
                return;
            }
        }
    }

    /// Wait until every VM of the earlier process is settled.
    pub async fn settled_all(&self) {
        let mut news = self.settled.subscribe();
        while !self.unsettled.lock().unwrap().is_empty() {
            if news.changed().await.is_err() {
                return;
            }
        }
    }
}
