-- Many hosts (issue 25): a snapshot whose image is also in object storage, with the machine it
-- was saved on (its fingerprint); NULL: on its node only. Any node of that machine starts a
-- sandbox from it (pulling the image once), so a snapshot outlives its node.
ALTER TABLE snapshots ADD COLUMN shared_fingerprint TEXT;
