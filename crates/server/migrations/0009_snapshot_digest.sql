-- A snapshot's content address (`sha256:<hex>` over its saved state, its disk and what they sit
-- on), computed once its image is saved; a create may name the snapshot by it. Forks' images
-- have none. Snapshots made before this migration keep NULL.
ALTER TABLE snapshots ADD COLUMN digest TEXT;
CREATE INDEX snapshots_tenant_digest ON snapshots (tenant_id, digest) WHERE digest IS NOT NULL;
