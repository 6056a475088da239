-- What counts against a tenant's disk quota and the node's disk budget besides sandbox disks
-- (issue 23): snapshots and forks' images, and saved memory.
--
-- A snapshot is recorded `saving` when its save is admitted, holding `held_mib` = its sandbox's
-- disk_mib + memory_mib (the most a save writes: the overlay and the memory); once saved it is
-- `ready` and holds its real size. Saves still `saving` at a restart are removed.
ALTER TABLE snapshots ADD COLUMN state TEXT NOT NULL DEFAULT 'ready';
ALTER TABLE snapshots ADD COLUMN held_mib INTEGER NOT NULL DEFAULT 0;
UPDATE snapshots SET held_mib = (bytes + 1048575) / 1048576;

-- The disk a sandbox's saved memory is charged, MiB, on top of its disk_mib: its memory_mib
-- once a suspend is admitted, or from its create when its timeout suspends it
-- (`on_timeout = 'suspend'`: the platform saves it without asking again).
ALTER TABLE sandboxes ADD COLUMN saved_mib INTEGER NOT NULL DEFAULT 0;
UPDATE sandboxes SET saved_mib = memory_mib WHERE state = 'suspended' OR on_timeout = 'suspend';
