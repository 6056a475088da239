-- Keys get a public id (to list and revoke them by), a name, a last-used time and a revocation
-- time (issue 11). The id is derived from the key's hash: it reveals nothing of the key.
ALTER TABLE api_keys ADD COLUMN id TEXT;
ALTER TABLE api_keys ADD COLUMN name TEXT NOT NULL DEFAULT '';
ALTER TABLE api_keys ADD COLUMN last_used_at_ms INTEGER;
ALTER TABLE api_keys ADD COLUMN revoked_at_ms INTEGER;
UPDATE api_keys SET id = 'key_' || substr(hash, 1, 16) WHERE id IS NULL;
CREATE UNIQUE INDEX api_keys_id ON api_keys(id);

-- The platform account (`root@local`): only an argon2 hash of its password.
CREATE TABLE console_accounts (
  name TEXT PRIMARY KEY,
  password_hash TEXT NOT NULL,
  updated_at_ms INTEGER NOT NULL);

-- Short-lived admin tokens from a sign-in, by the sha256 of the token.
CREATE TABLE admin_sessions (
  token_hash TEXT PRIMARY KEY,
  account TEXT NOT NULL,
  created_at_ms INTEGER NOT NULL,
  expires_at_ms INTEGER NOT NULL);

-- Who did what: every admin action and auth decision the server records.
CREATE TABLE audit (
  seq INTEGER PRIMARY KEY AUTOINCREMENT,
  at_ms INTEGER NOT NULL,
  actor TEXT NOT NULL,
  tenant TEXT,
  action TEXT NOT NULL,
  object TEXT,
  result TEXT NOT NULL);
CREATE INDEX audit_at ON audit(at_ms);
