-- Snapshots: images saved from a running sandbox (memory, processes, disk) that new sandboxes
-- start from, owned by the tenant that made them. `kind` is `snapshot` (named by the tenant,
-- kept until deleted) or `fork` (the image a fork's children start from, removed once they
-- have). A sandbox made from one records it in `image_id`.
ALTER TABLE sandboxes ADD COLUMN image_id TEXT;
CREATE TABLE snapshots (
  id TEXT PRIMARY KEY,
  tenant_id TEXT NOT NULL,
  name TEXT,
  kind TEXT NOT NULL DEFAULT 'snapshot',
  sandbox_id TEXT NOT NULL,
  template TEXT NOT NULL,
  vcpu INTEGER NOT NULL,
  memory_mib INTEGER NOT NULL,
  disk_mib INTEGER NOT NULL,
  bytes INTEGER NOT NULL,
  created_at_ms INTEGER NOT NULL
);
CREATE UNIQUE INDEX snapshots_tenant_name ON snapshots (tenant_id, name) WHERE name IS NOT NULL;
CREATE INDEX snapshots_tenant_created ON snapshots (tenant_id, created_at_ms);
