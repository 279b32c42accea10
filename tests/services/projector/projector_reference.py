"""The specification the projection is checked against: a plain, event-by-event fold of the stream.

It shares with the projector only what is the definition itself: the rollout view's `apply` (the
gateway's fold, which both readers must agree with) and the flag rules. Everything the projector
does to be fast and exactly-once (batching, selective loading, packed ids, chain hashes, upsert
merges, the position) is absent here: samples are counted on plain token lists, totals by
walking events one at a time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import asyncpg
import msgspec

from schemas import (
    CustomEvent,
    MalformedEvent,
    ModelRegistered,
    ModelRemoved,
    ModelRequestRecorded,
    PhaseChanged,
    RewardReported,
    RunStarted,
    decode,
)
from schemas.rollout import RolloutView
from schemas.rollout import fold as fold_rollout
from schemas.run import InvalidRunSpec, spec_of
from services.common.eventstore import EventStore, StoredEvent
from services.projector.flags import call_flags, flag_names
from services.projector.reader import PostgresRolloutReader

Key = tuple[str, str]
INT32 = range(-(2**31), 2**31)
MAX_CHAINS = 32


@dataclass
class Expected:
    """What Postgres must hold after projecting a stream."""

    views: dict[Key, RolloutView] = field(default_factory=dict)
    extras: dict[Key, dict[str, Any]] = field(default_factory=dict)
    stats: dict[tuple[str, str, str], dict[str, Any]] = field(default_factory=dict)
    runs: dict[str, dict[str, Any]] = field(default_factory=dict)
    models: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    events: dict[Key, list[StoredEvent]] = field(default_factory=dict)
    decoded: int = 0
    dead: set[int] = field(default_factory=set)
    chains: dict[tuple[str, str, str], list[tuple[list[int], list[int]]]] = field(default_factory=dict)


def is_poison(data: bytes) -> bool:
    """Messages the projector must dead-letter: undecodable, ids outside int32, or a NUL Postgres refuses."""
    if b"\\u0000" in data:
        return True
    try:
        event = decode(data)
    except MalformedEvent:
        return True
    if isinstance(event, ModelRequestRecorded):
        return any(i not in INT32 for i in (*event.prompt_ids, *event.response_ids))
    return False


def _opens_sample(chains: list[tuple[list[int], list[int]]], prompt: list[int], response: list[int]) -> bool:
    """Exact multi-chain prefix merging on token lists (the trainer's rule, retries replace)."""
    chosen = next((i for i, (last_prompt, _) in enumerate(chains) if last_prompt == prompt), None)
    if chosen is None:
        best = -1
        for i, (_, full) in enumerate(chains):
            if len(full) > best and prompt[: len(full)] == full and len(prompt) >= len(full):
                chosen, best = i, len(full)
    if chosen is not None:
        del chains[chosen]
    chains.append((prompt, prompt + response))
    if len(chains) > MAX_CHAINS:
        del chains[0]
    return chosen is None


def _extras() -> dict[str, Any]:
    return {
        "calls": 0, "failed_calls": 0, "prompt_tokens": 0, "response_tokens": 0, "samples": 0, "custom_events": 0,
        "rewards": 0, "flags": set(), "last_seq": 0, "last_event_at": 0.0, "ended_at": None,
    }  # fmt: skip


def _stats() -> dict[str, Any]:
    return {"calls": 0, "failed_calls": 0, "prompt_tokens": 0, "response_tokens": 0, "samples": 0, "reward": None}


def _run_and_model(out: Expected, seq: int, event: Any) -> None:
    run = out.runs.setdefault(
        event.run_id,
        {"name": None, "config": None, "started_at": None, "started_seq": None, "phase": None,
         "weights_version": None, "events": 0, "first_seq": seq, "last_seq": seq, "last_event_at": 0.0},
    )  # fmt: skip
    run["events"] += 1
    run["last_seq"], run["last_event_at"] = seq, event.time
    if isinstance(event, RunStarted) and run["started_seq"] is None:
        try:
            config = msgspec.to_builtins(spec_of(event))
        except InvalidRunSpec:
            config = event.config
        run.update(name=event.name, config=config, started_at=event.time, started_seq=seq)
    if isinstance(event, PhaseChanged):
        run.update(phase=event.phase, weights_version=event.weights_version)
    if isinstance(event, (ModelRegistered, ModelRemoved)):
        model = out.models.setdefault(
            (event.run_id, event.name),
            {"base_url": None, "served_model": None, "weights_version": None, "registered_seq": None,
             "removed_seq": None},
        )  # fmt: skip
        if isinstance(event, ModelRegistered):
            model.update(
                base_url=event.base_url, served_model=event.served_model, weights_version=event.weights_version,
                registered_seq=seq,
            )  # fmt: skip
        else:
            model["removed_seq"] = seq


def fold(messages: list[tuple[int, str, bytes]]) -> Expected:
    """Fold (seq, subject, data) messages in stream order."""
    out = Expected()
    for seq, subject, data in messages:
        if is_poison(data):
            out.dead.add(seq)
            continue
        event = decode(data)
        out.decoded += 1
        _run_and_model(out, seq, event)
        if event.rollout_id is None:
            continue
        key = (event.run_id, event.rollout_id)
        stored = StoredEvent(seq=seq, subject=subject, event=event)
        out.events.setdefault(key, []).append(stored)
        before = out.views.get(key)
        terminal_before = before.terminal_seq if before else 0
        view = fold_rollout(before, stored)
        if view is None:
            continue
        out.views[key] = view
        extras = out.extras.setdefault(key, _extras())
        extras["last_seq"], extras["last_event_at"] = seq, event.time
        if view.terminal_seq != terminal_before:
            extras["ended_at"] = event.time
        akey = (*key, event.attempt_id or "")
        if isinstance(event, ModelRequestRecorded):
            ok = event.status == "ok"
            opens = ok and _opens_sample(out.chains.setdefault(akey, []), event.prompt_ids, event.response_ids)
            prompt = len(event.prompt_ids) or event.usage.get("prompt_tokens", 0)
            response = len(event.response_ids) or event.usage.get("completion_tokens", 0)
            for totals in (extras, out.stats.setdefault(akey, _stats())):
                totals["calls"] += 1
                totals["failed_calls"] += not ok
                totals["prompt_tokens"] += prompt
                totals["response_tokens"] += response
                totals["samples"] += opens
            extras["flags"] |= flag_names(call_flags(event.response, event.finish_reason, event.status, event.error))
        elif isinstance(event, RewardReported):
            extras["rewards"] += 1
            out.stats.setdefault(akey, _stats())["reward"] = event.value
        elif isinstance(event, CustomEvent):
            extras["custom_events"] += 1
            if event.name.startswith("flag") and event.source != "agent":
                extras["flags"].add(event.name)
    for key, view in out.views.items():
        out.extras[key].update(attempts=len(view.attempts), reward=view.reward)
    return out


async def assert_projection(conn: asyncpg.Connection, reader: PostgresRolloutReader, expected: Expected) -> None:
    """Assert Postgres holds exactly `expected`: nothing lost, nothing twice, every total right."""
    counts = {t: await conn.fetchval(f"SELECT count(*) FROM {t}") for t in ("events", "rollouts", "dead_letters")}
    assert counts["events"] == expected.decoded, "events lost or duplicated"
    assert counts["rollouts"] == len(expected.views)
    assert {r["seq"] for r in await conn.fetch("SELECT seq FROM dead_letters")} == expected.dead
    for key, events in expected.events.items():
        assert await reader.events(key[1], key[0]) == events, f"events of {key}"
    rows = {(r["run_id"], r["rollout_id"]): r for r in await conn.fetch("SELECT * FROM rollouts")}
    for key, view in expected.views.items():
        assert await reader.get(key[1], key[0]) == view, f"view of {key}"
        got = {name: rows[key][name] for name in expected.extras[key]}
        got["flags"] = set(got["flags"])
        assert got == expected.extras[key], f"totals of {key}"
    stats = {
        (r["run_id"], r["rollout_id"], r["attempt_key"]): {k: r[k] for k in _stats()}
        for r in await conn.fetch("SELECT * FROM attempt_stats")
    }
    assert stats == expected.stats
    run_fields = ("name", "config", "started_at", "started_seq", "phase", "weights_version", "events", "first_seq",
                  "last_seq", "last_event_at")  # fmt: skip
    runs = {}
    for r in await conn.fetch("SELECT * FROM runs"):
        runs[r["run_id"]] = {k: r[k] for k in run_fields}
        if r["config"] is not None:
            runs[r["run_id"]]["config"] = msgspec.json.decode(r["config"])
    assert runs == expected.runs
    models = {
        (r["run_id"], r["name"]): {k: r[k] for k in ("base_url", "served_model", "weights_version",
                                                      "registered_seq", "removed_seq")}
        for r in await conn.fetch("SELECT * FROM models")
    }  # fmt: skip
    assert models == expected.models


async def stream_messages(store: EventStore) -> list[tuple[int, str, bytes]]:
    """Every message of the store's stream as (seq, subject, data), in order."""
    out: list[tuple[int, str, bytes]] = []
    async for msgs in store.read_raw("rl.>"):
        out += [(m.metadata.sequence.stream, m.subject, m.data) for m in msgs]
    return out
