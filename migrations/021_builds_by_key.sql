-- build_metadata, build_command_lines and build_metrics name their build
-- by its build key (016) rather than by (invocation_id, project): a row
-- loses the invocation id's 37 bytes, and a primary-key entry drops from
-- about 72 bytes to 32, in key order (a build's rows come early in it, so
-- they land at the end of the key range, where B-tree pages fill to 90%).
-- build_metadata and build_command_lines keep project: the lookup of a
-- project's builds by metadata (build_metadata_lookup) and the collection
-- of argument arrays (build_argv, per project) need it.
--
-- Online, like 016 and 019: each table gains a nullable column (catalog
-- only), filled 2,000 builds a transaction; the new keys are built
-- concurrently; the swap is one short transaction (the NOT NULL is proved
-- by a constraint validated before it, so it scans nothing). Dropped
-- columns are a catalog change: old rows keep their bytes until rewritten.
-- Stop the builds projector of the release before first.

---- tern: disable-tx ----

alter table build_metadata add column if not exists build_key bigint;
alter table build_command_lines add column if not exists build_key bigint;
alter table build_metrics add column if not exists build_key bigint;

create or replace procedure builds_by_key_backfill() language plpgsql as $$
declare
    lo bigint := -1;
    hi bigint;
begin
    if not exists (select 1 from pg_attribute where attrelid = 'build_metrics'::regclass and attname = 'invocation_id' and not attisdropped) then
        return;
    end if;
    loop
        select max(build_key) into hi from
            (select build_key from invocations where build_key > lo order by build_key limit 2000) b;
        exit when hi is null;
        update build_metadata m set build_key = i.build_key from invocations i
        where i.build_key > lo and i.build_key <= hi and m.invocation_id = i.id and m.project = i.project and m.build_key is null;
        update build_command_lines c set build_key = i.build_key from invocations i
        where i.build_key > lo and i.build_key <= hi and c.invocation_id = i.id and c.project = i.project and c.build_key is null;
        update build_metrics m set build_key = i.build_key from invocations i
        where i.build_key > lo and i.build_key <= hi and m.invocation_id = i.id and m.project = i.project and m.build_key is null;
        commit;
        lo := hi;
    end loop;
    -- Rows of no build (none are written so; a hand's) cannot be shown.
    delete from build_metadata where build_key is null;
    delete from build_command_lines where build_key is null;
    delete from build_metrics where build_key is null;
    commit;
end $$;
call builds_by_key_backfill();
drop procedure builds_by_key_backfill();

create unique index concurrently if not exists build_metadata_key on build_metadata (build_key, source, key);
create unique index concurrently if not exists build_command_lines_key on build_command_lines (build_key, source, label);
create unique index concurrently if not exists build_metrics_key on build_metrics (build_key);

do $$
declare
    t text;
begin
    foreach t in array array['build_metadata', 'build_command_lines', 'build_metrics'] loop
        if not exists (select 1 from pg_constraint where conname = t || '_build_key_set') then
            execute format('alter table %I add constraint %I check (build_key is not null) not valid', t, t || '_build_key_set');
        end if;
    end loop;
end $$;
alter table build_metadata validate constraint build_metadata_build_key_set;
alter table build_command_lines validate constraint build_command_lines_build_key_set;
alter table build_metrics validate constraint build_metrics_build_key_set;

begin;
alter table build_metadata drop constraint build_metadata_pkey,
    add constraint build_metadata_pkey primary key using index build_metadata_key;
alter table build_metadata drop constraint build_metadata_build_key_set, drop column invocation_id;
alter table build_command_lines drop constraint build_command_lines_pkey,
    add constraint build_command_lines_pkey primary key using index build_command_lines_key;
alter table build_command_lines drop constraint build_command_lines_build_key_set, drop column invocation_id;
alter table build_metrics drop constraint build_metrics_pkey,
    add constraint build_metrics_pkey primary key using index build_metrics_key;
alter table build_metrics drop constraint build_metrics_build_key_set, drop column invocation_id, drop column project;
commit;

---- create above / drop below ----

begin;
alter table build_metadata add column invocation_id text;
update build_metadata m set invocation_id = i.id from invocations i where i.build_key = m.build_key;
alter table build_metadata alter column invocation_id set not null, drop constraint build_metadata_pkey,
    add primary key (invocation_id, project, source, key), drop column build_key;
alter table build_command_lines add column invocation_id text;
update build_command_lines c set invocation_id = i.id from invocations i where i.build_key = c.build_key;
alter table build_command_lines alter column invocation_id set not null, drop constraint build_command_lines_pkey,
    add primary key (invocation_id, project, source, label), drop column build_key;
alter table build_metrics add column invocation_id text, add column project text;
update build_metrics m set invocation_id = i.id, project = i.project from invocations i where i.build_key = m.build_key;
alter table build_metrics alter column invocation_id set not null, alter column project set not null,
    drop constraint build_metrics_pkey, add primary key (invocation_id, project), drop column build_key;
commit;
