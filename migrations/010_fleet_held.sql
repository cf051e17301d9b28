-- What a node said it holds when it last connected: the allocation ids of
-- its last Connected event (NodeConnected.allocations: its Hello, or the
-- gateway's republish of the session's held set) and that event's stored
-- time. The placer compares them with the allocations the node reported
-- BOUND before then: one the node no longer holds (it rebooted) is
-- released and placed again ("node_lost").
--
-- Existing rows: no Connected has been stored with them yet, so they hold
-- nothing as far as anyone knows and held_at is null (the placer does not
-- act on a node until its next Connected sets it).

alter table fleet_nodes add column held_allocations text[] not null default '{}';
alter table fleet_nodes add column held_at timestamptz;

---- create above / drop below ----

alter table fleet_nodes drop column held_at;
alter table fleet_nodes drop column held_allocations;
