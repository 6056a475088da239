//! Placement: which node a new sandbox goes to. The candidates are the nodes that take sandboxes
//! now ([`Member::refuses`]), or the one node that must take it (where its warm pool VM or its
//! snapshot's image is). They are tried best first (best of two picked at random by their load,
//! then the rest by load), each through the store's admission, which checks the tenant's quota
//! and that node's budgets in one step: a node's budget is exact, the load only orders. A create
//! no node takes is refused with every node's reason.

use super::Core;
use crate::error::CoreError;
use crate::nodes::Member;
use crate::store::NodeBudget;

/// How many nodes are drawn at random before the less loaded of them is tried first.
const DRAW: usize = 2;

impl Core {
    /// The budgets of node `name` (a sandbox's `node`); every node's together when it is not a
    /// member now (its sandboxes then still count against what it had).
    pub(crate) fn budget_of(&self, name: &str) -> NodeBudget {
        let members = self.nodes.members();
        match members.iter().find(|m| m.name == name) {
            Some(m) => self.config.budget(&m.capacity),
            None => self.config.budget(&self.nodes.capacity()),
        }
    }

    /// The largest budgets one node has: a sandbox asking for more fits nowhere.
    pub(crate) fn largest_budget(&self) -> NodeBudget {
        let members = self.nodes.members();
        let budgets = members.iter().map(|m| self.config.budget(&m.capacity));
        budgets
            .reduce(|a, b| NodeBudget {
                vcpu: a.vcpu.max(b.vcpu),
                memory_mib: a.memory_mib.max(b.memory_mib),
                disk_mib: a.disk_mib.max(b.disk_mib),
            })
            .unwrap_or(NodeBudget {
                vcpu: 0,
                memory_mib: 0,
                disk_mib: 0,
            })
    }

    /// The nodes to try for a new sandbox, best first, with the reasons of those that refuse
    /// now. `pinned`: the only node that can take it.
    pub(crate) fn candidates(&self, pinned: Option<&str>) -> (Vec<Member>, Vec<(String, String)>) {
        let mut refused = Vec::new();
        let mut open: Vec<Member> = Vec::new();
        for m in self.nodes.members() {
            if pinned.is_some_and(|p| p != m.name) {
                continue;
            }
            match &m.refuses {
                Some(why) => refused.push((m.name.clone(), why.clone())),
                None => open.push(m),
            }
        }
        let load = |m: &Member| m.capacity.sandboxes_running;
        // Shuffled, so equal loads spread; the best of the first DRAW goes first.
        fastrand::shuffle(&mut open);
        if let Some(best) = (0..open.len().min(DRAW)).min_by_key(|i| load(&open[*i])) {
            let first = open.remove(best);
            open.sort_by_key(load);
            open.insert(0, first);
        }
        (open, refused)
    }
}

/// A create every node refused: each node's reason, in the order they were tried.
pub(crate) fn refused_everywhere(mut reasons: Vec<(String, String)>, last: Option<CoreError>) -> CoreError {
    // One node (single-host mode): its own error, as before there were many.
    if reasons.len() <= 1 {
        if let Some(e) = last {
            return e;
        }
    }
    reasons.sort_by(|a, b| a.0.cmp(&b.0));
    CoreError::NoNodeFits(
        reasons
            .into_iter()
            .map(|(node, why)| format!("node {node}: {why}"))
            .collect::<Vec<_>>()
            .join("; "),
    )
}

/// Whether `e` is a node's refusal, after which the next node is tried.
pub(crate) fn node_refused(e: &CoreError) -> bool {
    matches!(e, CoreError::NodeBudgetExceeded { .. })
}

/// What happened to `candidate`, for the refusal's reasons.
pub(crate) fn reason(e: &CoreError) -> String {
    e.to_string()
}
