-- The placer's sweep looks for live allocations placed within a window
-- (those not bound within the bind timeout): an index on placed_at of the
-- live allocations keeps that look small however long the history grows.

create index fleet_allocations_live_placed on fleet_allocations (placed_at) where released_at is null;

---- create above / drop below ----

drop index fleet_allocations_live_placed;
