-- Each token stored once: a model call whose prompt continues an earlier call of its rollout
-- stores only what is new, and the row it continues. With `base_seq` set, the call's full prompt
-- is the first `base_tokens` ids of that row's full prompt + response ids followed by
-- `prompt_ids`; its full prompt text the first `base_text` characters of that row's full prompt
-- text + response text followed by `prompt_text`; its full request `request` completed from that
-- row's full request as `request_ref` says (`same`: keys unchanged, `prefix`: list keys whose first
-- n items are that row's). Rows with `base_seq` NULL, every row written before this migration
-- among them, are stored in full.
ALTER TABLE model_calls
    ADD COLUMN base_seq     bigint,
    ADD COLUMN base_tokens  integer NOT NULL DEFAULT 0,
    ADD COLUMN base_text    integer NOT NULL DEFAULT 0,
    ADD COLUMN request_ref  jsonb;

-- A call's full prompt ids (packed int32), its references followed: SELECT rollwire_prompt_ids(seq) ...
CREATE FUNCTION rollwire_prompt_ids(call_seq bigint) RETURNS bytea
LANGUAGE sql STABLE STRICT PARALLEL SAFE AS $$
    WITH RECURSIVE up AS (
        SELECT seq, base_seq, base_tokens, prompt_ids, response_ids, 0 AS depth
        FROM model_calls WHERE seq = call_seq
      UNION ALL
        SELECT m.seq, m.base_seq, m.base_tokens, m.prompt_ids, m.response_ids, u.depth + 1
        FROM model_calls m JOIN up u ON m.seq = u.base_seq
    ), down AS (
        SELECT depth, prompt_ids AS full_ids, response_ids FROM up WHERE depth = (SELECT max(depth) FROM up)
      UNION ALL
        SELECT u.depth, substring(d.full_ids || d.response_ids FROM 1 FOR 4 * u.base_tokens) || u.prompt_ids,
               u.response_ids
        FROM down d JOIN up u ON u.depth = d.depth - 1
    )
    SELECT full_ids FROM down WHERE depth = 0
$$;
