-- Egress (issue 10). A sandbox's egress is fixed at create: the profiles chosen (JSON array of
-- names), whether it is sealed (no egress at all), and the tenant base policy it was created
-- under, narrowed by the create (JSON: {"allow": {...}, "deny": {...}}). Sandboxes made before
-- egress existed had no NIC: they read as sealed.
ALTER TABLE sandboxes ADD COLUMN egress_profiles TEXT NOT NULL DEFAULT '[]';
ALTER TABLE sandboxes ADD COLUMN egress_sealed INTEGER NOT NULL DEFAULT 1;
ALTER TABLE sandboxes ADD COLUMN egress_policy TEXT NOT NULL DEFAULT '{}';

-- A tenant's base egress policy (same JSON shape); a tenant without a row allows nothing.
CREATE TABLE tenant_egress (
  tenant_id TEXT PRIMARY KEY REFERENCES tenants(id),
  policy TEXT NOT NULL,
  updated_at_ms INTEGER NOT NULL);
