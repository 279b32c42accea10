"""`model_calls` stores each token once, and every read path returns the calls in full.

A long linear rollout recorded as the gateway records it (references to the previous call and only
the new ids and request parts) is projected with a tokenizer. Its rows must take bytes in
proportion to its distinct tokens, not to turns x context, and the query API's events, the
viewer's call and timeline, and `rollwire_prompt_ids` in SQL must give what the stream resolves
to; so must they after a `rebuild --run`. Also when a referenced call is stored in full (a gateway
that forgot the earlier calls) or has no row at all (Postgres refused it, so it is a dead letter).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import asyncpg
import msgspec
from projector_support import running_projector, wait_applied
from viewer_demo import WORDS, word_tokenizer_json

from schemas import AttemptStarted, Event, ModelRequestRecorded, RolloutCreated, RolloutStatusChanged, RunStarted
from services.common.eventstore import Appended, EventStore
from services.devstack.embedded import NatsServer
from services.gateway.proxy.recording import CallChains
from services.projector.packing import unpack_int32
from services.projector.reader import PostgresRolloutReader
from services.projector.rebuild import rebuild_run
from services.projector.tokens import Detokenizer
from services.projector.viewer import queries

RUN = "once"
TURNS = 30
BYTES_PER_TOKEN = 32  # the rows of this rollout measure about 20; storing full prompts takes over 100


def linear_rollout(rollout_id: str, turns: int, seed: int = 3) -> list[Event]:
    """A rollout whose every prompt is the previous prompt + response + a 60-token observation."""
    rng = random.Random(seed)
    attempt = f"{rollout_id}-a1"
    events: list[Event] = [
        RolloutCreated(run_id=RUN, rollout_id=rollout_id, input={"task": "fix"}),
        AttemptStarted(run_id=RUN, rollout_id=rollout_id, attempt_id=attempt, sequence=1, executor="local"),
        RolloutStatusChanged(run_id=RUN, rollout_id=rollout_id, attempt_id=attempt, status="running"),
    ]
    messages: list[dict[str, Any]] = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "go"}]
    prompt = [rng.randrange(len(WORDS)) for _ in range(40)]
    for turn in range(turns):
        response = [rng.randrange(len(WORDS)) for _ in range(20)]
        observation = [rng.randrange(len(WORDS)) for _ in range(60)]
        answer = " ".join(WORDS[i] for i in response)
        events.append(ModelRequestRecorded(
            run_id=RUN, rollout_id=rollout_id, attempt_id=attempt, call_id=f"{rollout_id}-c{turn}", model="policy",
            weights_version=1, prompt_ids=list(prompt), response_ids=response,
            logprobs=[-rng.random() for _ in response], finish_reason="stop",
            request={"model": "policy", "temperature": 1.0, "messages": list(messages)},
            response={"choices": [{"index": 0, "message": {"role": "assistant", "content": answer}}]},
            usage={"prompt_tokens": len(prompt), "completion_tokens": len(response)}, latency_s=0.1,
        ))  # fmt: skip
        messages += [
            {"role": "assistant", "content": answer},
            {"role": "tool", "content": " ".join(WORDS[i] for i in observation)},
        ]
        prompt = [*prompt, *response, *observation]
    return events


async def record(
    store: EventStore, events: list[Event], chains: CallChains, forget_at: int | None = None, poison: str = ""
) -> int:
    """Append as the gateway records: each call compacted against the attempt's earlier calls.

    From `forget_at` on, a fresh `CallChains` (a restarted gateway) records its next call in full;
    the call named `poison` is published with a request Postgres refuses to store.
    """
    last = 0
    for index, event in enumerate(events):
        if index == forget_at:
            chains = CallChains()
        if isinstance(event, ModelRequestRecorded):
            compact = chains.compact([event])
            if event.call_id == poison:  # valid JSON whose number Postgres's jsonb cannot hold
                data = msgspec.json.encode(compact[0]).replace(b'"request":{', b'"request":{"bad":1e1000000,')
                ack = await store.js.publish(event.subject, data, stream=store.stream)
                acks = [Appended(seq=ack.seq)]
            else:
                acks = [await store.append(e) for e in compact]
            chains.remember([event], acks)
            last = acks[-1].seq
        else:
            last = (await store.append(event)).seq
    return last


async def project(nats: NatsServer, database: str, conn: asyncpg.Connection, tokenizer: Path, last: int) -> None:
    tokenizer.write_text(word_tokenizer_json())  # noqa: ASYNC240  # a few hundred bytes
    async with running_projector(nats.url, database, tokenizers=[f"policy={tokenizer}"]):
        await wait_applied(conn, last)


async def check_reads(
    store: EventStore, database: str, conn: asyncpg.Connection, rollout_id: str, tokenizer: Path
) -> list[Any]:
    """Every read path gives the calls the stream resolves to; returns the resolved calls."""
    resolved = [s for s in await store.read_rollout(RUN, rollout_id) if isinstance(s.event, ModelRequestRecorded)]
    decode = Detokenizer.from_specs([f"policy={tokenizer}"])
    reader = PostgresRolloutReader(database)
    try:
        from_api = {s.seq: s.event for s in await reader.events(rollout_id, RUN)}
        timeline = await queries.timeline(reader, RUN, rollout_id)
        shown = {item["seq"]: item for item in timeline["events"] if item["type"] == "model_request"}
        later = await queries.timeline(reader, RUN, rollout_id, after_seq=resolved[len(resolved) // 2].seq)
        middle = next(item for item in later["events"] if item["type"] == "model_request")
        for stored in resolved:
            call = stored.event
            assert isinstance(call, ModelRequestRecorded)
            api = from_api[stored.seq]
            assert isinstance(api, ModelRequestRecorded)
            assert (api.prompt_ids, api.response_ids, api.logprobs) == (
                call.prompt_ids,
                call.response_ids,
                call.logprobs,
            )
            assert api.request == call.request
            full = await queries.call(reader, stored.seq)
            assert full is not None and full["prompt_ids"] == call.prompt_ids and full["request"] == call.request
            text = decode.decode("policy", call.prompt_ids, call.response_ids)
            assert text is not None and full["prompt_text"] == text.prompt_text
            assert shown[stored.seq]["messages_total"] == len(call.request["messages"])
            sql = await conn.fetchval("SELECT rollwire_prompt_ids($1)", stored.seq)
            assert unpack_int32(sql) == call.prompt_ids
        assert [m["role"] for m in middle["new_messages"]] == ["assistant", "tool"]  # only what is new
    finally:
        await reader.close()
    return resolved


async def test_a_long_rollout_stores_each_token_once(
    fresh_nats: NatsServer, database: str, conn: asyncpg.Connection, tmp_path: Path
) -> None:
    store = await EventStore.connect(fresh_nats.url)
    try:
        await store.append(RunStarted(run_id=RUN, name="once"))
        chains = CallChains()
        last = await record(store, linear_rollout("ro-long", TURNS), chains)
        assert chains.referenced == TURNS - 1
        await project(fresh_nats, database, conn, tmp_path / "tokenizer.json", last)
        resolved = await check_reads(store, database, conn, "ro-long", tmp_path / "tokenizer.json")
        detok = Detokenizer.from_specs([f"policy={tmp_path / 'tokenizer.json'}"])
        assert await rebuild_run(conn, store, store.stream, RUN, detok) == TURNS + 4  # re-folded the same
        assert await check_reads(store, database, conn, "ro-long", tmp_path / "tokenizer.json") == resolved
    finally:
        await store.close()
    final = resolved[-1].event
    assert isinstance(final, ModelRequestRecorded)
    distinct = len(final.prompt_ids) + len(final.response_ids)
    stored = await conn.fetchval(
        "SELECT sum(octet_length(prompt_ids) + octet_length(response_ids) + octet_length(logprobs) "
        "+ coalesce(octet_length(prompt_text), 0) + coalesce(octet_length(response_text), 0) "
        "+ octet_length(request::text) + octet_length(response::text) + coalesce(octet_length(request_ref::text), 0)) "
        "FROM model_calls WHERE rollout_id = 'ro-long'"
    )
    print(f"{TURNS} turns, {distinct} distinct tokens: {stored} bytes stored, {stored / distinct:.1f} per token")
    assert stored <= BYTES_PER_TOKEN * distinct
    assert await conn.fetchval("SELECT count(*) FROM model_calls WHERE base_seq IS NOT NULL") == TURNS - 1


async def test_a_base_stored_in_full_or_missing_still_reads_in_full(
    fresh_nats: NatsServer, database: str, conn: asyncpg.Connection, tmp_path: Path
) -> None:
    refused = linear_rollout("ro-refused", 8, seed=5)
    restarted = linear_rollout("ro-restarted", 8, seed=6)
    store = await EventStore.connect(fresh_nats.url)
    try:
        await store.append(RunStarted(run_id=RUN, name="once"))
        chains = CallChains()
        await record(store, refused, chains, poison="ro-refused-c3")  # call 3 has no row: a dead letter
        last = await record(store, restarted, chains, forget_at=3 + 4)  # call 4 recorded in full, 5.. refer to it
        await project(fresh_nats, database, conn, tmp_path / "tokenizer.json", last)
        assert await conn.fetchval("SELECT count(*) FROM dead_letters") == 1
        await check_reads(store, database, conn, "ro-restarted", tmp_path / "tokenizer.json")
        rows = await conn.fetch(
            "SELECT seq, call_id, base_seq, rollwire_prompt_ids(seq) AS ids FROM model_calls "
            "WHERE rollout_id = 'ro-refused' ORDER BY seq"
        )
        reader = PostgresRolloutReader(database)
        try:
            from_api = {s.seq: s.event for s in await reader.events("ro-refused", RUN)}
            shown = {seq: await queries.call(reader, seq) for seq in from_api}
        finally:
            await reader.close()
    finally:
        await store.close()
    calls = {c.call_id: c for c in refused if isinstance(c, ModelRequestRecorded)}
    assert [r["call_id"] for r in rows] == [f"ro-refused-c{i}" for i in range(8) if i != 3]
    assert [r["base_seq"] is None for r in rows] == [True, False, False, True, False, False, False]
    for row in rows:  # call 4 continues call 3, which has no row: it is stored in full
        expected = calls[row["call_id"]]
        api = from_api[row["seq"]]
        assert isinstance(api, ModelRequestRecorded) and api.prompt_ids == expected.prompt_ids
        assert unpack_int32(row["ids"]) == expected.prompt_ids
        assert (shown[row["seq"]] or {}).get("prompt_ids") == expected.prompt_ids
    full = await conn.fetch("SELECT call_id, base_seq FROM model_calls WHERE rollout_id = 'ro-restarted' ORDER BY seq")
    assert [r["base_seq"] is None for r in full] == [True, False, False, False, True, False, False, False]
