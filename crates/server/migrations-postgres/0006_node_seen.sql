-- Many hosts (issue 25): what each replica last saw of each node. A node is judged dead only
-- when every replica that asked it lately has had no answer from it for the whole grace
-- (`unanswered_since_ms` NULL: it answered the last time).
CREATE TABLE node_seen (
  node TEXT NOT NULL,
  replica TEXT NOT NULL,
  asked_ms BIGINT NOT NULL,
  unanswered_since_ms BIGINT,
  PRIMARY KEY (node, replica));
