-- The reservations API counts and lists one owner's reservations; without
-- this index both read the whole table.
create index fleet_reservations_owner on fleet_reservations (owner, requested_at, id);

---- create above / drop below ----

drop index fleet_reservations_owner;
