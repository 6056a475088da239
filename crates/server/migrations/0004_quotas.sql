-- Per-tenant quotas (issue 11). A NULL column: the server's default for that limit
-- (`--max-sandboxes`, `--max-sessions`; none for the others, the node's budgets still apply).
CREATE TABLE tenant_quotas (
  tenant_id TEXT PRIMARY KEY REFERENCES tenants(id),
  sandboxes INTEGER,
  vcpu INTEGER,
  memory_mib INTEGER,
  disk_mib INTEGER,
  sessions_per_sandbox INTEGER,
  creates_per_minute INTEGER,
  updated_at_ms INTEGER NOT NULL);

-- Creates per minute count the tenant's recent create operations.
CREATE INDEX IF NOT EXISTS operations_recent_creates ON operations(tenant_id, kind, created_at_ms);
