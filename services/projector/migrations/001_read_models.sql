-- Rollwire read models: what the projector folds the event stream into.
--
-- Every row here is derived from the JetStream stream and can be rebuilt from it
-- (`rollwire projector rebuild`). Times are Unix seconds (double precision), exactly as the
-- events carry them; `seq` columns are JetStream stream sequences.

-- The last stream sequence applied, written in the same transaction as the rows it covers:
-- a redelivered or replayed event (seq <= last_seq) is a no-op.
CREATE TABLE projector_position (
    stream      text PRIMARY KEY,
    last_seq    bigint NOT NULL DEFAULT 0,
    updated_at  timestamptz NOT NULL DEFAULT now()
);

-- One row per run seen on the stream. `name`, `config`, `started_*` come from the run's first
-- RunStarted (NULL when the run was never started); `phase`/`weights_version` from its latest
-- PhaseChanged; `events`, `first_seq`, `last_seq`, `last_event_at` count every event of the run.
CREATE TABLE runs (
    run_id           text PRIMARY KEY,
    name             text,
    config           jsonb,
    started_at       double precision,
    started_seq      bigint,
    phase            text,
    weights_version  integer,
    phase_seq        bigint,
    events           bigint NOT NULL DEFAULT 0,
    first_seq        bigint NOT NULL,
    last_seq         bigint NOT NULL,
    last_event_at    double precision NOT NULL
);
CREATE INDEX runs_last_seq ON runs (last_seq DESC);

-- One row per created rollout: the rollout view the API serves (the same fold as the gateway's
-- stream reader: `state` holds the view's fields except its lists and its large JSON fields,
-- which have columns of their own; the other columns copy view fields the API filters and sorts
-- on) plus totals over the rollout's events. `created_seq` orders and pages the list;
-- `terminal_seq` (0 until it ends) orders completed rollouts; `reward` is the last reward of the
-- succeeded attempt, else the latest one; `flags` are names of rules that matched its calls.
CREATE TABLE rollouts (
    run_id           text NOT NULL,
    rollout_id       text NOT NULL,
    input            jsonb,
    metadata         jsonb NOT NULL,
    config           jsonb NOT NULL,
    state            jsonb NOT NULL,
    group_id         text,
    mode             text NOT NULL,
    status           text NOT NULL,
    attempt_id       text,
    created_at       double precision NOT NULL,
    updated_at       double precision NOT NULL,
    created_seq      bigint NOT NULL,
    terminal_seq     bigint NOT NULL,
    ended_at         double precision,
    attempts         integer NOT NULL DEFAULT 0,
    reward           double precision,
    rewards          integer NOT NULL DEFAULT 0,
    calls            integer NOT NULL DEFAULT 0,
    failed_calls     integer NOT NULL DEFAULT 0,
    prompt_tokens    bigint NOT NULL DEFAULT 0,
    response_tokens  bigint NOT NULL DEFAULT 0,
    samples          integer NOT NULL DEFAULT 0,
    custom_events    integer NOT NULL DEFAULT 0,
    flags            text[] NOT NULL DEFAULT '{}',
    last_seq         bigint NOT NULL,
    last_event_at    double precision NOT NULL,
    PRIMARY KEY (run_id, rollout_id)
);
CREATE UNIQUE INDEX rollouts_created_seq ON rollouts (created_seq);
CREATE INDEX rollouts_by_id ON rollouts (rollout_id, created_seq);
CREATE INDEX rollouts_by_run ON rollouts (run_id, created_seq);
CREATE INDEX rollouts_by_run_status ON rollouts (run_id, status, created_seq);
CREATE INDEX rollouts_by_status ON rollouts (status, created_seq);
CREATE INDEX rollouts_by_group ON rollouts (group_id, created_seq);
CREATE INDEX rollouts_terminal ON rollouts (terminal_seq) WHERE terminal_seq > 0;

-- Attempts of each rollout, in the order the rollout view lists them (`idx`).
CREATE TABLE attempts (
    run_id      text NOT NULL,
    rollout_id  text NOT NULL,
    attempt_id  text NOT NULL,
    idx         integer NOT NULL,
    sequence    integer NOT NULL,
    started_at  double precision NOT NULL,
    executor    text,
    ended       boolean NOT NULL,
    PRIMARY KEY (run_id, rollout_id, attempt_id)
);

-- Totals over the model calls and rewards that name an attempt (`attempt_key` = attempt id, or ''
-- for events without one), counted once the rollout exists; `reward` is the attempt's last.
CREATE TABLE attempt_stats (
    run_id           text NOT NULL,
    rollout_id       text NOT NULL,
    attempt_key      text NOT NULL,
    calls            integer NOT NULL DEFAULT 0,
    failed_calls     integer NOT NULL DEFAULT 0,
    prompt_tokens    bigint NOT NULL DEFAULT 0,
    response_tokens  bigint NOT NULL DEFAULT 0,
    samples          integer NOT NULL DEFAULT 0,
    reward           double precision,
    reward_seq       bigint,
    PRIMARY KEY (run_id, rollout_id, attempt_key)
);

-- One row per model call (ModelRequestRecorded). Token ids are packed little-endian int32 and
-- logprobs little-endian float64 (`rollwire_int32s` / `rollwire_float64s` unpack them in SQL);
-- the *_text columns hold the decoded text when the projector knows the model's tokenizer.
-- `new_sample` says whether the call starts a new training sample under prefix merging.
CREATE TABLE model_calls (
    seq              bigint PRIMARY KEY,
    run_id           text NOT NULL,
    rollout_id       text NOT NULL,
    attempt_id       text,
    time             double precision NOT NULL,
    call_id          text NOT NULL,
    choice_index     integer NOT NULL,
    mode             text NOT NULL,
    status           text NOT NULL,
    model            text NOT NULL,
    weights_version  integer,
    prompt_ids       bytea NOT NULL,
    response_ids     bytea NOT NULL,
    logprobs         bytea NOT NULL,
    prompt_tokens    integer NOT NULL,
    response_tokens  integer NOT NULL,
    prompt_text      text,
    response_text    text,
    response_pieces  text[],
    finish_reason    text,
    request          jsonb NOT NULL,
    response         jsonb NOT NULL,
    usage            jsonb NOT NULL,
    latency_s        double precision NOT NULL,
    error            text,
    new_sample       boolean NOT NULL,
    flags            text[] NOT NULL
);
ALTER TABLE model_calls ALTER COLUMN prompt_ids SET STORAGE EXTERNAL;
ALTER TABLE model_calls ALTER COLUMN response_ids SET STORAGE EXTERNAL;
ALTER TABLE model_calls ALTER COLUMN logprobs SET STORAGE EXTERNAL;
CREATE INDEX model_calls_by_rollout ON model_calls (rollout_id, seq);
CREATE INDEX model_calls_by_run ON model_calls (run_id, weights_version);

-- Prefix-merge state of each (rollout, attempt): hashes of its open chains of calls (see
-- services/projector/chains.py), so the next call is classified without re-reading tokens.
CREATE TABLE sample_chains (
    run_id       text NOT NULL,
    rollout_id   text NOT NULL,
    attempt_key  text NOT NULL,
    chains       bytea NOT NULL,
    PRIMARY KEY (run_id, rollout_id, attempt_key)
);

-- Every RewardReported.
CREATE TABLE rewards (
    seq         bigint PRIMARY KEY,
    run_id      text NOT NULL,
    rollout_id  text NOT NULL,
    attempt_id  text,
    time        double precision NOT NULL,
    value       double precision NOT NULL,
    name        text,
    step        integer,
    source      text NOT NULL
);
CREATE INDEX rewards_by_rollout ON rewards (run_id, rollout_id, seq);

-- Every CustomEvent, payload as jsonb.
CREATE TABLE custom_events (
    seq         bigint PRIMARY KEY,
    run_id      text NOT NULL,
    rollout_id  text NOT NULL,
    attempt_id  text,
    time        double precision NOT NULL,
    name        text NOT NULL,
    payload     jsonb NOT NULL
);
CREATE INDEX custom_events_by_rollout ON custom_events (rollout_id, seq);
CREATE INDEX custom_events_by_name ON custom_events (run_id, name, seq);

-- Model endpoints per run: the latest registration and removal (API keys are never stored).
CREATE TABLE models (
    run_id           text NOT NULL,
    name             text NOT NULL,
    base_url         text,
    served_model     text,
    weights_version  integer,
    registered_at    double precision,
    registered_seq   bigint,
    removed_at       double precision,
    removed_seq      bigint,
    PRIMARY KEY (run_id, name)
);

-- Every PhaseChanged (collocated-async phase history).
CREATE TABLE phases (
    seq              bigint PRIMARY KEY,
    run_id           text NOT NULL,
    phase            text NOT NULL,
    weights_version  integer,
    time             double precision NOT NULL
);
CREATE INDEX phases_by_run ON phases (run_id, seq);

-- The ordered index of every event (the timeline). `body` is the event's JSON for types without
-- a table of their own; NULL for model_request, reward and custom, whose rows hold the body.
CREATE TABLE events (
    seq             bigint PRIMARY KEY,
    run_id          text NOT NULL,
    rollout_id      text,
    attempt_id      text,
    type            text NOT NULL,
    event_id        text NOT NULL,
    schema_version  integer NOT NULL,
    time            double precision NOT NULL,
    body            jsonb
);
CREATE INDEX events_by_rollout ON events (rollout_id, seq) WHERE rollout_id IS NOT NULL;
CREATE INDEX events_by_run ON events (run_id, seq);

-- Stream messages that could not be projected (undecodable, or rejected by Postgres), with why.
CREATE TABLE dead_letters (
    seq          bigint PRIMARY KEY,
    subject      text NOT NULL,
    reason       text NOT NULL,
    data         bytea NOT NULL,
    recorded_at  timestamptz NOT NULL DEFAULT now()
);

-- Unpack token ids (little-endian int32) for ad-hoc SQL: SELECT rollwire_int32s(prompt_ids) ...
CREATE FUNCTION rollwire_int32s(b bytea) RETURNS integer[]
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$
    SELECT coalesce(array_agg(
        get_byte(b, i) | (get_byte(b, i + 1) << 8) | (get_byte(b, i + 2) << 16) | (get_byte(b, i + 3) << 24)
        ORDER BY i), '{}')
    FROM generate_series(0, length(b) - 4, 4) AS i
$$;

-- Unpack logprobs (little-endian IEEE-754 float64) for ad-hoc SQL.
CREATE FUNCTION rollwire_float64s(b bytea) RETURNS double precision[]
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$
    WITH words AS (
        SELECT i, (get_byte(b, i)::bigint | (get_byte(b, i + 1)::bigint << 8) | (get_byte(b, i + 2)::bigint << 16)
                  | (get_byte(b, i + 3)::bigint << 24) | (get_byte(b, i + 4)::bigint << 32)
                  | (get_byte(b, i + 5)::bigint << 40) | (get_byte(b, i + 6)::bigint << 48)
                  | (get_byte(b, i + 7)::bigint << 56)) AS bits
        FROM generate_series(0, length(b) - 8, 8) AS i
    ), parts AS (
        SELECT i, bits < 0 AS negative, (bits >> 52) & 2047 AS e, bits & 4503599627370495 AS m FROM words
    )
    SELECT coalesce(array_agg(
        (CASE WHEN negative THEN -1.0::float8 ELSE 1.0::float8 END) * CASE
            WHEN e = 2047 AND m = 0 THEN 'Infinity'::float8
            WHEN e = 2047 THEN 'NaN'::float8
            WHEN e = 0 THEN m::float8 * power(2::float8, -1074)
            ELSE (1 + m::float8 / 4503599627370496) * power(2::float8, e - 1023)
        END ORDER BY i), '{}')
    FROM parts
$$;
