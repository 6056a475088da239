//! [`SandboxStore`] on SQLite: sandboxes (a create's, a resume's and a suspend's atomic
//! admission through `admission`), their access hashes and sessions. Uses the row helpers and the
//! `LIVE` states of `super`.

use super::*;
use crate::records::ParkedImage;

#[async_trait]
impl SandboxStore for SqliteStore {
    async fn insert_create_within(
        &self,
        sb: &SandboxRecord,
        op: &Operation,
        idem: Option<&str>,
        quota: &Quota,
        budget: &NodeBudget,
    ) -> Result<CreateRecorded, StoreError> {
        // IMMEDIATE takes the write lock up front (waiting up to busy_timeout for it), so the
        // idempotency lookup, the live count and the inserts see one state no other writer can
        // change in between: concurrent creates queue here instead of overshooting the limit
        // (and a DEFERRED read-then-write would fail with SQLITE_BUSY_SNAPSHOT under WAL).
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
        if let Some(key) = idem {
            let prior = sqlx::query("SELECT * FROM operations WHERE tenant_id = ? AND idempotency_key = ?")
                .bind(&sb.tenant_id)
                .bind(key)
                .fetch_optional(&mut *tx)
                .await?;
            if let Some(r) = prior {
                return Ok(CreateRecorded::Existing(op_from_row(&r)));
            }
        }
        // A sandbox its timeout suspends holds the place of its saved memory from the start:
        // the platform suspends it without asking again.
        let saved_mib = match sb.lifecycle.on_timeout {
            crate::model::OnTimeout::Suspend => sb.resources.memory_mib as u64,
            crate::model::OnTimeout::Delete => 0,
        };
        let disk = sb.resources.disk_mib as u64 + saved_mib;
        admit_within(
            &mut tx,
            &sb.tenant_id,
            &sb.resources,
            quota,
            &sb.node,
            budget,
            Some(disk),
        )
        .await?;
        sqlx::query(
            "INSERT INTO sandboxes (id, tenant_id, state, template, template_digest, runtime, accel, vcpu, memory_mib, disk_mib, env, metadata, created_at_ms, expires_at_ms, egress_profiles, egress_sealed, egress_policy, on_timeout, auto_resume, timeout_ms, image_id, saved_mib, node)
             VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        )
        .bind(&sb.id)
        .bind(&sb.tenant_id)
        .bind(sb.state.as_str())
        .bind(&sb.template)
        .bind(&sb.template_digest)
        .bind(&sb.runtime)
        .bind(&sb.accel)
        .bind(sb.resources.vcpu as i64)
        .bind(sb.resources.memory_mib as i64)
        .bind(sb.resources.disk_mib as i64)
        .bind(serde_json::to_string(&sb.env).unwrap_or_default())
        .bind(serde_json::to_string(&sb.metadata).unwrap_or_default())
        .bind(sb.created_at_ms)
        .bind(sb.expires_at_ms)
        .bind(serde_json::to_string(&sb.egress.profiles).unwrap_or_else(|_| "[]".into()))
        .bind(sb.egress.sealed as i64)
        .bind(sb.egress.tenant.to_json())
        .bind(sb.lifecycle.on_timeout.as_str())
        .bind(sb.lifecycle.auto_resume as i64)
        .bind(sb.timeout_ms)
        .bind(&sb.image_id)
        .bind(saved_mib as i64)
        .bind(&sb.node)
        .execute(&mut *tx)
        .await?;
        sqlx::query(
            "INSERT INTO operations (id, tenant_id, kind, state, sandbox_id, idempotency_key, created_at_ms, \
             lease_holder, lease_until_ms) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
        )
        .bind(&op.id)
        .bind(&sb.tenant_id)
        .bind(op.kind.as_str())
        .bind(op.state.as_str())
        .bind(&op.sandbox_id)
        .bind(idem)
        .bind(op_created_ms(op))
        .bind(&self.lease.holder)
        .bind(self.lease.until())
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(CreateRecorded::New(op.clone()))
    }

    async fn tenant_usage(&self, tenant_id: &str, now_ms: i64) -> Result<TenantUsage, StoreError> {
        let mut tx = self.pool.begin().await?;
        let usage = usage_within(&mut tx, tenant_id, now_ms).await?;
        tx.commit().await?;
        Ok(usage)
    }

    async fn get_sandbox(&self, tenant_id: &str, id: &str) -> Result<Option<SandboxRecord>, StoreError> {
        let r = sqlx::query("SELECT * FROM sandboxes WHERE tenant_id = ? AND id = ?")
            .bind(tenant_id)
            .bind(id)
            .fetch_optional(&self.pool)
            .await?;
        Ok(r.as_ref().map(sandbox_from_row))
    }

    async fn sandbox_by_id(&self, id: &str) -> Result<Option<SandboxRecord>, StoreError> {
        let r = sqlx::query("SELECT * FROM sandboxes WHERE id = ?")
            .bind(id)
            .fetch_optional(&self.pool)
            .await?;
        Ok(r.as_ref().map(sandbox_from_row))
    }

    async fn list_sandboxes(&self, tenant_id: &str, f: &SandboxFilter) -> Result<Vec<SandboxRecord>, StoreError> {
        // State, metadata, time and template are filtered here, after the SQL cursor; the page is
        // trimmed after.
        let query = if f.newest_first {
            "SELECT * FROM sandboxes WHERE tenant_id = ? AND state != 'deleted'
             AND (created_at_ms < ? OR (created_at_ms = ? AND id < ?)) ORDER BY created_at_ms DESC, id DESC"
        } else {
            "SELECT * FROM sandboxes WHERE tenant_id = ? AND state != 'deleted'
             AND (created_at_ms > ? OR (created_at_ms = ? AND id > ?)) ORDER BY created_at_ms, id"
        };
        let start = if f.newest_first {
            (i64::MAX, "~".to_string())
        } else {
            (i64::MIN, String::new())
        };
        let (after_ms, after_id) = f.after.clone().unwrap_or(start);
        let rows = sqlx::query(query)
            .bind(tenant_id)
            .bind(after_ms)
            .bind(after_ms)
            .bind(after_id)
            .fetch_all(&self.pool)
            .await?;
        Ok(rows
            .iter()
            .map(sandbox_from_row)
            .filter(|s| f.matches(s))
            .take(f.limit as usize + 1)
            .collect())
    }

    async fn live_sandboxes(&self) -> Result<Vec<SandboxRecord>, StoreError> {
        let rows = sqlx::query(&format!("SELECT * FROM sandboxes WHERE {LIVE}"))
            .fetch_all(&self.pool)
            .await?;
        Ok(rows.iter().map(sandbox_from_row).collect())
    }

    async fn running_sessions(&self) -> Result<Vec<(String, u64)>, StoreError> {
        let rows: Vec<(String, i64)> = sqlx::query_as(&format!(
            "SELECT sandbox_id, COUNT(*) FROM sessions WHERE exited = 0 \
             AND sandbox_id IN (SELECT id FROM sandboxes WHERE {LIVE}) GROUP BY sandbox_id"
        ))
        .fetch_all(&self.pool)
        .await?;
        Ok(rows.into_iter().map(|(id, n)| (id, n.max(0) as u64)).collect())
    }

    async fn count_live_sandboxes(&self, tenant_id: &str) -> Result<u32, StoreError> {
        let n: (i64,) = sqlx::query_as(&format!(
            "SELECT COUNT(*) FROM sandboxes WHERE tenant_id = ? AND {LIVE}"
        ))
        .bind(tenant_id)
        .fetch_one(&self.pool)
        .await?;
        Ok(n.0 as u32)
    }

    async fn move_starting(&self, id: &str, node: &str, budget: &NodeBudget) -> Result<bool, StoreError> {
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
        let Some(row) = sqlx::query("SELECT * FROM sandboxes WHERE id = ? AND state IN ('creating', 'resuming')")
            .bind(id)
            .fetch_optional(&mut *tx)
            .await?
        else {
            return Ok(false);
        };
        let sb = sandbox_from_row(&row);
        node_admits_within(&mut tx, &sb, node, budget).await?;
        sqlx::query("UPDATE sandboxes SET node = ? WHERE id = ?")
            .bind(node)
            .bind(id)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(true)
    }

    async fn admit_resume(&self, id: &str, node: &str, quota: &Quota, budget: &NodeBudget) -> Result<bool, StoreError> {
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
        let Some(row) = sqlx::query("SELECT * FROM sandboxes WHERE id = ? AND state = 'suspended'")
            .bind(id)
            .fetch_optional(&mut *tx)
            .await?
        else {
            return Ok(false);
        };
        let sb = sandbox_from_row(&row);
        admit_within(&mut tx, &sb.tenant_id, &sb.resources, quota, node, budget, None).await?;
        sqlx::query("UPDATE sandboxes SET state = 'resuming', node = ? WHERE id = ?")
            .bind(node)
            .bind(id)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(true)
    }

    async fn admit_suspend(&self, id: &str, quota: &Quota, budget: &NodeBudget) -> Result<bool, StoreError> {
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
        let row: Option<(String, i64, i64, String)> = sqlx::query_as(
            "SELECT tenant_id, memory_mib, saved_mib, node FROM sandboxes WHERE id = ? AND state IN ('running', 'paused')",
        )
        .bind(id)
        .fetch_optional(&mut *tx)
        .await?;
        let Some((tenant_id, memory_mib, saved_mib, node)) = row else {
            return Ok(false);
        };
        if saved_mib < memory_mib {
            let asked = (memory_mib - saved_mib).max(0) as u64;
            admit_disk_within(&mut tx, &tenant_id, asked, quota, &node, budget).await?;
            sqlx::query("UPDATE sandboxes SET saved_mib = memory_mib WHERE id = ?")
                .bind(id)
                .execute(&mut *tx)
                .await?;
            tx.commit().await?;
        }
        Ok(true)
    }

    async fn set_sandbox_state(&self, id: &str, state: SandboxState) -> Result<(), StoreError> {
        sqlx::query("UPDATE sandboxes SET state = ? WHERE id = ?")
            .bind(state.as_str())
            .bind(id)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    async fn transition_sandbox(&self, id: &str, from: &[SandboxState], to: SandboxState) -> Result<bool, StoreError> {
        // `from` holds known state names only, so listing them in the SQL is safe.
        let from: Vec<String> = from.iter().map(|s| format!("'{}'", s.as_str())).collect();
        let sql = format!(
            "UPDATE sandboxes SET state = ? WHERE id = ? AND state IN ({})",
            from.join(", ")
        );
        let done = sqlx::query(&sql).bind(to.as_str()).bind(id).execute(&self.pool).await?;
        Ok(done.rows_affected() == 1)
    }

    async fn set_sandbox_boot(&self, id: &str, booted: &crate::model::Booted) -> Result<(), StoreError> {
        sqlx::query(
            "UPDATE sandboxes SET template_digest = ?, accel = ?, started_from = ?, start_ms = ?, run = ? WHERE id = ?",
        )
        .bind(&booted.template_digest)
        .bind(&booted.accel)
        .bind(&booted.start.from)
        .bind(booted.start.ms as i64)
        .bind(&booted.run)
        .bind(id)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    async fn expired_sandboxes(&self, now: i64) -> Result<Vec<SandboxRecord>, StoreError> {
        let rows = sqlx::query(
            "SELECT * FROM sandboxes WHERE state IN ('running', 'paused', 'suspended') AND expires_at_ms <= ?",
        )
        .bind(now)
        .fetch_all(&self.pool)
        .await?;
        Ok(rows.iter().map(sandbox_from_row).collect())
    }

    async fn set_sandbox_expiry(&self, id: &str, expires_at_ms: i64) -> Result<(), StoreError> {
        sqlx::query("UPDATE sandboxes SET expires_at_ms = ? WHERE id = ?")
            .bind(expires_at_ms)
            .bind(id)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    async fn set_paused_remaining(&self, id: &str, remaining_ms: Option<i64>) -> Result<(), StoreError> {
        let q = match remaining_ms {
            Some(ms) => sqlx::query("INSERT OR REPLACE INTO paused_lifetimes (sandbox_id, remaining_ms) VALUES (?, ?)")
                .bind(id)
                .bind(ms),
            None => sqlx::query("DELETE FROM paused_lifetimes WHERE sandbox_id = ?").bind(id),
        };
        q.execute(&self.pool).await?;
        Ok(())
    }

    async fn set_sandbox_parked(&self, id: &str, parked: Option<&ParkedImage>) -> Result<(), StoreError> {
        let q = match parked {
            Some(p) => {
                sqlx::query("UPDATE sandboxes SET parked_image = ?, parked_on = ?, parked_resume = ? WHERE id = ?")
                    .bind(&p.image)
                    .bind(&p.fingerprint)
                    .bind(i32::from(p.resume))
                    .bind(id)
            }
            None => sqlx::query(
                "UPDATE sandboxes SET parked_image = NULL, parked_on = NULL, parked_resume = 0 WHERE id = ?",
            )
            .bind(id),
        };
        q.execute(&self.pool).await?;
        Ok(())
    }

    async fn sandbox_parked(&self, id: &str) -> Result<Option<ParkedImage>, StoreError> {
        let r: Option<(Option<String>, Option<String>, i32)> =
            sqlx::query_as("SELECT parked_image, parked_on, parked_resume FROM sandboxes WHERE id = ?")
                .bind(id)
                .fetch_optional(&self.pool)
                .await?;
        Ok(match r {
            Some((Some(image), fingerprint, resume)) => Some(ParkedImage {
                image,
                fingerprint: fingerprint.unwrap_or_default(),
                resume: resume != 0,
            }),
            _ => None,
        })
    }

    async fn parked_to_resume(&self) -> Result<Vec<SandboxRecord>, StoreError> {
        let rows = sqlx::query(
            "SELECT * FROM sandboxes WHERE state = 'suspended' AND parked_image IS NOT NULL AND parked_resume = 1",
        )
        .fetch_all(&self.pool)
        .await?;
        Ok(rows.iter().map(sandbox_from_row).collect())
    }

    async fn parked_of_ended(&self) -> Result<Vec<(String, String)>, StoreError> {
        Ok(sqlx::query_as(PARKED_OF_ENDED).fetch_all(&self.pool).await?)
    }

    async fn parked_images(&self) -> Result<Vec<String>, StoreError> {
        let rows: Vec<(String,)> = sqlx::query_as(PARKED_IMAGES).fetch_all(&self.pool).await?;
        Ok(rows.into_iter().map(|(image,)| image).collect())
    }

    async fn paused_remaining(&self, id: &str) -> Result<Option<i64>, StoreError> {
        let r: Option<(i64,)> = sqlx::query_as("SELECT remaining_ms FROM paused_lifetimes WHERE sandbox_id = ?")
            .bind(id)
            .fetch_optional(&self.pool)
            .await?;
        Ok(r.map(|r| r.0))
    }

    async fn set_access_hashes(&self, sandbox_id: &str, hashes: &AccessHashes) -> Result<(), StoreError> {
        sqlx::query(
            "INSERT INTO sandbox_access (sandbox_id, token_hash, traffic_hash) VALUES (?, ?, ?)
             ON CONFLICT (sandbox_id) DO UPDATE SET token_hash = excluded.token_hash, traffic_hash = excluded.traffic_hash",
        )
        .bind(sandbox_id)
        .bind(&hashes.envd)
        .bind(&hashes.traffic)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    async fn access_hashes(&self, sandbox_id: &str) -> Result<Option<AccessHashes>, StoreError> {
        let r: Option<(String, Option<String>)> =
            sqlx::query_as("SELECT token_hash, traffic_hash FROM sandbox_access WHERE sandbox_id = ?")
                .bind(sandbox_id)
                .fetch_optional(&self.pool)
                .await?;
        Ok(r.map(|(envd, traffic)| AccessHashes { envd, traffic }))
    }

    async fn sandbox_by_access_hash(
        &self,
        kind: TokenKind,
        token_hash: &str,
    ) -> Result<Option<SandboxRecord>, StoreError> {
        let sql = match kind {
            TokenKind::Envd => {
                "SELECT s.* FROM sandbox_access a JOIN sandboxes s ON s.id = a.sandbox_id WHERE a.token_hash = ?"
            }
            TokenKind::Traffic => {
                "SELECT s.* FROM sandbox_access a JOIN sandboxes s ON s.id = a.sandbox_id WHERE a.traffic_hash = ?"
            }
        };
        let r = sqlx::query(sql).bind(token_hash).fetch_optional(&self.pool).await?;
        Ok(r.as_ref().map(sandbox_from_row))
    }

    async fn insert_session(&self, s: &SessionRecord) -> Result<(), StoreError> {
        sqlx::query(
            "INSERT INTO sessions (id, sandbox_id, process_id, argv, cwd, user, pty, exit_code, signal, timed_out, exited, started_at_ms, ended_at_ms, tag)
             VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        )
        .bind(&s.id)
        .bind(&s.sandbox_id)
        .bind(s.process_id as i64)
        .bind(serde_json::to_string(&s.argv).unwrap_or_default())
        .bind(&s.cwd)
        .bind(&s.user)
        .bind(s.pty as i64)
        .bind(s.exit_code)
        .bind(s.signal)
        .bind(s.timed_out as i64)
        .bind(s.exited as i64)
        .bind(s.started_at_ms)
        .bind(s.ended_at_ms)
        .bind(&s.tag)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    async fn get_session(&self, sandbox_id: &str, id: &str) -> Result<Option<SessionRecord>, StoreError> {
        let r = sqlx::query("SELECT * FROM sessions WHERE sandbox_id = ? AND id = ?")
            .bind(sandbox_id)
            .bind(id)
            .fetch_optional(&self.pool)
            .await?;
        Ok(r.as_ref().map(session_from_row))
    }

    async fn list_sessions(&self, sandbox_id: &str) -> Result<Vec<SessionRecord>, StoreError> {
        let rows = sqlx::query("SELECT * FROM sessions WHERE sandbox_id = ? ORDER BY started_at_ms, id")
            .bind(sandbox_id)
            .fetch_all(&self.pool)
            .await?;
        Ok(rows.iter().map(session_from_row).collect())
    }

    async fn finish_session(&self, s: &SessionRecord) -> Result<(), StoreError> {
        sqlx::query(
            "UPDATE sessions SET exit_code = ?, signal = ?, timed_out = ?, exited = 1, ended_at_ms = ? WHERE id = ?",
        )
        .bind(s.exit_code)
        .bind(s.signal)
        .bind(s.timed_out as i64)
        .bind(s.ended_at_ms)
        .bind(&s.id)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    async fn session_by_process(&self, sandbox_id: &str, process_id: u64) -> Result<Option<SessionRecord>, StoreError> {
        let r = sqlx::query(
            "SELECT * FROM sessions WHERE sandbox_id = ? AND process_id = ? ORDER BY started_at_ms DESC, id DESC LIMIT 1",
        )
        .bind(sandbox_id)
        .bind(process_id as i64)
        .fetch_optional(&self.pool)
        .await?;
        Ok(r.as_ref().map(session_from_row))
    }

    async fn prune_finished_sessions(&self, sandbox_id: &str, keep: u32) -> Result<u64, StoreError> {
        let r = sqlx::query(
            "DELETE FROM sessions WHERE sandbox_id = ? AND exited = 1 AND id NOT IN (
                SELECT id FROM sessions WHERE sandbox_id = ? AND exited = 1
                ORDER BY COALESCE(ended_at_ms, started_at_ms) DESC, started_at_ms DESC, id DESC LIMIT ?)",
        )
        .bind(sandbox_id)
        .bind(sandbox_id)
        .bind(keep as i64)
        .execute(&self.pool)
        .await?;
        Ok(r.rows_affected())
    }

    async fn reserve_session_start(&self, start: &SessionStart<'_>) -> Result<Result<(), u32>, StoreError> {
        // The write lock up front: the count and the insert see one state.
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
        let reserved = reserve_session_start_in!(tx, start);
        tx.commit().await?;
        Ok(reserved)
    }

    async fn end_session_start(&self, id: &str) -> Result<(), StoreError> {
        sqlx::query(SESSION_START_END).bind(id).execute(&self.pool).await?;
        Ok(())
    }
}
