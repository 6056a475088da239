//! [`PgStore`]: the store in a Postgres database (the first step towards many hosts sharing
//! one; its admissions still sum one node's budgets), migrated on connect. The same semantics
//! as [`super::SqliteStore`], file by file in `postgres/`.
//!
//! Where SQLite takes its one write lock (`BEGIN IMMEDIATE`) this store takes one transaction-
//! scoped advisory lock ([`PgStore::begin_locked`]): admission sums what every tenant's
//! sandboxes hold of the node, so no row lock covers it, and READ COMMITTED then shows each
//! statement after the lock every write committed before it.

use super::{
    new_key, new_tenant_id, op_created_ms, token_hash, AccessHashes, AccountStore, AuditFilter, CreateRecorded,
    E2bStore, KeyFormat, Lease, NodeBudget, OperationStore, SandboxFilter, SandboxStore, StoreError, TenantStore,
    TokenKind, DISK_HELD, HOLDS_VM, LEAD, LIVE, NODE_OBSERVATIONS, OBSERVE_NODE, RATE_WINDOW_MS,
};
use super::{
    reserve_session_start_in, News, SessionStart, FORGET_NODE_SEEN, NEWS_CHANNEL, PARKED_IMAGES, PARKED_OF_ENDED,
    SESSION_START_END,
};
use crate::model::ErrorBody;
use crate::model::{Operation, OperationKind, OperationState, Quota, Resources, SandboxState, TenantUsage};
use crate::records::{now_ms, rfc3339, AuditRecord, EgressSpec, KeyRecord, SandboxRecord, SessionRecord, Tenant};
use async_trait::async_trait;
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions, PgRow};
use sqlx::{ConnectOptions, Connection, Postgres, Row, Transaction};
use std::str::FromStr;
use std::time::Duration;

/// The schema's versions, `crates/server/migrations-postgres/*.sql`, embedded at build time.
static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations-postgres");

mod accounts;
mod admission;
mod sandboxes;
mod snapshots;
mod tenants;

use admission::{admit_disk_within, admit_within, node_admits_within, usage_within};

/// The advisory lock of every admission and of the writes SQLite serializes: "airlock" in ASCII.
const WRITE_LOCK: i64 = 0x61_6972_6c6f_636b;
/// The class of the advisory locks a sandbox's session starts take, with the hash of its id
/// (two 32-bit keys: apart from [`WRITE_LOCK`]'s space).
const SESSION_STARTS_LOCK: i32 = 0x6169_7273;

/// Why a Postgres store could not be opened, naming what to fix.
#[derive(Debug, thiserror::Error)]
pub enum PgOpenError {
    #[error("{url} is not a Postgres URL ({reason}); write it as postgres://USER[:PASSWORD]@HOST[:PORT]/DATABASE, or leave --store out for SQLite in the data dir")]
    BadUrl { url: String, reason: String },
    #[error(
        "cannot reach the Postgres server of {url} ({source}); check that it runs, listens there and lets this user in"
    )]
    Unreachable {
        url: String,
        #[source]
        source: sqlx::Error,
    },
    #[error("cannot bring the schema of {url} up to date ({source}); the database user must be able to create tables")]
    Migrate {
        url: String,
        #[source]
        source: sqlx::migrate::MigrateError,
    },
}

impl From<PgOpenError> for StoreError {
    fn from(e: PgOpenError) -> Self {
        StoreError::backend(e)
    }
}

/// `url` without its password, for messages and logs.
pub fn redact_url(url: &str) -> String {
    match url::Url::parse(url) {
        Ok(mut u) => {
            if u.password().is_some() {
                let _ = u.set_password(Some("***"));
            }
            u.to_string()
        }
        Err(_) => "the store URL".into(),
    }
}

pub struct PgStore {
    pool: PgPool,
    lease: Lease,
}

impl PgStore {
    /// Whether `url` is a Postgres URL this store can connect with (nothing is dialed).
    pub fn parse_url(url: &str) -> Result<PgConnectOptions, PgOpenError> {
        let bad = |reason: String| PgOpenError::BadUrl {
            url: redact_url(url),
            reason,
        };
        if !(url.starts_with("postgres://") || url.starts_with("postgresql://")) {
            return Err(bad("it starts with neither postgres:// nor postgresql://".into()));
        }
        PgConnectOptions::from_str(url).map_err(|e| bad(e.to_string()))
    }

    /// Connect to the database at `url` (`postgres://...`) and bring its schema up to date.
    pub async fn connect(url: &str) -> Result<Self, PgOpenError> {
        let shown = redact_url(url);
        let opts = Self::parse_url(url)?;
        // One connection first: its error says why (refused, no such database, auth), where
        // the pool's would only say it timed out.
        let unreachable = |source| PgOpenError::Unreachable {
            url: shown.clone(),
            source,
        };
        opts.connect()
            .await
            .map_err(unreachable)?
            .close()
            .await
            .map_err(unreachable)?;
        let pool = PgPoolOptions::new()
            .max_connections(8)
            .acquire_timeout(Duration::from_secs(10))
            .connect_with(opts)
            .await
            .map_err(unreachable)?;
        MIGRATOR
            .run(&pool)
            .await
            .map_err(|source| PgOpenError::Migrate { url: shown, source })?;
        Ok(Self {
            pool,
            lease: Lease::replica(),
        })
    }

    /// The same store, leasing the operations it records as `lease` (see [`Lease`]).
    pub fn with_lease(mut self, lease: Lease) -> Self {
        self.lease = lease;
        self
    }

    /// A transaction holding [`WRITE_LOCK`] until it ends (committed or dropped). READ
    /// COMMITTED, the default: a snapshot taken before the lock was granted would miss what the
    /// holder before committed.
    async fn begin_locked(&self) -> Result<Transaction<'static, Postgres>, StoreError> {
        let mut tx = self.pool.begin().await?;
        sqlx::query("SELECT pg_advisory_xact_lock($1)")
            .bind(WRITE_LOCK)
            .execute(&mut *tx)
            .await?;
        Ok(tx)
    }
}

/// A JSONB column as the serde value it holds; a value that does not fit reads as `T`'s default.
fn json<T: serde::de::DeserializeOwned + Default>(r: &PgRow, column: &str) -> T {
    r.try_get::<serde_json::Value, _>(column)
        .ok()
        .and_then(|v| serde_json::from_value(v).ok())
        .unwrap_or_default()
}

fn op_from_row(r: &PgRow) -> Operation {
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

fn sandbox_from_row(r: &PgRow) -> SandboxRecord {
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
        env: json(r, "env"),
        metadata: json(r, "metadata"),
        created_at_ms: r.get("created_at_ms"),
        expires_at_ms: r.get("expires_at_ms"),
        egress: egress_from_row(r),
        lifecycle: crate::model::Lifecycle {
            on_timeout: match r.get::<&str, _>("on_timeout") {
                "suspend" => crate::model::OnTimeout::Suspend,
                _ => crate::model::OnTimeout::Delete,
            },
            auto_resume: r.get("auto_resume"),
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
fn egress_from_row(r: &PgRow) -> EgressSpec {
    let id: &str = r.get("id");
    let profiles = serde_json::from_value(r.get::<serde_json::Value, _>("egress_profiles"));
    let tenant = airlock_egress::TenantPolicy::from_json(&r.get::<serde_json::Value, _>("egress_policy").to_string());
    match (profiles, tenant) {
        (Ok(profiles), Ok(tenant)) => EgressSpec {
            profiles,
            sealed: r.get("egress_sealed"),
            tenant,
        },
        (p, t) => {
            tracing::error!(sandbox = %id, "its egress record does not parse ({:?}, {:?}); treating it as sealed", p.err(), t.err());
            EgressSpec::default()
        }
    }
}

fn session_from_row(r: &PgRow) -> SessionRecord {
    SessionRecord {
        id: r.get("id"),
        sandbox_id: r.get("sandbox_id"),
        process_id: r.get::<i64, _>("process_id") as u64,
        argv: json(r, "argv"),
        cwd: r.get("cwd"),
        user: r.get("user"),
        pty: r.get("pty"),
        exit_code: r.get("exit_code"),
        signal: r.get("signal"),
        timed_out: r.get("timed_out"),
        exited: r.get("exited"),
        started_at_ms: r.get("started_at_ms"),
        ended_at_ms: r.get("ended_at_ms"),
        tag: r.get("tag"),
    }
}

/// Record `key`'s hash for `tenant` (created if new), inside the caller's locked transaction.
async fn insert_key(tx: &mut Transaction<'_, Postgres>, tenant: &str, key: &str) -> Result<(), StoreError> {
    let row: Option<(String,)> = sqlx::query_as("SELECT id FROM tenants WHERE name = $1")
        .bind(tenant)
        .fetch_optional(&mut **tx)
        .await?;
    let tenant_id = match row {
        Some((id,)) => id,
        None => {
            let id = new_tenant_id(tenant);
            sqlx::query("INSERT INTO tenants (id, name, created_at_ms) VALUES ($1, $2, $3)")
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
    tx: &mut Transaction<'_, Postgres>,
    tenant_id: &str,
    key: &str,
    name: &str,
) -> Result<KeyRecord, StoreError> {
    let record = KeyRecord {
        id: super::key_id_of(key),
        tenant_id: tenant_id.into(),
        name: name.into(),
        prefix: key.get(..8).unwrap_or(key).into(),
        created_at_ms: now_ms(),
        last_used_at_ms: None,
        revoked_at_ms: None,
    };
    sqlx::query(
        "INSERT INTO api_keys (hash, tenant_id, prefix, created_at_ms, id, name) VALUES ($1, $2, $3, $4, $5, $6)",
    )
    .bind(token_hash(key))
    .bind(tenant_id)
    .bind(&record.prefix)
    .bind(record.created_at_ms)
    .bind(&record.id)
    .bind(name)
    .execute(&mut **tx)
    .await?;
    Ok(record)
}

fn key_from_row(r: &PgRow) -> Result<KeyRecord, StoreError> {
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
impl OperationStore for PgStore {
    async fn insert_operation(&self, tenant_id: &str, op: &Operation) -> Result<(), StoreError> {
        sqlx::query(
            "INSERT INTO operations (id, tenant_id, kind, state, sandbox_id, created_at_ms, lease_holder, lease_until_ms) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
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
        let r = sqlx::query("SELECT * FROM operations WHERE tenant_id = $1 AND id = $2")
            .bind(tenant_id)
            .bind(id)
            .fetch_optional(&self.pool)
            .await?;
        Ok(r.as_ref().map(op_from_row))
    }

    async fn operation_by_id(&self, id: &str) -> Result<Option<Operation>, StoreError> {
        let r = sqlx::query("SELECT * FROM operations WHERE id = $1")
            .bind(id)
            .fetch_optional(&self.pool)
            .await?;
        Ok(r.as_ref().map(op_from_row))
    }

    async fn operation_by_idempotency_key(&self, tenant_id: &str, key: &str) -> Result<Option<Operation>, StoreError> {
        let r = sqlx::query("SELECT * FROM operations WHERE tenant_id = $1 AND idempotency_key = $2")
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
            "UPDATE operations SET state = $1, error_code = $2, error_message = $3, finished_at_ms = $4 \
             WHERE id = $5 AND lease_holder = $6",
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
        sqlx::query("UPDATE operations SET state = $1 WHERE id = $2")
            .bind(state.as_str())
            .bind(id)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    async fn unfinished_operations(&self) -> Result<Vec<Operation>, StoreError> {
        let rows =
            sqlx::query("SELECT * FROM operations WHERE state IN ('pending', 'running') ORDER BY created_at_ms, id")
                .fetch_all(&self.pool)
                .await?;
        Ok(rows.iter().map(op_from_row).collect())
    }

    async fn open_delete_operation(&self, sandbox_id: &str) -> Result<Option<Operation>, StoreError> {
        let r = sqlx::query(
            "SELECT * FROM operations WHERE sandbox_id = $1 AND kind = 'delete' ORDER BY created_at_ms DESC LIMIT 1",
        )
        .bind(sandbox_id)
        .fetch_optional(&self.pool)
        .await?;
        Ok(r.as_ref().map(op_from_row))
    }

    async fn claim_operations(&self, own_too: bool) -> Result<Vec<super::Claimed>, StoreError> {
        let now = now_ms();
        // Rows another replica is claiming this moment are skipped, not waited for.
        let mut rows = sqlx::query(
            "UPDATE operations SET lease_holder = $1, lease_until_ms = $2, lease_epoch = lease_epoch + 1 WHERE id IN ( \
               SELECT id FROM operations WHERE state IN ('pending', 'running') \
               AND (lease_until_ms < $3 OR ($4 AND lease_holder = $1)) FOR UPDATE SKIP LOCKED) \
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

    async fn publish(&self, news: &News) -> Result<(), StoreError> {
        sqlx::query("SELECT pg_notify($1, $2)")
            .bind(NEWS_CHANNEL)
            .bind(news.encode(&self.lease.holder))
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    async fn listen(&self) -> Result<Option<futures_util::stream::BoxStream<'static, News>>, StoreError> {
        use futures_util::StreamExt;
        let mut listener = sqlx::postgres::PgListener::connect_with(&self.pool).await?;
        listener.listen(NEWS_CHANNEL).await?;
        let me = self.lease.holder.clone();
        let news = futures_util::stream::unfold((listener, me), |(mut listener, me)| async move {
            loop {
                match listener.recv().await {
                    Ok(n) => {
                        if let Some(news) = News::decode(n.payload(), &me) {
                            return Some((news, (listener, me)));
                        }
                    }
                    // It reconnects on the next call; what was sent meanwhile is lost.
                    Err(e) => {
                        tracing::warn!("the store's news: {e}");
                        tokio::time::sleep(Duration::from_secs(1)).await;
                    }
                }
            }
        });
        Ok(Some(news.boxed()))
    }

    async fn renew_leases(&self, ids: &[String]) -> Result<(), StoreError> {
        if ids.is_empty() {
            return Ok(());
        }
        sqlx::query("UPDATE operations SET lease_until_ms = $1 WHERE lease_holder = $2 AND id = ANY($3)")
            .bind(self.lease.until())
            .bind(&self.lease.holder)
            .bind(ids)
            .execute(&self.pool)
            .await?;
        Ok(())
    }
}

#[async_trait]
impl E2bStore for PgStore {
    async fn set_e2b_alias(&self, sandbox_id: &str, alias: &str) -> Result<(), StoreError> {
        sqlx::query(
            "INSERT INTO e2b_sandboxes (sandbox_id, template_alias) VALUES ($1, $2)
             ON CONFLICT (sandbox_id) DO UPDATE SET template_alias = excluded.template_alias",
        )
        .bind(sandbox_id)
        .bind(alias)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    async fn e2b_alias(&self, sandbox_id: &str) -> Result<Option<String>, StoreError> {
        let r: Option<(String,)> = sqlx::query_as("SELECT template_alias FROM e2b_sandboxes WHERE sandbox_id = $1")
            .bind(sandbox_id)
            .fetch_optional(&self.pool)
            .await?;
        Ok(r.map(|r| r.0))
    }
}

super::builds::impl_build_store!(PgStore);
super::volumes::impl_volume_store!(PgStore);
super::scrape_tokens::impl_scrape_token_store!(PgStore);
super::events::impl_event_store!(PgStore);
