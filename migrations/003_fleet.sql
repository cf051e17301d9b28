-- The fleet projections: node liveness and inventory (projectors/fleet,
-- from FLEET_NODES), reservations as requested (from FLEET_RESV) and
-- bookings as decided (from FLEET_PLACE), plus the outbox through which the
-- placer publishes its decisions.
--
-- Each table is written from exactly one stream, and no table refers to
-- another by a foreign key: a replay applies the three streams one after
-- the other, not interleaved as they were live, and must still yield the
-- same rows. The state a user sees (a reservation's PENDING, PLACED,
-- ACTIVE ...) is computed across tables in the fleet_reservation_status view.

-- rev orders changes to nodes and devices, so that the placer can load only
-- what changed since its last look (where rev > last rev seen).
create sequence fleet_rev;

-- One row per node ever seen. Liveness is kept the Kubernetes way: the
-- gateway tells who it heard from, in batches; state moves
-- healthy -> suspect -> unreachable as last_seen ages (projectors/fleet
-- Sweep), and back to healthy as soon as the node is heard again.
create table fleet_nodes (
    node_id       text primary key,
    pool          text not null,
    labels        jsonb not null default '{}',
    agent_version text not null default '',
    -- The session the node holds now, and through which gateway. A
    -- disconnect of an older session (from a gateway the node has left)
    -- does not touch these.
    session_id    text not null default '',
    gateway_id    text not null default '',
    connected     boolean not null default false,
    state         text not null default 'healthy'
                  check (state in ('healthy', 'suspect', 'unreachable')),
    -- When the node entered state: for sweep transitions, last_seen plus
    -- the threshold crossed (not the time of the sweep), so that a replay
    -- computes the same value.
    state_since   timestamptz not null,
    first_seen    timestamptz not null,
    last_seen     timestamptz not null,
    status_hash   text not null default '',
    conditions    jsonb not null default '[]',
    rev           bigint not null default nextval('fleet_rev')
) with (fillfactor = 80);

create index fleet_nodes_pool_state on fleet_nodes (pool, state);
create index fleet_nodes_rev on fleet_nodes (rev);

-- A node's GPUs, from its Hello inventory and status changes.
create table fleet_devices (
    node_id    text not null,
    gpu_index  int not null,
    model      text not null default '',
    memory_mib bigint not null default 0,
    uuid       text not null default '',
    health     text not null default 'ok'
               check (health in ('unspecified', 'ok', 'degraded', 'failed')),
    primary key (node_id, gpu_index)
);

-- The latest state each allocation's node reported (bound, unbound,
-- failed), from FLEET_NODES.
create table fleet_allocation_reports (
    allocation_id text primary key,
    node_id       text not null,
    state         text not null check (state in ('pending', 'bound', 'unbound', 'failed')),
    error         text not null default '',
    reported_at   timestamptz not null
);

-- The projector's clock: the stored time of the newest liveness batch.
-- The sweep never ages nodes past it by more than a slack, so a silent
-- control plane (every gateway down, or the stream stalled) marks no node
-- unreachable.
create table fleet_clock (
    id             boolean primary key default true check (id),
    liveness_time  timestamptz not null,
    -- The stored time of the first liveness batch after a silence longer
    -- than the sweep's clock slack: nodes age from no earlier than this, so
    -- that those still reconnecting after an outage of the control plane
    -- get a whole grace period (projectors/fleet README).
    resumed_at     timestamptz
);

-- Reservations as requested, from FLEET_RESV.
create table fleet_reservations (
    id                 text primary key,
    pool               text not null,
    gpus               int not null default 0,
    nodes              int not null default 0,
    model              text not null default '',
    labels             jsonb not null default '{}',
    min_gpu_memory_mib bigint not null default 0,
    owner              text not null default '',
    request_id         text not null default '',
    requested_at       timestamptz not null,
    cancelled_at       timestamptz
);

create index fleet_reservations_pool on fleet_reservations (pool, requested_at);

-- Allocations as decided, from FLEET_PLACE: one per node a reservation
-- holds. released_at is set by a Released decision.
create table fleet_allocations (
    id             text primary key,
    reservation_id text not null,
    pool           text not null,
    node_id        text not null,
    gpu_indices    int[] not null,
    whole_node     boolean not null default false,
    decision_id    text not null,
    placed_at      timestamptz not null,
    released_at    timestamptz,
    release_reason text
);

create index fleet_allocations_reservation on fleet_allocations (reservation_id);
create index fleet_allocations_live_node on fleet_allocations (node_id) where released_at is null;

-- The guard: one row per booked GPU. Whatever a planner believed, its
-- transaction cannot book a GPU that another allocation holds.
create table fleet_bookings (
    node_id        text not null,
    gpu_index      int not null,
    allocation_id  text not null,
    reservation_id text not null,
    primary key (node_id, gpu_index)
);

create index fleet_bookings_allocation on fleet_bookings (allocation_id);

-- One live placement per reservation: two placers cannot both place it.
-- A Released decision with requeued deletes the row (the reservation is
-- pending again); without requeue the row stays, marked ended.
create table fleet_placements (
    reservation_id text primary key,
    decision_id    text not null,
    placed_at      timestamptz not null,
    ended_at       timestamptz,
    end_reason     text
);

-- Reservations the placer gave up on (a Failed decision).
create table fleet_failures (
    reservation_id text primary key,
    decision_id    text not null,
    failed_at      timestamptz not null,
    reason         text not null
);

-- What a user sees of a reservation.
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

-- Messages to publish after the transaction that wrote them commits (the
-- transactional outbox): a relay publishes each with its msg_id as
-- Nats-Msg-Id, so a publish repeated after a crash is a no-op, and deletes
-- it. The placer writes its decisions here in the same transaction as the
-- bookings they describe.
create table outbox (
    id         bigserial primary key,
    subject    text not null,
    msg_id     text not null,
    headers    jsonb not null default '{}',
    body       bytea not null,
    created_at timestamptz not null default now()
);

---- create above / drop below ----

drop table outbox;
drop view fleet_reservation_status;
drop table fleet_failures;
drop table fleet_placements;
drop table fleet_bookings;
drop table fleet_allocations;
drop table fleet_reservations;
drop table fleet_clock;
drop table fleet_allocation_reports;
drop table fleet_devices;
drop table fleet_nodes;
drop sequence fleet_rev;
