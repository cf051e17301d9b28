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

-- An earlier run that failed while building one leaves it invalid:
-- dropped and built again.
do $$
declare
    i text;
begin
    foreach i in array array['build_metadata_key', 'build_command_lines_key', 'build_metrics_key'] loop
        if exists (select 1 from pg_index where indexrelid = to_regclass(i) and not indisvalid) then
            execute format('drop index %I', i);
        end if;
    end loop;
end $$;

create unique index concurrently if not exists build_metadata_key on build_metadata (build_key, source, key);
create unique index concurrently if not exists build_command_lines_key on build_command_lines (build_key, source, label);
create unique index concurrently if not exists build_metrics_key on build_metrics (build_key);

do $$
declare
    t text;
begin
    foreach t in array array['build_metadata', 'build_command_lines', 'build_metrics'] loop
        if not exists (select 1 from pg_constraint where conname = t || '_build_key_set')
           and exists (select 1 from pg_attribute where attrelid = t::regclass and attname = 'invocation_id' and not attisdropped) then
            execute format('alter table %I add constraint %I check (build_key is not null) not valid', t, t || '_build_key_set');
        end if;
    end loop;
end $$;
-- Validating scans each table under a lock that lets writers go on.
do $$
declare
    t text;
begin
    foreach t in array array['build_metadata', 'build_command_lines', 'build_metrics'] loop
        if exists (select 1 from pg_constraint where conname = t || '_build_key_set') then
            execute format('alter table %I validate constraint %I', t, t || '_build_key_set');
        end if;
    end loop;
end $$;

-- The swap, one transaction (a DO block), of each table not swapped yet:
-- a run that swapped and stopped before tern recorded it does nothing
-- again.
do $$
declare
    t text;
begin
    foreach t in array array['build_metadata', 'build_command_lines', 'build_metrics'] loop
        if not exists (select 1 from pg_attribute where attrelid = t::regclass and attname = 'invocation_id' and not attisdropped) then
            continue;
        end if;
        execute format('alter table %I drop constraint %I, add constraint %I primary key using index %I',
                       t, t || '_pkey', t || '_pkey', t || '_key');
        execute format('alter table %I drop constraint %I, drop column invocation_id', t, t || '_build_key_set');
    end loop;
    if exists (select 1 from pg_attribute where attrelid = 'build_metrics'::regclass and attname = 'project' and not attisdropped) then
        alter table build_metrics drop column project;
    end if;
    -- A run after the swap built the new keys again: they go.
    foreach t in array array['build_metadata', 'build_command_lines', 'build_metrics'] loop
        if to_regclass(t || '_key') is not null then
            execute format('drop index %I', t || '_key');
        end if;
    end loop;
end $$;

---- create above / drop below ----

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
