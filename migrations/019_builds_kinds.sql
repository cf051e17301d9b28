-- A target's kind (its rule class: "genrule rule", "sh_test rule", ...)
-- once, in build_kinds, and by a 4-byte id in targets (projectors/builds,
-- kindID): the text took 13 to 20 bytes of every target row, and a build
-- names a handful of kinds. The id is the first 4 bytes of the kind's
-- SHA-256 (build_kind_id, the same in Go), so that the projector names a
-- kind without a round trip and a replay finds the same id; kinds are few,
-- so 32 bits keep them apart (two of 1,000 kinds share an id with a chance
-- of about one in 10^4; they would then show the same text).
--
-- Online like 016: targets gains a nullable column (catalog only), filled
-- 2,000 builds a transaction; the kind column is dropped at the end (a
-- catalog change: old rows keep its bytes until they are next written).
-- Stop the builds projector of the release before first; its readers work
-- until the drop.

---- tern: disable-tx ----

create or replace function build_kind_id(kind text) returns int4
    language sql immutable parallel safe strict
    return ('x' || left(encode(sha256(convert_to(kind, 'UTF8')), 'hex'), 8))::bit(32)::int4;

create table if not exists build_kinds (
    id   int4 primary key, -- build_kind_id(kind)
    kind text not null
);

alter table targets add column if not exists kind_id int4;

create or replace procedure build_kinds_backfill() language plpgsql as $$
declare
    lo bigint := -1;
    hi bigint;
begin
    if not exists (select 1 from pg_attribute where attrelid = 'targets'::regclass and attname = 'kind' and not attisdropped) then
        return;
    end if;
    loop
        select max(build_key) into hi from
            (select build_key from invocations where build_key > lo order by build_key limit 2000) b;
        exit when hi is null;
        insert into build_kinds (id, kind)
        select distinct build_kind_id(kind), kind from targets
        where build_key > lo and build_key <= hi and kind is not null
        on conflict do nothing;
        update targets set kind_id = build_kind_id(kind)
        where build_key > lo and build_key <= hi and kind is not null and kind_id is null;
        commit;
        lo := hi;
    end loop;
end $$;
call build_kinds_backfill();
drop procedure build_kinds_backfill();

alter table targets drop column if exists kind;

---- create above / drop below ----

---- tern: disable-tx ----

alter table targets add column if not exists kind text;
update targets t set kind = k.kind from build_kinds k where k.id = t.kind_id;
alter table targets drop column kind_id;
drop table build_kinds;
drop function build_kind_id(text);
