-- Repeats of one refusal (the same actor, action, object and result) within a minute are one
-- audit row with a count, so a flood of bad credentials writes a bounded number of rows (issue 23).
ALTER TABLE audit ADD COLUMN count INTEGER NOT NULL DEFAULT 1;
