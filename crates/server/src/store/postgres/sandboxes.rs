//! [`SandboxStore`] on Postgres: sandboxes (a create's, a resume's and a suspend's atomic
//! admission through `admission`), their access hashes and sessions. Uses the row helpers and the
//! `LIVE` states of `super`.

use super::*;
use crate::records::ParkedImage;

#[async_trait]
impl SandboxStore for PgStore {
    async fn insert_create_within(
        &self,
        sb: &SandboxRecord,
        op: &Operation,
        idem: Option<&str>,
        quota: &Quota,
        budget: &NodeBudget,
    ) -> Result<CreateRecorded, StoreError> {
        // The write lock first, so the idempotency lookup, the live count and the inserts see
        // one state no other admission can change in between: concurrent creates (from any host
        // sharing the database) queue here instead of overshooting the limit.
        let mut tx = self.begin_locked().await?;
        if let Some(key) = idem {
            let prior = sqlx::query("SELECT * FROM operations WHERE tenant_id = $1 AND idempotency_key = $2")
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
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11::jsonb, $12::jsonb, $13, $14, $15::jsonb, $16, $17::jsonb, $18, $19, $20, $21, $22, $23)",
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
        .bind(sb.egress.sealed)
        .bind(sb.egress.tenant.to_json())
        .bind(sb.lifecycle.on_timeout.as_str())
        .bind(sb.lifecycle.auto_resume)
        .bind(sb.timeout_ms)
        .bind(&sb.image_id)
        .bind(saved_mib as i64)
        .bind(&sb.node)
        .execute(&mut *tx)
        .await?;
        sqlx::query(
            "INSERT INTO operations (id, tenant_id, kind, state, sandbox_id, idempotency_key, created_at_ms, \
             lease_holder, lease_until_ms) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)",
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
        // One snapshot for the three sums.
        let mut tx = self.pool.begin().await?;
        sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
            .execute(&mut *tx)
            .await?;
        let usage = usage_within(&mut tx, tenant_id, now_ms).await?;
        tx.commit().await?;
        Ok(usage)
    }

    async fn get_sandbox(&self, tenant_id: &str, id: &str) -> Result<Option<SandboxRecord>, StoreError> {
        let r = sqlx::query("SELECT * FROM sandboxes WHERE tenant_id = $1 AND id = $2")
            .bind(tenant_id)
            .bind(id)
            .fetch_optional(&self.pool)
            .await?;
        Ok(r.as_ref().map(sandbox_from_row))
    }

    async fn sandbox_by_id(&self, id: &str) -> Result<Option<SandboxRecord>, StoreError> {
        let r = sqlx::query("SELECT * FROM sandboxes WHERE id = $1")
            .bind(id)
            .fetch_optional(&self.pool)
            .await?;
        Ok(r.as_ref().map(sandbox_from_row))
    }

    async fn list_sandboxes(&self, tenant_id: &str, f: &SandboxFilter) -> Result<Vec<SandboxRecord>, StoreError> {
        // State, metadata, time and template are filtered here, after the SQL cursor; the page is
        // trimmed after.
        let query = if f.newest_first {
            "SELECT * FROM sandboxes WHERE tenant_id = $1 AND state != 'deleted'
             AND (created_at_ms < $2 OR (created_at_ms = $2 AND id < $3)) ORDER BY created_at_ms DESC, id DESC"
        } else {
            "SELECT * FROM sandboxes WHERE tenant_id = $1 AND state != 'deleted'
             AND (created_at_ms > $2 OR (created_at_ms = $2 AND id > $3)) ORDER BY created_at_ms, id"
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
            "SELECT sandbox_id, COUNT(*) FROM sessions WHERE NOT exited \
             AND sandbox_id IN (SELECT id FROM sandboxes WHERE {LIVE}) GROUP BY sandbox_id"
        ))
        .fetch_all(&self.pool)
        .await?;
        Ok(rows.into_iter().map(|(id, n)| (id, n.max(0) as u64)).collect())
    }

    async fn count_live_sandboxes(&self, tenant_id: &str) -> Result<u32, StoreError> {
        let n: (i64,) = sqlx::query_as(&format!(
            "SELECT COUNT(*) FROM sandboxes WHERE tenant_id = $1 AND {LIVE}"
        ))
        .bind(tenant_id)
        .fetch_one(&self.pool)
        .await?;
        Ok(n.0 as u32)
    }

    async fn move_starting(&self, id: &str, node: &str, budget: &NodeBudget) -> Result<bool, StoreError> {
        let mut tx = self.begin_locked().await?;
        let Some(row) = sqlx::query("SELECT * FROM sandboxes WHERE id = $1 AND state IN ('creating', 'resuming')")
            .bind(id)
            .fetch_optional(&mut *tx)
            .await?
        else {
            return Ok(false);
        };
        let sb = sandbox_from_row(&row);
        node_admits_within(&mut tx, &sb, node, budget).await?;
        sqlx::query("UPDATE sandboxes SET node = $1 WHERE id = $2")
            .bind(node)
            .bind(id)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(true)
    }

    async fn admit_resume(&self, id: &str, node: &str, quota: &Quota, budget: &NodeBudget) -> Result<bool, StoreError> {
        let mut tx = self.begin_locked().await?;
        let Some(row) = sqlx::query("SELECT * FROM sandboxes WHERE id = $1 AND state = 'suspended'")
            .bind(id)
            .fetch_optional(&mut *tx)
            .await?
        else {
            return Ok(false);
        };
        let sb = sandbox_from_row(&row);
        admit_within(&mut tx, &sb.tenant_id, &sb.resources, quota, node, budget, None).await?;
        sqlx::query("UPDATE sandboxes SET state = 'resuming', node = $1 WHERE id = $2")
            .bind(node)
            .bind(id)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(true)
    }

    async fn admit_suspend(&self, id: &str, quota: &Quota, budget: &NodeBudget) -> Result<bool, StoreError> {
        let mut tx = self.begin_locked().await?;
        let row: Option<(String, i64, i64, String)> = sqlx::query_as(
            "SELECT tenant_id, memory_mib, saved_mib, node FROM sandboxes WHERE id = $1 AND state IN ('running', 'paused')",
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
            sqlx::query("UPDATE sandboxes SET saved_mib = memory_mib WHERE id = $1")
                .bind(id)
                .execute(&mut *tx)
                .await?;
            tx.commit().await?;
        }
        Ok(true)
    }

    async fn set_sandbox_state(&self, id: &str, state: SandboxState) -> Result<(), StoreError> {
        sqlx::query("UPDATE sandboxes SET state = $1 WHERE id = $2")
            .bind(state.as_str())
            .bind(id)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    async fn transition_sandbox(&self, id: &str, from: &[SandboxState], to: SandboxState) -> Result<bool, StoreError> {
        let from: Vec<&str> = from.iter().map(|s| s.as_str()).collect();
        let done = sqlx::query("UPDATE sandboxes SET state = $1 WHERE id = $2 AND state = ANY($3)")
            .bind(to.as_str())
            .bind(id)
            .bind(&from)
            .execute(&self.pool)
            .await?;
        Ok(done.rows_affected() == 1)
    }

    async fn set_sandbox_boot(&self, id: &str, booted: &crate::model::Booted) -> Result<(), StoreError> {
        sqlx::query(
            "UPDATE sandboxes SET template_digest = $1, accel = $2, started_from = $3, start_ms = $4, run = $5 WHERE id = $6",
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
            "SELECT * FROM sandboxes WHERE state IN ('running', 'paused', 'suspended') AND expires_at_ms <= $1",
        )
        .bind(now)
        .fetch_all(&self.pool)
        .await?;
        Ok(rows.iter().map(sandbox_from_row).collect())
    }

    async fn set_sandbox_expiry(&self, id: &str, expires_at_ms: i64) -> Result<(), StoreError> {
        sqlx::query("UPDATE sandboxes SET expires_at_ms = $1 WHERE id = $2")
            .bind(expires_at_ms)
            .bind(id)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    async fn set_paused_remaining(&self, id: &str, remaining_ms: Option<i64>) -> Result<(), StoreError> {
        let q = match remaining_ms {
            Some(ms) => sqlx::query(
                "INSERT INTO paused_lifetimes (sandbox_id, remaining_ms) VALUES ($1, $2)
                 ON CONFLICT (sandbox_id) DO UPDATE SET remaining_ms = excluded.remaining_ms",
            )
            .bind(id)
            .bind(ms),
            None => sqlx::query("DELETE FROM paused_lifetimes WHERE sandbox_id = $1").bind(id),
        };
        q.execute(&self.pool).await?;
        Ok(())
    }

    async fn set_sandbox_parked(&self, id: &str, parked: Option<&ParkedImage>) -> Result<(), StoreError> {
        let q = match parked {
            Some(p) => {
                sqlx::query("UPDATE sandboxes SET parked_image = $1, parked_on = $2, parked_resume = $3 WHERE id = $4")
                    .bind(&p.image)
                    .bind(&p.fingerprint)
                    .bind(i32::from(p.resume))
                    .bind(id)
            }
            None => sqlx::query(
                "UPDATE sandboxes SET parked_image = NULL, parked_on = NULL, parked_resume = 0 WHERE id = $1",
            )
            .bind(id),
        };
        q.execute(&self.pool).await?;
        Ok(())
    }

    async fn sandbox_parked(&self, id: &str) -> Result<Option<ParkedImage>, StoreError> {
        let r: Option<(Option<String>, Option<String>, i32)> =
            sqlx::query_as("SELECT parked_image, parked_on, parked_resume FROM sandboxes WHERE id = $1")
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
        let r: Option<(i64,)> = sqlx::query_as("SELECT remaining_ms FROM paused_lifetimes WHERE sandbox_id = $1")
            .bind(id)
            .fetch_optional(&self.pool)
            .await?;
        Ok(r.map(|r| r.0))
    }

    async fn set_access_hashes(&self, sandbox_id: &str, hashes: &AccessHashes) -> Result<(), StoreError> {
        sqlx::query(
            "INSERT INTO sandbox_access (sandbox_id, token_hash, traffic_hash) VALUES ($1, $2, $3)
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
            sqlx::query_as("SELECT token_hash, traffic_hash FROM sandbox_access WHERE sandbox_id = $1")
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
                "SELECT s.* FROM sandbox_access a JOIN sandboxes s ON s.id = a.sandbox_id WHERE a.token_hash = $1"
            }
            TokenKind::Traffic => {
                "SELECT s.* FROM sandbox_access a JOIN sandboxes s ON s.id = a.sandbox_id WHERE a.traffic_hash = $1"
            }
        };
        let r = sqlx::query(sql).bind(token_hash).fetch_optional(&self.pool).await?;
        Ok(r.as_ref().map(sandbox_from_row))
    }

    async fn insert_session(&self, s: &SessionRecord) -> Result<(), StoreError> {
        sqlx::query(
            "INSERT INTO sessions (id, sandbox_id, process_id, argv, cwd, \"user\", pty, exit_code, signal, timed_out, exited, started_at_ms, ended_at_ms, tag)
             VALUES ($1, $2, $3, $4::jsonb, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14)",
        )
        .bind(&s.id)
        .bind(&s.sandbox_id)
        .bind(s.process_id as i64)
        .bind(serde_json::to_string(&s.argv).unwrap_or_default())
        .bind(&s.cwd)
        .bind(&s.user)
        .bind(s.pty)
        .bind(s.exit_code)
        .bind(s.signal)
        .bind(s.timed_out)
        .bind(s.exited)
        .bind(s.started_at_ms)
        .bind(s.ended_at_ms)
        .bind(&s.tag)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    async fn get_session(&self, sandbox_id: &str, id: &str) -> Result<Option<SessionRecord>, StoreError> {
        let r = sqlx::query("SELECT * FROM sessions WHERE sandbox_id = $1 AND id = $2")
            .bind(sandbox_id)
            .bind(id)
            .fetch_optional(&self.pool)
            .await?;
        Ok(r.as_ref().map(session_from_row))
    }

    async fn list_sessions(&self, sandbox_id: &str) -> Result<Vec<SessionRecord>, StoreError> {
        let rows = sqlx::query("SELECT * FROM sessions WHERE sandbox_id = $1 ORDER BY started_at_ms, id")
            .bind(sandbox_id)
            .fetch_all(&self.pool)
            .await?;
        Ok(rows.iter().map(session_from_row).collect())
    }

    async fn finish_session(&self, s: &SessionRecord) -> Result<(), StoreError> {
        sqlx::query(
            "UPDATE sessions SET exit_code = $1, signal = $2, timed_out = $3, exited = TRUE, ended_at_ms = $4 WHERE id = $5",
        )
        .bind(s.exit_code)
        .bind(s.signal)
        .bind(s.timed_out)
        .bind(s.ended_at_ms)
        .bind(&s.id)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    async fn session_by_process(&self, sandbox_id: &str, process_id: u64) -> Result<Option<SessionRecord>, StoreError> {
        let r = sqlx::query(
            "SELECT * FROM sessions WHERE sandbox_id = $1 AND process_id = $2 ORDER BY started_at_ms DESC, id DESC LIMIT 1",
        )
        .bind(sandbox_id)
        .bind(process_id as i64)
        .fetch_optional(&self.pool)
        .await?;
        Ok(r.as_ref().map(session_from_row))
    }

    async fn prune_finished_sessions(&self, sandbox_id: &str, keep: u32) -> Result<u64, StoreError> {
        let r = sqlx::query(
            "DELETE FROM sessions WHERE sandbox_id = $1 AND exited AND id NOT IN (
                SELECT id FROM sessions WHERE sandbox_id = $1 AND exited
                ORDER BY COALESCE(ended_at_ms, started_at_ms) DESC, started_at_ms DESC, id DESC LIMIT $2)",
        )
        .bind(sandbox_id)
        .bind(keep as i64)
        .execute(&self.pool)
        .await?;
        Ok(r.rows_affected())
    }

    async fn reserve_session_start(&self, start: &SessionStart<'_>) -> Result<Result<(), u32>, StoreError> {
        // This sandbox's starts queue here (its own lock, not the store's write lock: starts
        // of other sandboxes go on), so the count and the insert see one state.
        let mut tx = self.pool.begin().await?;
        sqlx::query("SELECT pg_advisory_xact_lock($1, hashtext($2))")
            .bind(SESSION_STARTS_LOCK)
            .bind(start.sandbox_id)
            .execute(&mut *tx)
            .await?;
        let reserved = reserve_session_start_in!(tx, start);
        tx.commit().await?;
        Ok(reserved)
    }

    async fn end_session_start(&self, id: &str) -> Result<(), StoreError> {
        sqlx::query(SESSION_START_END).bind(id).execute(&self.pool).await?;
        Ok(())
    }
}
