-- How each sandbox's VM started: `boot` or `restore` (from a base snapshot), and how long it took
-- from the VMM's start to the agent's READY. NULL until the VM runs.
ALTER TABLE sandboxes ADD COLUMN started_from TEXT;
ALTER TABLE sandboxes ADD COLUMN start_ms INTEGER;
