//! [`AccountStore`] on SQLite: tenants as the admin manages them, named keys, the console
//! account and its sessions, the audit log. Uses the key and row helpers of `super`.

use super::*;

#[async_trait]
impl AccountStore for SqliteStore {
    async fn create_tenant(&self, name: &str) -> Result<Option<Tenant>, StoreError> {
        let id = new_tenant_id(name);
        let r = sqlx::query("INSERT INTO tenants (id, name, created_at_ms) VALUES (?, ?, ?) ON CONFLICT DO NOTHING")
            .bind(&id)
            .bind(name)
            .bind(now_ms())
            .execute(&self.pool)
            .await?;
        Ok((r.rows_affected() == 1).then(|| Tenant { id, name: name.into() }))
    }

    async fn list_tenants(&self) -> Result<Vec<(Tenant, i64)>, StoreError> {
        let rows: Vec<(String, String, i64)> =
            sqlx::query_as("SELECT id, name, created_at_ms FROM tenants ORDER BY name")
                .fetch_all(&self.pool)
                .await?;
        Ok(rows
            .into_iter()
            .map(|(id, name, at)| (Tenant { id, name }, at))
            .collect())
    }

    async fn delete_tenant(&self, tenant_id: &str) -> Result<(), StoreError> {
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
        for sql in [
            "DELETE FROM api_keys WHERE tenant_id = ?",
            "DELETE FROM tenant_quotas WHERE tenant_id = ?",
            "DELETE FROM tenant_egress WHERE tenant_id = ?",
            "DELETE FROM snapshots WHERE tenant_id = ?",
            "DELETE FROM e2b_sandboxes WHERE sandbox_id IN (SELECT id FROM sandboxes WHERE tenant_id = ?)",
            "DELETE FROM sandbox_access WHERE sandbox_id IN (SELECT id FROM sandboxes WHERE tenant_id = ?)",
            "DELETE FROM tenants WHERE id = ?",
        ] {
            sqlx::query(sql).bind(tenant_id).execute(&mut *tx).await?;
        }
        tx.commit().await?;
        Ok(())
    }

    async fn mint_key(
        &self,
        tenant_id: &str,
        format: KeyFormat,
        name: &str,
    ) -> Result<(String, KeyRecord), StoreError> {
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
        let key = new_key(format);
        let record = insert_key_row(&mut tx, tenant_id, &key, name).await?;
        tx.commit().await?;
        Ok((key, record))
    }

    async fn list_keys(&self, tenant_id: &str) -> Result<Vec<KeyRecord>, StoreError> {
        sqlx::query("SELECT * FROM api_keys WHERE tenant_id = ? ORDER BY created_at_ms, id")
            .bind(tenant_id)
            .fetch_all(&self.pool)
            .await?
            .iter()
            .map(key_from_row)
            .collect()
    }

    async fn revoke_key(&self, tenant_id: &str, key_id: &str) -> Result<bool, StoreError> {
        let r = sqlx::query(
            "UPDATE api_keys SET revoked_at_ms = COALESCE(revoked_at_ms, ?) WHERE tenant_id = ? AND id = ?",
        )
        .bind(now_ms())
        .bind(tenant_id)
        .bind(key_id)
        .execute(&self.pool)
        .await?;
        Ok(r.rows_affected() == 1)
    }

    async fn password_hash(&self, account: &str) -> Result<Option<String>, StoreError> {
        let row: Option<(String,)> = sqlx::query_as("SELECT password_hash FROM console_accounts WHERE name = ?")
            .bind(account)
            .fetch_optional(&self.pool)
            .await?;
        Ok(row.map(|(h,)| h))
    }

    async fn set_password_hash(&self, account: &str, hash: &str) -> Result<(), StoreError> {
        sqlx::query(
            "INSERT INTO console_accounts (name, password_hash, updated_at_ms) VALUES (?, ?, ?)
             ON CONFLICT (name) DO UPDATE SET password_hash = excluded.password_hash, updated_at_ms = excluded.updated_at_ms",
        )
        .bind(account)
        .bind(hash)
        .bind(now_ms())
        .execute(&self.pool)
        .await?;
        // A new password ends every sign-in made with the old one.
        sqlx::query("DELETE FROM admin_sessions WHERE account = ?")
            .bind(account)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    async fn reserve_sign_in(
        &self,
        attempt: &super::super::SignInAttempt<'_>,
    ) -> Result<Result<(), super::super::SignInFull>, StoreError> {
        let mut tx = self.pool.begin().await?;
        let reserved = super::super::reserve_sign_in_in!(tx, attempt);
        tx.commit().await?;
        Ok(reserved)
    }

    async fn end_sign_in(&self, id: &str, failed: bool, now_ms: i64) -> Result<(), StoreError> {
        super::super::end_sign_in_on!(&self.pool, id, failed, now_ms)
    }

    async fn insert_admin_session(
        &self,
        token_hash: &str,
        account: &str,
        expires_at_ms: i64,
    ) -> Result<(), StoreError> {
        sqlx::query(
            "INSERT INTO admin_sessions (token_hash, account, created_at_ms, expires_at_ms) VALUES (?, ?, ?, ?)",
        )
        .bind(token_hash)
        .bind(account)
        .bind(now_ms())
        .bind(expires_at_ms)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    async fn admin_session(&self, token_hash: &str, now_ms: i64) -> Result<Option<String>, StoreError> {
        sqlx::query("DELETE FROM admin_sessions WHERE expires_at_ms <= ?")
            .bind(now_ms)
            .execute(&self.pool)
            .await?;
        let row: Option<(String,)> = sqlx::query_as("SELECT account FROM admin_sessions WHERE token_hash = ?")
            .bind(token_hash)
            .fetch_optional(&self.pool)
            .await?;
        Ok(row.map(|(a,)| a))
    }

    async fn insert_audit(&self, r: &AuditRecord) -> Result<i64, StoreError> {
        let done = sqlx::query(
            "INSERT INTO audit (at_ms, actor, tenant, action, object, result, count) VALUES (?, ?, ?, ?, ?, ?, ?)",
        )
        .bind(r.at_ms)
        .bind(&r.actor)
        .bind(&r.tenant)
        .bind(&r.action)
        .bind(&r.object)
        .bind(&r.result)
        .bind(r.count.max(1) as i64)
        .execute(&self.pool)
        .await?;
        Ok(done.last_insert_rowid())
    }

    async fn add_audit_count(&self, seq: i64, by: u64) -> Result<(), StoreError> {
        sqlx::query("UPDATE audit SET count = count + ? WHERE seq = ?")
            .bind(by.min(i64::MAX as u64) as i64)
            .bind(seq)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    async fn audit(&self, filter: &AuditFilter, limit: u32) -> Result<Vec<AuditRecord>, StoreError> {
        let rows = sqlx::query(
            "SELECT * FROM audit WHERE (?1 IS NULL OR seq < ?1) AND (?2 IS NULL OR tenant = ?2)
             AND (?3 IS NULL OR action = ?3) ORDER BY seq DESC LIMIT ?4",
        )
        .bind(filter.before_seq)
        .bind(&filter.tenant)
        .bind(&filter.action)
        .bind(limit as i64)
        .fetch_all(&self.pool)
        .await?;
        rows.iter()
            .map(|r| {
                Ok(AuditRecord {
                    seq: r.try_get("seq")?,
                    at_ms: r.try_get("at_ms")?,
                    actor: r.try_get("actor")?,
                    tenant: r.try_get("tenant")?,
                    action: r.try_get("action")?,
                    object: r.try_get("object")?,
                    result: r.try_get("result")?,
                    count: r.try_get::<i64, _>("count")?.max(1) as u64,
                })
            })
            .collect()
    }

    async fn prune_audit(&self, before_ms: i64) -> Result<u64, StoreError> {
        let r = sqlx::query("DELETE FROM audit WHERE at_ms < ?")
            .bind(before_ms)
            .execute(&self.pool)
            .await?;
        Ok(r.rows_affected())
    }
}
