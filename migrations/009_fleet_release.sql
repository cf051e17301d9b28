-- A release is done when the node has carried it out. A Released decision
-- sets released_at; the allocation's bookings stay in fleet_bookings (the
-- primary key keeps guarding its GPUs) until a Freed decision sets
-- freed_at: the node reported UNBOUND (or FAILED) for it, or the node was
-- declared unreachable and is fenced (fleet_fences) until it confirms.
--
-- Existing rows: before this migration a release deleted the bookings at
-- once, so every released allocation is freed as of its release.

alter table fleet_allocations add column freed_at timestamptz;
alter table fleet_allocations add column free_reason text;
update fleet_allocations set freed_at = released_at, free_reason = 'released'
    where released_at is not null;

-- The sweep looks for releasing allocations (released, not freed).
create index fleet_allocations_releasing on fleet_allocations (pool, node_id)
    where released_at is not null and freed_at is null;

-- A fence: an allocation freed because its node was unreachable, which the
-- node has not confirmed it dropped. Nothing new is placed on a node with
-- a fence; an Unfenced decision (the node's UNBOUND or FAILED report)
-- deletes the row.
create table fleet_fences (
    pool          text not null,
    node_id       text not null,
    allocation_id text not null,
    fenced_at     timestamptz not null,
    primary key (pool, node_id, allocation_id)
);

---- create above / drop below ----

drop table fleet_fences;
-- Going back frees what is releasing: its GPUs become bookable at once.
delete from fleet_bookings b using fleet_allocations a
    where a.id = b.allocation_id and a.released_at is not null;
drop index fleet_allocations_releasing;
alter table fleet_allocations drop column free_reason;
alter table fleet_allocations drop column freed_at;
