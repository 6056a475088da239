//! [`TenantStore`] on SQLite: the bootstrap key, keys by hash, tenants by name, quotas and base
//! egress policies. Uses the key helpers of `super`.

use super::*;

#[async_trait]
impl TenantStore for SqliteStore {
    async fn needs_bootstrap(&self) -> Result<bool, StoreError> {
        let keys: (i64,) = sqlx::query_as(
            "SELECT COUNT(*) FROM api_keys k JOIN tenants t ON t.id = k.tenant_id WHERE t.name = 'default'",
        )
        .fetch_one(&self.pool)
        .await?;
        Ok(keys.0 == 0)
    }

    async fn bootstrap(&self, key: &str) -> Result<bool, StoreError> {
        // One immediate transaction: the count and the insert cannot interleave with another.
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
        let keys: (i64,) = sqlx::query_as(
            "SELECT COUNT(*) FROM api_keys k JOIN tenants t ON t.id = k.tenant_id WHERE t.name = 'default'",
        )
        .fetch_one(&mut *tx)
        .await?;
        if keys.0 > 0 {
            return Ok(false);
        }
        insert_key(&mut tx, "default", key).await?;
        tx.commit().await?;
        Ok(true)
    }

    async fn create_key(&self, tenant: &str, format: KeyFormat) -> Result<String, StoreError> {
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
        let key = new_key(format);
        insert_key(&mut tx, tenant, &key).await?;
        tx.commit().await?;
        Ok(key)
    }

    async fn tenant_by_key(&self, key: &str) -> Result<Option<Tenant>, StoreError> {
        let hash = token_hash(key);
        let row: Option<(String, String, Option<i64>)> = sqlx::query_as(
            "SELECT t.id, t.name, k.last_used_at_ms FROM api_keys k JOIN tenants t ON t.id = k.tenant_id
             WHERE k.hash = ? AND k.revoked_at_ms IS NULL",
        )
        .bind(&hash)
        .fetch_optional(&self.pool)
        .await?;
        let Some((id, name, last_used)) = row else {
            return Ok(None);
        };
        // Last use to the minute: a write per request would serialize every call on the lock.
        let now = now_ms();
        if last_used.is_none_or(|t| now - t >= 60_000) {
            sqlx::query("UPDATE api_keys SET last_used_at_ms = ? WHERE hash = ?")
                .bind(now)
                .bind(&hash)
                .execute(&self.pool)
                .await?;
        }
        Ok(Some(Tenant { id, name }))
    }

    async fn tenant_by_name(&self, name: &str) -> Result<Option<Tenant>, StoreError> {
        let row: Option<(String, String)> = sqlx::query_as("SELECT id, name FROM tenants WHERE name = ?")
            .bind(name)
            .fetch_optional(&self.pool)
            .await?;
        Ok(row.map(|(id, name)| Tenant { id, name }))
    }

    async fn egress_policy(&self, tenant_id: &str) -> Result<airlock_egress::TenantPolicy, StoreError> {
        let row: Option<(String,)> = sqlx::query_as("SELECT policy FROM tenant_egress WHERE tenant_id = ?")
            .bind(tenant_id)
            .fetch_optional(&self.pool)
            .await?;
        match row {
            None => Ok(airlock_egress::TenantPolicy::sealed()),
            Some((json,)) => airlock_egress::TenantPolicy::from_json(&json).map_err(|e| {
                StoreError::backend(format!(
                    "tenant {tenant_id}: the stored egress policy does not parse: {e}"
                ))
            }),
        }
    }

    async fn quota(&self, tenant_id: &str) -> Result<Quota, StoreError> {
        let row = sqlx::query(
            "SELECT sandboxes, vcpu, memory_mib, disk_mib, sessions_per_sandbox, creates_per_minute, volume_mib
             FROM tenant_quotas WHERE tenant_id = ?",
        )
        .bind(tenant_id)
        .fetch_optional(&self.pool)
        .await?;
        let Some(r) = row else { return Ok(Quota::default()) };
        let get = |c: &str| -> Result<Option<u64>, StoreError> {
            Ok(r.try_get::<Option<i64>, _>(c)?.map(|v| v.max(0) as u64))
        };
        let small = |v: Option<u64>| v.map(|v| v.min(u32::MAX as u64) as u32);
        Ok(Quota {
            sandboxes: small(get("sandboxes")?),
            vcpu: get("vcpu")?,
            memory_mib: get("memory_mib")?,
            disk_mib: get("disk_mib")?,
            sessions_per_sandbox: small(get("sessions_per_sandbox")?),
            creates_per_minute: small(get("creates_per_minute")?),
            volume_mib: get("volume_mib")?,
        })
    }

    async fn set_quota(&self, tenant_id: &str, q: &Quota) -> Result<(), StoreError> {
        let big = |v: Option<u64>| v.map(|v| v.min(i64::MAX as u64) as i64);
        sqlx::query(
            "INSERT INTO tenant_quotas (tenant_id, sandboxes, vcpu, memory_mib, disk_mib, sessions_per_sandbox,
                                        creates_per_minute, updated_at_ms, volume_mib) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)
             ON CONFLICT (tenant_id) DO UPDATE SET sandboxes = excluded.sandboxes, vcpu = excluded.vcpu,
               memory_mib = excluded.memory_mib, disk_mib = excluded.disk_mib,
               sessions_per_sandbox = excluded.sessions_per_sandbox,
               creates_per_minute = excluded.creates_per_minute, updated_at_ms = excluded.updated_at_ms,
               volume_mib = excluded.volume_mib",
        )
        .bind(tenant_id)
        .bind(q.sandboxes.map(i64::from))
        .bind(big(q.vcpu))
        .bind(big(q.memory_mib))
        .bind(big(q.disk_mib))
        .bind(q.sessions_per_sandbox.map(i64::from))
        .bind(q.creates_per_minute.map(i64::from))
        .bind(now_ms())
        .bind(big(q.volume_mib))
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    async fn set_egress_policy(
        &self,
        tenant_id: &str,
        policy: &airlock_egress::TenantPolicy,
    ) -> Result<(), StoreError> {
        sqlx::query(
            "INSERT INTO tenant_egress (tenant_id, policy, updated_at_ms) VALUES (?, ?, ?)
             ON CONFLICT (tenant_id) DO UPDATE SET policy = excluded.policy, updated_at_ms = excluded.updated_at_ms",
        )
        .bind(tenant_id)
        .bind(policy.to_json())
        .bind(now_ms())
        .execute(&self.pool)
        .await?;
        Ok(())
    }
}
