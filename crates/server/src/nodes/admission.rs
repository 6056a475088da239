//! A node's own admission, at its face: a replica places by a report seconds old and several
//! replicas place at once, so the node checks each create against what it holds now (its VMs
//! and the starts under way) and refuses with a typed reason ([`Refusal`]) rather than overcommit.
//! The replica then tries its next node. Single-host mode has no face and no need: its one
//! store's admission is exact.

use super::{Capacity, NodeError, VmRequest};
use airlock_runtime::Resources;
use std::collections::HashMap;
use std::sync::Mutex;

/// Why a node turns a VM away: the caller places it elsewhere.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Refusal {
    /// No room in its vCPU or memory budget now.
    Capacity,
    /// As many starts under way as it takes at once: one frees within seconds (the replica
    /// asks again rather than fail the create).
    Busy,
    /// The node is stopping (SIGTERM): it takes no new VM, and its own go elsewhere.
    Draining,
    /// A VM saved on another machine (CPU, VMM build, accelerator) that this one cannot start.
    Incompatible,
}

/// What a node enforces itself: at most `max_starts` creates at once, its VMs' vCPUs within its
/// CPUs times `vcpu_overcommit`, their memory within its own less `memory_reserve_mib`; and a
/// VM whose timeout passed `expiry_grace` ago ended (`expiry.rs`), its deadline kept in
/// `deadlines` across restarts (None: in memory only).
#[derive(Debug, Clone)]
pub struct NodeRules {
    pub max_starts: usize,
    pub vcpu_overcommit: f64,
    pub memory_reserve_mib: u64,
    pub expiry_grace: std::time::Duration,
    pub deadlines: Option<std::path::PathBuf>,
}

pub struct Admission {
    rules: NodeRules,
    /// Creates admitted and not yet returned, by VM id: they hold their resources already.
    starting: Mutex<HashMap<String, Resources>>,
}

/// An admitted create's place, given back when it is dropped (the VM then counts among the
/// node's own, or is gone).
pub struct Ticket<'a> {
    admission: &'a Admission,
    id: String,
}

impl Drop for Ticket<'_> {
    fn drop(&mut self) {
        self.admission.starting().remove(&self.id);
    }
}

/// Whether `vm` can start on a node whose machine is `here`: one moving in from another node
/// only where its saved machine matches.
pub fn machine_fits(here: &str, vm: &VmRequest) -> Result<(), NodeError> {
    match &vm.moved_from {
        Some(from) if from != here => Err(NodeError::Refused(
            Refusal::Incompatible,
            format!("incompatible: it was saved on machine {from}; this node is {here} (CPU, VMM build or accelerator differ)"),
        )),
        _ => Ok(()),
    }
}

fn capacity(message: String) -> NodeError {
    NodeError::Refused(Refusal::Capacity, message)
}

impl Admission {
    pub fn new(rules: NodeRules) -> Self {
        Admission {
            rules,
            starting: Mutex::default(),
        }
    }

    fn starting(&self) -> std::sync::MutexGuard<'_, HashMap<String, Resources>> {
        self.starting.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Admit `vm` on a node that has `now` (its VMs' holdings included), or say why not.
    pub fn admit(&self, now: &Capacity, vm: &VmRequest) -> Result<Ticket<'_>, NodeError> {
        let mut starting = self.starting();
        if starting.len() >= self.rules.max_starts {
            return Err(NodeError::Refused(
                Refusal::Busy,
                format!(
                    "{} starts under way on this node (it takes at most {} at once)",
                    starting.len(),
                    self.rules.max_starts
                ),
            ));
        }
        let (vcpu_held, memory_held) = starting
            .values()
            .fold((now.vcpu_held, now.memory_held_mib), |(v, m), r| {
                (v + u64::from(r.vcpu), m + u64::from(r.memory_mib))
            });
        let vcpu_budget = (f64::from(now.cpus) * self.rules.vcpu_overcommit).floor().max(0.0) as u64;
        let memory_budget = now.memory_mib.saturating_sub(self.rules.memory_reserve_mib);
        let (vcpu, memory) = (u64::from(vm.resources.vcpu), u64::from(vm.resources.memory_mib));
        if vcpu_held + vcpu > vcpu_budget {
            return Err(capacity(format!(
                "this node's vCPU budget: {vcpu_held} held, {vcpu} asked, {vcpu_budget} in all"
            )));
        }
        if memory_held + memory > memory_budget {
            return Err(capacity(format!(
                "this node's memory budget: {memory_held} MiB held, {memory} MiB asked, {memory_budget} MiB in all"
            )));
        }
        starting.insert(vm.id.clone(), vm.resources);
        Ok(Ticket {
            admission: self,
            id: vm.id.clone(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vm(id: &str, vcpu: u32, memory_mib: u32) -> VmRequest {
        VmRequest {
            id: id.into(),
            template: "seed".into(),
            resources: Resources {
                vcpu,
                memory_mib,
                disk_mib: 2048,
            },
            image_id: None,
            env: Default::default(),
            egress: Default::default(),
            node: String::new(),
            moved_from: None,
            keep_image: false,
            volumes: Vec::new(),
        }
    }

    #[test]
    fn a_vm_moving_in_needs_the_machine_it_was_saved_on() {
        let mut moving = vm("x", 1, 128);
        assert!(machine_fits("kvm-aaaa", &moving).is_ok(), "a new VM goes anywhere");
        moving.moved_from = Some("kvm-aaaa".into());
        assert!(machine_fits("kvm-aaaa", &moving).is_ok());
        let e = machine_fits("kvm-bbbb", &moving).err().unwrap();
        assert!(matches!(e, NodeError::Refused(Refusal::Incompatible, _)), "{e}");
        assert_eq!(
            e.to_string(),
            "incompatible: it was saved on machine kvm-aaaa; this node is kvm-bbbb (CPU, VMM build or accelerator differ)"
        );
    }

    fn node(memory_mib: u64, memory_held_mib: u64) -> Capacity {
        Capacity {
            cpus: 2,
            memory_mib,
            sandboxes_running: 0,
            disk_free_mib: 100_000,
            disk_held_mib: 0,
            vcpu_held: 0,
            memory_held_mib,
        }
    }

    #[test]
    fn starts_under_way_hold_their_place_until_their_ticket_goes() {
        let rules = NodeRules {
            max_starts: 2,
            vcpu_overcommit: 4.0,
            memory_reserve_mib: 512,
            expiry_grace: std::time::Duration::from_secs(3),
            deadlines: None,
        };
        let a = Admission::new(rules);
        let now = node(2048, 512);
        // 2048 - 512 reserved = 1536; 512 held: room for two of 512.
        let one = a.admit(&now, &vm("one", 1, 512)).unwrap();
        let two = a.admit(&now, &vm("two", 1, 512)).unwrap();
        let e = a.admit(&now, &vm("three", 1, 128)).err().unwrap();
        assert!(matches!(e, NodeError::Refused(Refusal::Busy, _)), "{e}");
        assert!(e.to_string().contains("2 starts under way"), "{e}");
        drop(one);
        let e = a.admit(&now, &vm("three", 1, 1024)).err().unwrap();
        assert_eq!(
            e.to_string(),
            "this node's memory budget: 1024 MiB held, 1024 MiB asked, 1536 MiB in all"
        );
        drop(two);
        assert!(a.admit(&now, &vm("three", 1, 1024)).is_ok());
    }

    #[test]
    fn vcpus_are_counted_against_cpus_times_overcommit() {
        let a = Admission::new(NodeRules {
            max_starts: 8,
            vcpu_overcommit: 1.5,
            memory_reserve_mib: 0,
            expiry_grace: std::time::Duration::from_secs(3),
            deadlines: None,
        });
        let now = Capacity {
            vcpu_held: 2,
            ..node(100_000, 0)
        };
        let e = a.admit(&now, &vm("x", 2, 128)).err().unwrap();
        assert_eq!(e.to_string(), "this node's vCPU budget: 2 held, 2 asked, 3 in all");
        assert!(a.admit(&now, &vm("x", 1, 128)).is_ok());
    }
}
