-- Per-project retention overrides (projectors/builds, "Retention"): how
-- many days a project's raw events (stream and archive), projected rows
-- and hourly rollups are kept. A null column takes the process's default
-- (--retention-raw-days, --retention-days, --retention-rollup-days); a
-- project without a row takes all three. `millrace projects retention`
-- writes it, and refuses a row whose effective values break the order
-- raw <= rows <= rollups (each 0 = for ever, the longest): rows outlive
-- raw events, so that a replay keeps the rows of builds it cannot rebuild
-- and never rebuilds a build whose rows are deleted (counting it in the
-- rollups twice); rollups outlive the rows they count.
create table project_retention (
    project     text primary key check (project <> ''),
    raw_days    int check (raw_days > 0),
    rows_days   int check (rows_days > 0),
    rollup_days int check (rollup_days > 0),
    updated_at  timestamptz not null default now()
);

-- The retention deletes a project's finished builds by their last event's
-- time (projectors/builds/expire.go). Like invocations_finished_idx, the
-- index holds only finished builds: a running build's updates, which move
-- last_event_bucket, stay HOT, and a finished build enters it once.
create index invocations_retention_idx on invocations (project, last_event_bucket) where status <> 'running';

-- When the raw retention removed a build's raw events (its object and
-- what the stream held of them; object_key is then ''): a replay keeps the
-- build's rows as they are, whatever the stream's age, and the archiver
-- never archives it again (archive/expire.go).
alter table archived_builds add column raw_expired_at timestamptz;

-- The raw retention finds a project's archived builds by their last
-- event's time (archive/expire.go); a build whose raw events are gone
-- (object_key '') leaves the index.
create index archived_builds_raw_idx on archived_builds (project, last_event_at) where object_key <> '';

---- create above / drop below ----

drop index archived_builds_raw_idx;
alter table archived_builds drop column raw_expired_at;
drop index invocations_retention_idx;
drop table project_retention;
