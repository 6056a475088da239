//! The control-plane store. SQLite is the embedded default; the trait keeps room for Postgres.

use crate::error::ErrorBody;
use crate::model::{Operation, OperationKind, OperationState, Resources, Sandbox, SandboxState};
use async_trait::async_trait;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions};
use sqlx::Row;
use std::collections::BTreeMap;
use std::path::Path;
use std::str::FromStr;

pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

pub fn rfc3339(ms: i64) -> String {
    let t = std::time::UNIX_EPOCH + std::time::Duration::from_millis(ms.max(0) as u64);
    humantime::format_rfc3339_millis(t).to_string()
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tenant {
    pub id: String,
    pub name: String,
}

/// A sandbox row with what the API shows plus what the engine needs.
#[derive(Debug, Clone)]
pub struct SandboxRow {
    pub id: String,
    pub tenant_id: String,
    pub state: SandboxState,
    pub template: String,
    pub template_digest: String,
    pub runtime: String,
    pub accel: String,
    pub resources: Resources,
    pub env: BTreeMap<String, String>,
    pub metadata: BTreeMap<String, String>,
    pub created_at_ms: i64,
    pub expires_at_ms: i64,
}

impl SandboxRow {
    pub fn view(&self) -> Sandbox {
        Sandbox {
            id: self.id.clone(),
            state: self.state,
            template: self.template.clone(),
            template_digest: self.template_digest.clone(),
            runtime: self.runtime.clone(),
            accel: self.accel.clone(),
            resources: self.resources,
            metadata: self.metadata.clone(),
            created_at: rfc3339(self.created_at_ms),
            expires_at: rfc3339(self.expires_at_ms),
        }
    }
}

#[derive(Debug, Clone)]
pub struct SessionRow {
    pub id: String,
    pub sandbox_id: String,
    pub process_id: u64,
    pub argv: Vec<String>,
    pub cwd: String,
    pub user: String,
    pub pty: bool,
    pub exit_code: Option<i32>,
    pub signal: Option<i32>,
    pub timed_out: bool,
    pub exited: bool,
    pub started_at_ms: i64,
    pub ended_at_ms: Option<i64>,
}

/// Opaque cursor of a sandbox list page: `<created_at_ms>.<id>` of the last row shown.
pub fn parse_page_token(token: &str) -> Option<(i64, String)> {
    let (ms, id) = token.split_once('.')?;
    Some((ms.parse().ok()?, id.to_string()))
}

/// The token for the page after `rows` (fetched with one row more than `limit`), if any.
pub fn next_page_token(rows: &[SandboxRow], limit: u32) -> Option<String> {
    (rows.len() > limit as usize).then(|| {
        let last = &rows[limit as usize - 1];
        format!("{}.{}", last.created_at_ms, last.id)
    })
}

pub struct SandboxFilter {
    /// Only these states; empty means every state but `deleted`.
    pub states: Vec<SandboxState>,
    pub metadata: BTreeMap<String, String>,
    /// Return rows after this (created_at_ms, id) cursor.
    pub after: Option<(i64, String)>,
    pub limit: u32,
}

#[async_trait]
pub trait Store: Send + Sync {
    /// Make sure tenant `default` exists; returns a new admin key the first time.
    async fn bootstrap(&self) -> Result<Option<String>, sqlx::Error>;
    async fn create_key(&self, tenant: &str, format: KeyFormat) -> Result<String, sqlx::Error>;
    async fn tenant_by_key(&self, key: &str) -> Result<Option<Tenant>, sqlx::Error>;

    /// Record a new sandbox and its create operation; with an idempotency key already used by
    /// this tenant, return the earlier operation instead.
    async fn insert_create(
        &self,
        sb: &SandboxRow,
        op: &Operation,
        idempotency_key: Option<&str>,
    ) -> Result<Operation, sqlx::Error>;
    async fn get_sandbox(&self, tenant_id: &str, id: &str) -> Result<Option<SandboxRow>, sqlx::Error>;
    async fn sandbox_by_id(&self, id: &str) -> Result<Option<SandboxRow>, sqlx::Error>;
    async fn list_sandboxes(&self, tenant_id: &str, filter: &SandboxFilter) -> Result<Vec<SandboxRow>, sqlx::Error>;
    async fn live_sandboxes(&self) -> Result<Vec<SandboxRow>, sqlx::Error>;
    async fn count_live_sandboxes(&self, tenant_id: &str) -> Result<i64, sqlx::Error>;
    async fn set_sandbox_state(&self, id: &str, state: SandboxState) -> Result<(), sqlx::Error>;
    async fn set_sandbox_boot(&self, id: &str, template_digest: &str, accel: &str) -> Result<(), sqlx::Error>;
    async fn expired_sandboxes(&self, now_ms: i64) -> Result<Vec<SandboxRow>, sqlx::Error>;

    async fn insert_operation(&self, tenant_id: &str, op: &Operation) -> Result<(), sqlx::Error>;
    async fn get_operation(&self, tenant_id: &str, id: &str) -> Result<Option<Operation>, sqlx::Error>;
    async fn operation_by_idempotency_key(&self, tenant_id: &str, key: &str) -> Result<Option<Operation>, sqlx::Error>;
    async fn finish_operation(
        &self,
        id: &str,
        state: OperationState,
        error: Option<&ErrorBody>,
    ) -> Result<(), sqlx::Error>;
    async fn set_operation_state(&self, id: &str, state: OperationState) -> Result<(), sqlx::Error>;
    async fn unfinished_operations(&self) -> Result<Vec<Operation>, sqlx::Error>;
    async fn open_delete_operation(&self, sandbox_id: &str) -> Result<Option<Operation>, sqlx::Error>;

    async fn set_sandbox_expiry(&self, id: &str, expires_at_ms: i64) -> Result<(), sqlx::Error>;
    /// The lifetime a paused sandbox has left: its clock stops while paused and resume restores it.
    async fn set_paused_remaining(&self, id: &str, remaining_ms: Option<i64>) -> Result<(), sqlx::Error>;
    async fn paused_remaining(&self, id: &str) -> Result<Option<i64>, sqlx::Error>;
    /// The per-sandbox access token of the E2B door (envd's `X-Access-Token`).
    async fn set_sandbox_token(&self, id: &str, token: &str) -> Result<(), sqlx::Error>;
    async fn sandbox_token(&self, id: &str) -> Result<Option<String>, sqlx::Error>;
    async fn sandbox_by_token(&self, token: &str) -> Result<Option<SandboxRow>, sqlx::Error>;

    async fn insert_session(&self, s: &SessionRow) -> Result<(), sqlx::Error>;
    async fn get_session(&self, sandbox_id: &str, id: &str) -> Result<Option<SessionRow>, sqlx::Error>;
    async fn list_sessions(&self, sandbox_id: &str) -> Result<Vec<SessionRow>, sqlx::Error>;
    async fn finish_session(&self, s: &SessionRow) -> Result<(), sqlx::Error>;
}

pub struct SqliteStore {
    pool: SqlitePool,
}

fn key_hash(key: &str) -> String {
    use sha2::Digest;
    hex::encode(sha2::Sha256::digest(key.as_bytes()))
}

/// How a minted key is spelled; both are 160 random bits and work on both doors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyFormat {
    /// `ak_<40 hex>`.
    Airlock,
    /// `e2b_<40 hex>`: E2B's own shape, which e2b SDKs 2.26 to 2.5x insist on client-side
    /// (`Invalid API key format: expected "e2b_" followed by hex characters`).
    E2b,
}

pub fn new_key(format: KeyFormat) -> String {
    let prefix = match format {
        KeyFormat::Airlock => "ak_",
        KeyFormat::E2b => "e2b_",
    };
    format!("{prefix}{}", airlock_runtime::datadir::random_hex(20))
}

const SCHEMA: &str = r#"
CREATE TABLE IF NOT EXISTS tenants (id TEXT PRIMARY KEY, name TEXT NOT NULL UNIQUE, created_at_ms INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS api_keys (hash TEXT PRIMARY KEY, tenant_id TEXT NOT NULL REFERENCES tenants(id), prefix TEXT NOT NULL, created_at_ms INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS sandboxes (
  id TEXT PRIMARY KEY, tenant_id TEXT NOT NULL, state TEXT NOT NULL, template TEXT NOT NULL,
  template_digest TEXT NOT NULL, runtime TEXT NOT NULL, accel TEXT NOT NULL,
  vcpu INTEGER NOT NULL, memory_mib INTEGER NOT NULL, disk_mib INTEGER NOT NULL,
  env TEXT NOT NULL, metadata TEXT NOT NULL, created_at_ms INTEGER NOT NULL, expires_at_ms INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS sandboxes_tenant ON sandboxes(tenant_id, created_at_ms, id);
CREATE TABLE IF NOT EXISTS operations (
  id TEXT PRIMARY KEY, tenant_id TEXT NOT NULL, kind TEXT NOT NULL, state TEXT NOT NULL, sandbox_id TEXT NOT NULL,
  error_code TEXT, error_message TEXT, idempotency_key TEXT, created_at_ms INTEGER NOT NULL, finished_at_ms INTEGER);
CREATE UNIQUE INDEX IF NOT EXISTS operations_idem ON operations(tenant_id, idempotency_key) WHERE idempotency_key IS NOT NULL;
CREATE TABLE IF NOT EXISTS sessions (
  id TEXT PRIMARY KEY, sandbox_id TEXT NOT NULL, process_id INTEGER NOT NULL, argv TEXT NOT NULL, cwd TEXT NOT NULL,
  user TEXT NOT NULL, pty INTEGER NOT NULL, exit_code INTEGER, signal INTEGER, timed_out INTEGER NOT NULL,
  exited INTEGER NOT NULL, started_at_ms INTEGER NOT NULL, ended_at_ms INTEGER);
CREATE INDEX IF NOT EXISTS sessions_sandbox ON sessions(sandbox_id, started_at_ms);
CREATE TABLE IF NOT EXISTS sandbox_tokens (sandbox_id TEXT PRIMARY KEY, token TEXT NOT NULL UNIQUE);
CREATE TABLE IF NOT EXISTS paused_lifetimes (sandbox_id TEXT PRIMARY KEY, remaining_ms INTEGER NOT NULL);
"#;

impl SqliteStore {
    pub async fn open(path: &Path) -> Result<Self, sqlx::Error> {
        let opts = SqliteConnectOptions::from_str(&format!("sqlite://{}", path.display()))?
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .busy_timeout(std::time::Duration::from_secs(5));
        let pool = SqlitePoolOptions::new().max_connections(4).connect_with(opts).await?;
        sqlx::raw_sql(SCHEMA).execute(&pool).await?;
        Ok(Self { pool })
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

fn sandbox_from_row(r: &sqlx::sqlite::SqliteRow) -> SandboxRow {
    SandboxRow {
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
    }
}

fn session_from_row(r: &sqlx::sqlite::SqliteRow) -> SessionRow {
    SessionRow {
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
    }
}

fn op_created_ms(op: &Operation) -> i64 {
    humantime::parse_rfc3339(&op.created_at)
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map(|d| d.as_millis() as i64)
        .unwrap_or_else(now_ms)
}

#[async_trait]
impl Store for SqliteStore {
    async fn bootstrap(&self) -> Result<Option<String>, sqlx::Error> {
        let keys: (i64,) = sqlx::query_as(
            "SELECT COUNT(*) FROM api_keys k JOIN tenants t ON t.id = k.tenant_id WHERE t.name = 'default'",
        )
        .fetch_one(&self.pool)
        .await?;
        if keys.0 > 0 {
            return Ok(None);
        }
        self.create_key("default", KeyFormat::Airlock).await.map(Some)
    }

    async fn create_key(&self, tenant: &str, format: KeyFormat) -> Result<String, sqlx::Error> {
        let row: Option<(String,)> = sqlx::query_as("SELECT id FROM tenants WHERE name = ?")
            .bind(tenant)
            .fetch_optional(&self.pool)
            .await?;
        let tenant_id = match row {
            Some((id,)) => id,
            None => {
                sqlx::query("INSERT INTO tenants (id, name, created_at_ms) VALUES (?, ?, ?)")
                    .bind(tenant)
                    .bind(tenant)
                    .bind(now_ms())
                    .execute(&self.pool)
                    .await?;
                tenant.to_string()
            }
        };
        let key = new_key(format);
        sqlx::query("INSERT INTO api_keys (hash, tenant_id, prefix, created_at_ms) VALUES (?, ?, ?, ?)")
            .bind(key_hash(&key))
            .bind(tenant_id)
            .bind(&key[..8])
            .bind(now_ms())
            .execute(&self.pool)
            .await?;
        Ok(key)
    }

    async fn tenant_by_key(&self, key: &str) -> Result<Option<Tenant>, sqlx::Error> {
        let row: Option<(String, String)> =
            sqlx::query_as("SELECT t.id, t.name FROM api_keys k JOIN tenants t ON t.id = k.tenant_id WHERE k.hash = ?")
                .bind(key_hash(key))
                .fetch_optional(&self.pool)
                .await?;
        Ok(row.map(|(id, name)| Tenant { id, name }))
    }

    async fn insert_create(
        &self,
        sb: &SandboxRow,
        op: &Operation,
        idem: Option<&str>,
    ) -> Result<Operation, sqlx::Error> {
        let mut tx = self.pool.begin().await?;
        if let Some(key) = idem {
            let prior = sqlx::query("SELECT * FROM operations WHERE tenant_id = ? AND idempotency_key = ?")
                .bind(&sb.tenant_id)
                .bind(key)
                .fetch_optional(&mut *tx)
                .await?;
            if let Some(r) = prior {
                return Ok(op_from_row(&r));
            }
        }
        sqlx::query(
            "INSERT INTO sandboxes (id, tenant_id, state, template, template_digest, runtime, accel, vcpu, memory_mib, disk_mib, env, metadata, created_at_ms, expires_at_ms)
             VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
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
        Ok(op.clone())
    }

    async fn get_sandbox(&self, tenant_id: &str, id: &str) -> Result<Option<SandboxRow>, sqlx::Error> {
        let r = sqlx::query("SELECT * FROM sandboxes WHERE tenant_id = ? AND id = ?")
            .bind(tenant_id)
            .bind(id)
            .fetch_optional(&self.pool)
            .await?;
        Ok(r.as_ref().map(sandbox_from_row))
    }

    async fn sandbox_by_id(&self, id: &str) -> Result<Option<SandboxRow>, sqlx::Error> {
        let r = sqlx::query("SELECT * FROM sandboxes WHERE id = ?")
            .bind(id)
            .fetch_optional(&self.pool)
            .await?;
        Ok(r.as_ref().map(sandbox_from_row))
    }

    async fn list_sandboxes(&self, tenant_id: &str, f: &SandboxFilter) -> Result<Vec<SandboxRow>, sqlx::Error> {
        // State and metadata are filtered here, after the SQL cursor; the page is trimmed after.
        let (after_ms, after_id) = f.after.clone().unwrap_or((i64::MIN, String::new()));
        let rows = sqlx::query(
            "SELECT * FROM sandboxes WHERE tenant_id = ? AND state != 'deleted'
             AND (created_at_ms > ? OR (created_at_ms = ? AND id > ?)) ORDER BY created_at_ms, id",
        )
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
            .take(f.limit as usize + 1)
            .collect())
    }

    async fn live_sandboxes(&self) -> Result<Vec<SandboxRow>, sqlx::Error> {
        let rows = sqlx::query("SELECT * FROM sandboxes WHERE state IN ('creating', 'running', 'paused', 'deleting')")
            .fetch_all(&self.pool)
            .await?;
        Ok(rows.iter().map(sandbox_from_row).collect())
    }

    async fn count_live_sandboxes(&self, tenant_id: &str) -> Result<i64, sqlx::Error> {
        let n: (i64,) = sqlx::query_as(
            "SELECT COUNT(*) FROM sandboxes WHERE tenant_id = ? AND state IN ('creating', 'running', 'paused', 'deleting')",
        )
        .bind(tenant_id)
        .fetch_one(&self.pool)
        .await?;
        Ok(n.0)
    }

    async fn set_sandbox_state(&self, id: &str, state: SandboxState) -> Result<(), sqlx::Error> {
        sqlx::query("UPDATE sandboxes SET state = ? WHERE id = ?")
            .bind(state.as_str())
            .bind(id)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    async fn set_sandbox_boot(&self, id: &str, digest: &str, accel: &str) -> Result<(), sqlx::Error> {
        sqlx::query("UPDATE sandboxes SET template_digest = ?, accel = ? WHERE id = ?")
            .bind(digest)
            .bind(accel)
            .bind(id)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    async fn expired_sandboxes(&self, now: i64) -> Result<Vec<SandboxRow>, sqlx::Error> {
        let rows = sqlx::query("SELECT * FROM sandboxes WHERE state IN ('running', 'paused') AND expires_at_ms <= ?")
            .bind(now)
            .fetch_all(&self.pool)
            .await?;
        Ok(rows.iter().map(sandbox_from_row).collect())
    }

    async fn insert_operation(&self, tenant_id: &str, op: &Operation) -> Result<(), sqlx::Error> {
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

    async fn get_operation(&self, tenant_id: &str, id: &str) -> Result<Option<Operation>, sqlx::Error> {
        let r = sqlx::query("SELECT * FROM operations WHERE tenant_id = ? AND id = ?")
            .bind(tenant_id)
            .bind(id)
            .fetch_optional(&self.pool)
            .await?;
        Ok(r.as_ref().map(op_from_row))
    }

    async fn operation_by_idempotency_key(&self, tenant_id: &str, key: &str) -> Result<Option<Operation>, sqlx::Error> {
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
    ) -> Result<(), sqlx::Error> {
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

    async fn set_operation_state(&self, id: &str, state: OperationState) -> Result<(), sqlx::Error> {
        sqlx::query("UPDATE operations SET state = ? WHERE id = ?")
            .bind(state.as_str())
            .bind(id)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    async fn unfinished_operations(&self) -> Result<Vec<Operation>, sqlx::Error> {
        let rows = sqlx::query("SELECT * FROM operations WHERE state IN ('pending', 'running') ORDER BY created_at_ms")
            .fetch_all(&self.pool)
            .await?;
        Ok(rows.iter().map(op_from_row).collect())
    }

    async fn open_delete_operation(&self, sandbox_id: &str) -> Result<Option<Operation>, sqlx::Error> {
        let r = sqlx::query(
            "SELECT * FROM operations WHERE sandbox_id = ? AND kind = 'delete' ORDER BY created_at_ms DESC LIMIT 1",
        )
        .bind(sandbox_id)
        .fetch_optional(&self.pool)
        .await?;
        Ok(r.as_ref().map(op_from_row))
    }

    async fn set_sandbox_expiry(&self, id: &str, expires_at_ms: i64) -> Result<(), sqlx::Error> {
        sqlx::query("UPDATE sandboxes SET expires_at_ms = ? WHERE id = ?")
            .bind(expires_at_ms)
            .bind(id)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    async fn set_paused_remaining(&self, id: &str, remaining_ms: Option<i64>) -> Result<(), sqlx::Error> {
        let q = match remaining_ms {
            Some(ms) => sqlx::query("INSERT OR REPLACE INTO paused_lifetimes (sandbox_id, remaining_ms) VALUES (?, ?)")
                .bind(id)
                .bind(ms),
            None => sqlx::query("DELETE FROM paused_lifetimes WHERE sandbox_id = ?").bind(id),
        };
        q.execute(&self.pool).await?;
        Ok(())
    }

    async fn paused_remaining(&self, id: &str) -> Result<Option<i64>, sqlx::Error> {
        let r: Option<(i64,)> = sqlx::query_as("SELECT remaining_ms FROM paused_lifetimes WHERE sandbox_id = ?")
            .bind(id)
            .fetch_optional(&self.pool)
            .await?;
        Ok(r.map(|r| r.0))
    }

    async fn set_sandbox_token(&self, id: &str, token: &str) -> Result<(), sqlx::Error> {
        sqlx::query("INSERT OR REPLACE INTO sandbox_tokens (sandbox_id, token) VALUES (?, ?)")
            .bind(id)
            .bind(token)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    async fn sandbox_token(&self, id: &str) -> Result<Option<String>, sqlx::Error> {
        let r: Option<(String,)> = sqlx::query_as("SELECT token FROM sandbox_tokens WHERE sandbox_id = ?")
            .bind(id)
            .fetch_optional(&self.pool)
            .await?;
        Ok(r.map(|r| r.0))
    }

    async fn sandbox_by_token(&self, token: &str) -> Result<Option<SandboxRow>, sqlx::Error> {
        let r =
            sqlx::query("SELECT s.* FROM sandbox_tokens t JOIN sandboxes s ON s.id = t.sandbox_id WHERE t.token = ?")
                .bind(token)
                .fetch_optional(&self.pool)
                .await?;
        Ok(r.as_ref().map(sandbox_from_row))
    }

    async fn insert_session(&self, s: &SessionRow) -> Result<(), sqlx::Error> {
        sqlx::query(
            "INSERT INTO sessions (id, sandbox_id, process_id, argv, cwd, user, pty, exit_code, signal, timed_out, exited, started_at_ms, ended_at_ms)
             VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
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
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    async fn get_session(&self, sandbox_id: &str, id: &str) -> Result<Option<SessionRow>, sqlx::Error> {
        let r = sqlx::query("SELECT * FROM sessions WHERE sandbox_id = ? AND id = ?")
            .bind(sandbox_id)
            .bind(id)
            .fetch_optional(&self.pool)
            .await?;
        Ok(r.as_ref().map(session_from_row))
    }

    async fn list_sessions(&self, sandbox_id: &str) -> Result<Vec<SessionRow>, sqlx::Error> {
        let rows = sqlx::query("SELECT * FROM sessions WHERE sandbox_id = ? ORDER BY started_at_ms, id")
            .bind(sandbox_id)
            .fetch_all(&self.pool)
            .await?;
        Ok(rows.iter().map(session_from_row).collect())
    }

    async fn finish_session(&self, s: &SessionRow) -> Result<(), sqlx::Error> {
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
}
