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

---- create above / drop below ----

drop table consumer_paused;
drop table consumer_members;
