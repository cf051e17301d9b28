-- invocations.last_event_bucket (last_event_at rounded down to 5 minutes,
-- the sweep's index) was a stored generated column. PostgreSQL computes
-- such a column in a step of its own, materialising the whole new row, in
-- every UPDATE that sets a column it depends on; with many slow builds a
-- batch moves last_event_at of about one invocation per event, and the
-- step took about 5% of the database's time (projectors/builds,
-- BenchmarkApplyPaced). It is now an ordinary column that the projector
-- sets with last_event_at, by the same expression (projectors/builds,
-- eventBucket). Existing rows keep their values; nothing else writes
-- last_event_at.

alter table invocations alter column last_event_bucket drop expression;

---- create above / drop below ----

-- PostgreSQL 15 cannot make a column generated again: it is dropped (with
-- its index) and added again, at the end of the row.
alter table invocations drop column last_event_bucket;
alter table invocations add column last_event_bucket timestamptz generated always as
    (date_bin('5 minutes', last_event_at, timestamptz '2000-01-01 00:00:00+00')) stored;
create index invocations_running_idx on invocations (last_event_bucket) where status = 'running';
