-- Many replicas (issue 25): a duty only one replica does at a time (the reaper's sweeps) is
-- held by `holder` until `until_ms`, renewed while it does it; another replica takes it over
-- once that lapses.
CREATE TABLE duties (
  duty TEXT PRIMARY KEY,
  holder TEXT NOT NULL,
  until_ms BIGINT NOT NULL);
