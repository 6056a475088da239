//! [`VolumeStore`]: tenants' volumes and what each sandbox mounts (migrations sqlite 0024,
//! pg 0013). The statements are valid on both stores, so one macro implements the trait.

use crate::records::{VolumeHolderRecord, VolumeMountRecord, VolumeRecord};
use crate::store::StoreError;
use async_trait::async_trait;

#[async_trait]
pub trait VolumeStore: Send + Sync {
    /// Record `volume` if the tenant's volumes and it stay within `limit_mib` (none: no limit);
    /// [`StoreError::QuotaExceeded`] (`volume_mib`) otherwise, in one statement. False when the
    /// tenant has a volume of that name.
    async fn insert_volume(&self, volume: &VolumeRecord, limit_mib: Option<u64>) -> Result<bool, StoreError>;
    /// The tenant's volume whose id or name is `key`.
    async fn get_volume(&self, tenant_id: &str, key: &str) -> Result<Option<VolumeRecord>, StoreError>;
    /// Volume `id`, whoever's (a volume token names it).
    async fn volume_by_id(&self, id: &str) -> Result<Option<VolumeRecord>, StoreError>;
    /// The tenant's volumes, oldest first.
    async fn list_volumes(&self, tenant_id: &str) -> Result<Vec<VolumeRecord>, StoreError>;
    /// Set volume `id`'s size within `limit_mib` like an insert.
    async fn resize_volume(&self, id: &str, size_mib: u64, limit_mib: Option<u64>) -> Result<(), StoreError>;
    /// Remove volume `id`'s record; false when it was gone.
    async fn delete_volume(&self, id: &str) -> Result<bool, StoreError>;
    /// The MiB the tenant's volumes hold.
    async fn volume_mib_used(&self, tenant_id: &str) -> Result<u64, StoreError>;
    /// The MiB every volume on `node` holds.
    async fn node_volume_mib(&self, node: &str) -> Result<u64, StoreError>;
    /// Record what sandbox `sandbox_id` mounts (before its create is submitted).
    async fn put_sandbox_volumes(&self, sandbox_id: &str, mounts: &[VolumeMountRecord]) -> Result<(), StoreError>;
    /// What sandbox `sandbox_id` mounts, in order.
    async fn sandbox_volumes(&self, sandbox_id: &str) -> Result<Vec<VolumeMountRecord>, StoreError>;
    /// The sandboxes not ended that mount volume `id`.
    async fn volume_holders(&self, id: &str) -> Result<Vec<VolumeHolderRecord>, StoreError>;
}

#[derive(sqlx::FromRow)]
pub(super) struct VolumeRow {
    id: String,
    tenant_id: String,
    name: String,
    size_mib: i64,
    node: String,
    token_hash: String,
    created_at_ms: i64,
}

impl From<VolumeRow> for VolumeRecord {
    fn from(r: VolumeRow) -> Self {
        VolumeRecord {
            id: r.id,
            tenant_id: r.tenant_id,
            name: r.name,
            size_mib: r.size_mib.max(0) as u64,
            node: r.node,
            token_hash: r.token_hash,
            created_at_ms: r.created_at_ms,
        }
    }
}

#[derive(sqlx::FromRow)]
pub(super) struct MountRow {
    volume_id: String,
    path: String,
    read_only: bool,
}

impl From<MountRow> for VolumeMountRecord {
    fn from(r: MountRow) -> Self {
        VolumeMountRecord {
            volume_id: r.volume_id,
            path: r.path,
            read_only: r.read_only,
        }
    }
}

#[derive(sqlx::FromRow)]
pub(super) struct HolderRow {
    sandbox_id: String,
    read_only: bool,
    state: String,
}

impl From<HolderRow> for VolumeHolderRecord {
    fn from(r: HolderRow) -> Self {
        VolumeHolderRecord {
            sandbox_id: r.sandbox_id,
            read_only: r.read_only,
            state: r.state,
        }
    }
}

pub(super) const COLUMNS: &str = "id, tenant_id, name, size_mib, node, token_hash, created_at_ms";
/// An insert that happens only within the quota (`$8`, none: no limit).
pub(super) const INSERT: &str = "INSERT INTO volumes (id, tenant_id, name, size_mib, node, token_hash, created_at_ms) \
     SELECT $1, $2, $3, CAST($4 AS BIGINT), $5, $6, CAST($7 AS BIGINT) \
     WHERE CAST($8 AS BIGINT) IS NULL \
        OR (SELECT COALESCE(SUM(size_mib), 0) FROM volumes WHERE tenant_id = $2) + CAST($4 AS BIGINT) <= CAST($8 AS BIGINT)";
/// A resize within the quota (`$3`): the tenant's other volumes plus the new size.
pub(super) const RESIZE: &str = "UPDATE volumes SET size_mib = CAST($2 AS BIGINT) WHERE id = $1 \
     AND (CAST($3 AS BIGINT) IS NULL OR (SELECT COALESCE(SUM(o.size_mib), 0) FROM volumes o \
          WHERE o.tenant_id = volumes.tenant_id AND o.id <> $1) + CAST($2 AS BIGINT) <= CAST($3 AS BIGINT))";
pub(super) const HOLDERS: &str = "SELECT v.sandbox_id, v.read_only, s.state FROM sandbox_volumes v \
     JOIN sandboxes s ON s.id = v.sandbox_id \
     WHERE v.volume_id = $1 AND s.state NOT IN ('deleted', 'failed', 'lost') ORDER BY s.created_at_ms";

/// Implements [`VolumeStore`] for a store whose pool is `self.pool` (both run the same SQL).
macro_rules! impl_volume_store {
    ($store:ty) => {
        #[async_trait::async_trait]
        impl $crate::store::volumes::VolumeStore for $store {
            async fn insert_volume(
                &self,
                v: &$crate::records::VolumeRecord,
                limit_mib: Option<u64>,
            ) -> Result<bool, $crate::store::StoreError> {
                let big = |n: u64| n.min(i64::MAX as u64) as i64;
                let done = sqlx::query($crate::store::volumes::INSERT)
                    .bind(&v.id)
                    .bind(&v.tenant_id)
                    .bind(&v.name)
                    .bind(big(v.size_mib))
                    .bind(&v.node)
                    .bind(&v.token_hash)
                    .bind(v.created_at_ms)
                    .bind(limit_mib.map(big))
                    .execute(&self.pool)
                    .await;
                match done {
                    Ok(r) if r.rows_affected() == 1 => Ok(true),
                    Ok(_) => {
                        let used = self.volume_mib_used(&v.tenant_id).await?;
                        Err($crate::store::StoreError::QuotaExceeded {
                            quota: "volume_mib",
                            used,
                            asked: v.size_mib,
                            limit: limit_mib.unwrap_or(u64::MAX),
                        })
                    }
                    Err(sqlx::Error::Database(d)) if d.is_unique_violation() => Ok(false),
                    Err(e) => Err(e.into()),
                }
            }

            async fn get_volume(
                &self,
                tenant_id: &str,
                key: &str,
            ) -> Result<Option<$crate::records::VolumeRecord>, $crate::store::StoreError> {
                let row: Option<$crate::store::volumes::VolumeRow> = sqlx::query_as(&format!(
                    "SELECT {} FROM volumes WHERE tenant_id = $1 AND (id = $2 OR name = $2)",
                    $crate::store::volumes::COLUMNS
                ))
                .bind(tenant_id)
                .bind(key)
                .fetch_optional(&self.pool)
                .await?;
                Ok(row.map(Into::into))
            }

            async fn volume_by_id(
                &self,
                id: &str,
            ) -> Result<Option<$crate::records::VolumeRecord>, $crate::store::StoreError> {
                let row: Option<$crate::store::volumes::VolumeRow> = sqlx::query_as(&format!(
                    "SELECT {} FROM volumes WHERE id = $1",
                    $crate::store::volumes::COLUMNS
                ))
                .bind(id)
                .fetch_optional(&self.pool)
                .await?;
                Ok(row.map(Into::into))
            }

            async fn list_volumes(
                &self,
                tenant_id: &str,
            ) -> Result<Vec<$crate::records::VolumeRecord>, $crate::store::StoreError> {
                let rows: Vec<$crate::store::volumes::VolumeRow> = sqlx::query_as(&format!(
                    "SELECT {} FROM volumes WHERE tenant_id = $1 ORDER BY created_at_ms, id",
                    $crate::store::volumes::COLUMNS
                ))
                .bind(tenant_id)
                .fetch_all(&self.pool)
                .await?;
                Ok(rows.into_iter().map(Into::into).collect())
            }

            async fn resize_volume(
                &self,
                id: &str,
                size_mib: u64,
                limit_mib: Option<u64>,
            ) -> Result<(), $crate::store::StoreError> {
                let big = |n: u64| n.min(i64::MAX as u64) as i64;
                let done = sqlx::query($crate::store::volumes::RESIZE)
                    .bind(id)
                    .bind(big(size_mib))
                    .bind(limit_mib.map(big))
                    .execute(&self.pool)
                    .await?;
                if done.rows_affected() == 1 {
                    return Ok(());
                }
                let Some(v) = self.volume_by_id(id).await? else {
                    return Ok(());
                };
                let used = self.volume_mib_used(&v.tenant_id).await?;
                Err($crate::store::StoreError::QuotaExceeded {
                    quota: "volume_mib",
                    used,
                    asked: size_mib.saturating_sub(v.size_mib),
                    limit: limit_mib.unwrap_or(u64::MAX),
                })
            }

            async fn delete_volume(&self, id: &str) -> Result<bool, $crate::store::StoreError> {
                let done = sqlx::query("DELETE FROM volumes WHERE id = $1")
                    .bind(id)
                    .execute(&self.pool)
                    .await?;
                Ok(done.rows_affected() > 0)
            }

            async fn volume_mib_used(&self, tenant_id: &str) -> Result<u64, $crate::store::StoreError> {
                let (used,): (i64,) = sqlx::query_as(
                    "SELECT CAST(COALESCE(SUM(size_mib), 0) AS BIGINT) FROM volumes WHERE tenant_id = $1",
                )
                .bind(tenant_id)
                .fetch_one(&self.pool)
                .await?;
                Ok(used.max(0) as u64)
            }

            async fn node_volume_mib(&self, node: &str) -> Result<u64, $crate::store::StoreError> {
                let (used,): (i64,) =
                    sqlx::query_as("SELECT CAST(COALESCE(SUM(size_mib), 0) AS BIGINT) FROM volumes WHERE node = $1")
                        .bind(node)
                        .fetch_one(&self.pool)
                        .await?;
                Ok(used.max(0) as u64)
            }

            async fn put_sandbox_volumes(
                &self,
                sandbox_id: &str,
                mounts: &[$crate::records::VolumeMountRecord],
            ) -> Result<(), $crate::store::StoreError> {
                for (n, m) in mounts.iter().enumerate() {
                    sqlx::query(
                        "INSERT INTO sandbox_volumes (sandbox_id, position, volume_id, path, read_only) \
                         VALUES ($1, $2, $3, $4, $5)",
                    )
                    .bind(sandbox_id)
                    .bind(n as i64)
                    .bind(&m.volume_id)
                    .bind(&m.path)
                    .bind(m.read_only)
                    .execute(&self.pool)
                    .await?;
                }
                Ok(())
            }

            async fn sandbox_volumes(
                &self,
                sandbox_id: &str,
            ) -> Result<Vec<$crate::records::VolumeMountRecord>, $crate::store::StoreError> {
                let rows: Vec<$crate::store::volumes::MountRow> = sqlx::query_as(
                    "SELECT volume_id, path, read_only FROM sandbox_volumes WHERE sandbox_id = $1 ORDER BY position",
                )
                .bind(sandbox_id)
                .fetch_all(&self.pool)
                .await?;
                Ok(rows.into_iter().map(Into::into).collect())
            }

            async fn volume_holders(
                &self,
                id: &str,
            ) -> Result<Vec<$crate::records::VolumeHolderRecord>, $crate::store::StoreError> {
                let rows: Vec<$crate::store::volumes::HolderRow> = sqlx::query_as($crate::store::volumes::HOLDERS)
                    .bind(id)
                    .fetch_all(&self.pool)
                    .await?;
                Ok(rows.into_iter().map(Into::into).collect())
            }
        }
    };
}
pub(crate) use impl_volume_store;
