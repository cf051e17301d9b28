-- The placements of a window, by time (projectors/fleet, PlacementLatency:
-- the console's fleet page reads how long the last hour's and day's
-- placements took without reading every placement). Built concurrently:
-- the placer goes on writing meanwhile.

---- tern: disable-tx ----

create index concurrently if not exists fleet_placements_placed on fleet_placements (placed_at);

---- create above / drop below ----

drop index if exists fleet_placements_placed;
