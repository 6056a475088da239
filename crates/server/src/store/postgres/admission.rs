//! Admission inside the store's locked transactions: what a tenant and the node hold (live
//! sandboxes by their resources, suspended ones by their disk and saved memory, snapshots by
//! what they hold), checked against the tenant's quota and the node's budgets (`store/admit.rs`,
//! as SQLite's) before an insert. Postgres' SUM of BIGINT is NUMERIC, hence the casts back.

use super::{DISK_HELD, HOLDS_VM, LIVE, RATE_WINDOW_MS};
use crate::model::{Quota, TenantUsage};
use crate::records::now_ms;
use crate::store::admit::{
    check_budget, check_disk_budget, check_disk_quota, check_quota, rate_limit_reached, rate_limited, NodeUsage,
};
use crate::store::{NodeBudget, StoreError};
use sqlx::PgConnection;

/// A tenant's usage, read on `c` (inside the caller's transaction, so admission sees what it
/// decides on).
pub(super) async fn usage_within(c: &mut PgConnection, tenant_id: &str, now: i64) -> Result<TenantUsage, StoreError> {
    let (sandboxes, vcpu, memory, disk): (i64, i64, i64, i64) = sqlx::query_as(&format!(
        "SELECT COALESCE(SUM({HOLDS_VM}), 0)::BIGINT, COALESCE(SUM(vcpu * {HOLDS_VM}), 0)::BIGINT,
                COALESCE(SUM(memory_mib * {HOLDS_VM}), 0)::BIGINT, COALESCE(SUM({DISK_HELD}), 0)::BIGINT
         FROM sandboxes WHERE tenant_id = $1 AND {LIVE}"
    ))
    .bind(tenant_id)
    .fetch_one(&mut *c)
    .await?;
    let (snapshots, snapshot_disk): (i64, i64) =
        sqlx::query_as("SELECT COUNT(*), COALESCE(SUM(held_mib), 0)::BIGINT FROM snapshots WHERE tenant_id = $1")
            .bind(tenant_id)
            .fetch_one(&mut *c)
            .await?;
    let (creates,): (i64,) = sqlx::query_as(
        "SELECT COUNT(*) FROM operations WHERE tenant_id = $1 AND kind = 'create' AND created_at_ms > $2",
    )
    .bind(tenant_id)
    .bind(now - RATE_WINDOW_MS)
    .fetch_one(&mut *c)
    .await?;
    let n = |v: i64| v.max(0) as u64;
    Ok(TenantUsage {
        sandboxes: n(sandboxes) as u32,
        vcpu: n(vcpu),
        memory_mib: n(memory),
        disk_mib: n(disk) + n(snapshot_disk),
        snapshots: n(snapshots) as u32,
        snapshot_disk_mib: n(snapshot_disk),
        creates_last_minute: n(creates) as u32,
    })
}

/// What every tenant's live sandboxes, snapshots and volumes on `node` hold of it: vCPUs,
/// memory, disk.
async fn node_usage_within(c: &mut PgConnection, node: &str) -> Result<NodeUsage, StoreError> {
    let (vcpu, memory, disk): (i64, i64, i64) = sqlx::query_as(&format!(
        "SELECT COALESCE(SUM(vcpu * {HOLDS_VM}), 0)::BIGINT, COALESCE(SUM(memory_mib * {HOLDS_VM}), 0)::BIGINT,
            COALESCE(SUM({DISK_HELD}), 0)::BIGINT
         FROM sandboxes WHERE {LIVE} AND node = $1"
    ))
    .bind(node)
    .fetch_one(&mut *c)
    .await?;
    let (snapshots,): (i64,) =
        sqlx::query_as("SELECT COALESCE(SUM(held_mib), 0)::BIGINT FROM snapshots WHERE node = $1")
            .bind(node)
            .fetch_one(&mut *c)
            .await?;
    // Volumes on the node hold their full size, like a sandbox's disk.
    let (volumes,): (i64,) = sqlx::query_as("SELECT COALESCE(SUM(size_mib), 0)::BIGINT FROM volumes WHERE node = $1")
        .bind(node)
        .fetch_one(&mut *c)
        .await?;
    let n = |v: i64| v.max(0) as u64;
    Ok(NodeUsage {
        vcpu: n(vcpu),
        memory_mib: n(memory),
        disk_mib: n(disk) + n(snapshots) + n(volumes),
    })
}

/// Admission of `asked_mib` more disk on `c`: within the tenant's `disk_mib` quota and the
/// disk budget of `node`, next to what every live sandbox and snapshot on it holds.
pub(super) async fn admit_disk_within(
    c: &mut PgConnection,
    tenant_id: &str,
    asked_mib: u64,
    quota: &Quota,
    node: &str,
    budget: &NodeBudget,
) -> Result<(), StoreError> {
    let usage = usage_within(c, tenant_id, now_ms()).await?;
    check_disk_quota(usage.disk_mib, asked_mib, quota)?;
    check_disk_budget(node_usage_within(c, node).await?.disk_mib, asked_mib, budget)
}

/// Whether `node`'s budgets take sandbox `sb` (placed elsewhere until now) next to what every
/// sandbox and snapshot on it holds, on `c`.
pub(super) async fn node_admits_within(
    c: &mut PgConnection,
    sb: &crate::records::SandboxRecord,
    node: &str,
    budget: &NodeBudget,
) -> Result<(), StoreError> {
    let (held,): (i64,) = sqlx::query_as(&format!("SELECT {DISK_HELD} FROM sandboxes WHERE id = $1"))
        .bind(&sb.id)
        .fetch_one(&mut *c)
        .await?;
    check_budget(
        node_usage_within(c, node).await?,
        &sb.resources,
        held.max(0) as u64,
        budget,
    )
}

/// Admission on `c`: a sandbox of `tenant_id` with resources `r` fits the tenant's `quota` and
/// the `budget` of `node` next to every live sandbox and snapshot on it. A `new` one also counts its
/// disk (`new_disk_mib`: its disk, and its memory if its timeout suspends it) and a create
/// against the rate limit; one resuming from suspended already holds its disk.
pub(super) async fn admit_within(
    c: &mut PgConnection,
    tenant_id: &str,
    r: &crate::model::Resources,
    quota: &Quota,
    node: &str,
    budget: &NodeBudget,
    new_disk_mib: Option<u64>,
) -> Result<(), StoreError> {
    let now = now_ms();
    let new = new_disk_mib.is_some();
    let disk_asked = new_disk_mib.unwrap_or(0);
    let usage = usage_within(c, tenant_id, now).await?;
    check_quota(&usage, r, disk_asked, quota)?;
    if let Some(limit) = rate_limit_reached(&usage, quota).filter(|_| new) {
        // The window frees a place when the oldest create counted in it turns 60 s old.
        let (oldest,): (Option<i64>,) = sqlx::query_as(
            "SELECT MIN(created_at_ms) FROM (SELECT created_at_ms FROM operations
             WHERE tenant_id = $1 AND kind = 'create' AND created_at_ms > $2
             ORDER BY created_at_ms DESC LIMIT $3) AS recent",
        )
        .bind(tenant_id)
        .bind(now - RATE_WINDOW_MS)
        .bind(limit as i64)
        .fetch_one(&mut *c)
        .await?;
        return Err(rate_limited(limit, oldest, now));
    }
    // The node's budgets, summed over every tenant's live sandboxes and snapshots under the
    // same lock.
    check_budget(node_usage_within(c, node).await?, r, disk_asked, budget)
}
