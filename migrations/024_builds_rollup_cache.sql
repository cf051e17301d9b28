-- The action cache in hourly_rollups (projectors/builds, sqlReconcile):
-- what the hour's finished builds counted of their action cache hits and
-- misses (BuildMetrics' action summary), for the console's trends of the
-- cache hit rate. As for its tests, each invocation records what it
-- counts there (counted_cache_hits, counted_cache_misses; null until it
-- is counted), so that a build's metrics arriving after its end, or a
-- replay, move the rollup by the difference. int columns: 8 bytes a
-- finished build.

alter table invocations add column if not exists counted_cache_hits int,
                        add column if not exists counted_cache_misses int;
alter table hourly_rollups add column if not exists cache_hits bigint not null default 0,
                           add column if not exists cache_misses bigint not null default 0;

-- The builds already counted: one pass over the finished invocations
-- (each row is written again once; the table's next vacuum takes the old
-- versions), then the rollups from them.
update invocations i set
    counted_cache_hits   = coalesce(m.action_cache_hits, 0)::int,
    counted_cache_misses = coalesce(m.action_cache_misses, 0)::int
from invocations i2 left join build_metrics m on m.build_key = i2.build_key
where i2.build_key = i.build_key and i.counted_status is not null and i.counted_cache_hits is null;
update hourly_rollups r set cache_hits = s.hits, cache_misses = s.misses
from (select counted_project as project, counted_hour as hour,
             sum(counted_cache_hits) as hits, sum(counted_cache_misses) as misses
      from invocations where counted_status is not null group by 1, 2) s
where r.project = s.project and r.hour = s.hour;

---- create above / drop below ----

alter table hourly_rollups drop column if exists cache_misses, drop column if exists cache_hits;
alter table invocations drop column if exists counted_cache_misses, drop column if exists counted_cache_hits;
