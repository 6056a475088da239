//! An admission's decisions, shared by both stores: each reads what the tenant and the node hold
//! inside its own atomic step (`sqlite/admission.rs`, `postgres/admission.rs`) and asks these.

use super::{NodeBudget, StoreError, RATE_WINDOW_MS};
use crate::model::{Quota, Resources, TenantUsage};

/// What every tenant's live sandboxes and snapshots hold of the node.
#[derive(Debug, Clone, Copy)]
pub(super) struct NodeUsage {
    pub vcpu: u64,
    pub memory_mib: u64,
    pub disk_mib: u64,
}

/// One more sandbox of resources `r`, asking `disk_asked` more disk, within the tenant's quotas:
/// its place, vCPUs, memory and disk.
pub(super) fn check_quota(
    usage: &TenantUsage,
    r: &Resources,
    disk_asked: u64,
    quota: &Quota,
) -> Result<(), StoreError> {
    for (name, used, asked, limit) in [
        ("sandboxes", usage.sandboxes as u64, 1, quota.sandboxes.map(u64::from)),
        ("vcpu", usage.vcpu, r.vcpu as u64, quota.vcpu),
        ("memory_mib", usage.memory_mib, r.memory_mib as u64, quota.memory_mib),
        ("disk_mib", usage.disk_mib, disk_asked, quota.disk_mib),
    ] {
        if let Some(limit) = limit.filter(|l| used.saturating_add(asked) > *l) {
            return Err(StoreError::QuotaExceeded {
                quota: name,
                used,
                asked,
                limit,
            });
        }
    }
    Ok(())
}

/// The tenant's creates per minute when a new create would pass them (the store then finds when
/// the window frees a place, [`rate_limited`]).
pub(super) fn rate_limit_reached(usage: &TenantUsage, quota: &Quota) -> Option<u32> {
    quota
        .creates_per_minute
        .filter(|limit| usage.creates_last_minute >= *limit)
}

/// The refusal of a create past `limit`: the window frees a place when the oldest create counted
/// in it (`oldest`, ms) turns 60 s old.
pub(super) fn rate_limited(limit: u32, oldest: Option<i64>, now: i64) -> StoreError {
    let free_at = oldest.unwrap_or(now) + RATE_WINDOW_MS;
    StoreError::RateLimited {
        limit,
        retry_after_s: ((free_at - now).max(0) as u64).div_ceil(1000).max(1),
    }
}

/// One more sandbox of resources `r`, asking `disk_asked` more disk, within the node's budgets.
pub(super) fn check_budget(
    node: NodeUsage,
    r: &Resources,
    disk_asked: u64,
    budget: &NodeBudget,
) -> Result<(), StoreError> {
    for (name, used, asked, total) in [
        ("vcpu", node.vcpu, r.vcpu as u64, budget.vcpu),
        ("memory", node.memory_mib, r.memory_mib as u64, budget.memory_mib),
        ("disk", node.disk_mib, disk_asked, budget.disk_mib),
    ] {
        if used.saturating_add(asked) > total {
            return Err(StoreError::NodeBudgetExceeded {
                budget: name,
                asked,
                used,
                total,
            });
        }
    }
    Ok(())
}

/// `asked_mib` more disk within the tenant's `disk_mib` quota (it holds `tenant_mib`).
pub(super) fn check_disk_quota(tenant_mib: u64, asked_mib: u64, quota: &Quota) -> Result<(), StoreError> {
    match quota.disk_mib.filter(|l| tenant_mib.saturating_add(asked_mib) > *l) {
        Some(limit) => Err(StoreError::QuotaExceeded {
            quota: "disk_mib",
            used: tenant_mib,
            asked: asked_mib,
            limit,
        }),
        None => Ok(()),
    }
}

/// `asked_mib` more disk within the node's disk budget (its sandboxes and snapshots hold
/// `node_mib`).
pub(super) fn check_disk_budget(node_mib: u64, asked_mib: u64, budget: &NodeBudget) -> Result<(), StoreError> {
    if node_mib.saturating_add(asked_mib) > budget.disk_mib {
        return Err(StoreError::NodeBudgetExceeded {
            budget: "disk",
            asked: asked_mib,
            used: node_mib,
            total: budget.disk_mib,
        });
    }
    Ok(())
}
