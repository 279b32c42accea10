"""Version-2 calls (references and packed arrays) replay exactly as the version-1 recording of the same run."""

from __future__ import annotations

import base64
import json
from collections import Counter
from typing import Any

import msgspec
import pytest
from agentrun import agent_run

from schemas import SCHEMA_VERSION, Event, ModelRequestRecorded, PackedTokens, Resolver, decode, encode
from schemas.calls import CallRecord
from schemas.codec import MalformedEvent
from schemas.refs import (
    _packed_alike,
    ids_int32,
    pack,
    pack_floats,
    pack_ids,
    prompt_length,
    unpack_arrays,
    unpack_floats,
    unpack_ids,
    unpack_together,
    upcast,
)
from services.common.eventstore import Appended, EventStore
from services.gateway.proxy.recording import CallChains, compact_request
from services.tools.replay import ReplayReport, replay_run
from trainer.core import AdapterConfig, build_step, collect_rollouts, merge_rollout, plain, rollout_calls
from trainer.rollouts import rollout_history

SCHEMES = ["merge=exact", "per-call+token-mean", "rloo+rollout-mean"]


async def record(store: EventStore, events: list[Event], chains: CallChains) -> None:
    """Append a run as the gateway does: each call through `CallChains` (compacted, then remembered)."""
    for event in events:
        if isinstance(event, ModelRequestRecorded):
            acks = [await store.append(e) for e in chains.compact([event])]
            chains.remember([event], acks)
        else:
            await store.append(event)


def _samples(report: ReplayReport) -> list[Any]:
    return [[msgspec.structs.asdict(s) for s in scheme.samples] for scheme in report.schemes]


async def test_replay_of_a_compact_recording_equals_the_full_one(store: EventStore, run_id: str) -> None:
    full_run, compact_run = f"{run_id}-full", f"{run_id}-compact"
    full_events = agent_run(full_run, groups=4, per_group=4, seed=5)
    compact_events = agent_run(compact_run, groups=4, per_group=4, seed=5)
    full, compact = CallChains(compact=False), CallChains()
    await record(store, full_events, full)
    await record(store, compact_events, compact)
    assert compact.referenced > 10  # the run's multi-turn rollouts were recorded as references
    raw = [m.data async for batch in store.read_raw(f"rl.{compact_run}.rollout.*.model_request") for m in batch]
    assert all(json.loads(data)["schema_version"] == SCHEMA_VERSION >= 2 for data in raw)
    assert sum(b'"prompt_ref"' in data for data in raw) == compact.referenced
    old = [m.data async for batch in store.read_raw(f"rl.{full_run}.rollout.*.model_request") for m in batch]
    assert not any(b'"packed"' in data or b'"prompt_ref"' in data for data in old)
    assert sum(map(len, raw)) < sum(map(len, old))

    before = await replay_run(store, full_run, compare_specs=SCHEMES)
    after = await replay_run(store, compact_run, compare_specs=SCHEMES, budget=5)
    assert _samples(after) == _samples(before)
    expected = build_step(collect_rollouts(full_events).rollouts, before.schemes[0].config)
    assert [s.response_tokens for s in expected.samples] == [s.response_tokens for s in after.schemes[0].samples]
    # typed reads of the compact run give the trainer the same rollouts
    typed = [s.event async for s in store.read_run(compact_run)]
    mine = collect_rollouts(typed).rollouts
    theirs = collect_rollouts(full_events).rollouts
    assert plain([[c.prompt_ids for c in r.calls] for r in mine]) == plain(
        [[c.prompt_ids for c in r.calls] for r in theirs]
    )
    assert plain([[c.logprobs for c in r.calls] for r in mine]) == plain(
        [[c.logprobs for c in r.calls] for r in theirs]
    )


async def test_read_rollout_and_resolved_give_full_prompts_and_requests(store: EventStore, run_id: str) -> None:
    events = agent_run(run_id, groups=1, per_group=2, seed=1)
    chains = CallChains()
    await record(store, events, chains)
    originals = {e.event_id: e for e in events if isinstance(e, ModelRequestRecorded)}
    per_rollout = Counter(e.rollout_id for e in originals.values())
    rollout_id = per_rollout.most_common(1)[0][0]
    assert rollout_id is not None and per_rollout[rollout_id] > 2
    history = await store.read_rollout(run_id, rollout_id)
    calls = [s.event for s in history if isinstance(s.event, ModelRequestRecorded)]
    assert calls and all(not c.prompt_ref for c in calls)
    for call in calls:
        original = originals[call.event_id]
        assert (call.prompt_ids, call.response_ids, call.logprobs) == (
            original.prompt_ids,
            original.response_ids,
            original.logprobs,
        )
    # a monitor that sees only the last call resolves it through direct gets
    last = [m async for batch in store.read_raw(f"rl.{run_id}.rollout.{rollout_id}.model_request") for m in batch][-1]
    event = decode(last.data)
    assert isinstance(event, ModelRequestRecorded) and event.prompt_ref
    resolved = await store.resolved(event)
    assert resolved.prompt_ids == originals[event.event_id].prompt_ids


def test_request_copy_keeps_only_what_is_new_and_resolves_back() -> None:
    tools = [{"type": "function", "function": {"name": "f"}}]
    first: dict[str, Any] = {
        "model": "m",
        "tools": tools,
        "messages": [{"role": "user", "content": "a"}],
        "temperature": 1.0,
    }
    second: dict[str, Any] = {
        "model": "m",
        "tools": tools,
        "messages": [*first["messages"], {"role": "assistant", "content": "b"}, {"role": "tool", "content": "c"}],
        "temperature": 0.5,
        "top_p": 0.9,
    }
    stored, same, prefix = compact_request(second, first)
    assert stored == {"messages": second["messages"][1:], "temperature": 0.5, "top_p": 0.9}
    assert sorted(same) == ["model", "tools"] and prefix == {"messages": 1}
    base = ModelRequestRecorded(run_id="r", rollout_id="x", call_id="c1", prompt_ids=[1] * 20, request=first)
    chains = CallChains()
    chains.remember([base], [Appended(seq=1)])
    nxt = ModelRequestRecorded(run_id="r", rollout_id="x", call_id="c2", prompt_ids=[1] * 20 + [2], request=second)
    (compact,) = chains.compact([nxt])
    assert compact.prompt_ref and compact.prompt_ref.tokens == 20
    again = decode(encode(compact))
    assert isinstance(again, ModelRequestRecorded) and again.prompt_ids == [2]
    refs = Resolver()
    refs.resolve(base)
    resolved = refs.resolve(again)
    assert resolved.request == second and resolved.prompt_ids == nxt.prompt_ids


def test_logprobs_pack_as_float32_only_when_exact() -> None:
    exact = [-0.5, -1.25, 0.0]
    data, width = pack_floats(exact)
    assert width == 4 and len(data) == 12 and unpack_floats(data, width) == exact
    data, width = pack_floats([-0.1])
    assert width == 8 and unpack_floats(data, width) == [-0.1]


def test_ids_pack_in_24_bits_when_they_fit_else_32() -> None:
    small = [0, 5, (1 << 24) - 1]
    assert pack(small, [], []).id_width == 3 and unpack_ids(pack_ids(small, 3), 3) == small
    assert len(pack_ids(small, 3)) == 9
    assert ids_int32(pack_ids(small, 3), 3) == ids_int32(pack_ids(small, 4), 4)
    large = [1 << 24, -1]
    assert pack(small, large, []).id_width == 4 and unpack_ids(pack_ids(large, 4), 4) == large


def test_packed_arrays_are_base64_on_the_wire_and_checked_when_read() -> None:
    """`PackedTokens` holds bytes; the JSON holds their base64; a bad one is a `MalformedEvent` naming the field."""
    packed = pack([1, 2, 3], [4], [-0.5])
    event = ModelRequestRecorded(run_id="r", rollout_id="a", call_id="c", packed=packed)
    wire = json.loads(encode(event))["packed"]
    assert base64.b64decode(wire["prompt"]) == pack_ids([1, 2, 3], 3) and wire["id_width"] == 3
    assert base64.b64decode(wire["logprobs"]) == pack_floats([-0.5])[0]
    decoded = decode(encode(event))
    assert isinstance(decoded, ModelRequestRecorded)
    assert (decoded.prompt_ids, decoded.response_ids, decoded.logprobs) == ([1, 2, 3], [4], [-0.5])
    as_recorded = decode(encode(event), unpack=False)
    assert isinstance(as_recorded, ModelRequestRecorded) and as_recorded.packed == packed
    assert (as_recorded.prompt_ids, as_recorded.response_ids, as_recorded.logprobs) == ([], [], [])
    assert upcast(as_recorded) == decoded
    for bad, named in (({"prompt": "AAA*"}, "packed.prompt"), ({"id_width": 5}, "id_width 5"),
                       ({"logprob_width": 2}, "logprob_width 2"),
                       ({"prompt": base64.b64encode(b"\0" * 4).decode()}, "not whole 24-bit ids"),
                       ({"response": base64.b64encode(b"\0" * 2).decode()}, "not whole 24-bit ids"),
                       ({"logprobs": base64.b64encode(b"\0" * 6).decode()}, "not whole 4-byte floats")):  # fmt: skip
        body = json.loads(encode(event))
        body["packed"].update(bad)
        for unpack in (True, False):  # left packed, the arrays are checked as unpacking checks them
            with pytest.raises(MalformedEvent, match=named):
                decode(json.dumps(body).encode(), unpack=unpack)


async def test_the_trainers_history_gives_the_samples_of_resolved_reads(store: EventStore, run_id: str) -> None:
    """`rollout_history` (calls left packed and referenced) feeds the adapter what `read_rollout` resolves."""
    events = agent_run(run_id, groups=3, per_group=3, seed=9)
    chains = CallChains()
    await record(store, events, chains)
    assert chains.referenced > 5
    config = AdapterConfig()
    compared = referencing = 0
    for rollout in collect_rollouts(events).rollouts:
        history = await rollout_history(store, run_id, rollout.rollout_id)
        referencing += any(isinstance(e, CallRecord) and e.prompt_ref for e in history)  # left as recorded
        resolved = [stored.event for stored in await store.read_rollout(run_id, rollout.rollout_id)]
        ours = merge_rollout(rollout_calls(history), config, 1.0)
        theirs = merge_rollout(rollout_calls(resolved), config, 1.0)
        assert plain(ours) == plain(theirs) == plain(merge_rollout(rollout, config, 1.0))
        compared += 1
    assert compared >= 6 and referencing >= 3


def test_an_attempts_calls_unpack_together_as_each_alone() -> None:
    """`unpack_together` (one array for all calls' ids) gives each call what `unpack_arrays` gives it
    alone, and that array when there is one."""

    def call(n: int, packed: PackedTokens | None = None, **plain: Any) -> ModelRequestRecorded:
        return ModelRequestRecorded(
            run_id="r", rollout_id="a", call_id=f"c{n}", packed=packed or msgspec.UNSET, **plain
        )

    alike = [
        call(0, pack([1, 2, 3], [4], [-0.5])),
        call(1, pack([], [5, 6], [-0.25, -1.0])),
        call(2, pack([9], [], [])),
    ]
    wide = call(3, pack([1 << 24], [7], [-0.5]))  # 32-bit ids
    listed = call(4, prompt_ids=[8], response_ids=[9], logprobs=[-0.1])
    for events in (alike, [*alike, wide], [listed, *alike], []):
        together = [tuple(a.tolist() for a in arrays) for arrays in unpack_together(events)[0]]
        assert together == [tuple(a.tolist() for a in unpack_arrays(e)) for e in events]
    arrays, joined = unpack_together(alike)  # every call's prompt, then its response, in one array
    assert joined is not None and joined.tolist() == [1, 2, 3, 4, 5, 6, 9]
    assert [a.tolist() for a in arrays[1]] == [[], [5, 6], [-0.25, -1.0]]
    assert unpack_together([listed, *alike])[1] is None
    assert _packed_alike(alike) is not None and _packed_alike([*alike, wide]) is None  # together, then alone


async def test_a_read_that_leaves_arrays_packed_feeds_the_trainer_and_the_resolver_alike(
    store: EventStore, run_id: str
) -> None:
    """`read_run(unpack=False)`: calls as recorded; `upcast`, `Resolver`, `prompt_length` and the trainer take them."""
    events = agent_run(run_id, groups=3, per_group=3, seed=4)
    await record(store, events, CallChains())
    lists = [stored async for stored in store.read_run(run_id)]
    packed = [stored async for stored in store.read_run(run_id, unpack=False)]
    assert [(s.seq, s.subject) for s in packed] == [(s.seq, s.subject) for s in lists]
    calls = [s.event for s in packed if isinstance(s.event, ModelRequestRecorded)]
    assert not any(c.prompt_ids or c.response_ids or c.logprobs for c in calls)
    with_tokens = {e.event_id for e in events if isinstance(e, ModelRequestRecorded) and e.response_ids}
    assert len(with_tokens) > 10 and {c.event_id for c in calls if c.packed} == with_tokens
    assert sum(bool(c.prompt_ref) for c in calls) >= 3
    for as_recorded, unpacked in zip(packed, lists, strict=True):
        event = upcast(as_recorded.event) if isinstance(as_recorded.event, ModelRequestRecorded) else as_recorded.event
        assert event == unpacked.event
    assert [prompt_length(c) for c in calls] == [
        prompt_length(s.event) for s in lists if isinstance(s.event, ModelRequestRecorded)
    ]
    config = AdapterConfig()
    ours = build_step(collect_rollouts([s.event for s in packed]).rollouts, config)
    theirs = build_step(collect_rollouts(events).rollouts, config)
    assert plain(ours.samples) == plain(theirs.samples) and ours.samples
    originals = {e.event_id: e for e in events if isinstance(e, ModelRequestRecorded)}
    resolver = Resolver()
    for call in calls:
        full, original = resolver.resolve(call), originals[call.event_id]
        assert (full.prompt_ids, full.response_ids, full.logprobs) == (
            original.prompt_ids, original.response_ids, original.logprobs,
        )  # fmt: skip
        assert full.request == original.request and not full.packed and not full.prompt_ref
