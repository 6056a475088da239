-- Many hosts (issue 25): the console account's sign-in throttle (`core/sign_in.rs`) is shared
-- by every replica. One row per attempt in flight (failed = 0) or failed (failed = 1), by its
-- client's window key; rows older than the window go as new attempts come.
CREATE TABLE sign_in_attempts (
  id TEXT PRIMARY KEY,
  client TEXT NOT NULL,
  remote INTEGER NOT NULL,
  at_ms INTEGER NOT NULL,
  failed INTEGER NOT NULL);
CREATE INDEX sign_in_attempts_client ON sign_in_attempts(client);
