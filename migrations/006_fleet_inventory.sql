-- A node that re-homes (its gateway died, or a reconnect storm) sends its
-- whole inventory again in a new session's Connected event. Rewriting its
-- devices each time (delete and insert, eight rows for a GPU node) made
-- PostgreSQL a sixth of the machine's CPU while 10,000 nodes re-homed. The
-- projector keeps a hash of the hardware (index, model, memory, uuid; not
-- health) here and replaces the devices only when it changed.
alter table fleet_nodes add column inventory_hash text not null default '';

---- create above / drop below ----

alter table fleet_nodes drop column inventory_hash;
