-- Who wrote a custom event (`agent`, `evaluator` or `admin`): parts that act on an event's name
-- ignore an agent's, so a custom event read back from Postgres must say whose it is. Rows written
-- before this migration, like events on the stream written before the field existed, read as `admin`.
ALTER TABLE custom_events ADD COLUMN source text NOT NULL DEFAULT 'admin';
