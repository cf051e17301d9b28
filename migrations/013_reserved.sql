-- Reserved: the number of a migration on a branch not yet merged. Migrations
-- run in an unbroken sequence, so a later one needs this file until that
-- branch lands; merging it replaces this file.

select 1;

---- create above / drop below ----

select 1;
