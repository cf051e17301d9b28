-- What a build says about itself and why its targets failed
-- (projectors/builds): workspace status keys (--workspace_status_command
-- and Bazel's own: BUILD_USER, BUILD_HOST, BUILD_TIMESTAMP, ...) and
-- --build_metadata entries, one row per key; its canonical command line
-- and the options given explicitly, as argument arrays; the
-- events that are root causes of failures (failed actions, with their exit
-- code and stderr, and failed labels); and, per failed target, the root
-- causes Bazel named in the event that reported its failure.
--
-- Online: only new tables and an index on one of them; nothing existing is
-- rewritten. Every row carries the project and is keyed (invocation id,
-- project, ...) like the other tables of the projection. Each kind of row
-- comes once per build from an event that comes once (the resend guard of
-- the invocation skips repeats), so the projector inserts them with ON
-- CONFLICT DO NOTHING: the first value of a key wins, whatever the batch
-- boundaries.
--
-- The values are what the stream holds: the BES edge has redacted the
-- events before storing them (services/bes/redact), so a secret in a
-- --remote_header, an environment flag or a metadata value that is not
-- allowed reaches these tables as the redaction marker.

-- source: 'build_metadata' (--build_metadata KEY=VALUE), or the workspace
-- status file the key belongs to by Bazel's rule: 'stable' for keys starting
-- with STABLE_ and for BUILD_EMBED_LABEL, BUILD_HOST, BUILD_USER; else
-- 'volatile' (BUILD_TIMESTAMP, BUILD_SCM_REVISION unless the command names
-- it STABLE_...). Bazel reports both files in one WorkspaceStatus event.
create table build_metadata (
    project       text not null,
    invocation_id text not null,
    source        text not null check (source in ('build_metadata', 'stable', 'volatile')),
    key           text not null,
    value         text not null,
    primary key (invocation_id, project, source, key)
);
-- "The builds of project P where KEY = VALUE": the builds of a commit
-- (COMMIT_SHA, BUILD_SCM_REVISION), of a branch, of a CI role. The
-- projector cuts keys at 256 and values at 1,024 bytes so that an entry
-- always fits a btree page (see projectors/builds/README.md).
create index build_metadata_lookup on build_metadata (project, key, value);

-- source: 'structured_command_line' (label: Bazel's command_line_label,
-- "canonical", or "tool" when it has arguments) or 'options_parsed' (label:
-- explicit_startup_options or explicit_cmd_line: the options given
-- explicitly). argv is the command line as Bazel gave it (a structured one
-- flattened: chunks as they are, options in their combined form), redacted
-- by the edge. The "original" and unstructured command lines and the full
-- option lists repeat these and are not projected (projectors/builds,
-- metadata.go). 017 moves argv to build_argv, each distinct array once per
-- project, which these rows name by its hash (argv_hash).
create table build_command_lines (
    project       text not null,
    invocation_id text not null,
    source        text not null,
    label         text not null,
    argv          text[] not null,
    primary key (invocation_id, project, source, label)
);

-- The events that can be a target's root cause: a failed action (kind
-- 'action', keyed by its id: label, primary output, configuration) or a
-- label that failed to load or analyse (kinds 'configured_label',
-- 'unconfigured_label', from an Aborted event; primary_output and
-- configuration ''). stderr_uri is ActionExecuted.stderr as Bazel sent it:
-- from Bazel 4.2.3 a file:// URI on the client's machine, which this
-- server cannot read; stderr holds the contents when the event carried
-- them inline. message is the failure detail's message (an action) or the
-- Aborted event's description.
create table build_failures (
    project        text not null,
    invocation_id  text not null,
    kind           text not null check (kind in ('action', 'configured_label', 'unconfigured_label')),
    label          text not null,
    primary_output text not null,
    configuration  text not null,
    mnemonic       text,                       -- ActionExecuted.type, e.g. Genrule
    exit_code      int,
    message        text,
    stderr_uri     text,
    stderr         text,
    stdout_uri     text,
    primary key (invocation_id, project, kind, label, primary_output, configuration)
);

-- The root causes of a failed target: the children of its failed
-- TargetComplete (or Aborted) event, each naming a build_failures row by
-- its key. A target can be its own root cause (its action failed); a
-- dependent names its dependency's, and keeps no copy of its message.
create table target_causes (
    project             text not null,
    invocation_id       text not null,
    label               text not null,
    cause_kind          text not null,
    cause_label         text not null,
    cause_output        text not null,
    cause_configuration text not null,
    primary key (invocation_id, project, label, cause_kind, cause_label, cause_output, cause_configuration)
);

---- create above / drop below ----

drop table target_causes;
drop table build_failures;
drop table build_command_lines;
drop table build_metadata;
