-- Members of a partitioned consumer group (streams/group.go): each instance
-- of a partitioned projector writes its row at start and renews seen_at
-- while it runs; every instance reads the live rows and runs the
-- partitions that fall to it. A row whose seen_at is older than the
-- group's member TTL is a member that died, and any member deletes it.
create table consumer_members (
    consumer_group text not null,
    member         text not null,
    seen_at        timestamptz not null default now(),
    primary key (consumer_group, member)
);

-- Partitions of a group that no member runs while a row names them: a
-- replay of one partition (or of all) pauses them, takes their leases as
-- the members let go, and deletes its rows when done.
create table consumer_paused (
    consumer_group text not null,
    partition      int not null,
    paused_by      text not null,
    paused_at      timestamptz not null default now(),
    primary key (consumer_group, partition)
);

-- The consumer position that orders an archived build's events (builds, or
-- its partition's builds_<p>): its console output moves into its object
-- once that position is past the object's last message (archive/output.go).
-- Null for builds archived before: the one consumer's.
alter table archived_builds add column position text;

---- create above / drop below ----

alter table archived_builds drop column position;
drop table consumer_paused;
drop table consumer_members;
