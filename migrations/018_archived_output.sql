-- Console output in the archive (archive/output.go,
-- projectors/builds/outputarchive.go). Once a build's object holds every
-- event the projector applied of it, and the output those events fold to
-- is what build_output_pages (or a build_output row of before 012) holds,
-- byte for byte and cut into the same pages, the archiver deletes those
-- rows and records here what the object holds instead:
--
--   output_seq           the object's messages up to this BES stream
--                        sequence fold to the build's output (null: the
--                        output is in PostgreSQL, where it always was);
--                        pages of the build left in build_output_pages are
--                        the output of its later events, cut from page 0
--   output_stdout_bytes, output_stderr_bytes
--                        its size per stream, for the reads that need no
--                        more (builds.OutputSizes) and to place the later
--                        pages after it
--   output_error         why the object's output differs from
--                        PostgreSQL's (kept there then; a re-archive
--                        clears it and tries again)
--
-- Existing rows get nulls: their output is in PostgreSQL, as it is, and the
-- archiver moves it a batch at a time. Adding nullable columns rewrites
-- nothing; the index is built concurrently, and holds only the builds
-- whose output may move (a pass's worth, all archived builds just after
-- this migration or a replay, until the archiver has moved them).
--
-- Down: output already moved stays in the objects only, which the code of
-- before cannot read; `millrace replay builds` of that code folds it into
-- pages again.

---- tern: disable-tx ----

alter table archived_builds add column if not exists output_seq bigint;
alter table archived_builds add column if not exists output_stdout_bytes bigint;
alter table archived_builds add column if not exists output_stderr_bytes bigint;
alter table archived_builds add column if not exists output_error text;
create index concurrently if not exists archived_builds_output_idx on archived_builds (last_seq)
    where object_key <> '' and verify_error is null and output_error is null and raw_expired_at is null
      and (output_seq is null or output_seq < last_seq);

---- create above / drop below ----

---- tern: disable-tx ----

drop index concurrently if exists archived_builds_output_idx;
alter table archived_builds drop column if exists output_error;
alter table archived_builds drop column if exists output_stderr_bytes;
alter table archived_builds drop column if exists output_stdout_bytes;
alter table archived_builds drop column if exists output_seq;
