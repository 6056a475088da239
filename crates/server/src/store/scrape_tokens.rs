//! [`ScrapeTokenStore`]: the tokens a Prometheus presents to read `GET /metrics` (migrations
//! sqlite 0025, pg 0014), kept by their sha256 only. The statements are valid on both stores,
//! so one macro implements the trait.

use crate::records::ScrapeTokenRecord;
use crate::store::StoreError;
use async_trait::async_trait;

#[async_trait]
pub trait ScrapeTokenStore: Send + Sync {
    /// Record a scrape token (by its hash).
    async fn insert_scrape_token(&self, token: &ScrapeTokenRecord, token_hash: &str) -> Result<(), StoreError>;
    /// The id of the scrape token with this hash, if there is one.
    async fn scrape_token(&self, token_hash: &str) -> Result<Option<String>, StoreError>;
    /// Every scrape token, oldest first.
    async fn scrape_tokens(&self) -> Result<Vec<ScrapeTokenRecord>, StoreError>;
    /// Remove scrape token `id`; false if there is none.
    async fn delete_scrape_token(&self, id: &str) -> Result<bool, StoreError>;
}

#[derive(sqlx::FromRow)]
pub(super) struct ScrapeTokenRow {
    id: String,
    name: String,
    created_by: String,
    created_at_ms: i64,
}

impl From<ScrapeTokenRow> for ScrapeTokenRecord {
    fn from(r: ScrapeTokenRow) -> Self {
        ScrapeTokenRecord {
            id: r.id,
            name: r.name,
            created_by: r.created_by,
            created_at_ms: r.created_at_ms,
        }
    }
}

/// Implements [`ScrapeTokenStore`] for a store whose pool is `self.pool` (both run the same SQL).
macro_rules! impl_scrape_token_store {
    ($store:ty) => {
        #[async_trait::async_trait]
        impl $crate::store::scrape_tokens::ScrapeTokenStore for $store {
            async fn insert_scrape_token(
                &self,
                t: &$crate::records::ScrapeTokenRecord,
                token_hash: &str,
            ) -> Result<(), $crate::store::StoreError> {
                sqlx::query(
                    "INSERT INTO scrape_tokens (id, token_hash, name, created_by, created_at_ms) \
                     VALUES ($1, $2, $3, $4, $5)",
                )
                .bind(&t.id)
                .bind(token_hash)
                .bind(&t.name)
                .bind(&t.created_by)
                .bind(t.created_at_ms)
                .execute(&self.pool)
                .await?;
                Ok(())
            }

            async fn scrape_token(&self, token_hash: &str) -> Result<Option<String>, $crate::store::StoreError> {
                let row: Option<(String,)> = sqlx::query_as("SELECT id FROM scrape_tokens WHERE token_hash = $1")
                    .bind(token_hash)
                    .fetch_optional(&self.pool)
                    .await?;
                Ok(row.map(|(id,)| id))
            }

            async fn scrape_tokens(
                &self,
            ) -> Result<Vec<$crate::records::ScrapeTokenRecord>, $crate::store::StoreError> {
                let rows: Vec<$crate::store::scrape_tokens::ScrapeTokenRow> = sqlx::query_as(
                    "SELECT id, name, created_by, created_at_ms FROM scrape_tokens ORDER BY created_at_ms, id",
                )
                .fetch_all(&self.pool)
                .await?;
                Ok(rows.into_iter().map(Into::into).collect())
            }

            async fn delete_scrape_token(&self, id: &str) -> Result<bool, $crate::store::StoreError> {
                let done = sqlx::query("DELETE FROM scrape_tokens WHERE id = $1")
                    .bind(id)
                    .execute(&self.pool)
                    .await?;
                Ok(done.rows_affected() == 1)
            }
        }
    };
}
pub(crate) use impl_scrape_token_store;
