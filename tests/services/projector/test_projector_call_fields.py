"""A model call read back from Postgres carries every field the stream's call has.

Calls with `agent`, `endpoint`, `started_at`, sampling parameters, `api` and, in continuous prompt
mode, `continuity` are projected; the reader and the query API must return each call equal to
the stream's (an exact-mode call without `continuity`, as on the stream), and the viewer's
timeline and call must show the continuity.
"""

from __future__ import annotations

from typing import Any

import asyncpg
import httpx
import msgspec
from msgspec import UNSET
from projector_support import running_projector, wait_applied

from schemas import (
    AttemptStarted,
    Event,
    ModelRequestRecorded,
    RolloutCreated,
    RolloutStatusChanged,
    RunStarted,
    encode,
)
from services.common.eventstore import EventStore
from services.common.readside import StreamRolloutReader
from services.devstack.embedded import NatsServer
from services.projector.api import create_query_app
from services.projector.reader import PostgresRolloutReader

RUN = "fields"
ROLLOUT = "ro-fields"
ATTEMPT = "ro-fields-a1"
TOKEN = "fields-admin"
FIELDS = ("agent", "endpoint", "started_at", "temperature", "top_p", "top_k", "api", "continuity")
FRESH = "fresh: history differs from every earlier call at message 2"


def call(index: int, prompt: list[int], **fields: Any) -> ModelRequestRecorded:
    """Call `index` of the attempt: `prompt`, a two-token answer, and the given fields."""
    response = [100 + index, 200 + index]
    return ModelRequestRecorded(
        run_id=RUN, rollout_id=ROLLOUT, attempt_id=ATTEMPT, call_id=f"c{index}", model="policy", weights_version=2,
        time=1_700_000_010.0 + index, prompt_ids=prompt, response_ids=response, logprobs=[-0.5, -0.125],
        finish_reason="stop", request={"messages": [{"role": "user", "content": f"turn {index}"}]},
        response={"choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}}]},
        usage={"prompt_tokens": len(prompt), "completion_tokens": 2}, latency_s=0.25, **fields,
    )  # fmt: skip


def stream_events() -> list[Event]:
    """One attempt whose calls carry the fields in every combination that matters."""
    return [
        RunStarted(run_id=RUN, name="fields"),
        RolloutCreated(run_id=RUN, rollout_id=ROLLOUT, input={"task": 1}),
        AttemptStarted(run_id=RUN, rollout_id=ROLLOUT, attempt_id=ATTEMPT, sequence=1, executor="local"),
        RolloutStatusChanged(run_id=RUN, rollout_id=ROLLOUT, attempt_id=ATTEMPT, status="running"),
        call(0, [1, 2, 3], agent="planner", endpoint="policy-a", started_at=1_700_000_009.875, temperature=0.7,
             top_p=0.95, top_k=40, api="responses", continuity="fresh: first call of the attempt"),
        call(1, [1, 2, 3, 100, 200, 7], agent="planner", endpoint="policy-a", started_at=1_700_000_010.5,
             temperature=0.0, top_k=-1, continuity="extended"),
        call(2, [9, 8], agent="coder", endpoint="policy-b", api="messages", top_k=10**30, continuity=FRESH),
        call(3, [5]),  # exact prompt mode: no continuity, nothing but the defaults
    ]  # fmt: skip


async def test_calls_read_back_with_every_field(
    fresh_nats: NatsServer, database: str, conn: asyncpg.Connection
) -> None:
    store = await EventStore.connect(fresh_nats.url)
    reader = PostgresRolloutReader(database)
    try:
        await store.append_many(stream_events())
        async with running_projector(fresh_nats.url, database):
            await wait_applied(conn, await store.last_sequence())
        on_stream = await StreamRolloutReader(store).events(ROLLOUT, RUN)
        projected = await reader.events(ROLLOUT, RUN)
        transport = httpx.ASGITransport(app=create_query_app(reader, admin_token=TOKEN))
        async with httpx.AsyncClient(
            transport=transport, base_url="http://projector", headers={"Authorization": f"Bearer {TOKEN}"}
        ) as client:
            answer = await client.get(f"/query/rollouts/{ROLLOUT}/events", params={"run_id": RUN})
            timeline = (await client.get(f"/ui/api/runs/{RUN}/rollouts/{ROLLOUT}/timeline")).json()
            seqs = [s.seq for s in on_stream if isinstance(s.event, ModelRequestRecorded)]
            shown = [(await client.get(f"/ui/api/calls/{seq}")).json() for seq in seqs]
        # Rows projected before migration 004 have the columns NULL: they read as calls without them.
        await conn.execute(
            "UPDATE model_calls SET agent = NULL, endpoint = NULL, started_at = NULL, temperature = NULL, "
            "top_p = NULL, top_k = NULL, api = DEFAULT, continuity = NULL"
        )
        older = [s.event for s in await reader.events(ROLLOUT, RUN) if isinstance(s.event, ModelRequestRecorded)]
    finally:
        await reader.close()
        await store.close()
    calls = [s.event for s in on_stream if isinstance(s.event, ModelRequestRecorded)]
    assert [tuple(getattr(c, f) for f in FIELDS) for c in calls][2:] == [
        ("coder", "policy-b", None, None, None, 10**30, "messages", FRESH),
        (None, None, None, None, None, None, "chat", UNSET),
    ]
    assert projected == on_stream
    assert answer.status_code == 200
    assert answer.json() == msgspec.json.decode(msgspec.json.encode(on_stream))
    api_calls = [item["event"] for item in answer.json() if item["event"]["type"] == "model_request"]
    assert [{f: c.get(f, "absent") for f in FIELDS} for c in api_calls] == [
        {f: msgspec.json.decode(encode(c)).get(f, "absent") for f in FIELDS} for c in calls
    ]
    assert not set(FIELDS) & api_calls[3].keys() and api_calls[2]["top_k"] == 10**30  # defaults are absent
    expected = ["fresh: first call of the attempt", "extended", FRESH, None]
    assert [e.get("continuity") for e in timeline["events"] if e["type"] == "model_request"] == expected
    assert [c["continuity"] for c in shown] == expected
    assert [tuple(getattr(c, f) for f in FIELDS) for c in older] == [(None,) * 6 + ("chat", UNSET)] * 4
