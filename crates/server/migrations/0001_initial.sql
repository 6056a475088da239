-- The schema before versioned migrations, verbatim: a database made by that code gets this as a no-op.
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
