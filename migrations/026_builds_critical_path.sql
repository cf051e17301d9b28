-- The critical path of a build, from its BuildToolLogs event (the log
-- Bazel names "critical path": "Critical Path: 12.34s, ..." and a line a
-- step), for the timing on the console's build page (projectors/builds,
-- criticalPath): its length, and its steps as lines of "MS<tab>WHAT", the
-- 5 longest in the path's order, each description cut at 200 bytes.
-- About 4 bytes and 40 a step for a build that sends it; builds projected
-- before this show none until replayed.
alter table build_metrics add column if not exists critical_path_ms int;
alter table build_metrics add column if not exists critical_path text;

---- create above / drop below ----

alter table build_metrics drop column if exists critical_path;
alter table build_metrics drop column if exists critical_path_ms;
