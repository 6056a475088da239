//! [`SnapshotStore`] on SQLite: snapshots are admitted `saving` with a reserve, then `ready`
//! holding their size (see migration 0012).

use super::admission::admit_disk_within;
use super::SqliteStore;
use crate::model::{Quota, Resources};
use crate::records::{SnapshotKind, SnapshotRecord};
use crate::store::{NodeBudget, SnapshotAdmission, SnapshotStore, StoreError};
use async_trait::async_trait;
use sqlx::Row;

fn snapshot_from_row(r: &sqlx::sqlite::SqliteRow) -> SnapshotRecord {
    SnapshotRecord {
        id: r.get("id"),
        tenant_id: r.get("tenant_id"),
        name: r.get("name"),
        kind: match r.get::<&str, _>("kind") {
            "fork" => SnapshotKind::Fork,
            _ => SnapshotKind::Snapshot,
        },
        sandbox_id: r.get("sandbox_id"),
        template: r.get("template"),
        resources: Resources {
            vcpu: r.get::<i64, _>("vcpu") as u32,
            memory_mib: r.get::<i64, _>("memory_mib") as u32,
            disk_mib: r.get::<i64, _>("disk_mib") as u32,
        },
        bytes: r.get::<i64, _>("bytes").max(0) as u64,
        digest: r.get("digest"),
        created_at_ms: r.get("created_at_ms"),
        shared: r.get("shared_fingerprint"),
    }
}

/// MiB a saved image of `bytes` holds, rounded up.
fn held_mib(bytes: u64) -> i64 {
    bytes.div_ceil(1 << 20).min(i64::MAX as u64) as i64
}

#[async_trait]
impl SnapshotStore for SqliteStore {
    async fn admit_snapshot(
        &self,
        s: &SnapshotRecord,
        reserve_mib: u64,
        quota: &Quota,
        budget: &NodeBudget,
    ) -> Result<SnapshotAdmission, StoreError> {
        // One immediate transaction, as a create's: concurrent saves never overshoot.
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
        let tenant: Option<(String,)> = sqlx::query_as("SELECT id FROM tenants WHERE id = ?")
            .bind(&s.tenant_id)
            .fetch_optional(&mut *tx)
            .await?;
        if tenant.is_none() {
            return Ok(SnapshotAdmission::NoTenant);
        }
        if let Some(name) = &s.name {
            let taken: Option<(String,)> = sqlx::query_as("SELECT id FROM snapshots WHERE tenant_id = ? AND name = ?")
                .bind(&s.tenant_id)
                .bind(name)
                .fetch_optional(&mut *tx)
                .await?;
            if taken.is_some() {
                return Ok(SnapshotAdmission::NameTaken);
            }
        }
        // Its image is saved on its sandbox's node, whose disk budget it counts against.
        let (node,): (String,) = sqlx::query_as("SELECT node FROM sandboxes WHERE id = ?")
            .bind(&s.sandbox_id)
            .fetch_optional(&mut *tx)
            .await?
            .unwrap_or_default();
        admit_disk_within(&mut tx, &s.tenant_id, reserve_mib, quota, &node, budget).await?;
        sqlx::query(
            "INSERT INTO snapshots (id, tenant_id, name, kind, sandbox_id, template, vcpu, memory_mib, disk_mib, bytes, digest, created_at_ms, state, held_mib, node)
             VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 'saving', ?, ?)",
        )
        .bind(&s.id)
        .bind(&s.tenant_id)
        .bind(&s.name)
        .bind(match s.kind {
            SnapshotKind::Snapshot => "snapshot",
            SnapshotKind::Fork => "fork",
        })
        .bind(&s.sandbox_id)
        .bind(&s.template)
        .bind(s.resources.vcpu as i64)
        .bind(s.resources.memory_mib as i64)
        .bind(s.resources.disk_mib as i64)
        .bind(s.bytes as i64)
        .bind(&s.digest)
        .bind(s.created_at_ms)
        .bind(reserve_mib.min(i64::MAX as u64) as i64)
        .bind(&node)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(SnapshotAdmission::Admitted)
    }

    async fn snapshot_saved(&self, s: &SnapshotRecord) -> Result<bool, StoreError> {
        let done = sqlx::query(
            "UPDATE snapshots SET state = 'ready', bytes = ?, digest = ?, held_mib = ?, shared_fingerprint = ? \
             WHERE tenant_id = ? AND id = ?",
        )
        .bind(s.bytes.min(i64::MAX as u64) as i64)
        .bind(&s.digest)
        .bind(held_mib(s.bytes))
        .bind(&s.shared)
        .bind(&s.tenant_id)
        .bind(&s.id)
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected() == 1)
    }

    async fn get_snapshot(&self, tenant_id: &str, id_or_name: &str) -> Result<Option<SnapshotRecord>, StoreError> {
        let r = sqlx::query(
            "SELECT * FROM snapshots WHERE tenant_id = ? AND state = 'ready' AND (id = ? OR name = ? OR digest = ?)
             ORDER BY created_at_ms DESC LIMIT 1",
        )
        .bind(tenant_id)
        .bind(id_or_name)
        .bind(id_or_name)
        .bind(id_or_name)
        .fetch_optional(&self.pool)
        .await?;
        Ok(r.as_ref().map(snapshot_from_row))
    }

    async fn list_snapshots(
        &self,
        tenant_id: &str,
        sandbox_id: Option<&str>,
    ) -> Result<Vec<SnapshotRecord>, StoreError> {
        let rows = sqlx::query(
            "SELECT * FROM snapshots WHERE tenant_id = ? AND kind = 'snapshot' AND state = 'ready'
             AND (? IS NULL OR sandbox_id = ?) ORDER BY created_at_ms, id",
        )
        .bind(tenant_id)
        .bind(sandbox_id)
        .bind(sandbox_id)
        .fetch_all(&self.pool)
        .await?;
        Ok(rows.iter().map(snapshot_from_row).collect())
    }

    async fn tenant_snapshots(&self, tenant_id: &str) -> Result<Vec<SnapshotRecord>, StoreError> {
        let rows = sqlx::query("SELECT * FROM snapshots WHERE tenant_id = ? ORDER BY created_at_ms, id")
            .bind(tenant_id)
            .fetch_all(&self.pool)
            .await?;
        Ok(rows.iter().map(snapshot_from_row).collect())
    }

    async fn delete_snapshot(&self, tenant_id: &str, id: &str) -> Result<bool, StoreError> {
        let done = sqlx::query("DELETE FROM snapshots WHERE tenant_id = ? AND id = ?")
            .bind(tenant_id)
            .bind(id)
            .execute(&self.pool)
            .await?;
        Ok(done.rows_affected() == 1)
    }

    async fn snapshot_ids(&self) -> Result<Vec<String>, StoreError> {
        let rows: Vec<(String,)> = sqlx::query_as("SELECT id FROM snapshots").fetch_all(&self.pool).await?;
        Ok(rows.into_iter().map(|(id,)| id).collect())
    }

    async fn interrupted_images(&self, before_ms: i64) -> Result<Vec<SnapshotRecord>, StoreError> {
        let rows =
            sqlx::query("SELECT * FROM snapshots WHERE (kind = 'fork' OR state = 'saving') AND created_at_ms < ?")
                .bind(before_ms)
                .fetch_all(&self.pool)
                .await?;
        Ok(rows.iter().map(snapshot_from_row).collect())
    }
}
