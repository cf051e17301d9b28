-- Consumer positions: the highest stream sequence each projector has applied.
-- The consumer runner upserts a row in the same transaction as the projected
-- rows, so a redelivered message at or below the position is skipped.
create table consumer_positions (
    consumer   text primary key,
    stream     text not null,
    stream_seq bigint not null,
    updated_at timestamptz not null default now()
);

---- create above / drop below ----

drop table consumer_positions;
