-- Many replicas (issue 25): an unfinished operation is leased by the process running it
-- (`lease_holder`) until `lease_until_ms`, renewed while it runs. Another replica takes over
-- only an operation whose lease lapsed, so none is run twice and none is left stuck.
ALTER TABLE operations ADD COLUMN lease_holder TEXT NOT NULL DEFAULT '';
ALTER TABLE operations ADD COLUMN lease_until_ms INTEGER NOT NULL DEFAULT 0;
CREATE INDEX operations_unfinished ON operations(state, lease_until_ms);
