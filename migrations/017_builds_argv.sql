-- Each distinct command line once per project (projectors/builds,
-- metadata.go). 013 kept every build's command lines as argument arrays in
-- build_command_lines, about 3.3 KB a build (loadtest, storage), although
-- the CI builds of a project send the same command lines build after build.
-- From here on an argument array is a row of build_argv, keyed by the
-- project and the SHA-256 of its canonical encoding (build_argv_hash), and
-- build_command_lines names it by that hash. A content hash rather than a
-- serial number: it is what the row holds, so a replay makes the same rows
-- as the live run whatever order the builds come in, and writing a command
-- line needs no read of the id first.
--
-- Who writes and who deletes: the projector inserts a build's
-- build_command_lines rows and, for those it inserted, their build_argv
-- rows, locking an existing one (ON CONFLICT DO UPDATE ... WHERE false)
-- until it commits. Deleting builds (retention, deletion on request) then
-- collects the build_argv rows that the deleted rows named and that no
-- other row names: it locks them first (FOR UPDATE SKIP LOCKED: one the
-- projector holds is about to be named again and stays), then deletes
-- those still unreferenced in a later statement, whose snapshot sees every
-- row committed by a transaction that held the lock. No foreign key: its
-- check would lock every argv row once more per command line, and a
-- projector whose check met a row being deleted would fail with a
-- permanent error (23503).
--
-- Existing rows are moved in batches of 1,000, each its own transaction
-- (a procedure that commits per batch, called outside a transaction: tern
-- runs the statements of a disable-tx migration one by one, each outside
-- any transaction block). Meanwhile a trigger hashes the rows that a
-- projector of the previous version inserts; it goes with the old column.
-- The argv column is nulled as each row is hashed, so that its space is
-- reclaimed by vacuum, and dropped at the end (no rewrite). argv_hash
-- becomes NOT NULL through a CHECK constraint validated without blocking
-- writers. The locks that block readers or writers (adding and dropping
-- the column, the trigger, the constraint) are each held for a catalog
-- change only, and wait at most lock_timeout for the lock (a long query in
-- the way fails the migration, which can be run again, rather than stall
-- every query queued behind it).
--
-- Until the last step a reader of the previous version sees a moved row's
-- argv as null, and afterwards a projector of the previous version fails
-- (transiently: 42703) until it is replaced.

---- tern: disable-tx ----

set lock_timeout = '10s';

create table if not exists build_argv (
    project text not null,
    hash    bytea not null, -- build_argv_hash(argv)
    argv    text[] not null,
    primary key (project, hash)
);

-- The canonical encoding of an argument array: each argument's UTF-8 bytes
-- preceded by their length as 4 bytes, big-endian (a null argument, which
-- the projector never writes, as length -1), so that distinct arrays
-- encode differently. The projector computes the same in Go (argvHash in
-- projectors/builds/metadata.go; a test holds the two equal). Stable, not
-- immutable, because convert_to is.
create or replace function build_argv_hash(argv text[]) returns bytea
language sql stable strict parallel safe as $$
    select sha256(coalesce(
        (select string_agg(coalesce(int4send(octet_length(convert_to(a, 'UTF8'))) || convert_to(a, 'UTF8'),
                                    '\xffffffff'::bytea), ''::bytea order by i)
         from unnest(argv) with ordinality as u(a, i)),
        ''::bytea))
$$;

alter table build_command_lines add column if not exists argv_hash bytea;

-- Rows that a projector of the previous version inserts from here on.
create or replace function build_command_lines_hash_argv() returns trigger language plpgsql as $$
begin
    if new.argv_hash is null and new.argv is not null then
        new.argv_hash := build_argv_hash(new.argv);
        insert into build_argv (project, hash, argv) values (new.project, new.argv_hash, new.argv)
        on conflict do nothing;
        new.argv := null;
    end if;
    return new;
end $$;

do $$
begin
    if exists (select 1 from pg_attribute where attrelid = 'build_command_lines'::regclass
               and attname = 'argv' and not attisdropped) then
        alter table build_command_lines alter column argv drop not null;
        create or replace trigger build_command_lines_hash_argv before insert on build_command_lines
            for each row execute function build_command_lines_hash_argv();
    end if;
end $$;

-- One batch per transaction, in primary-key order from where the last one
-- ended (the first from '': an invocation id is never empty); a row is
-- hashed, its array moved (once per project and hash) and its argv nulled.
create or replace procedure build_argv_backfill(batch int) language plpgsql as $$
declare
    k_inv text := '';
    k_project text := '';
    k_source text := '';
    k_label text := '';
    n int;
begin
    if not exists (select 1 from pg_attribute where attrelid = 'build_command_lines'::regclass
                   and attname = 'argv' and not attisdropped) then
        return;
    end if;
    loop
        with b as (
            select invocation_id, project, source, label, argv, build_argv_hash(argv) as hash
            from build_command_lines
            where (invocation_id, project, source, label) > (k_inv, k_project, k_source, k_label)
            order by invocation_id, project, source, label
            limit batch
        ), moved as (
            insert into build_argv (project, hash, argv)
            select distinct on (project, hash) project, hash, argv from b where argv is not null
            on conflict do nothing
        ), done as (
            update build_command_lines c set argv_hash = b.hash, argv = null
            from b
            where c.invocation_id = b.invocation_id and c.project = b.project and c.source = b.source
              and c.label = b.label and c.argv_hash is null and b.argv is not null
        )
        select invocation_id, project, source, label, count(*) over ()
        into k_inv, k_project, k_source, k_label, n
        from b order by invocation_id desc, project desc, source desc, label desc limit 1;
        exit when not found;
        commit;
        exit when n < batch;
    end loop;
    commit;
end $$;

call build_argv_backfill(1000);

drop procedure build_argv_backfill(int);

-- NOT NULL without a scan under an exclusive lock: a CHECK constraint added
-- NOT VALID (rows written from here on must satisfy it; the trigger sees
-- to those of a previous projector), validated while writers go on, then
-- SET NOT NULL, which takes the constraint as proof.
do $$
begin
    if not exists (select 1 from pg_constraint where conrelid = 'build_command_lines'::regclass
                   and conname = 'build_command_lines_argv_hash_set')
       and exists (select 1 from pg_attribute where attrelid = 'build_command_lines'::regclass
                   and attname = 'argv_hash' and not attnotnull) then
        alter table build_command_lines add constraint build_command_lines_argv_hash_set
            check (argv_hash is not null) not valid;
    end if;
end $$;

do $$
begin
    if exists (select 1 from pg_constraint where conrelid = 'build_command_lines'::regclass
               and conname = 'build_command_lines_argv_hash_set' and not convalidated) then
        alter table build_command_lines validate constraint build_command_lines_argv_hash_set;
    end if;
end $$;

begin;
alter table build_command_lines alter column argv_hash set not null;
alter table build_command_lines drop constraint if exists build_command_lines_argv_hash_set;
drop trigger if exists build_command_lines_hash_argv on build_command_lines;
alter table build_command_lines drop column if exists argv;
commit;

drop function if exists build_command_lines_hash_argv();

-- Which rows name an argument array: deleting builds asks it of the arrays
-- their rows named (and one may ask which builds ran a command line).
-- Built after the move, so that the move's updates do not each add an
-- entry; a build's rows with the same array share one entry (btree
-- deduplication). An earlier run that failed while building it leaves it
-- invalid: dropped and built again.
do $$
begin
    if exists (select 1 from pg_index where indexrelid = 'build_command_lines_argv_idx'::regclass
               and not indisvalid) then
        drop index build_command_lines_argv_idx;
    end if;
exception when undefined_table then
    null;
end $$;

-- Building it waits for older transactions without blocking anyone.
reset lock_timeout;

create index concurrently if not exists build_command_lines_argv_idx on build_command_lines (project, argv_hash);

---- create above / drop below ----

---- tern: disable-tx ----

-- Back to 013's shape: every row's argv filled from build_argv, in batches.
-- Stop the projectors of this version first: they write no argv, and
-- after the constraint below a row without one is refused.

set lock_timeout = '10s';

alter table build_command_lines add column if not exists argv text[];

create or replace procedure build_argv_restore(batch int) language plpgsql as $$
declare
    k_inv text := '';
    k_project text := '';
    k_source text := '';
    k_label text := '';
    n int;
begin
    loop
        with b as (
            select invocation_id, project, source, label, argv_hash
            from build_command_lines
            where (invocation_id, project, source, label) > (k_inv, k_project, k_source, k_label)
            order by invocation_id, project, source, label
            limit batch
        ), done as (
            update build_command_lines c set argv = a.argv
            from b join build_argv a on a.project = b.project and a.hash = b.argv_hash
            where c.invocation_id = b.invocation_id and c.project = b.project and c.source = b.source
              and c.label = b.label and c.argv is null
        )
        select invocation_id, project, source, label, count(*) over ()
        into k_inv, k_project, k_source, k_label, n
        from b order by invocation_id desc, project desc, source desc, label desc limit 1;
        exit when not found;
        commit;
        exit when n < batch;
    end loop;
    commit;
end $$;

call build_argv_restore(1000);

drop procedure build_argv_restore(int);

-- A row whose array is missing from build_argv (none, unless written
-- around the protocol) gets an empty one rather than stopping the
-- downgrade.
update build_command_lines set argv = '{}' where argv is null;

do $$
begin
    if not exists (select 1 from pg_constraint where conrelid = 'build_command_lines'::regclass
                   and conname = 'build_command_lines_argv_set')
       and exists (select 1 from pg_attribute where attrelid = 'build_command_lines'::regclass
                   and attname = 'argv' and not attnotnull) then
        alter table build_command_lines add constraint build_command_lines_argv_set check (argv is not null) not valid;
    end if;
end $$;

do $$
begin
    if exists (select 1 from pg_constraint where conrelid = 'build_command_lines'::regclass
               and conname = 'build_command_lines_argv_set' and not convalidated) then
        alter table build_command_lines validate constraint build_command_lines_argv_set;
    end if;
end $$;

begin;
alter table build_command_lines alter column argv set not null;
alter table build_command_lines drop constraint if exists build_command_lines_argv_set;
commit;

drop index concurrently if exists build_command_lines_argv_idx;
alter table build_command_lines drop column if exists argv_hash;
drop table if exists build_argv;
drop function if exists build_argv_hash(text[]);
