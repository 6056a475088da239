//! [`SqliteStore`]: the store in one SQLite file (WAL, a small pool), migrated on open.

use super::{
    new_key, new_tenant_id, op_created_ms, token_hash, AccessHashes, AccountStore, AuditFilter, CreateRecorded,
    E2bStore, KeyFormat, Lease, NodeBudget, OperationStore, SandboxFilter, SandboxStore, StoreError, TenantStore,
    TokenKind, DISK_HELD, HOLDS_VM, LEAD, LIVE, NODE_OBSERVATIONS, OBSERVE_NODE, RATE_WINDOW_MS,
};
use super::{
    reserve_session_start_in, SessionStart, FORGET_NODE_SEEN, PARKED_IMAGES, PARKED_OF_ENDED, SESSION_START_END,
};
use crate::model::ErrorBody;
use crate::model::{Operation, OperationKind, OperationState, Quota, Resources, SandboxState, TenantUsage};
use crate::records::{now_ms, rfc3339, AuditRecord, EgressSpec, KeyRecord, SandboxRecord, SessionRecord, Tenant};
use async_trait::async_trait;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions};
use sqlx::Row;
use std::path::Path;
use std::str::FromStr;

/// The schema's versions, `crates/server/migrations/*.sql`, embedded at build time.
static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!();

mod accounts;
mod admission;
mod sandboxes;
mod snapshots;
mod tenants;

use admission::{admit_disk_within, admit_within, node_admits_within, usage_within};

pub struct SqliteStore {
    pool: SqlitePool,
    lease: Lease,
}

impl SqliteStore {
    /// Open (or create) the database at `path` and bring its schema up to date: the embedded
    /// migrations, then the one step SQL cannot do (hashing legacy plain access tokens).
    pub async fn open(path: &Path) -> Result<Self, StoreError> {
        // The store holds key and token hashes: only the server's user reads it. Created 0600
        // before SQLite opens it (SQLite gives its -wal and -shm files the database's mode), and
        // an existing file (and its -wal/-shm) is tightened.
        private_files(path)?;
        let opts = SqliteConnectOptions::from_str(&format!("sqlite://{}", path.display()))?
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .busy_timeout(std::time::Duration::from_secs(5));
        let pool = SqlitePoolOptions::new().max_connections(4).connect_with(opts).await?;
        MIGRATOR.run(&pool).await?;
        let store = Self {
            pool,
            lease: Lease::local(),
        };
        store.hash_legacy_tokens().await?;
        // Only chmod now: opening (and closing) the file outside SQLite while the pool has it
        // open would drop this process's POSIX locks on it, and another process closing its
        // connection would then think it is the last and delete the -wal and -shm under us.
        tighten(path)?;
        Ok(store)
    }

    /// The same store, leasing the operations it records as `lease` (one of many replicas on
    /// one file, as tests run them; a server alone on its data dir keeps [`Lease::LOCAL`]).
    pub fn with_lease(mut self, lease: Lease) -> Self {
        self.lease = lease;
        self
    }

    /// Move the plain tokens of the pre-migration `sandbox_tokens` table into `sandbox_access`
    /// as hashes and drop the table, in one transaction; nothing to do once it is gone.
    async fn hash_legacy_tokens(&self) -> Result<(), StoreError> {
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
        let legacy: Option<(String,)> =
            sqlx::query_as("SELECT name FROM sqlite_master WHERE type = 'table' AND name = 'sandbox_tokens'")
                .fetch_optional(&mut *tx)
                .await?;
        if legacy.is_none() {
            return Ok(());
        }
        let rows: Vec<(String, String)> = sqlx::query_as("SELECT sandbox_id, token FROM sandbox_tokens")
            .fetch_all(&mut *tx)
            .await?;
        for (sandbox_id, token) in &rows {
            sqlx::query("INSERT OR REPLACE INTO sandbox_access (sandbox_id, token_hash) VALUES (?, ?)")
                .bind(sandbox_id)
                .bind(token_hash(token))
                .execute(&mut *tx)
                .await?;
        }
        sqlx::query("DROP TABLE sandbox_tokens").execute(&mut *tx).await?;
        tx.commit().await?;
        if !rows.is_empty() {
            tracing::info!("hashed {} sandbox access tokens into sandbox_access", rows.len());
        }
        Ok(())
    }
}

fn op_from_row(r: &sqlx::sqlite::SqliteRow) -> Operation {
    let code: Option<String> = r.get("error_code");
    let message: Option<String> = r.get("error_message");
    let finished: Option<i64> = r.get("finished_at_ms");
    Operation {
        id: r.get("id"),
        kind: OperationKind::parse(r.get::<&str, _>("kind")).unwrap_or(OperationKind::Create),
        state: OperationState::parse(r.get::<&str, _>("state")).unwrap_or(OperationState::Failed),
        sandbox_id: r.get("sandbox_id"),
        error: code.map(|code| ErrorBody {
            code,
            message: message.unwrap_or_default(),
        }),
        created_at: rfc3339(r.get("created_at_ms")),
        finished_at: finished.map(rfc3339),
    }
}

fn sandbox_from_row(r: &sqlx::sqlite::SqliteRow) -> SandboxRecord {
    SandboxRecord {
        id: r.get("id"),
        tenant_id: r.get("tenant_id"),
        state: SandboxState::parse(r.get::<&str, _>("state")).unwrap_or(SandboxState::Failed),
        template: r.get("template"),
        template_digest: r.get("template_digest"),
        runtime: r.get("runtime"),
        accel: r.get("accel"),
        resources: Resources {
            vcpu: r.get::<i64, _>("vcpu") as u32,
            memory_mib: r.get::<i64, _>("memory_mib") as u32,
            disk_mib: r.get::<i64, _>("disk_mib") as u32,
        },
        env: serde_json::from_str(r.get::<&str, _>("env")).unwrap_or_default(),
        metadata: serde_json::from_str(r.get::<&str, _>("metadata")).unwrap_or_default(),
        created_at_ms: r.get("created_at_ms"),
        expires_at_ms: r.get("expires_at_ms"),
        egress: egress_from_row(r),
        lifecycle: crate::model::Lifecycle {
            on_timeout: match r.get::<&str, _>("on_timeout") {
                "suspend" => crate::model::OnTimeout::Suspend,
                _ => crate::model::OnTimeout::Delete,
            },
            auto_resume: r.get::<i64, _>("auto_resume") != 0,
        },
        timeout_ms: r.get("timeout_ms"),
        image_id: r.get("image_id"),
        node: r.get("node"),
        run: r.get("run"),
        start: r
            .get::<Option<String>, _>("started_from")
            .map(|from| crate::model::SandboxStart {
                from,
                ms: r.get::<Option<i64>, _>("start_ms").unwrap_or(0).max(0) as u64,
            }),
    }
}

/// A sandbox's recorded egress; a record that no longer parses reads as sealed (fails closed).
fn egress_from_row(r: &sqlx::sqlite::SqliteRow) -> EgressSpec {
    let id: &str = r.get("id");
    let profiles = serde_json::from_str(r.get::<&str, _>("egress_profiles"));
    let tenant = airlock_egress::TenantPolicy::from_json(r.get::<&str, _>("egress_policy"));
    match (profiles, tenant) {
        (Ok(profiles), Ok(tenant)) => EgressSpec {
            profiles,
            sealed: r.get::<i64, _>("egress_sealed") != 0,
            tenant,
        },
        (p, t) => {
            tracing::error!(sandbox = %id, "its egress record does not parse ({:?}, {:?}); treating it as sealed", p.err(), t.err());
            EgressSpec::default()
        }
    }
}

fn session_from_row(r: &sqlx::sqlite::SqliteRow) -> SessionRecord {
    SessionRecord {
        id: r.get("id"),
        sandbox_id: r.get("sandbox_id"),
        process_id: r.get::<i64, _>("process_id") as u64,
        argv: serde_json::from_str(r.get::<&str, _>("argv")).unwrap_or_default(),
        cwd: r.get("cwd"),
        user: r.get("user"),
        pty: r.get::<i64, _>("pty") != 0,
        exit_code: r.get::<Option<i64>, _>("exit_code").map(|v| v as i32),
        signal: r.get::<Option<i64>, _>("signal").map(|v| v as i32),
        timed_out: r.get::<i64, _>("timed_out") != 0,
        exited: r.get::<i64, _>("exited") != 0,
        started_at_ms: r.get("started_at_ms"),
        ended_at_ms: r.get("ended_at_ms"),
        tag: r.get("tag"),
    }
}

/// Make the database file (creating it empty if missing) and its -wal and -shm files 0600.
/// Only before SQLite opens the file (see `open`).
fn private_files(path: &Path) -> Result<(), StoreError> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(path)
        .map_err(|e| io_error(path, e))?;
    tighten(path)
}

fn io_error(p: &Path, e: std::io::Error) -> StoreError {
    StoreError::backend(std::io::Error::new(e.kind(), format!("{}: {e}", p.display())))
}

/// chmod 0600 the database and its -wal and -shm files; never opens them.
fn tighten(path: &Path) -> Result<(), StoreError> {
    use std::os::unix::fs::PermissionsExt;
    for suffix in ["", "-wal", "-shm"] {
        let mut p = path.as_os_str().to_owned();
        p.push(suffix);
        let p = std::path::PathBuf::from(p);
        match std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(io_error(&p, e)),
        }
    }
    Ok(())
}

/// Record `key`'s hash for `tenant` (created if new), inside the caller's transaction.
async fn insert_key(tx: &mut sqlx::Transaction<'_, sqlx::Sqlite>, tenant: &str, key: &str) -> Result<(), StoreError> {
    let row: Option<(String,)> = sqlx::query_as("SELECT id FROM tenants WHERE name = ?")
        .bind(tenant)
        .fetch_optional(&mut **tx)
        .await?;
    let tenant_id = match row {
        Some((id,)) => id,
        None => {
            let id = new_tenant_id(tenant);
            sqlx::query("INSERT INTO tenants (id, name, created_at_ms) VALUES (?, ?, ?)")
                .bind(&id)
                .bind(tenant)
                .bind(now_ms())
                .execute(&mut **tx)
                .await?;
            id
        }
    };
    insert_key_row(tx, &tenant_id, key, "").await?;
    Ok(())
}

async fn insert_key_row(
    tx: &mut sqlx::Transaction<'_, sqlx::Sqlite>,
    tenant_id: &str,
    key: &str,
    name: &str,
) -> Result<KeyRecord, StoreError> {
    let hash = token_hash(key);
    let record = KeyRecord {
        id: super::key_id_of(key),
        tenant_id: tenant_id.into(),
        name: name.into(),
        prefix: key.get(..8).unwrap_or(key).into(),
        created_at_ms: now_ms(),
        last_used_at_ms: None,
        revoked_at_ms: None,
    };
    sqlx::query("INSERT INTO api_keys (hash, tenant_id, prefix, created_at_ms, id, name) VALUES (?, ?, ?, ?, ?, ?)")
        .bind(&hash)
        .bind(tenant_id)
        .bind(&record.prefix)
        .bind(record.created_at_ms)
        .bind(&record.id)
        .bind(name)
        .execute(&mut **tx)
        .await?;
    Ok(record)
}

fn key_from_row(r: &sqlx::sqlite::SqliteRow) -> Result<KeyRecord, StoreError> {
    Ok(KeyRecord {
        id: r.try_get("id")?,
        tenant_id: r.try_get("tenant_id")?,
        name: r.try_get("name")?,
        prefix: r.try_get("prefix")?,
        created_at_ms: r.try_get("created_at_ms")?,
        last_used_at_ms: r.try_get("last_used_at_ms")?,
        revoked_at_ms: r.try_get("revoked_at_ms")?,
    })
}

#[async_trait]
impl OperationStore for SqliteStore {
    async fn insert_operation(&self, tenant_id: &str, op: &Operation) -> Result<(), StoreError> {
        sqlx::query(
            "INSERT INTO operations (id, tenant_id, kind, state, sandbox_id, created_at_ms, lease_holder, lease_until_ms) \
             VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
        )
        .bind(&op.id)
        .bind(tenant_id)
        .bind(op.kind.as_str())
        .bind(op.state.as_str())
        .bind(&op.sandbox_id)
        .bind(op_created_ms(op))
        .bind(&self.lease.holder)
        .bind(self.lease.until())
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    async fn get_operation(&self, tenant_id: &str, id: &str) -> Result<Option<Operation>, StoreError> {
        let r = sqlx::query("SELECT * FROM operations WHERE tenant_id = ? AND id = ?")
            .bind(tenant_id)
            .bind(id)
            .fetch_optional(&self.pool)
            .await?;
        Ok(r.as_ref().map(op_from_row))
    }

    async fn operation_by_id(&self, id: &str) -> Result<Option<Operation>, StoreError> {
        let r = sqlx::query("SELECT * FROM operations WHERE id = ?")
            .bind(id)
            .fetch_optional(&self.pool)
            .await?;
        Ok(r.as_ref().map(op_from_row))
    }

    async fn operation_by_idempotency_key(&self, tenant_id: &str, key: &str) -> Result<Option<Operation>, StoreError> {
        let r = sqlx::query("SELECT * FROM operations WHERE tenant_id = ? AND idempotency_key = ?")
            .bind(tenant_id)
            .bind(key)
            .fetch_optional(&self.pool)
            .await?;
        Ok(r.as_ref().map(op_from_row))
    }

    async fn finish_operation(
        &self,
        id: &str,
        state: OperationState,
        error: Option<&ErrorBody>,
    ) -> Result<bool, StoreError> {
        let done = sqlx::query(
            "UPDATE operations SET state = ?, error_code = ?, error_message = ?, finished_at_ms = ? \
             WHERE id = ? AND lease_holder = ?",
        )
        .bind(state.as_str())
        .bind(error.map(|e| e.code.clone()))
        .bind(error.map(|e| e.message.clone()))
        .bind(now_ms())
        .bind(id)
        .bind(&self.lease.holder)
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected() == 1)
    }

    async fn set_operation_state(&self, id: &str, state: OperationState) -> Result<(), StoreError> {
        sqlx::query("UPDATE operations SET state = ? WHERE id = ?")
            .bind(state.as_str())
            .bind(id)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    async fn unfinished_operations(&self) -> Result<Vec<Operation>, StoreError> {
        let rows = sqlx::query("SELECT * FROM operations WHERE state IN ('pending', 'running') ORDER BY created_at_ms")
            .fetch_all(&self.pool)
            .await?;
        Ok(rows.iter().map(op_from_row).collect())
    }

    async fn open_delete_operation(&self, sandbox_id: &str) -> Result<Option<Operation>, StoreError> {
        let r = sqlx::query(
            "SELECT * FROM operations WHERE sandbox_id = ? AND kind = 'delete' ORDER BY created_at_ms DESC LIMIT 1",
        )
        .bind(sandbox_id)
        .fetch_optional(&self.pool)
        .await?;
        Ok(r.as_ref().map(op_from_row))
    }

    async fn claim_operations(&self, own_too: bool) -> Result<Vec<super::Claimed>, StoreError> {
        let now = now_ms();
        let mut rows = sqlx::query(
            "UPDATE operations SET lease_holder = ?1, lease_until_ms = ?2, lease_epoch = lease_epoch + 1 \
             WHERE state IN ('pending', 'running') AND (lease_until_ms < ?3 OR (?4 AND lease_holder = ?1)) \
             RETURNING *",
        )
        .bind(&self.lease.holder)
        .bind(now + self.lease.ms)
        .bind(now)
        .bind(own_too)
        .fetch_all(&self.pool)
        .await?;
        rows.sort_by_key(|r| r.get::<i64, _>("created_at_ms"));
        Ok(rows
            .iter()
            .map(|r| super::Claimed {
                op: op_from_row(r),
                epoch: r.get("lease_epoch"),
            })
            .collect())
    }

    fn lease(&self) -> &Lease {
        &self.lease
    }

    async fn lead(&self, duty: &str) -> Result<bool, StoreError> {
        let now = now_ms();
        let done = sqlx::query(LEAD)
            .bind(duty)
            .bind(&self.lease.holder)
            .bind(now + self.lease.ms)
            .bind(now)
            .execute(&self.pool)
            .await?;
        Ok(done.rows_affected() == 1)
    }

    async fn observe_node(&self, node: &str, answered: bool, now_ms: i64) -> Result<(), StoreError> {
        sqlx::query(OBSERVE_NODE)
            .bind(node)
            .bind(&self.lease.holder)
            .bind(now_ms)
            .bind((!answered).then_some(now_ms))
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    async fn node_observations(&self, since_ms: i64) -> Result<Vec<super::NodeSeen>, StoreError> {
        let rows: Vec<(String, String, Option<i64>)> = sqlx::query_as(NODE_OBSERVATIONS)
            .bind(since_ms)
            .fetch_all(&self.pool)
            .await?;
        Ok(rows
            .into_iter()
            .map(|(node, replica, unanswered_since_ms)| super::NodeSeen {
                node,
                replica,
                unanswered_since_ms,
            })
            .collect())
    }

    async fn forget_node_observations(&self, before_ms: i64) -> Result<u64, StoreError> {
        let done = sqlx::query(FORGET_NODE_SEEN)
            .bind(before_ms)
            .execute(&self.pool)
            .await?;
        Ok(done.rows_affected())
    }

    async fn renew_leases(&self, ids: &[String]) -> Result<(), StoreError> {
        if ids.is_empty() {
            return Ok(());
        }
        sqlx::query(
            "UPDATE operations SET lease_until_ms = ? \
             WHERE lease_holder = ? AND id IN (SELECT value FROM json_each(?))",
        )
        .bind(self.lease.until())
        .bind(&self.lease.holder)
        .bind(serde_json::to_string(ids).unwrap_or_default())
        .execute(&self.pool)
        .await?;
        Ok(())
    }
}

#[async_trait]
impl E2bStore for SqliteStore {
    async fn set_e2b_alias(&self, sandbox_id: &str, alias: &str) -> Result<(), StoreError> {
        sqlx::query(
            "INSERT INTO e2b_sandboxes (sandbox_id, template_alias) VALUES (?, ?)
             ON CONFLICT (sandbox_id) DO UPDATE SET template_alias = excluded.template_alias",
        )
        .bind(sandbox_id)
        .bind(alias)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    async fn e2b_alias(&self, sandbox_id: &str) -> Result<Option<String>, StoreError> {
        let r: Option<(String,)> = sqlx::query_as("SELECT template_alias FROM e2b_sandboxes WHERE sandbox_id = ?")
            .bind(sandbox_id)
            .fetch_optional(&self.pool)
            .await?;
        Ok(r.map(|r| r.0))
    }
}

super::builds::impl_build_store!(SqliteStore);
super::volumes::impl_volume_store!(SqliteStore);
super::scrape_tokens::impl_scrape_token_store!(SqliteStore);
super::events::impl_event_store!(SqliteStore);
