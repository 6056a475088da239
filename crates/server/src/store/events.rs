//! [`EventStore`]: sandboxes' lifecycle events, tenants' webhooks and their delivery attempts
//! (migrations sqlite 0026, pg 0015). The statements are valid on both stores, so one macro
//! implements the trait.

use crate::records::{DeliveryRecord, EventRecord, WebhookRecord};
use crate::store::StoreError;
use async_trait::async_trait;

/// Which events a read wants.
#[derive(Debug, Clone, Default)]
pub struct EventFilter {
    pub tenant_id: String,
    pub sandbox_id: Option<String>,
    /// Only events after this `seq` (oldest first), or else before it (newest first).
    pub after_seq: Option<i64>,
    pub before_seq: Option<i64>,
    pub limit: u32,
    /// Only these kinds (`sandbox.created`, ...); empty: every kind.
    pub kinds: Vec<String>,
    /// Skip this many first (E2B's offset paging; 0 with a cursor).
    pub offset: u32,
    /// Without a cursor: oldest first instead of newest first.
    pub ascending: bool,
}

#[async_trait]
pub trait EventStore: Send + Sync {
    /// Record an event; its `seq`.
    async fn insert_event(&self, event: &EventRecord) -> Result<i64, StoreError>;
    /// A tenant's events: after `after_seq` oldest first, else newest first (before
    /// `before_seq` if set); at most `limit`.
    async fn events(&self, filter: &EventFilter) -> Result<Vec<EventRecord>, StoreError>;
    /// The newest event's `seq` (0 without any): where a new webhook starts.
    async fn last_event_seq(&self) -> Result<i64, StoreError>;
    /// Remove events and delivery attempts older than `before_ms`; how many events went.
    async fn prune_events(&self, before_ms: i64) -> Result<u64, StoreError>;

    async fn insert_webhook(&self, webhook: &WebhookRecord) -> Result<(), StoreError>;
    async fn webhook(&self, tenant_id: &str, id: &str) -> Result<Option<WebhookRecord>, StoreError>;
    /// A tenant's webhooks, oldest first.
    async fn webhooks(&self, tenant_id: &str) -> Result<Vec<WebhookRecord>, StoreError>;
    /// Every enabled webhook of every tenant (the delivery loop's).
    async fn enabled_webhooks(&self) -> Result<Vec<WebhookRecord>, StoreError>;
    /// Change a webhook's url, kinds, name and enabled flag (by id and tenant); false if none.
    async fn update_webhook(&self, webhook: &WebhookRecord) -> Result<bool, StoreError>;
    /// Record how far its deliveries got: cursor, attempts, when next, the last answer.
    async fn set_webhook_progress(&self, webhook: &WebhookRecord) -> Result<(), StoreError>;
    async fn delete_webhook(&self, tenant_id: &str, id: &str) -> Result<bool, StoreError>;
    /// Remove every webhook of a deleted tenant.
    async fn delete_tenant_webhooks(&self, tenant_id: &str) -> Result<(), StoreError>;
    async fn insert_delivery(&self, delivery: &DeliveryRecord) -> Result<(), StoreError>;
    /// A webhook's delivery attempts, newest first, at most `limit`.
    async fn deliveries(&self, webhook_id: &str, limit: u32) -> Result<Vec<DeliveryRecord>, StoreError>;
}

#[derive(sqlx::FromRow)]
pub(super) struct EventRow {
    seq: i64,
    id: String,
    tenant_id: String,
    sandbox_id: String,
    kind: String,
    at_ms: i64,
    data: String,
}

impl From<EventRow> for EventRecord {
    fn from(r: EventRow) -> Self {
        EventRecord {
            seq: r.seq,
            id: r.id,
            tenant_id: r.tenant_id,
            sandbox_id: r.sandbox_id,
            kind: r.kind,
            at_ms: r.at_ms,
            data: serde_json::from_str(&r.data).unwrap_or(serde_json::Value::Null),
        }
    }
}

#[derive(sqlx::FromRow)]
pub(super) struct WebhookRow {
    id: String,
    tenant_id: String,
    name: String,
    url: String,
    kinds: String,
    enabled: bool,
    created_at_ms: i64,
    cursor_seq: i64,
    attempts: i64,
    next_at_ms: i64,
    last_status: Option<i64>,
    last_error: Option<String>,
    last_attempt_at_ms: Option<i64>,
}

impl From<WebhookRow> for WebhookRecord {
    fn from(r: WebhookRow) -> Self {
        WebhookRecord {
            id: r.id,
            tenant_id: r.tenant_id,
            name: r.name,
            url: r.url,
            kinds: serde_json::from_str(&r.kinds).unwrap_or_default(),
            enabled: r.enabled,
            created_at_ms: r.created_at_ms,
            cursor_seq: r.cursor_seq,
            attempts: r.attempts.clamp(0, u32::MAX as i64) as u32,
            next_at_ms: r.next_at_ms,
            last_status: r.last_status.and_then(|s| u16::try_from(s).ok()),
            last_error: r.last_error,
            last_attempt_at_ms: r.last_attempt_at_ms,
        }
    }
}

#[derive(sqlx::FromRow)]
pub(super) struct DeliveryRow {
    webhook_id: String,
    event_id: String,
    attempt: i64,
    at_ms: i64,
    status: Option<i64>,
    error: Option<String>,
    duration_ms: i64,
}

impl From<DeliveryRow> for DeliveryRecord {
    fn from(r: DeliveryRow) -> Self {
        DeliveryRecord {
            webhook_id: r.webhook_id,
            event_id: r.event_id,
            attempt: r.attempt.clamp(0, u32::MAX as i64) as u32,
            at_ms: r.at_ms,
            status: r.status.and_then(|s| u16::try_from(s).ok()),
            error: r.error,
            duration_ms: r.duration_ms.max(0) as u64,
        }
    }
}

pub(super) const EVENT_COLUMNS: &str = "seq, id, tenant_id, sandbox_id, kind, at_ms, data";
pub(super) const WEBHOOK_COLUMNS: &str = "id, tenant_id, name, url, kinds, enabled, created_at_ms, cursor_seq, \
     attempts, next_at_ms, last_status, last_error, last_attempt_at_ms";

/// The events query of `f`: its statement, with `$1` the tenant, `$2` the sandbox (or NULL),
/// `$3` the cursor, `$4` the limit.
pub(super) fn events_query(f: &EventFilter) -> (String, Option<i64>) {
    let (cmp, order, cursor) = match (f.after_seq, f.before_seq) {
        (Some(after), _) => (">", "ASC", Some(after)),
        (None, Some(before)) => ("<", "DESC", Some(before)),
        (None, None) => (">", if f.ascending { "ASC" } else { "DESC" }, None),
    };
    // Kinds as one ",a,b," text: the same statement on both stores, however many kinds.
    (
        format!(
            "SELECT {EVENT_COLUMNS} FROM events WHERE tenant_id = $1 \
             AND (CAST($2 AS TEXT) IS NULL OR sandbox_id = $2) \
             AND (CAST($3 AS BIGINT) IS NULL OR seq {cmp} $3) \
             AND ($5 = '' OR $5 LIKE '%,' || kind || ',%') \
             ORDER BY seq {order} LIMIT $4 OFFSET $6"
        ),
        cursor,
    )
}

/// [`EventFilter::kinds`] as the query's `$5`.
pub(super) fn kinds_param(f: &EventFilter) -> String {
    if f.kinds.is_empty() {
        String::new()
    } else {
        format!(",{},", f.kinds.join(","))
    }
}

/// Implements [`EventStore`] for a store whose pool is `self.pool` (both run the same SQL).
macro_rules! impl_event_store {
    ($store:ty) => {
        #[async_trait::async_trait]
        impl $crate::store::events::EventStore for $store {
            async fn insert_event(&self, e: &$crate::records::EventRecord) -> Result<i64, $crate::store::StoreError> {
                let (seq,): (i64,) = sqlx::query_as(
                    "INSERT INTO events (id, tenant_id, sandbox_id, kind, at_ms, data) \
                     VALUES ($1, $2, $3, $4, $5, $6) RETURNING seq",
                )
                .bind(&e.id)
                .bind(&e.tenant_id)
                .bind(&e.sandbox_id)
                .bind(&e.kind)
                .bind(e.at_ms)
                .bind(e.data.to_string())
                .fetch_one(&self.pool)
                .await?;
                Ok(seq)
            }

            async fn events(
                &self,
                f: &$crate::store::events::EventFilter,
            ) -> Result<Vec<$crate::records::EventRecord>, $crate::store::StoreError> {
                let (sql, cursor) = $crate::store::events::events_query(f);
                let rows: Vec<$crate::store::events::EventRow> = sqlx::query_as(&sql)
                    .bind(&f.tenant_id)
                    .bind(&f.sandbox_id)
                    .bind(cursor)
                    .bind(i64::from(f.limit))
                    .bind($crate::store::events::kinds_param(f))
                    .bind(i64::from(f.offset))
                    .fetch_all(&self.pool)
                    .await?;
                Ok(rows.into_iter().map(Into::into).collect())
            }

            async fn last_event_seq(&self) -> Result<i64, $crate::store::StoreError> {
                let (seq,): (Option<i64>,) = sqlx::query_as("SELECT MAX(seq) FROM events")
                    .fetch_one(&self.pool)
                    .await?;
                Ok(seq.unwrap_or(0))
            }

            async fn prune_events(&self, before_ms: i64) -> Result<u64, $crate::store::StoreError> {
                sqlx::query("DELETE FROM webhook_deliveries WHERE at_ms < $1")
                    .bind(before_ms)
                    .execute(&self.pool)
                    .await?;
                let done = sqlx::query("DELETE FROM events WHERE at_ms < $1")
                    .bind(before_ms)
                    .execute(&self.pool)
                    .await?;
                Ok(done.rows_affected())
            }

            async fn insert_webhook(&self, w: &$crate::records::WebhookRecord) -> Result<(), $crate::store::StoreError> {
                sqlx::query(&format!(
                    "INSERT INTO webhooks ({}) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13)",
                    $crate::store::events::WEBHOOK_COLUMNS
                ))
                .bind(&w.id)
                .bind(&w.tenant_id)
                .bind(&w.name)
                .bind(&w.url)
                .bind(serde_json::to_string(&w.kinds).unwrap_or_default())
                .bind(w.enabled)
                .bind(w.created_at_ms)
                .bind(w.cursor_seq)
                .bind(i64::from(w.attempts))
                .bind(w.next_at_ms)
                .bind(w.last_status.map(i64::from))
                .bind(&w.last_error)
                .bind(w.last_attempt_at_ms)
                .execute(&self.pool)
                .await?;
                Ok(())
            }

            async fn webhook(
                &self,
                tenant_id: &str,
                id: &str,
            ) -> Result<Option<$crate::records::WebhookRecord>, $crate::store::StoreError> {
                let row: Option<$crate::store::events::WebhookRow> = sqlx::query_as(&format!(
                    "SELECT {} FROM webhooks WHERE tenant_id = $1 AND id = $2",
                    $crate::store::events::WEBHOOK_COLUMNS
                ))
                .bind(tenant_id)
                .bind(id)
                .fetch_optional(&self.pool)
                .await?;
                Ok(row.map(Into::into))
            }

            async fn webhooks(
                &self,
                tenant_id: &str,
            ) -> Result<Vec<$crate::records::WebhookRecord>, $crate::store::StoreError> {
                let rows: Vec<$crate::store::events::WebhookRow> = sqlx::query_as(&format!(
                    "SELECT {} FROM webhooks WHERE tenant_id = $1 ORDER BY created_at_ms, id",
                    $crate::store::events::WEBHOOK_COLUMNS
                ))
                .bind(tenant_id)
                .fetch_all(&self.pool)
                .await?;
                Ok(rows.into_iter().map(Into::into).collect())
            }

            async fn enabled_webhooks(&self) -> Result<Vec<$crate::records::WebhookRecord>, $crate::store::StoreError> {
                let rows: Vec<$crate::store::events::WebhookRow> = sqlx::query_as(&format!(
                    "SELECT {} FROM webhooks WHERE enabled ORDER BY created_at_ms, id",
                    $crate::store::events::WEBHOOK_COLUMNS
                ))
                .fetch_all(&self.pool)
                .await?;
                Ok(rows.into_iter().map(Into::into).collect())
            }

            async fn update_webhook(&self, w: &$crate::records::WebhookRecord) -> Result<bool, $crate::store::StoreError> {
                let done = sqlx::query(
                    "UPDATE webhooks SET name = $3, url = $4, kinds = $5, enabled = $6 \
                     WHERE tenant_id = $1 AND id = $2",
                )
                .bind(&w.tenant_id)
                .bind(&w.id)
                .bind(&w.name)
                .bind(&w.url)
                .bind(serde_json::to_string(&w.kinds).unwrap_or_default())
                .bind(w.enabled)
                .execute(&self.pool)
                .await?;
                Ok(done.rows_affected() == 1)
            }

            async fn set_webhook_progress(
                &self,
                w: &$crate::records::WebhookRecord,
            ) -> Result<(), $crate::store::StoreError> {
                sqlx::query(
                    "UPDATE webhooks SET cursor_seq = $2, attempts = $3, next_at_ms = $4, last_status = $5, \
                     last_error = $6, last_attempt_at_ms = $7 WHERE id = $1",
                )
                .bind(&w.id)
                .bind(w.cursor_seq)
                .bind(i64::from(w.attempts))
                .bind(w.next_at_ms)
                .bind(w.last_status.map(i64::from))
                .bind(&w.last_error)
                .bind(w.last_attempt_at_ms)
                .execute(&self.pool)
                .await?;
                Ok(())
            }

            async fn delete_webhook(&self, tenant_id: &str, id: &str) -> Result<bool, $crate::store::StoreError> {
                let done = sqlx::query("DELETE FROM webhooks WHERE tenant_id = $1 AND id = $2")
                    .bind(tenant_id)
                    .bind(id)
                    .execute(&self.pool)
                    .await?;
                sqlx::query("DELETE FROM webhook_deliveries WHERE webhook_id = $1")
                    .bind(id)
                    .execute(&self.pool)
                    .await?;
                Ok(done.rows_affected() == 1)
            }

            async fn delete_tenant_webhooks(&self, tenant_id: &str) -> Result<(), $crate::store::StoreError> {
                sqlx::query(
                    "DELETE FROM webhook_deliveries WHERE webhook_id IN (SELECT id FROM webhooks WHERE tenant_id = $1)",
                )
                .bind(tenant_id)
                .execute(&self.pool)
                .await?;
                sqlx::query("DELETE FROM webhooks WHERE tenant_id = $1")
                    .bind(tenant_id)
                    .execute(&self.pool)
                    .await?;
                Ok(())
            }

            async fn insert_delivery(&self, d: &$crate::records::DeliveryRecord) -> Result<(), $crate::store::StoreError> {
                sqlx::query(
                    "INSERT INTO webhook_deliveries (webhook_id, event_id, attempt, at_ms, status, error, duration_ms) \
                     VALUES ($1, $2, $3, $4, $5, $6, $7)",
                )
                .bind(&d.webhook_id)
                .bind(&d.event_id)
                .bind(i64::from(d.attempt))
                .bind(d.at_ms)
                .bind(d.status.map(i64::from))
                .bind(&d.error)
                .bind(d.duration_ms.min(i64::MAX as u64) as i64)
                .execute(&self.pool)
                .await?;
                Ok(())
            }

            async fn deliveries(
                &self,
                webhook_id: &str,
                limit: u32,
            ) -> Result<Vec<$crate::records::DeliveryRecord>, $crate::store::StoreError> {
                let rows: Vec<$crate::store::events::DeliveryRow> = sqlx::query_as(
                    "SELECT webhook_id, event_id, attempt, at_ms, status, error, duration_ms \
                     FROM webhook_deliveries WHERE webhook_id = $1 ORDER BY at_ms DESC, attempt DESC LIMIT $2",
                )
                .bind(webhook_id)
                .bind(i64::from(limit))
                .fetch_all(&self.pool)
                .await?;
                Ok(rows.into_iter().map(Into::into).collect())
            }
        }
    };
}
pub(crate) use impl_event_store;
