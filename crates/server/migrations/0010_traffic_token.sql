-- A sandbox's traffic token (E2B's `trafficAccessToken`: it opens the sandbox's ports and
-- nothing else), hashed beside its envd access token. Sandboxes from before this migration get
-- one when the E2B door hands their tokens out again (get, connect).
ALTER TABLE sandbox_access ADD COLUMN traffic_hash TEXT;
CREATE UNIQUE INDEX sandbox_access_traffic ON sandbox_access (traffic_hash) WHERE traffic_hash IS NOT NULL;
