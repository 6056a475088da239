-- Many hosts (issue 25): each lease of an operation has an epoch, raised whenever a replica
-- takes the operation (over). Its calls to nodes carry it, and a node refuses a call of an
-- operation with an epoch lower than one it has seen: a replica that stalled past its lease
-- cannot change a VM after the operation's new holder has.
ALTER TABLE operations ADD COLUMN lease_epoch BIGINT NOT NULL DEFAULT 1;
