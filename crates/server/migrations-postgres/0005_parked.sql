-- Many hosts (issue 25): a sandbox a draining node parked in object storage has no VM on any
-- node; `parked_image` is the image it resumes from, on a node whose machine fingerprint is
-- `parked_on`; `parked_resume` = 1: it ran when parked, and the replicas start it again on
-- another node at once (the tenant never asked it to stop).
ALTER TABLE sandboxes ADD COLUMN parked_image TEXT;
ALTER TABLE sandboxes ADD COLUMN parked_on TEXT;
ALTER TABLE sandboxes ADD COLUMN parked_resume INTEGER NOT NULL DEFAULT 0;
