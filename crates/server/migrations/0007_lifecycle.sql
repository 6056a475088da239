-- What a sandbox's timeout does (`delete`, or `suspend` it to disk: E2B's autoPause), whether
-- traffic to a suspended (or paused) sandbox resumes it, and the lifetime it was created with
-- (what a sandbox suspended by its timeout gets again when it resumes).
ALTER TABLE sandboxes ADD COLUMN on_timeout TEXT NOT NULL DEFAULT 'delete';
ALTER TABLE sandboxes ADD COLUMN auto_resume INTEGER NOT NULL DEFAULT 0;
ALTER TABLE sandboxes ADD COLUMN timeout_ms INTEGER NOT NULL DEFAULT 300000;
