//! Placement: which node a new sandbox goes to. The candidates are the nodes that take sandboxes
//! now ([`Member::refuses`]), or the one node that must take it (where its warm pool VM or its
//! snapshot's image is). They are tried best first (best of two picked at random by their load,
//! then the rest by load), each through the store's admission, which checks the tenant's quota
//! and that node's budgets in one step: a node's budget is exact, the load only orders. A create
//! no node takes is refused with every node's reason.

use super::Core;
use crate::error::{CoreError, CoreResult};
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

    /// [`Core::candidates`] for a VM saved on machine `fingerprint`: nodes of another machine
    /// refuse it.
    pub(crate) fn candidates_matching(&self, fingerprint: &str) -> (Vec<Member>, Vec<(String, String)>) {
        let (open, mut refused) = self.candidates(None);
        let (same, other): (Vec<Member>, Vec<Member>) = open.into_iter().partition(|m| m.fingerprint == fingerprint);
        for m in other {
            refused.push((
                m.name,
                format!(
                    "incompatible: it was saved on machine {fingerprint}; this node is {}",
                    m.fingerprint
                ),
            ));
        }
        (same, refused)
    }

    /// Every node as this replica sees it now (`GET /v1/admin/nodes`).
    pub fn nodes_info(&self) -> Vec<crate::model::NodeInfo> {
        use crate::model::NodeState;
        let mut nodes: Vec<_> = self
            .nodes
            .members()
            .into_iter()
            .map(|m| crate::model::NodeInfo {
                state: match (&m.refuses, m.answering, m.draining) {
                    (_, false, _) => NodeState::Unreachable,
                    (_, true, true) => NodeState::Draining,
                    (Some(_), true, false) => NodeState::Refusing,
                    (None, true, false) => NodeState::Ready,
                },
                reason: m.refuses,
                fingerprint: m.fingerprint,
                parks: m.parks,
                cpus: m.capacity.cpus,
                memory_mib: m.capacity.memory_mib,
                disk_free_mib: m.capacity.disk_free_mib,
                sandboxes_running: m.capacity.sandboxes_running,
                name: m.name,
            })
            .collect();
        nodes.sort_by(|a, b| a.name.cmp(&b.name));
        nodes
    }

    /// Offer a start to each of `candidates` in turn (`submit(node, its budget, the rest as
    /// fallbacks)`) until one is not refused by its budget; when all are, the refusal names
    /// every node's reason.
    pub(crate) async fn offer<F, Fut, T>(
        &self,
        (candidates, mut reasons): (Vec<Member>, Vec<(String, String)>),
        mut submit: F,
    ) -> CoreResult<T>
    where
        F: FnMut(String, NodeBudget, Vec<(String, NodeBudget)>) -> Fut,
        Fut: std::future::Future<Output = CoreResult<T>>,
    {
        let budgets: Vec<(String, NodeBudget)> = candidates
            .iter()
            .map(|m| (m.name.clone(), self.config.budget(&m.capacity)))
            .collect();
        let mut last = None;
        for (i, (name, budget)) in budgets.iter().enumerate() {
            match submit(name.clone(), *budget, budgets[i + 1..].to_vec()).await {
                Err(e) if node_refused(&e) => {
                    reasons.push((name.clone(), reason(&e)));
                    last = Some(e);
                }
                other => return other,
            }
        }
        Err(refused_everywhere(reasons, last))
    }
}

/// How often parked sandboxes that ran are offered to the nodes again.
const REHOME_EVERY: std::time::Duration = std::time::Duration::from_secs(2);
/// The least time between two resumes of the same parked sandbox (none fitted anywhere), doubled
/// after each failure up to [`REHOME_RETRY_MAX`]: a sandbox no node can take for long leaves a
/// failed operation now and then, not every 15 s.
const REHOME_RETRY: std::time::Duration = std::time::Duration::from_secs(15);
const REHOME_RETRY_MAX: std::time::Duration = std::time::Duration::from_secs(600);

/// When a parked sandbox's `failures`-th failed resume may be tried again.
fn rehome_backoff(failures: u32) -> std::time::Duration {
    REHOME_RETRY.saturating_mul(1 << failures.min(10)).min(REHOME_RETRY_MAX)
}

impl Core {
    /// Start again, on another node, every sandbox a draining node parked while it ran (its
    /// tenant never asked it to stop), for as long as the core lives. Any replica may: the
    /// store admits each resume once. One whose resume fails (no node fits now) is tried again
    /// after [`rehome_backoff`].
    pub fn spawn_rehoming(&self) {
        let core = self.clone();
        tokio::spawn(async move {
            // Per parked sandbox: when it was last tried and how many tries failed in a row.
            let mut tried: std::collections::HashMap<String, (tokio::time::Instant, u32)> = Default::default();
            loop {
                tokio::time::sleep(REHOME_EVERY).await;
                let Ok(parked) = core.store.parked_to_resume().await else {
                    continue;
                };
                let now = tokio::time::Instant::now();
                // Kept while it resumes too (it is not parked then): a resume that fails on its
                // node counts as a failed try.
                tried.retain(|_, (at, _)| now.duration_since(*at) < 2 * REHOME_RETRY_MAX);
                for row in parked {
                    let failures = match tried.get(&row.id) {
                        Some((at, n)) if now.duration_since(*at) < rehome_backoff(n.saturating_sub(1)) => continue,
                        Some((_, n)) => *n,
                        None => 0,
                    };
                    tried.insert(row.id.clone(), (now, failures + 1));
                    let id = row.id.clone();
                    let outcome = match core.submit_resume(row).await {
                        Ok(_) => "ok",
                        // Another replica's resume got there first.
                        Err(CoreError::InvalidState { .. }) => continue,
                        Err(e) => {
                            tracing::warn!(sandbox = %id, tries = failures + 1, "cannot start the parked sandbox again: {e}");
                            "failed"
                        }
                    };
                    core.audit("rehome", None, "sandbox.resume", Some(&id), outcome).await;
                }
            }
        });
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_parked_sandbox_no_node_takes_is_tried_ever_less_often() {
        let secs: Vec<u64> = (0..8).map(|n| rehome_backoff(n).as_secs()).collect();
        assert_eq!(secs, vec![15, 30, 60, 120, 240, 480, 600, 600]);
        assert_eq!(rehome_backoff(u32::MAX), REHOME_RETRY_MAX);
    }
}
