-- The critical path's length of a build, from its BuildToolLogs event
-- (the log Bazel names "critical path": "Critical Path: 12.34s, ..."),
-- for the timing on the console's build page (projectors/builds,
-- criticalPath). The steps of the path are not kept: they are in the
-- build's raw events. 4 bytes a build that sends it; builds projected
-- before this show none until replayed.
alter table build_metrics add column if not exists critical_path_ms int;

---- create above / drop below ----

alter table build_metrics drop column if exists critical_path_ms;
