"""The multi-agent example harness end to end: the real gateway and controller processes, real vLLM.

`examples/multiagent/agent.py` runs per rollout: a writer fans one prompt out to three concurrent
identical calls, a frozen checker (its own registered model, named by a header) picks a draft, a
rewriter edits it (its first request retried once), and the writer finishes. Counted by hand per
rollout: 6 calls to the trained model, of which 1 is a retry; 1 checker call (context). Both models
are the session's vLLM server (`tests/vllm_server.py`), registered under their own names with its key.
"""

from __future__ import annotations

import asyncio
import sys
from collections import Counter
from typing import Any

import pytest
from controller_rig import REPO, Rig
from vllm_server import VllmServer

from services.common.eventstore import EventStore
from services.tools.replay import replay_run
from trainer.core import AdapterConfig, build_step, collect_rollouts, events_by_rollout
from trainer.core.tokens import same_ids

AGENT = [sys.executable, str(REPO / "examples" / "multiagent" / "agent.py")]
ROLLOUTS = 4
FAN_OUT = 3
WRITER_CALLS, REWRITER_CALLS, RETRIES, CHECKER_CALLS = 4, 2, 1, 1


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


def _late_drafts(rollout: Any) -> int:
    """The rollout's drafts (its first `FAN_OUT` writer calls) that ended before an identical one started
    and that, by the retry rule (`trainer/core/dedup.py`), are retries: that twin answered the same,
    or no call of the rollout continues the draft's prompt + answer."""
    drafts = [c for c in rollout.calls if c.agent == "writer"][:FAN_OUT]
    late = 0
    for draft in drafts:
        twins = [o for o in drafts if o is not draft and o.started_at >= draft.ended_at]
        prompt, answer = list(draft.prompt_ids), list(draft.response_ids)
        continues = (c for c in rollout.calls if c is not draft)
        used = bool(answer) and any(
            list(c.prompt_ids[: len(prompt) + len(answer)]) == prompt + answer for c in continues
        )
        late += bool(twins) and (not used or any(same_ids(t.response_ids, draft.response_ids) for t in twins))
    return late


@pytest.mark.timeout(1200)  # the first test to use the session's vLLM server waits for it to start
def test_the_multi_agent_harness_trains_the_right_calls(rig: Rig, vllm_server: VllmServer) -> None:
    routes = {"writer": "policy", "rewriter": "policy", "checker": "checker"}
    spec = {"run_id": rig.run_id, "command": AGENT, "timeout_s": 120, "concurrency": 2, "agent_models": routes,
            "train_agents": ["writer", "rewriter"], "train_models": ["policy"]}  # fmt: skip
    assert rig.admin.post("/api/runs", json=spec).status_code == 201
    for name in ("policy", "checker"):
        body = {
            "name": name,
            "base_url": f"{vllm_server.url}/v1",
            "run_id": rig.run_id,
            "served_model": vllm_server.served_name,
            "api_key": vllm_server.api_key,
        }
        assert rig.admin.post("/api/models", json=body).status_code == 201
    rig.start_controller()
    ids = rig.create(*({"topic": f"topic {i % 2}"} for i in range(ROLLOUTS)), group_id="g")
    for rid in ids:
        assert rig.wait(rid, timeout=180)["state"] == "succeeded", rig.controllers[0].log()[-3000:]

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
    # Nothing used was deduped: the concurrent drafts stay, only the rewriter's retry goes. A draft
    # whose twin reached the gateway only after it had ended (the harness's threads can start that
    # late on loaded cores) is, by the rule, a retry: counted, and most rollouts must have none.
    late = [_late_drafts(rollout) for rollout in collected.rollouts]
    assert late.count(0) >= ROLLOUTS // 2, late
    assert step.stats.calls_deduped - sum(late) == ROLLOUTS * RETRIES, late
    assert step.stats.calls_context == ROLLOUTS * CHECKER_CALLS
    by_call = {c.call_id: c for c in calls}
    trained = Counter(by_call[cid].agent for s in step.samples for cid in s.call_ids)
    writer = ROLLOUTS * WRITER_CALLS - sum(late)
    assert trained == {"writer": writer, "rewriter": ROLLOUTS * (REWRITER_CALLS - RETRIES)}
    assert all(by_call[cid].endpoint == "policy" for s in step.samples for cid in s.call_ids)  # checker never
    exact = build_step(collected.rollouts, AdapterConfig(agents=("writer", "rewriter"), models=("policy",)))
    assert exact.stats.calls_deduped - sum(late) == ROLLOUTS * RETRIES
    merged_calls = sum(s.num_calls for s in exact.samples)
    assert merged_calls == ROLLOUTS * (WRITER_CALLS + REWRITER_CALLS - RETRIES) - sum(late)
    figures = exact.stats.samples_per_rollout_mean, exact.stats.merge_ratio, step.stats.samples_per_rollout_mean
    print("\nmulti-agent harness: samples/rollout {:.2f}, merge ratio {:.2f} (per-call: {:.2f})".format(*figures))

    # replay without options takes the selection the run spec declared (train_agents, train_models)
    declared = asyncio.run(_replay(rig.nats_url, rig.run_id, {})).schemes[0].summary
    assert declared.calls == ROLLOUTS * (WRITER_CALLS + REWRITER_CALLS)
    assert declared.calls_context == ROLLOUTS * CHECKER_CALLS
    assert declared.calls_deduped == ROLLOUTS * RETRIES + sum(late)

    # replay under another selection equals the hand count
    only_writer = asyncio.run(_replay(rig.nats_url, rig.run_id, {"agents": ("writer",), "merge": "per-call"}))
    (scheme,) = only_writer.schemes
    assert scheme.summary.samples == ROLLOUTS * WRITER_CALLS - sum(late)
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
    assert checker_too.schemes[0].summary.samples == ROLLOUTS * (WRITER_CALLS + REWRITER_CALLS - RETRIES + 1) - sum(
        late
    )
