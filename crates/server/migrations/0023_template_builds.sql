-- Custom templates (issue 26): a tenant's template builds. A template is a (tenant, name, tag)
-- whose newest ready build serves it; a build in progress leaves the older one serving.
-- `template` is the built image's name in the nodes' template stores, `manifest` its node manifest (JSON), `cache_key` what its
-- content came from (parent digest and steps), `heartbeat_ms` renewed while a replica runs it:
-- one that stopped (a crash) is failed by any replica's reaper.
CREATE TABLE template_builds (
    id TEXT PRIMARY KEY,
    tenant_id TEXT NOT NULL,
    name TEXT NOT NULL,
    tag TEXT NOT NULL,
    status TEXT NOT NULL,
    definition TEXT NOT NULL,
    cache_key TEXT,
    template TEXT,
    digest TEXT,
    manifest TEXT,
    node TEXT NOT NULL DEFAULT '',
    sandbox_id TEXT,
    step TEXT,
    error TEXT,
    error_step TEXT,
    created_at_ms BIGINT NOT NULL,
    finished_at_ms BIGINT,
    heartbeat_ms BIGINT NOT NULL
);
CREATE INDEX template_builds_by_name ON template_builds (tenant_id, name, tag, status);
CREATE TABLE template_build_logs (
    build_id TEXT NOT NULL,
    seq BIGINT NOT NULL,
    at_ms BIGINT NOT NULL,
    level TEXT NOT NULL,
    step TEXT NOT NULL,
    message TEXT NOT NULL,
    PRIMARY KEY (build_id, seq)
);
-- A tag names a build of a template (E2B's tag assignments): a create of `name:tag` starts the
-- newest assignment whose build is ready. A build's own tag is assigned when it is recorded.
CREATE TABLE template_tags (
    tenant_id TEXT NOT NULL,
    name TEXT NOT NULL,
    tag TEXT NOT NULL,
    build_id TEXT NOT NULL,
    assigned_at_ms BIGINT NOT NULL,
    PRIMARY KEY (tenant_id, name, tag, build_id)
);
-- The step cache: the build VM saved (an image on `node`) after a step, under the key of
-- everything that made it (parent digest, shape, each step so far); per tenant. `context` is
-- the user, workdir and env the steps so far left (JSON).
CREATE TABLE template_build_cache (
    tenant_id TEXT NOT NULL,
    cache_key TEXT NOT NULL,
    image_id TEXT NOT NULL,
    template TEXT NOT NULL,
    vcpu BIGINT NOT NULL,
    memory_mib BIGINT NOT NULL,
    disk_mib BIGINT NOT NULL,
    context TEXT NOT NULL,
    node TEXT NOT NULL DEFAULT '',
    used_at_ms BIGINT NOT NULL,
    PRIMARY KEY (tenant_id, cache_key)
);
