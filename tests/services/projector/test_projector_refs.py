"""The projector resolves version-2 call references: every call's full prompt is recoverable from
its rows, also after a restart that lost its reference cache (the referenced calls are read back
by sequence)."""

from __future__ import annotations

import sys
from pathlib import Path

import asyncpg
from projector_support import running_projector, wait_applied

from schemas import Event, ModelRequestRecorded
from services.common.eventstore import EventStore
from services.devstack.embedded import NatsServer
from services.gateway.proxy.recording import CallChains
from services.projector.packing import unpack_float64, unpack_int32

sys.path.insert(0, str(Path(__file__).parents[1] / "tools"))
from agentrun import agent_run


async def _record(store: EventStore, events: list[Event], chains: CallChains) -> int:
    last = 0
    for event in events:
        if isinstance(event, ModelRequestRecorded):
            acks = [await store.append(e) for e in chains.compact([event])]
            chains.remember([event], acks)
            last = acks[-1].seq
        else:
            last = (await store.append(event)).seq
    return last


async def test_rows_hold_full_prompts_across_a_restart(
    fresh_nats: NatsServer, database: str, conn: asyncpg.Connection
) -> None:
    events = agent_run("refs", groups=3, per_group=3, seed=2)
    half = len(events) // 2
    chains = CallChains()
    store = await EventStore.connect(fresh_nats.url)
    try:
        first = await _record(store, events[:half], chains)
        async with running_projector(fresh_nats.url, database):
            await wait_applied(conn, first)
        last = await _record(store, events[half:], chains)
        async with running_projector(fresh_nats.url, database) as projector:  # a cold reference cache
            await wait_applied(conn, last)
            assert projector.refs.fetched > 0
    finally:
        await store.close()
    assert chains.referenced > 5
    assert await conn.fetchval("SELECT count(*) FROM dead_letters") == 0
    assert await conn.fetchval("SELECT count(*) FROM model_calls WHERE base_seq IS NOT NULL") > 5
    rows = {  # the rows store each token once; rollwire_prompt_ids follows their references in SQL
        (r["call_id"], r["choice_index"]): r
        for r in await conn.fetch(
            "SELECT call_id, choice_index, rollwire_prompt_ids(seq) AS prompt_ids, response_ids, logprobs "
            "FROM model_calls"
        )
    }
    calls = [e for e in events if isinstance(e, ModelRequestRecorded)]
    assert len(rows) == len(calls)
    for call in calls:
        row = rows[(call.call_id, call.choice_index)]
        assert unpack_int32(row["prompt_ids"]) == call.prompt_ids
        assert unpack_int32(row["response_ids"]) == call.response_ids
        assert unpack_float64(row["logprobs"]) == call.logprobs
