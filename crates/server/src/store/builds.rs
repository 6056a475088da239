//! [`BuildStore`]: template builds and their logs (migrations sqlite 0023, pg 0012). The
//! statements are valid on both stores, so one macro implements the trait for each.

use crate::records::{BuildLogEntry, BuildRecord, BuildStatus, CachedStep};
use crate::store::StoreError;
use async_trait::async_trait;

#[async_trait]
pub trait BuildStore: Send + Sync {
    async fn insert_build(&self, build: &BuildRecord) -> Result<(), StoreError>;
    /// Write every field of `build` but its identity. False when its record is gone (its
    /// template was deleted meanwhile).
    async fn update_build(&self, build: &BuildRecord) -> Result<bool, StoreError>;
    /// The tenant's build `id`.
    async fn get_build(&self, tenant_id: &str, id: &str) -> Result<Option<BuildRecord>, StoreError>;
    /// The build of the newest assignment of the tenant's `name:tag` that is ready: what a
    /// create of it starts.
    async fn ready_build(&self, tenant_id: &str, name: &str, tag: &str) -> Result<Option<BuildRecord>, StoreError>;
    /// Every tag of the tenant's templates with the ready build it serves (the newest ready
    /// assignment of each), by name and tag.
    async fn tagged_builds(&self, tenant_id: &str) -> Result<Vec<(String, BuildRecord)>, StoreError>;
    /// Assign `tag` of the tenant's `name` to build `build_id` (it serves once ready, if it is
    /// the newest such assignment).
    async fn assign_tag(
        &self,
        tenant_id: &str,
        name: &str,
        tag: &str,
        build_id: &str,
        at_ms: i64,
    ) -> Result<(), StoreError>;
    /// Remove every assignment of the tenant's `name:tag`; false when it had none.
    async fn remove_tag(&self, tenant_id: &str, name: &str, tag: &str) -> Result<bool, StoreError>;
    /// The assignments of the tenant's `name`: (tag, build id, assigned at), newest first.
    async fn tags_of(&self, tenant_id: &str, name: &str) -> Result<Vec<(String, String, i64)>, StoreError>;
    /// The tenant's builds, newest first, of `name` only if given.
    async fn list_builds(&self, tenant_id: &str, name: Option<&str>) -> Result<Vec<BuildRecord>, StoreError>;
    /// The tenant's newest ready build whose content came from `cache_key`.
    async fn build_by_key(&self, tenant_id: &str, cache_key: &str) -> Result<Option<BuildRecord>, StoreError>;
    /// Remove every build of the tenant's `name` (every tag) with its logs and tags; returns them.
    async fn delete_builds(&self, tenant_id: &str, name: &str) -> Result<Vec<BuildRecord>, StoreError>;
    /// Every tenant's builds not ended whose heartbeat is older than `before_ms`.
    async fn stalled_builds(&self, before_ms: i64) -> Result<Vec<BuildRecord>, StoreError>;
    /// End build `id` with `error` at `step`, if it still runs and its heartbeat is older than
    /// `before_ms` (a replica that stopped); false when it ended or beat meanwhile.
    async fn fail_stalled_build(
        &self,
        id: &str,
        before_ms: i64,
        error: &str,
        step: &str,
        now_ms: i64,
    ) -> Result<bool, StoreError>;
    /// Record a step cache entry (replacing one of its key), before its image is saved: an
    /// image is claimed by a record before it exists.
    async fn put_cached_step(&self, step: &CachedStep) -> Result<(), StoreError>;
    /// The tenant's cache entry `key`, its use recorded now.
    async fn cached_step(&self, tenant_id: &str, key: &str, now_ms: i64) -> Result<Option<CachedStep>, StoreError>;
    /// The tenant's cache entries, most recently used first.
    async fn cached_steps(&self, tenant_id: &str) -> Result<Vec<CachedStep>, StoreError>;
    async fn drop_cached_step(&self, tenant_id: &str, key: &str) -> Result<(), StoreError>;
    /// Every tenant's cached steps' images (what the sweep of unclaimed images keeps).
    async fn cached_step_images(&self) -> Result<Vec<String>, StoreError>;
    /// Renew a running build's heartbeat.
    async fn beat_build(&self, id: &str, now_ms: i64) -> Result<(), StoreError>;
    /// Append `entries` (their `seq` is assigned here, after the build's last).
    async fn append_build_logs(&self, build_id: &str, entries: &[BuildLogEntry]) -> Result<(), StoreError>;
    /// Up to `limit` entries of the build's log from `offset` on.
    async fn build_logs(&self, build_id: &str, offset: i64, limit: i64) -> Result<Vec<BuildLogEntry>, StoreError>;
}

#[derive(sqlx::FromRow)]
pub(super) struct BuildRow {
    pub(super) id: String,
    tenant_id: String,
    pub(super) name: String,
    tag: String,
    status: String,
    definition: String,
    cache_key: Option<String>,
    template: Option<String>,
    digest: Option<String>,
    manifest: Option<String>,
    node: String,
    sandbox_id: Option<String>,
    step: Option<String>,
    error: Option<String>,
    error_step: Option<String>,
    created_at_ms: i64,
    finished_at_ms: Option<i64>,
    heartbeat_ms: i64,
}

impl From<BuildRow> for BuildRecord {
    fn from(r: BuildRow) -> Self {
        BuildRecord {
            id: r.id,
            tenant_id: r.tenant_id,
            name: r.name,
            tag: r.tag,
            status: BuildStatus::parse(&r.status),
            definition: r.definition,
            cache_key: r.cache_key,
            template: r.template,
            digest: r.digest,
            manifest: r.manifest,
            node: r.node,
            sandbox_id: r.sandbox_id,
            step: r.step,
            error: r.error,
            error_step: r.error_step,
            created_at_ms: r.created_at_ms,
            finished_at_ms: r.finished_at_ms,
            heartbeat_ms: r.heartbeat_ms,
        }
    }
}

#[derive(sqlx::FromRow)]
pub(super) struct CacheRow {
    tenant_id: String,
    cache_key: String,
    image_id: String,
    template: String,
    vcpu: i64,
    memory_mib: i64,
    disk_mib: i64,
    context: String,
    node: String,
    used_at_ms: i64,
}

impl From<CacheRow> for CachedStep {
    fn from(r: CacheRow) -> Self {
        CachedStep {
            tenant_id: r.tenant_id,
            cache_key: r.cache_key,
            image_id: r.image_id,
            template: r.template,
            resources: crate::model::Resources {
                vcpu: r.vcpu as u32,
                memory_mib: r.memory_mib as u32,
                disk_mib: r.disk_mib as u32,
            },
            context: r.context,
            node: r.node,
            used_at_ms: r.used_at_ms,
        }
    }
}

pub(super) const CACHE_COLUMNS: &str =
    "tenant_id, cache_key, image_id, template, vcpu, memory_mib, disk_mib, context, node, used_at_ms";

#[derive(sqlx::FromRow)]
pub(super) struct LogRow {
    seq: i64,
    at_ms: i64,
    level: String,
    step: String,
    message: String,
}

impl From<LogRow> for BuildLogEntry {
    fn from(r: LogRow) -> Self {
        BuildLogEntry {
            seq: r.seq,
            at_ms: r.at_ms,
            level: r.level,
            step: r.step,
            message: r.message,
        }
    }
}

pub(super) const COLUMNS: &str =
    "id, tenant_id, name, tag, status, definition, cache_key, template, digest, manifest, node, \
     sandbox_id, step, error, error_step, created_at_ms, finished_at_ms, heartbeat_ms";
pub(super) const ASSIGN: &str =
    "INSERT INTO template_tags (tenant_id, name, tag, build_id, assigned_at_ms) VALUES ($1, $2, $3, $4, $5)";

/// [`COLUMNS`] of the builds table under alias `t`.
pub(super) fn columns_of(t: &str) -> String {
    COLUMNS
        .split(", ")
        .map(|c| format!("{t}.{}", c.trim()))
        .collect::<Vec<_>>()
        .join(", ")
}

#[derive(sqlx::FromRow)]
pub(super) struct TaggedRow {
    pub(super) assigned_tag: String,
    #[sqlx(flatten)]
    pub(super) build: BuildRow,
}

pub(super) const INSERT: &str = "INSERT INTO template_builds (id, tenant_id, name, tag, status, definition, cache_key, \
     template, digest, manifest, node, sandbox_id, step, error, error_step, created_at_ms, finished_at_ms, heartbeat_ms) \
     VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17, $18)";
pub(super) const UPDATE: &str = "UPDATE template_builds SET status = $2, cache_key = $3, template = $4, digest = $5, \
     manifest = $6, node = $7, sandbox_id = $8, step = $9, error = $10, error_step = $11, finished_at_ms = $12, \
     heartbeat_ms = $13, definition = $14 WHERE id = $1 AND status IN ('waiting', 'building')";

/// Implements [`BuildStore`] for a store whose pool is `self.pool` (both run the same SQL).
macro_rules! impl_build_store {
    ($store:ty) => {
        #[async_trait::async_trait]
        impl $crate::store::builds::BuildStore for $store {
            async fn insert_build(&self, b: &$crate::records::BuildRecord) -> Result<(), $crate::store::StoreError> {
                sqlx::query($crate::store::builds::INSERT)
                    .bind(&b.id)
                    .bind(&b.tenant_id)
                    .bind(&b.name)
                    .bind(&b.tag)
                    .bind(b.status.as_str())
                    .bind(&b.definition)
                    .bind(&b.cache_key)
                    .bind(&b.template)
                    .bind(&b.digest)
                    .bind(&b.manifest)
                    .bind(&b.node)
                    .bind(&b.sandbox_id)
                    .bind(&b.step)
                    .bind(&b.error)
                    .bind(&b.error_step)
                    .bind(b.created_at_ms)
                    .bind(b.finished_at_ms)
                    .bind(b.heartbeat_ms)
                    .execute(&self.pool)
                    .await?;
                sqlx::query($crate::store::builds::ASSIGN)
                    .bind(&b.tenant_id)
                    .bind(&b.name)
                    .bind(&b.tag)
                    .bind(&b.id)
                    .bind(b.created_at_ms)
                    .execute(&self.pool)
                    .await?;
                Ok(())
            }

            async fn update_build(&self, b: &$crate::records::BuildRecord) -> Result<bool, $crate::store::StoreError> {
                let done = sqlx::query($crate::store::builds::UPDATE)
                    .bind(&b.id)
                    .bind(b.status.as_str())
                    .bind(&b.cache_key)
                    .bind(&b.template)
                    .bind(&b.digest)
                    .bind(&b.manifest)
                    .bind(&b.node)
                    .bind(&b.sandbox_id)
                    .bind(&b.step)
                    .bind(&b.error)
                    .bind(&b.error_step)
                    .bind(b.finished_at_ms)
                    .bind(b.heartbeat_ms)
                    .bind(&b.definition)
                    .execute(&self.pool)
                    .await?;
                Ok(done.rows_affected() > 0)
            }

            async fn get_build(
                &self,
                tenant_id: &str,
                id: &str,
            ) -> Result<Option<$crate::records::BuildRecord>, $crate::store::StoreError> {
                let q = format!(
                    "SELECT {} FROM template_builds WHERE tenant_id = $1 AND id = $2",
                    $crate::store::builds::COLUMNS
                );
                let row: Option<$crate::store::builds::BuildRow> =
                    sqlx::query_as(&q).bind(tenant_id).bind(id).fetch_optional(&self.pool).await?;
                Ok(row.map(Into::into))
            }

            async fn ready_build(
                &self,
                tenant_id: &str,
                name: &str,
                tag: &str,
            ) -> Result<Option<$crate::records::BuildRecord>, $crate::store::StoreError> {
                let q = format!(
                    "SELECT {} FROM template_tags t JOIN template_builds b ON b.id = t.build_id \
                     WHERE t.tenant_id = $1 AND t.name = $2 AND t.tag = $3 AND b.status = 'ready' \
                     ORDER BY t.assigned_at_ms DESC, b.finished_at_ms DESC LIMIT 1",
                    $crate::store::builds::columns_of("b")
                );
                let row: Option<$crate::store::builds::BuildRow> = sqlx::query_as(&q)
                    .bind(tenant_id)
                    .bind(name)
                    .bind(tag)
                    .fetch_optional(&self.pool)
                    .await?;
                Ok(row.map(Into::into))
            }

            async fn tagged_builds(
                &self,
                tenant_id: &str,
            ) -> Result<Vec<(String, $crate::records::BuildRecord)>, $crate::store::StoreError> {
                let q = format!(
                    "SELECT t.tag AS assigned_tag, {} FROM template_tags t JOIN template_builds b ON b.id = t.build_id \
                     WHERE t.tenant_id = $1 AND b.status = 'ready' \
                     ORDER BY t.name, t.tag, t.assigned_at_ms DESC, b.finished_at_ms DESC",
                    $crate::store::builds::columns_of("b")
                );
                let rows: Vec<$crate::store::builds::TaggedRow> =
                    sqlx::query_as(&q).bind(tenant_id).fetch_all(&self.pool).await?;
                let mut out: Vec<(String, $crate::records::BuildRecord)> = Vec::new();
                for r in rows {
                    let b: $crate::records::BuildRecord = r.build.into();
                    if !out.iter().any(|(t, o)| *t == r.assigned_tag && o.name == b.name) {
                        out.push((r.assigned_tag, b));
                    }
                }
                Ok(out)
            }

            async fn assign_tag(
                &self,
                tenant_id: &str,
                name: &str,
                tag: &str,
                build_id: &str,
                at_ms: i64,
            ) -> Result<(), $crate::store::StoreError> {
                sqlx::query("DELETE FROM template_tags WHERE tenant_id = $1 AND name = $2 AND tag = $3 AND build_id = $4")
                    .bind(tenant_id)
                    .bind(name)
                    .bind(tag)
                    .bind(build_id)
                    .execute(&self.pool)
                    .await?;
                sqlx::query($crate::store::builds::ASSIGN)
                    .bind(tenant_id)
                    .bind(name)
                    .bind(tag)
                    .bind(build_id)
                    .bind(at_ms)
                    .execute(&self.pool)
                    .await?;
                Ok(())
            }

            async fn remove_tag(&self, tenant_id: &str, name: &str, tag: &str) -> Result<bool, $crate::store::StoreError> {
                let done = sqlx::query("DELETE FROM template_tags WHERE tenant_id = $1 AND name = $2 AND tag = $3")
                    .bind(tenant_id)
                    .bind(name)
                    .bind(tag)
                    .execute(&self.pool)
                    .await?;
                Ok(done.rows_affected() > 0)
            }

            async fn tags_of(
                &self,
                tenant_id: &str,
                name: &str,
            ) -> Result<Vec<(String, String, i64)>, $crate::store::StoreError> {
                Ok(sqlx::query_as(
                    "SELECT tag, build_id, assigned_at_ms FROM template_tags WHERE tenant_id = $1 AND name = $2 \
                     ORDER BY assigned_at_ms DESC, tag",
                )
                .bind(tenant_id)
                .bind(name)
                .fetch_all(&self.pool)
                .await?)
            }

            async fn list_builds(
                &self,
                tenant_id: &str,
                name: Option<&str>,
            ) -> Result<Vec<$crate::records::BuildRecord>, $crate::store::StoreError> {
                let q = format!(
                    "SELECT {} FROM template_builds WHERE tenant_id = $1 ORDER BY created_at_ms DESC, id",
                    $crate::store::builds::COLUMNS
                );
                let rows: Vec<$crate::store::builds::BuildRow> =
                    sqlx::query_as(&q).bind(tenant_id).fetch_all(&self.pool).await?;
                Ok(rows
                    .into_iter()
                    .filter(|r| name.is_none_or(|n| r.name == n))
                    .map(Into::into)
                    .collect())
            }

            async fn build_by_key(
                &self,
                tenant_id: &str,
                cache_key: &str,
            ) -> Result<Option<$crate::records::BuildRecord>, $crate::store::StoreError> {
                let q = format!(
                    "SELECT {} FROM template_builds WHERE tenant_id = $1 AND cache_key = $2 AND status = 'ready' \
                     ORDER BY finished_at_ms DESC, id LIMIT 1",
                    $crate::store::builds::COLUMNS
                );
                let row: Option<$crate::store::builds::BuildRow> = sqlx::query_as(&q)
                    .bind(tenant_id)
                    .bind(cache_key)
                    .fetch_optional(&self.pool)
                    .await?;
                Ok(row.map(Into::into))
            }

            async fn delete_builds(
                &self,
                tenant_id: &str,
                name: &str,
            ) -> Result<Vec<$crate::records::BuildRecord>, $crate::store::StoreError> {
                let q = format!(
                    "DELETE FROM template_builds WHERE tenant_id = $1 AND name = $2 RETURNING {}",
                    $crate::store::builds::COLUMNS
                );
                let rows: Vec<$crate::store::builds::BuildRow> =
                    sqlx::query_as(&q).bind(tenant_id).bind(name).fetch_all(&self.pool).await?;
                for r in &rows {
                    sqlx::query("DELETE FROM template_build_logs WHERE build_id = $1")
                        .bind(&r.id)
                        .execute(&self.pool)
                        .await?;
                }
                sqlx::query("DELETE FROM template_tags WHERE tenant_id = $1 AND name = $2")
                    .bind(tenant_id)
                    .bind(name)
                    .execute(&self.pool)
                    .await?;
                Ok(rows.into_iter().map(Into::into).collect())
            }

            async fn stalled_builds(
                &self,
                before_ms: i64,
            ) -> Result<Vec<$crate::records::BuildRecord>, $crate::store::StoreError> {
                let q = format!(
                    "SELECT {} FROM template_builds WHERE status IN ('waiting', 'building') AND heartbeat_ms < $1",
                    $crate::store::builds::COLUMNS
                );
                let rows: Vec<$crate::store::builds::BuildRow> =
                    sqlx::query_as(&q).bind(before_ms).fetch_all(&self.pool).await?;
                Ok(rows.into_iter().map(Into::into).collect())
            }

            async fn fail_stalled_build(
                &self,
                id: &str,
                before_ms: i64,
                error: &str,
                step: &str,
                now_ms: i64,
            ) -> Result<bool, $crate::store::StoreError> {
                let done = sqlx::query(
                    "UPDATE template_builds SET status = 'error', error = $3, error_step = $4, finished_at_ms = $5, \
                     heartbeat_ms = $5 WHERE id = $1 AND status IN ('waiting', 'building') AND heartbeat_ms < $2",
                )
                .bind(id)
                .bind(before_ms)
                .bind(error)
                .bind(step)
                .bind(now_ms)
                .execute(&self.pool)
                .await?;
                Ok(done.rows_affected() > 0)
            }

            async fn put_cached_step(&self, c: &$crate::records::CachedStep) -> Result<(), $crate::store::StoreError> {
                sqlx::query("DELETE FROM template_build_cache WHERE tenant_id = $1 AND cache_key = $2")
                    .bind(&c.tenant_id)
                    .bind(&c.cache_key)
                    .execute(&self.pool)
                    .await?;
                sqlx::query(
                    "INSERT INTO template_build_cache (tenant_id, cache_key, image_id, template, vcpu, memory_mib, \
                     disk_mib, context, node, used_at_ms) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)",
                )
                .bind(&c.tenant_id)
                .bind(&c.cache_key)
                .bind(&c.image_id)
                .bind(&c.template)
                .bind(c.resources.vcpu as i64)
                .bind(c.resources.memory_mib as i64)
                .bind(c.resources.disk_mib as i64)
                .bind(&c.context)
                .bind(&c.node)
                .bind(c.used_at_ms)
                .execute(&self.pool)
                .await?;
                Ok(())
            }

            async fn cached_step(
                &self,
                tenant_id: &str,
                key: &str,
                now_ms: i64,
            ) -> Result<Option<$crate::records::CachedStep>, $crate::store::StoreError> {
                sqlx::query("UPDATE template_build_cache SET used_at_ms = $3 WHERE tenant_id = $1 AND cache_key = $2")
                    .bind(tenant_id)
                    .bind(key)
                    .bind(now_ms)
                    .execute(&self.pool)
                    .await?;
                let q = format!(
                    "SELECT {} FROM template_build_cache WHERE tenant_id = $1 AND cache_key = $2",
                    $crate::store::builds::CACHE_COLUMNS
                );
                let row: Option<$crate::store::builds::CacheRow> =
                    sqlx::query_as(&q).bind(tenant_id).bind(key).fetch_optional(&self.pool).await?;
                Ok(row.map(Into::into))
            }

            async fn cached_steps(
                &self,
                tenant_id: &str,
            ) -> Result<Vec<$crate::records::CachedStep>, $crate::store::StoreError> {
                let q = format!(
                    "SELECT {} FROM template_build_cache WHERE tenant_id = $1 ORDER BY used_at_ms DESC, cache_key",
                    $crate::store::builds::CACHE_COLUMNS
                );
                let rows: Vec<$crate::store::builds::CacheRow> =
                    sqlx::query_as(&q).bind(tenant_id).fetch_all(&self.pool).await?;
                Ok(rows.into_iter().map(Into::into).collect())
            }

            async fn drop_cached_step(&self, tenant_id: &str, key: &str) -> Result<(), $crate::store::StoreError> {
                sqlx::query("DELETE FROM template_build_cache WHERE tenant_id = $1 AND cache_key = $2")
                    .bind(tenant_id)
                    .bind(key)
                    .execute(&self.pool)
                    .await?;
                Ok(())
            }

            async fn cached_step_images(&self) -> Result<Vec<String>, $crate::store::StoreError> {
                let rows: Vec<(String,)> = sqlx::query_as("SELECT image_id FROM template_build_cache")
                    .fetch_all(&self.pool)
                    .await?;
                Ok(rows.into_iter().map(|r| r.0).collect())
            }

            async fn beat_build(&self, id: &str, now_ms: i64) -> Result<(), $crate::store::StoreError> {
                sqlx::query("UPDATE template_builds SET heartbeat_ms = $2 WHERE id = $1")
                    .bind(id)
                    .bind(now_ms)
                    .execute(&self.pool)
                    .await?;
                Ok(())
            }

            async fn append_build_logs(
                &self,
                build_id: &str,
                entries: &[$crate::records::BuildLogEntry],
            ) -> Result<(), $crate::store::StoreError> {
                // One writer per build (the replica running it), so the next seq is its own.
                let (next,): (i64,) =
                    sqlx::query_as("SELECT COALESCE(MAX(seq) + 1, 0) FROM template_build_logs WHERE build_id = $1")
                        .bind(build_id)
                        .fetch_one(&self.pool)
                        .await?;
                for (i, e) in entries.iter().enumerate() {
                    sqlx::query(
                        "INSERT INTO template_build_logs (build_id, seq, at_ms, level, step, message) \
                         VALUES ($1, $2, $3, $4, $5, $6)",
                    )
                    .bind(build_id)
                    .bind(next + i as i64)
                    .bind(e.at_ms)
                    .bind(&e.level)
                    .bind(&e.step)
                    .bind(&e.message)
                    .execute(&self.pool)
                    .await?;
                }
                Ok(())
            }

            async fn build_logs(
                &self,
                build_id: &str,
                offset: i64,
                limit: i64,
            ) -> Result<Vec<$crate::records::BuildLogEntry>, $crate::store::StoreError> {
                let rows: Vec<$crate::store::builds::LogRow> = sqlx::query_as(
                    "SELECT seq, at_ms, level, step, message FROM template_build_logs \
                     WHERE build_id = $1 AND seq >= $2 ORDER BY seq LIMIT $3",
                )
                .bind(build_id)
                .bind(offset)
                .bind(limit)
                .fetch_all(&self.pool)
                .await?;
                Ok(rows.into_iter().map(Into::into).collect())
            }
        }
    };
}
pub(super) use impl_build_store;
