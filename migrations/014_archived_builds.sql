-- The raw archive's bookkeeping (package archive): one row per build whose
-- raw events are in the bucket, one object each. The archiver writes it;
-- the builds projector never does, and a replay of the BES stream neither
-- empties nor rebuilds it (it is not among the projection's Digest and
-- Reset tables: what it records is the bucket's state, not the stream's).
create table archived_builds (
    invocation_id text not null,
    project       text not null,
    object_key    text not null,            -- '' when the stream held none of its events
    dict_id       bigint not null,          -- the zstd dictionary's id; 0: plain zstd
    events        bigint not null,          -- messages in the object
    first_seq     bigint not null,          -- BES stream sequences of the first and last
    last_seq      bigint not null,
    last_event_at timestamptz not null,     -- invocations.last_event_at when read: a newer one re-archives
    raw_bytes     bigint not null,          -- the records uncompressed
    stored_bytes  bigint not null,          -- the object
    archived_at   timestamptz not null,
    verified_at   timestamptz,              -- last `millrace archive verify` of it
    verify_error  text,                     -- its finding; null: good
    trimmed_seq   bigint,                   -- the last BES sequence trimmed from the stream; null: none
    primary key (invocation_id, project)
);

-- The builds whose raw events are still in the stream, waiting for every
-- consumer of BES to read them before they are trimmed: few at any time
-- (a pass's worth, or a holder's backlog), so the index stays small while
-- the table grows by every build.
create index archived_builds_untrimmed_idx on archived_builds (last_seq)
    where object_key <> '' and verify_error is null and (trimmed_seq is null or trimmed_seq < last_seq);

-- The archiver looks for finished builds by their last event's time. The
-- index holds the column invocations_running_idx holds, and of its
-- predicate's columns only stream_done is new to the set that decides
-- whether an update is HOT: it changes once per build, so the projector's
-- updates of running builds stay HOT.
create index invocations_finished_idx on invocations (last_event_bucket)
    where status <> 'running' or stream_done;

---- create above / drop below ----

drop index invocations_finished_idx;
drop index archived_builds_untrimmed_idx;
drop table archived_builds;
