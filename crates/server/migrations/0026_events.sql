-- Lifecycle events (issue 28): every change of a sandbox, kept 7 days, in the order recorded
-- (`seq`: the cursor of the events API, its SSE ids and each webhook's progress).
CREATE TABLE events (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    tenant_id TEXT NOT NULL,
    sandbox_id TEXT NOT NULL,
    kind TEXT NOT NULL,
    at_ms BIGINT NOT NULL,
    data TEXT NOT NULL
);
CREATE INDEX events_by_tenant ON events (tenant_id, seq);
CREATE INDEX events_by_sandbox ON events (sandbox_id, seq);
CREATE INDEX events_by_time ON events (at_ms);
-- A tenant's webhooks: where its events are delivered, signed (the signing secret is derived
-- from the server secret and the webhook's id, never stored). `cursor_seq`: the last event
-- handled (delivered, or given up on after its attempts); `attempts` and `next_at_ms`: the
-- next event's tries so far and when it is tried again.
CREATE TABLE webhooks (
    id TEXT PRIMARY KEY,
    tenant_id TEXT NOT NULL,
    name TEXT NOT NULL,
    url TEXT NOT NULL,
    kinds TEXT NOT NULL,
    enabled BOOLEAN NOT NULL,
    created_at_ms BIGINT NOT NULL,
    cursor_seq BIGINT NOT NULL,
    attempts BIGINT NOT NULL DEFAULT 0,
    next_at_ms BIGINT NOT NULL DEFAULT 0,
    last_status BIGINT,
    last_error TEXT,
    last_attempt_at_ms BIGINT
);
CREATE INDEX webhooks_by_tenant ON webhooks (tenant_id);
-- Each delivery attempt, kept 7 days like the events.
CREATE TABLE webhook_deliveries (
    webhook_id TEXT NOT NULL,
    event_id TEXT NOT NULL,
    attempt BIGINT NOT NULL,
    at_ms BIGINT NOT NULL,
    status BIGINT,
    error TEXT,
    duration_ms BIGINT NOT NULL
);
CREATE INDEX webhook_deliveries_by_webhook ON webhook_deliveries (webhook_id, at_ms);
