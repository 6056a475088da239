-- Many hosts (issue 25): the node a sandbox was placed on, and the node a snapshot's image is
-- saved on. '' is the one node of single-host mode (the server's own runtime). A node's budgets
-- count only what is on it.
ALTER TABLE sandboxes ADD COLUMN node TEXT NOT NULL DEFAULT '';
ALTER TABLE snapshots ADD COLUMN node TEXT NOT NULL DEFAULT '';
