//! [`SqliteStore`]: the store in one SQLite file (WAL, a small pool), migrated on open.

use super::{
    new_key, token_hash, AccessHashes, AccountStore, AuditFilter, CreateRecorded, E2bStore, KeyFormat, NodeBudget,
    OperationStore, SandboxFilter, SandboxStore, StoreError, TenantStore, TokenKind,
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

mod admission;
mod snapshots;

use admission::{admit_disk_within, admit_within, usage_within};

/// `state IN (...)` of the states of a sandbox that exists, written from
/// [`crate::records::LIVE_STATES`] (its one definition) wherever a query says `{LIVE}`.
const LIVE: LiveStates = LiveStates;

struct LiveStates;

impl std::fmt::Display for LiveStates {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("state IN (")?;
        for (i, s) in crate::records::LIVE_STATES.iter().enumerate() {
            let sep = if i == 0 { "" } else { ", " };
            write!(f, "{sep}'{}'", s.as_str())?;
        }
        f.write_str(")")
    }
}
/// Per row of a live sandbox: 1 unless it is suspended (no VM: it holds its disk, no place, CPU
/// or memory), for the sums of what counts against quotas and budgets.
const HOLDS_VM: &str = "(CASE WHEN state = 'suspended' THEN 0 ELSE 1 END)";
/// Per row of a live sandbox: the disk it holds, its overlay at full size plus the memory a
/// suspend saved (or will: see `saved_mib`, migration 0012).
const DISK_HELD: &str = "(disk_mib + saved_mib)";
/// The window `creates_per_minute` counts in.
const RATE_WINDOW_MS: i64 = 60_000;

impl From<sqlx::Error> for StoreError {
    fn from(e: sqlx::Error) -> Self {
        StoreError::backend(e)
    }
}

impl From<sqlx::migrate::MigrateError> for StoreError {
    fn from(e: sqlx::migrate::MigrateError) -> Self {
        StoreError::backend(e)
    }
}

pub struct SqliteStore {
    pool: SqlitePool,
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
        let store = Self { pool };
        store.hash_legacy_tokens().await?;
        // Only chmod now: opening (and closing) the file outside SQLite while the pool has it
        // open would drop this process's POSIX locks on it, and another process closing its
        // connection would then think it is the last and delete the -wal and -shm under us.
        tighten(path)?;
        Ok(store)
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

fn op_created_ms(op: &Operation) -> i64 {
    humantime::parse_rfc3339(&op.created_at)
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map(|d| d.as_millis() as i64)
        .unwrap_or_else(now_ms)
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

/// A new tenant's id: opaque (`tn_` + 16 random hex), never its name, so a tenant made later
/// under a deleted one's name shares nothing recorded under the old id. The bootstrap tenant
/// `default` keeps the id `default` (stores before this had it; it can't be deleted).
fn new_tenant_id(name: &str) -> String {
    if name == "default" {
        return name.into();
    }
    format!("tn_{}", airlock_runtime::datadir::random_hex(8))
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
            "SELECT sandboxes, vcpu, memory_mib, disk_mib, sessions_per_sandbox, creates_per_minute
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
        })
    }

    async fn set_quota(&self, tenant_id: &str, q: &Quota) -> Result<(), StoreError> {
        let big = |v: Option<u64>| v.map(|v| v.min(i64::MAX as u64) as i64);
        sqlx::query(
            "INSERT INTO tenant_quotas (tenant_id, sandboxes, vcpu, memory_mib, disk_mib, sessions_per_sandbox,
                                        creates_per_minute, updated_at_ms) VALUES (?, ?, ?, ?, ?, ?, ?, ?)
             ON CONFLICT (tenant_id) DO UPDATE SET sandboxes = excluded.sandboxes, vcpu = excluded.vcpu,
               memory_mib = excluded.memory_mib, disk_mib = excluded.disk_mib,
               sessions_per_sandbox = excluded.sessions_per_sandbox,
               creates_per_minute = excluded.creates_per_minute, updated_at_ms = excluded.updated_at_ms",
        )
        .bind(tenant_id)
        .bind(q.sandboxes.map(i64::from))
        .bind(big(q.vcpu))
        .bind(big(q.memory_mib))
        .bind(big(q.disk_mib))
        .bind(q.sessions_per_sandbox.map(i64::from))
        .bind(q.creates_per_minute.map(i64::from))
        .bind(now_ms())
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
        admit_within(&mut tx, &sb.tenant_id, &sb.resources, quota, budget, Some(disk)).await?;
        sqlx::query(
            "INSERT INTO sandboxes (id, tenant_id, state, template, template_digest, runtime, accel, vcpu, memory_mib, disk_mib, env, metadata, created_at_ms, expires_at_ms, egress_profiles, egress_sealed, egress_policy, on_timeout, auto_resume, timeout_ms, image_id, saved_mib)
             VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
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
        .execute(&mut *tx)
        .await?;
        sqlx::query(
            "INSERT INTO operations (id, tenant_id, kind, state, sandbox_id, idempotency_key, created_at_ms) VALUES (?, ?, ?, ?, ?, ?, ?)",
        )
        .bind(&op.id)
        .bind(&sb.tenant_id)
        .bind(op.kind.as_str())
        .bind(op.state.as_str())
        .bind(&op.sandbox_id)
        .bind(idem)
        .bind(op_created_ms(op))
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
            .filter(|s| f.states.is_empty() || f.states.contains(&s.state))
            .filter(|s| f.metadata.iter().all(|(k, v)| s.metadata.get(k) == Some(v)))
            .filter(|s| f.created_from_ms.is_none_or(|t| s.created_at_ms >= t))
            .filter(|s| f.created_before_ms.is_none_or(|t| s.created_at_ms < t))
            .filter(|s| f.templates.is_empty() || f.templates.contains(&s.template))
            .take(f.limit as usize + 1)
            .collect())
    }

    async fn live_sandboxes(&self) -> Result<Vec<SandboxRecord>, StoreError> {
        let rows = sqlx::query(&format!("SELECT * FROM sandboxes WHERE {LIVE}"))
            .fetch_all(&self.pool)
            .await?;
        Ok(rows.iter().map(sandbox_from_row).collect())
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

    async fn admit_resume(&self, id: &str, quota: &Quota, budget: &NodeBudget) -> Result<bool, StoreError> {
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
        let Some(row) = sqlx::query("SELECT * FROM sandboxes WHERE id = ? AND state = 'suspended'")
            .bind(id)
            .fetch_optional(&mut *tx)
            .await?
        else {
            return Ok(false);
        };
        let sb = sandbox_from_row(&row);
        admit_within(&mut tx, &sb.tenant_id, &sb.resources, quota, budget, None).await?;
        sqlx::query("UPDATE sandboxes SET state = 'resuming' WHERE id = ?")
            .bind(id)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(true)
    }

    async fn admit_suspend(&self, id: &str, quota: &Quota, budget: &NodeBudget) -> Result<bool, StoreError> {
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
        let row: Option<(String, i64, i64)> = sqlx::query_as(
            "SELECT tenant_id, memory_mib, saved_mib FROM sandboxes WHERE id = ? AND state IN ('running', 'paused')",
        )
        .bind(id)
        .fetch_optional(&mut *tx)
        .await?;
        let Some((tenant_id, memory_mib, saved_mib)) = row else {
            return Ok(false);
        };
        if saved_mib < memory_mib {
            let asked = (memory_mib - saved_mib).max(0) as u64;
            admit_disk_within(&mut tx, &tenant_id, asked, quota, budget).await?;
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
        sqlx::query("UPDATE sandboxes SET template_digest = ?, accel = ?, started_from = ?, start_ms = ? WHERE id = ?")
            .bind(&booted.template_digest)
            .bind(&booted.accel)
            .bind(&booted.start.from)
            .bind(booted.start.ms as i64)
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

    async fn count_running_sessions(&self, sandbox_id: &str) -> Result<u32, StoreError> {
        let n: (i64,) = sqlx::query_as("SELECT COUNT(*) FROM sessions WHERE sandbox_id = ? AND exited = 0")
            .bind(sandbox_id)
            .fetch_one(&self.pool)
            .await?;
        Ok(n.0 as u32)
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
}

#[async_trait]
impl OperationStore for SqliteStore {
    async fn insert_operation(&self, tenant_id: &str, op: &Operation) -> Result<(), StoreError> {
        sqlx::query(
            "INSERT INTO operations (id, tenant_id, kind, state, sandbox_id, created_at_ms) VALUES (?, ?, ?, ?, ?, ?)",
        )
        .bind(&op.id)
        .bind(tenant_id)
        .bind(op.kind.as_str())
        .bind(op.state.as_str())
        .bind(&op.sandbox_id)
        .bind(op_created_ms(op))
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
    ) -> Result<(), StoreError> {
        sqlx::query(
            "UPDATE operations SET state = ?, error_code = ?, error_message = ?, finished_at_ms = ? WHERE id = ?",
        )
        .bind(state.as_str())
        .bind(error.map(|e| e.code.clone()))
        .bind(error.map(|e| e.message.clone()))
        .bind(now_ms())
        .bind(id)
        .execute(&self.pool)
        .await?;
        Ok(())
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
