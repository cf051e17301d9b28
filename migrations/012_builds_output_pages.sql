-- Builds of a million events (projectors/builds, pages.go and fold.go).
--
-- Console output in pages: 002 kept a finished build's output as one zstd
-- frame per stream (build_output), which the projector had to hold whole to
-- make and a reader to hold whole to show. From here on the projector folds
-- it into build_output_pages: each stream (1 stdout, 2 stderr) cut at fixed
-- offsets of its uncompressed bytes (projectors/builds OutputPageBytes), each
-- page its own frame, made with the canonical encoder, so that live and
-- replay store identical rows whatever the batch boundaries. Rows folded
-- before stay in build_output and are read as they are (one page each); a
-- late event of such a build moves its output into pages. Nothing is
-- rewritten here, so the migration takes no lock on existing rows.
--
-- Indexes for paged reads by keyset (label after the last one shown): the
-- failed targets of a build, and its tests by status. The failed-targets
-- index is partial and small (failures are few). Its predicate is on a
-- column of its own, targets.failed (true for a failed target, null
-- otherwise), not on success: a column an index holds or filters on makes
-- every update that changes it non-HOT, and success changes when every
-- target completes (measured: 12 more WAL bytes per paced event, a new
-- targets_pkey entry per completed target), failed only when one fails.
-- Adding a nullable column rewrites nothing; the backfill touches the
-- failed targets only. Built concurrently: writers go on while they build.

---- tern: disable-tx ----

create table if not exists build_output_pages (
    invocation_id text not null,
    project       text not null,
    stream        smallint not null check (stream in (1, 2)), -- 1 stdout, 2 stderr
    page          int not null check (page >= 0),             -- bytes [page*size, (page+1)*size)
    bytes         int not null,                               -- uncompressed size of this page
    data          bytea not null,                             -- one zstd frame
    primary key (invocation_id, project, stream, page)
);
alter table build_output_pages alter column data set storage external;

alter table targets add column if not exists failed boolean;
update targets set failed = true where success = false and failed is null;
create index concurrently if not exists targets_failed_idx on targets (invocation_id, project, label)
    where failed;
-- Status leads: an index that began with (invocation_id, project) would be
-- a way to probe a build's rows by label too, and a plan made while the
-- table was empty may take it for the projector's probes (scanning all
-- the build's tests for each).
create index concurrently if not exists tests_status_idx on tests (status, invocation_id, project, label);

---- create above / drop below ----

---- tern: disable-tx ----

drop index concurrently if exists tests_status_idx;
drop index concurrently if exists targets_failed_idx;
alter table targets drop column if exists failed;
drop table if exists build_output_pages;
