-- Many hosts (issue 25): which start of a sandbox on its node its VM is (the node's random run
-- id, from the create that started it). A reaper acting on a node's report names the run it
-- saw, so a VM started since is never ended by it. '' until the sandbox's VM runs.
ALTER TABLE sandboxes ADD COLUMN run TEXT NOT NULL DEFAULT '';
