-- The model call fields the rows did not keep, so that a call read back from Postgres equals the
-- call on the stream: who made it (`agent`), the registered model it was routed to (`endpoint`),
-- when it was admitted (`started_at`), the sampling parameters, the API the harness called, and
-- in continuous prompt mode how its prompt was built (`continuity`: `extended` or
-- `fresh: <why>`; NULL in exact mode). `top_k` is numeric: the event's integer is unbounded.
-- Rows written before this migration read as NULL and `chat` until a rebuild.
ALTER TABLE model_calls
    ADD COLUMN agent        text,
    ADD COLUMN endpoint     text,
    ADD COLUMN started_at   double precision,
    ADD COLUMN temperature  double precision,
    ADD COLUMN top_p        double precision,
    ADD COLUMN top_k        numeric,
    ADD COLUMN api          text NOT NULL DEFAULT 'chat',
    ADD COLUMN continuity   text;
