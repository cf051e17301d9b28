-- A node's identity is (pool, node id), as in its certificate and its
-- subject fleet.node.<pool>.<node>. The tables of 003 keyed nodes by id
-- alone, so that a node of one pool could overwrite the row, devices and
-- liveness of a node with the same id in another pool. Every table that
-- names a node now carries its pool and is keyed by the pair.
--
-- Existing rows keep their meaning: before this migration a node id was
-- unique, so each device takes the pool of its node's row; each booking the
-- pool of its allocation; each allocation report the pool of the node that
-- sent it (its fleet_nodes row), else of the allocation it names. A row whose
-- pool cannot be found (none of those rows exists) keeps pool '' and stays
-- harmless: no reader joins it to a node of a real pool.

alter table fleet_nodes drop constraint fleet_nodes_pkey;
alter table fleet_nodes add primary key (pool, node_id);
-- (pool, state) and the primary key serve the pool's reads; node_id alone
-- still finds a node by id across pools (the console's search).
create index fleet_nodes_node on fleet_nodes (node_id);

alter table fleet_devices add column pool text not null default '';
update fleet_devices d set pool = n.pool from fleet_nodes n where n.node_id = d.node_id;
alter table fleet_devices alter column pool drop default;
alter table fleet_devices drop constraint fleet_devices_pkey;
alter table fleet_devices add primary key (pool, node_id, gpu_index);

alter table fleet_bookings add column pool text not null default '';
update fleet_bookings b set pool = a.pool from fleet_allocations a where a.id = b.allocation_id;
alter table fleet_bookings alter column pool drop default;
alter table fleet_bookings drop constraint fleet_bookings_pkey;
alter table fleet_bookings add primary key (pool, node_id, gpu_index);

drop index fleet_allocations_live_node;
create index fleet_allocations_live_node on fleet_allocations (pool, node_id) where released_at is null;

-- A report is kept per reporting node: a report names an allocation, but
-- only the report of the node the allocation was placed on counts (every
-- reader joins on the allocation's pool and node). A sibling's report about
-- an allocation it does not hold is stored under its own key and never
-- changes the allocation's state.
drop view fleet_reservation_status;
alter table fleet_allocation_reports add column pool text not null default '';
update fleet_allocation_reports r set pool = coalesce(
    (select n.pool from fleet_nodes n where n.node_id = r.node_id),
    (select a.pool from fleet_allocations a where a.id = r.allocation_id),
    '');
alter table fleet_allocation_reports alter column pool drop default;
alter table fleet_allocation_reports drop constraint fleet_allocation_reports_pkey;
alter table fleet_allocation_reports add primary key (allocation_id, pool, node_id);

create view fleet_reservation_status as
select r.*,
       case
           when r.cancelled_at is not null then 'CANCELLED'
           when f.reservation_id is not null then 'FAILED'
           when p.reservation_id is null or p.ended_at is not null or coalesce(a.live, 0) = 0 then 'PENDING'
           when a.bound = a.live then 'ACTIVE'
           else 'PLACED'
       end as state,
       p.placed_at,
       case when a.live > 0 and a.bound = a.live then a.active_at end as active_at,
       coalesce(r.cancelled_at, f.failed_at) as ended_at,
       coalesce(f.reason, p.end_reason, '') as reason
from fleet_reservations r
left join fleet_failures f on f.reservation_id = r.id
left join fleet_placements p on p.reservation_id = r.id
left join lateral (
    select count(*) as live,
           count(*) filter (where ar.state = 'bound') as bound,
           max(ar.reported_at) as active_at
    from fleet_allocations al
    left join fleet_allocation_reports ar
           on ar.allocation_id = al.id and ar.pool = al.pool and ar.node_id = al.node_id
    where al.reservation_id = r.id and al.released_at is null
) a on true;

---- create above / drop below ----

-- Going back merges what the pair kept apart: rows of a node id that
-- exists in several pools keep one of them (the first pool in byte order).

drop view fleet_reservation_status;
delete from fleet_allocation_reports r using fleet_allocation_reports o
    where o.allocation_id = r.allocation_id and (o.pool, o.node_id) < (r.pool, r.node_id);
alter table fleet_allocation_reports drop constraint fleet_allocation_reports_pkey;
alter table fleet_allocation_reports add primary key (allocation_id);
alter table fleet_allocation_reports drop column pool;

create view fleet_reservation_status as
select r.*,
       case
           when r.cancelled_at is not null then 'CANCELLED'
           when f.reservation_id is not null then 'FAILED'
           when p.reservation_id is null or p.ended_at is not null or coalesce(a.live, 0) = 0 then 'PENDING'
           when a.bound = a.live then 'ACTIVE'
           else 'PLACED'
       end as state,
       p.placed_at,
       case when a.live > 0 and a.bound = a.live then a.active_at end as active_at,
       coalesce(r.cancelled_at, f.failed_at) as ended_at,
       coalesce(f.reason, p.end_reason, '') as reason
from fleet_reservations r
left join fleet_failures f on f.reservation_id = r.id
left join fleet_placements p on p.reservation_id = r.id
left join lateral (
    select count(*) as live,
           count(*) filter (where ar.state = 'bound') as bound,
           max(ar.reported_at) as active_at
    from fleet_allocations al
    left join fleet_allocation_reports ar on ar.allocation_id = al.id
    where al.reservation_id = r.id and al.released_at is null
) a on true;

drop index fleet_allocations_live_node;
create index fleet_allocations_live_node on fleet_allocations (node_id) where released_at is null;

delete from fleet_bookings b using fleet_bookings o
    where o.node_id = b.node_id and o.gpu_index = b.gpu_index and o.pool < b.pool;
alter table fleet_bookings drop constraint fleet_bookings_pkey;
alter table fleet_bookings add primary key (node_id, gpu_index);
alter table fleet_bookings drop column pool;

delete from fleet_devices d using fleet_devices o
    where o.node_id = d.node_id and o.gpu_index = d.gpu_index and o.pool < d.pool;
alter table fleet_devices drop constraint fleet_devices_pkey;
alter table fleet_devices add primary key (node_id, gpu_index);
alter table fleet_devices drop column pool;

drop index fleet_nodes_node;
delete from fleet_nodes n using fleet_nodes o where o.node_id = n.node_id and o.pool < n.pool;
alter table fleet_nodes drop constraint fleet_nodes_pkey;
alter table fleet_nodes add primary key (node_id);
