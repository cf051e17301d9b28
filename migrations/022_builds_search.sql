-- The console's list of builds (projectors/builds, Search):
-- - a project's builds newest first, a page at a time: in build key order,
--   which is the order of their first events (016). Its project is
--   collate "C", and so is Search's condition: the look-ups of a build
--   by (id, project) cannot take it for the primary key (PostgreSQL
--   would, on tables without statistics, and read all the project's
--   builds for each);
-- - the builds of a commit or a branch across the projects a reader may
--   see: build_metadata_lookup becomes (key, value, project), which serves
--   the look-up within one project as well as before.
-- Built concurrently: writers go on meanwhile; the old index goes once the
-- new one is valid.

---- tern: disable-tx ----

create index concurrently if not exists invocations_project_key_idx on invocations (project collate "C", build_key);
create index concurrently if not exists build_metadata_lookup_kvp on build_metadata (key, value, project);
drop index concurrently if exists build_metadata_lookup;
alter index build_metadata_lookup_kvp rename to build_metadata_lookup;

---- create above / drop below ----

---- tern: disable-tx ----

create index concurrently if not exists build_metadata_lookup_pkv on build_metadata (project, key, value);
drop index concurrently if exists build_metadata_lookup;
alter index build_metadata_lookup_pkv rename to build_metadata_lookup;
drop index concurrently if exists invocations_project_key_idx;
