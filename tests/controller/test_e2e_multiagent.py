"""The multi-agent example harness end to end: the real gateway and controller processes, the real engine.

`examples/multiagent/agent.py` runs per rollout: a writer fans one prompt out to three concurrent
identical calls, a frozen checker (its own registered model, named by a header) picks a draft, a
rewriter edits it (its first request retried once), and the writer finishes. Counted by hand per
rollout: 6 calls to the trained model, of which 1 is a retry; 1 checker call (context).
"""

from __future__ import annotations

import asyncio
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from controller_rig import REPO, Child, Rig, _wait_http, base_env

from services.common.eventstore import EventStore
from services.devstack.embedded import free_port
from services.tools.replay import replay_run
from trainer.core import AdapterConfig, build_step, collect_rollouts, events_by_rollout

AGENT = [sys.executable, str(REPO / "examples" / "multiagent" / "agent.py")]
ROLLOUTS = 4
WRITER_CALLS, REWRITER_CALLS, RETRIES, CHECKER_CALLS = 4, 2, 1, 1


def _engine(tmp: Path) -> tuple[Child, str]:
    port = free_port()
    args = [sys.executable, "-m", "services.engine", "--port", str(port), "--served-name", "tiny", "--seed", "7"]
    child = Child("engine", args, base_env(OMP_NUM_THREADS="1"), tmp / "engine.log")
    _wait_http(f"http://127.0.0.1:{port}/v1/models", child, timeout=120)
    return child, f"http://127.0.0.1:{port}/v1"


async def _events(nats_url: str, run_id: str) -> list[Any]:
    store = await EventStore.connect(nats_url)
    try:
        return [stored.event async for stored in store.read(f"rl.{run_id}.>")]
    finally:
        await store.close()


async def _replay(nats_url: str, run_id: str, options: dict[str, Any]) -> Any:
    store = await EventStore.connect(nats_url)
    try:
        return await replay_run(store, run_id, options=options, workers=0)
    finally:
        await store.close()


def test_the_multi_agent_harness_trains_the_right_calls(rig: Rig) -> None:
    engine, engine_url = _engine(rig.tmp)
    try:
        routes = {"writer": "policy", "rewriter": "policy", "checker": "checker"}
        spec = {"run_id": rig.run_id, "command": AGENT, "timeout_s": 120, "concurrency": 2, "agent_models": routes,
                "train_agents": ["writer", "rewriter"], "train_models": ["policy"]}  # fmt: skip
        assert rig.admin.post("/api/runs", json=spec).status_code == 201
        for name in ("policy", "checker"):
            body = {"name": name, "base_url": engine_url, "run_id": rig.run_id, "served_model": "tiny"}
            assert rig.admin.post("/api/models", json=body).status_code == 201
        rig.start_controller()
        ids = rig.create(*({"topic": f"topic {i % 2}"} for i in range(ROLLOUTS)), group_id="g")
        for rid in ids:
            assert rig.wait(rid, timeout=180)["state"] == "succeeded", rig.controllers[0].log()[-3000:]
    finally:
        engine.stop()

    events = asyncio.run(_events(rig.nats_url, rig.run_id))
    calls = [e for e in events if getattr(e, "call_id", None) and e.status == "ok"]
    per_role = Counter((c.agent, c.endpoint) for c in calls)
    assert per_role == {
        ("writer", "policy"): ROLLOUTS * WRITER_CALLS,
        ("rewriter", "policy"): ROLLOUTS * REWRITER_CALLS,
        ("checker", "checker"): ROLLOUTS * CHECKER_CALLS,
    }
    config = AdapterConfig(agents=("writer", "rewriter"), models=("policy",), merge="per-call")
    collected = collect_rollouts(events_by_rollout(events), config.selection())
    assert len(collected.rollouts) == ROLLOUTS and not collected.skipped
    step = build_step(collected.rollouts, config)
    # nothing used was deduped: the three concurrent drafts stay, only the rewriter's retry goes
    assert step.stats.calls_deduped == ROLLOUTS * RETRIES
    assert step.stats.calls_context == ROLLOUTS * CHECKER_CALLS
    by_call = {c.call_id: c for c in calls}
    trained = Counter(by_call[cid].agent for s in step.samples for cid in s.call_ids)
    assert trained == {"writer": ROLLOUTS * WRITER_CALLS, "rewriter": ROLLOUTS * (REWRITER_CALLS - RETRIES)}
    assert all(by_call[cid].endpoint == "policy" for s in step.samples for cid in s.call_ids)  # checker never
    exact = build_step(collected.rollouts, AdapterConfig(agents=("writer", "rewriter"), models=("policy",)))
    assert exact.stats.calls_deduped == ROLLOUTS * RETRIES
    merged_calls = sum(s.num_calls for s in exact.samples)
    assert merged_calls == ROLLOUTS * (WRITER_CALLS + REWRITER_CALLS - RETRIES)
    figures = exact.stats.samples_per_rollout_mean, exact.stats.merge_ratio, step.stats.samples_per_rollout_mean
    print("\nmulti-agent harness: samples/rollout {:.2f}, merge ratio {:.2f} (per-call: {:.2f})".format(*figures))

    # replay without options takes the selection the run spec declared (train_agents, train_models)
    declared = asyncio.run(_replay(rig.nats_url, rig.run_id, {})).schemes[0].summary
    assert declared.calls == ROLLOUTS * (WRITER_CALLS + REWRITER_CALLS)
    assert declared.calls_context == ROLLOUTS * CHECKER_CALLS and declared.calls_deduped == ROLLOUTS * RETRIES

    # replay under another selection equals the hand count
    only_writer = asyncio.run(_replay(rig.nats_url, rig.run_id, {"agents": ("writer",), "merge": "per-call"}))
    (scheme,) = only_writer.schemes
    assert scheme.summary.samples == ROLLOUTS * WRITER_CALLS
    assert scheme.summary.calls_context == ROLLOUTS * (REWRITER_CALLS + CHECKER_CALLS)
    only_rewriter = asyncio.run(_replay(rig.nats_url, rig.run_id, {"agents": ("rewriter",), "merge": "per-call"}))
    assert only_rewriter.schemes[0].summary.samples == ROLLOUTS * (REWRITER_CALLS - RETRIES)
    checker_too = asyncio.run(
        _replay(
            rig.nats_url,
            rig.run_id,
            {"agents": ("writer", "rewriter", "checker"), "merge": "per-call", "models": ("policy", "checker")},
        )
    )
    assert checker_too.schemes[0].summary.samples == ROLLOUTS * (WRITER_CALLS + REWRITER_CALLS - RETRIES + 1)
