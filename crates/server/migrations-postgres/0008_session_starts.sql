-- Many hosts (issue 25): a sandbox's session limit holds across replicas. One row per session
-- start between its admission and its session's record; a row whose replica died before ending
-- it stops counting at until_ms.
CREATE TABLE session_starts (
  id TEXT PRIMARY KEY,
  sandbox_id TEXT NOT NULL,
  until_ms BIGINT NOT NULL);
CREATE INDEX session_starts_sandbox ON session_starts(sandbox_id);
