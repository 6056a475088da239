-- Volumes (issue 27): a tenant's named disks that outlive sandboxes, each on one node (its
-- `node`, '' in single-host mode). `token_hash`: the volume's own token for E2B's content API
-- (sha256, the token itself shown once).
CREATE TABLE volumes (
    id TEXT PRIMARY KEY,
    tenant_id TEXT NOT NULL,
    name TEXT NOT NULL,
    size_mib BIGINT NOT NULL,
    node TEXT NOT NULL DEFAULT '',
    token_hash TEXT NOT NULL DEFAULT '',
    created_at_ms BIGINT NOT NULL,
    UNIQUE (tenant_id, name)
);
-- What each sandbox mounts, in order; a live sandbox's rows are what hold a volume.
CREATE TABLE sandbox_volumes (
    sandbox_id TEXT NOT NULL,
    position BIGINT NOT NULL,
    volume_id TEXT NOT NULL,
    path TEXT NOT NULL,
    read_only BOOLEAN NOT NULL,
    PRIMARY KEY (sandbox_id, position)
);
CREATE INDEX sandbox_volumes_by_volume ON sandbox_volumes (volume_id);
ALTER TABLE tenant_quotas ADD COLUMN volume_mib BIGINT;
