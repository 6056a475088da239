-- Scrape tokens (issue 28): what a Prometheus server presents to read `GET /metrics`, minted by
-- the platform account. Only the token's sha256 is kept; the token is shown once.
CREATE TABLE scrape_tokens (
    id TEXT PRIMARY KEY,
    token_hash TEXT NOT NULL UNIQUE,
    name TEXT NOT NULL,
    created_by TEXT NOT NULL,
    created_at_ms BIGINT NOT NULL
);
