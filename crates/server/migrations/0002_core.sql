-- Sessions carry the caller's own label (e.g. an E2B process tag).
ALTER TABLE sessions ADD COLUMN tag TEXT;
CREATE INDEX IF NOT EXISTS sessions_process ON sessions(sandbox_id, process_id);

-- A sandbox's access token, as the sha256 hex of the token: the token itself is never stored.
-- The legacy plain `sandbox_tokens` rows are hashed into here by SqliteStore::open (SQL has no sha256).
CREATE TABLE sandbox_access (sandbox_id TEXT PRIMARY KEY, token_hash TEXT NOT NULL UNIQUE);

-- State only the E2B door has, out of the sandbox's user-visible metadata.
CREATE TABLE e2b_sandboxes (sandbox_id TEXT PRIMARY KEY, template_alias TEXT NOT NULL);
INSERT INTO e2b_sandboxes (sandbox_id, template_alias)
  SELECT id, json_extract(metadata, '$._e2b_template') FROM sandboxes
  WHERE json_valid(metadata) AND json_type(metadata, '$._e2b_template') = 'text';
UPDATE sandboxes SET metadata = json_remove(metadata, '$._e2b_template')
  WHERE json_valid(metadata) AND json_type(metadata, '$._e2b_template') IS NOT NULL;
