-- airlock's schema on Postgres: the end state of the SQLite chain (crates/server/migrations,
-- 0001 to 0012) in one step; see those files for what each column means. The same tables and
-- columns (a test compares them), in Postgres' own types: times are ms since the epoch (BIGINT),
-- flags BOOLEAN, JSON documents JSONB. Ids that lists order and page by compare byte-wise
-- (COLLATE "C"), as SQLite's do, whatever the database's locale.

CREATE TABLE tenants (
  id TEXT PRIMARY KEY,
  name TEXT COLLATE "C" NOT NULL UNIQUE,
  created_at_ms BIGINT NOT NULL);

CREATE TABLE api_keys (
  hash TEXT PRIMARY KEY,
  tenant_id TEXT NOT NULL REFERENCES tenants(id),
  prefix TEXT NOT NULL,
  created_at_ms BIGINT NOT NULL,
  id TEXT COLLATE "C",
  name TEXT NOT NULL DEFAULT '',
  last_used_at_ms BIGINT,
  revoked_at_ms BIGINT);
CREATE UNIQUE INDEX api_keys_id ON api_keys(id);

CREATE TABLE sandboxes (
  id TEXT COLLATE "C" PRIMARY KEY,
  tenant_id TEXT NOT NULL,
  state TEXT NOT NULL,
  template TEXT NOT NULL,
  template_digest TEXT NOT NULL,
  runtime TEXT NOT NULL,
  accel TEXT NOT NULL,
  vcpu BIGINT NOT NULL,
  memory_mib BIGINT NOT NULL,
  disk_mib BIGINT NOT NULL,
  env JSONB NOT NULL,
  metadata JSONB NOT NULL,
  created_at_ms BIGINT NOT NULL,
  expires_at_ms BIGINT NOT NULL,
  egress_profiles JSONB NOT NULL DEFAULT '[]',
  egress_sealed BOOLEAN NOT NULL DEFAULT TRUE,
  egress_policy JSONB NOT NULL DEFAULT '{}',
  started_from TEXT,
  start_ms BIGINT,
  on_timeout TEXT NOT NULL DEFAULT 'delete',
  auto_resume BOOLEAN NOT NULL DEFAULT FALSE,
  timeout_ms BIGINT NOT NULL DEFAULT 300000,
  image_id TEXT,
  saved_mib BIGINT NOT NULL DEFAULT 0);
CREATE INDEX sandboxes_tenant ON sandboxes(tenant_id, created_at_ms, id);

CREATE TABLE operations (
  id TEXT PRIMARY KEY,
  tenant_id TEXT NOT NULL,
  kind TEXT NOT NULL,
  state TEXT NOT NULL,
  sandbox_id TEXT NOT NULL,
  error_code TEXT,
  error_message TEXT,
  idempotency_key TEXT,
  created_at_ms BIGINT NOT NULL,
  finished_at_ms BIGINT);
CREATE UNIQUE INDEX operations_idem ON operations(tenant_id, idempotency_key) WHERE idempotency_key IS NOT NULL;
CREATE INDEX operations_recent_creates ON operations(tenant_id, kind, created_at_ms);

CREATE TABLE sessions (
  id TEXT COLLATE "C" PRIMARY KEY,
  sandbox_id TEXT NOT NULL,
  process_id BIGINT NOT NULL,
  argv JSONB NOT NULL,
  cwd TEXT NOT NULL,
  "user" TEXT NOT NULL,
  pty BOOLEAN NOT NULL,
  exit_code INTEGER,
  signal INTEGER,
  timed_out BOOLEAN NOT NULL,
  exited BOOLEAN NOT NULL,
  started_at_ms BIGINT NOT NULL,
  ended_at_ms BIGINT,
  tag TEXT);
CREATE INDEX sessions_sandbox ON sessions(sandbox_id, started_at_ms);
CREATE INDEX sessions_process ON sessions(sandbox_id, process_id);

CREATE TABLE paused_lifetimes (sandbox_id TEXT PRIMARY KEY, remaining_ms BIGINT NOT NULL);

CREATE TABLE sandbox_access (
  sandbox_id TEXT PRIMARY KEY,
  token_hash TEXT NOT NULL UNIQUE,
  traffic_hash TEXT);
CREATE UNIQUE INDEX sandbox_access_traffic ON sandbox_access (traffic_hash) WHERE traffic_hash IS NOT NULL;

CREATE TABLE e2b_sandboxes (sandbox_id TEXT PRIMARY KEY, template_alias TEXT NOT NULL);

CREATE TABLE tenant_egress (
  tenant_id TEXT PRIMARY KEY REFERENCES tenants(id),
  policy JSONB NOT NULL,
  updated_at_ms BIGINT NOT NULL);

CREATE TABLE tenant_quotas (
  tenant_id TEXT PRIMARY KEY REFERENCES tenants(id),
  sandboxes BIGINT,
  vcpu BIGINT,
  memory_mib BIGINT,
  disk_mib BIGINT,
  sessions_per_sandbox BIGINT,
  creates_per_minute BIGINT,
  updated_at_ms BIGINT NOT NULL);

CREATE TABLE console_accounts (
  name TEXT PRIMARY KEY,
  password_hash TEXT NOT NULL,
  updated_at_ms BIGINT NOT NULL);

CREATE TABLE admin_sessions (
  token_hash TEXT PRIMARY KEY,
  account TEXT NOT NULL,
  created_at_ms BIGINT NOT NULL,
  expires_at_ms BIGINT NOT NULL);

CREATE TABLE audit (
  seq BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
  at_ms BIGINT NOT NULL,
  actor TEXT NOT NULL,
  tenant TEXT,
  action TEXT NOT NULL,
  object TEXT,
  result TEXT NOT NULL,
  count BIGINT NOT NULL DEFAULT 1);
CREATE INDEX audit_at ON audit(at_ms);

CREATE TABLE snapshots (
  id TEXT COLLATE "C" PRIMARY KEY,
  tenant_id TEXT NOT NULL,
  name TEXT,
  kind TEXT NOT NULL DEFAULT 'snapshot',
  sandbox_id TEXT NOT NULL,
  template TEXT NOT NULL,
  vcpu BIGINT NOT NULL,
  memory_mib BIGINT NOT NULL,
  disk_mib BIGINT NOT NULL,
  bytes BIGINT NOT NULL,
  created_at_ms BIGINT NOT NULL,
  digest TEXT,
  state TEXT NOT NULL DEFAULT 'ready',
  held_mib BIGINT NOT NULL DEFAULT 0);
CREATE UNIQUE INDEX snapshots_tenant_name ON snapshots (tenant_id, name) WHERE name IS NOT NULL;
CREATE INDEX snapshots_tenant_created ON snapshots (tenant_id, created_at_ms);
CREATE INDEX snapshots_tenant_digest ON snapshots (tenant_id, digest) WHERE digest IS NOT NULL;
