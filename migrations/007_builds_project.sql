-- A build's identity is (project, invocation id). Bazel lets any client
-- choose its invocation id (--invocation_id), and the BES stream keeps
-- projects apart (bes.<project>.<invocation>), but 002 keyed the builds
-- projection by invocation id alone: two projects sending the same id got
-- one merged row, and the events of one were skipped as resends of the
-- other's. Every table of the projection now carries the project and is
-- keyed by it.
--
-- Existing rows: invocations.project holds the project of the first event
-- applied (the edge's Millrace-Project header). It is '' only for events
-- that carried no project, which the edge names "default" (services/bes
-- Config.DefaultProject, and the projector's fallback now), so '' becomes
-- 'default' here, with the rollups it was counted in. Targets, tests,
-- metrics and output take their invocation's project; a row whose
-- invocation is gone takes 'default'. An invocation that two projects
-- already merged cannot be split from the rows: it stays with the project
-- of its first event (a replay of the stream, `millrace replay builds`,
-- rebuilds both apart).
--
-- Key order: the invocation id leads each primary key. It is the selective
-- part, and `millrace builds show <id>` without --project finds every
-- project holding that id on the same index.

update invocations set project = 'default' where project = '';
update invocations set counted_project = 'default' where counted_project = '';

insert into hourly_rollups as r (project, hour, builds, succeeded, failed, abandoned, duration_hist,
                                 duration_sum_ms, tests_passed, tests_failed, tests_flaky)
select 'default', hour, builds, succeeded, failed, abandoned, duration_hist,
       duration_sum_ms, tests_passed, tests_failed, tests_flaky
from hourly_rollups where project = ''
on conflict (project, hour) do update set
    builds          = r.builds + excluded.builds,
    succeeded       = r.succeeded + excluded.succeeded,
    failed          = r.failed + excluded.failed,
    abandoned       = r.abandoned + excluded.abandoned,
    duration_hist   = array(select a + b from unnest(r.duration_hist, excluded.duration_hist)
                            with ordinality as h(a, b, n) order by n),
    duration_sum_ms = r.duration_sum_ms + excluded.duration_sum_ms,
    tests_passed    = r.tests_passed + excluded.tests_passed,
    tests_failed    = r.tests_failed + excluded.tests_failed,
    tests_flaky     = r.tests_flaky + excluded.tests_flaky;
delete from hourly_rollups where project = '';

-- The project is part of the key now, so it has no default: the projector
-- always names it.
alter table invocations
    alter column project drop default,
    add constraint invocations_project_check check (project <> ''),
    drop constraint invocations_pkey,
    add primary key (id, project);

alter table targets add column project text;
update targets t set project = i.project from invocations i where i.id = t.invocation_id;
update targets set project = 'default' where project is null;
alter table targets
    alter column project set not null,
    drop constraint targets_pkey,
    add primary key (invocation_id, project, label);

alter table tests add column project text;
update tests t set project = i.project from invocations i where i.id = t.invocation_id;
update tests set project = 'default' where project is null;
alter table tests
    alter column project set not null,
    drop constraint tests_pkey,
    add primary key (invocation_id, project, label);

alter table build_metrics add column project text;
update build_metrics m set project = i.project from invocations i where i.id = m.invocation_id;
update build_metrics set project = 'default' where project is null;
alter table build_metrics
    alter column project set not null,
    drop constraint build_metrics_pkey,
    add primary key (invocation_id, project);

alter table build_output add column project text;
update build_output o set project = i.project from invocations i where i.id = o.invocation_id;
update build_output set project = 'default' where project is null;
alter table build_output
    alter column project set not null,
    drop constraint build_output_pkey,
    add primary key (invocation_id, project);

alter table build_output_chunks add column project text;
update build_output_chunks c set project = i.project from invocations i where i.id = c.invocation_id;
update build_output_chunks set project = 'default' where project is null;
alter table build_output_chunks
    alter column project set not null,
    drop constraint build_output_chunks_pkey,
    add primary key (invocation_id, project, first_seq);

---- create above / drop below ----

-- Fails (duplicate key) once two projects hold the same invocation id: the
-- old shape cannot hold them. Dropping a column drops the keys holding it.
alter table build_output_chunks drop column project;
alter table build_output_chunks add primary key (invocation_id, first_seq);
alter table build_output drop column project;
alter table build_output add primary key (invocation_id);
alter table build_metrics drop column project;
alter table build_metrics add primary key (invocation_id);
alter table tests drop column project;
alter table tests add primary key (invocation_id, label);
alter table targets drop column project;
alter table targets add primary key (invocation_id, label);
alter table invocations
    drop constraint invocations_pkey,
    drop constraint invocations_project_check,
    alter column project set default '';
alter table invocations add primary key (id);
