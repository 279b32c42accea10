"""Two trained models and a frozen one in one quickstart-sized run, on the embedded stack with fake vLLM servers.

The multi-agent harness (`examples/multiagent/agent.py`): the writer's calls train `[model]`, the
rewriter's train the `[[policies]]` model, the checker is a `[[frozen]]` model. Each trained model
gets its own samples, optimizer step and weights versions; the step metrics are per model; the
frozen model is never trained; a validation pass runs in `val` mode and logs `val/reward`.

The three models are served by fake vLLM servers (`tests/services/gateway/fake_vllm.py`, started by the stack
and the trainer as they start vLLM, through `fake_vllm_python`): the test is about the run's three
models (samples, steps, versions, routing), not what they generate, and three real vLLM servers take
minutes each to start on a small CPU. The same run on real vLLM is
`tests/system/vllm/test_other_models_engine.py`. The fake's token ids stay within the tiny model's vocabulary,
and its identical requests answer differently, so the rewards (and advantages) of a group differ.
"""

from __future__ import annotations

import asyncio
import sys
from collections import Counter
from pathlib import Path

import pytest
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "services" / "gateway"))
from fake_vllm import fake_vllm_python

from schemas import ModelRequestRecorded
from services.common.eventstore import EventStore
from services.common.tinymodel.build import ensure_tiny_model
from services.devstack.embedded import NatsServer, free_port
from trainer.embedded import embedded_stack
from trainer.loop import Trainer
from trainer.run.load import config_from_mapping, load_config

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


async def _calls(nats_dir: Path, run_id: str) -> list[ModelRequestRecorded]:
    server = NatsServer(nats_dir).start()
    try:
        store = await EventStore.connect(server.url)
        try:
            return [s.event async for s in store.read_run(run_id) if isinstance(s.event, ModelRequestRecorded)]
        finally:
            await store.close()
    finally:
        server.stop()


def test_two_trained_models_and_a_frozen_one_in_one_run(
    tmp_path: Path, model_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_VLLM_VOCAB", "2048")  # the tiny model's vocabulary
    monkeypatch.setenv("FAKE_VLLM_VARY", "1")  # a group's rollouts answer differently: their rewards differ
    example = load_config(REPO / "examples" / "multiagent" / "train.toml")
    assert example.policies[0].name == "rewriter-policy" and example.frozen[0].name == "checker"
    # the agent runs in a fresh workspace, so its script path is made absolute
    assert example.agent.command[1] == str(REPO / "examples" / "multiagent" / "agent.py")
    writer, rewriter = ensure_tiny_model(model_cache, seed=0), ensure_tiny_model(model_cache, seed=1)
    mapping = {
        "run": {"name": "multi", "out_dir": str(tmp_path / "runs"), "steps": 2, "seed": 0},
        "data": {"path": str(REPO / "examples" / "multiagent" / "tasks.jsonl"), "tasks_per_step": 2,
                 "rollouts_per_task": 4},
        "agent": {"command": [sys.executable, str(REPO / "examples" / "multiagent" / "agent.py")], "timeout_s": 120,
                  "concurrency": 4},
        "model": {"path": str(writer), "served_name": "writer-policy", "agents": ["writer"]},
        "policies": [{"name": "rewriter-policy", "path": str(rewriter), "agents": ["rewriter"]}],
        "frozen": [{"name": "checker", "path": str(writer), "agents": ["checker"]}],
        "backend": {"threads": 1},
        "engine": {"kind": "vllm", "executable": str(fake_vllm_python(tmp_path)), "port": free_port()},
        "algorithm": {"lr": 1e-3, "adapter": {"agents": ["writer", "rewriter"]}},
        "validation": {"path": str(REPO / "examples" / "multiagent" / "tasks.jsonl"), "every": 2, "max_tasks": 2},
    }  # fmt: skip
    config = config_from_mapping(mapping)
    with embedded_stack(tmp_path / "stack", writer, say=lambda line: None, engine=config.engine) as urls:
        rows = asyncio.run(Trainer(config, urls, say=lambda line: None).run())

    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:
        assert row["rollouts"] == 8 and row["rollouts_failed"] == 0
        assert row["samples"] > 0 and row["rewriter-policy/samples"] > 0
        # for the writer's model, the checker's call and the rewriter's two are context in each rollout
        assert row["calls_context"] == 8 * 3 and row["calls"] == 8 * 4
    assert rows[-1]["weights_version"] == 2 and rows[-1]["rewriter-policy/weights_version"] == 2
    assert isinstance(rows[-1]["val/reward"], float) and "val/reward" not in rows[0]
    run_dir = tmp_path / "runs" / "multi"
    header = (run_dir / "metrics.csv").read_text().splitlines()[0]
    assert "rewriter-policy/samples" in header and "val/reward" in header
    for weights in (run_dir / "weights", run_dir / "policies" / "rewriter-policy" / "weights"):
        before, after = load_file(weights / "v0" / "model.safetensors"), load_file(weights / "v1" / "model.safetensors")
        assert any(not before[name].equal(after[name]) for name in before)  # each model was trained
    assert not (run_dir / "policies" / "checker").exists()

    calls = asyncio.run(_calls(tmp_path / "stack" / "nats", "multi"))
    train = [c for c in calls if c.mode == "train"]
    assert Counter((c.agent, c.endpoint) for c in train) == {
        ("writer", "writer-policy"): 16 * 4, ("rewriter", "rewriter-policy"): 16 * 2, ("checker", "checker"): 16,
    }  # fmt: skip
    # each trained model's step-2 calls ran on its own version 1
    step2 = [c for c in train if int(str(c.rollout_id).split("-g")[1].split("-")[0]) >= 2]
    assert {c.weights_version for c in step2 if c.endpoint == "rewriter-policy"} == {1}
    assert {c.weights_version for c in step2 if c.endpoint == "writer-policy"} == {1}
    assert {c.mode for c in calls} == {"train", "val"}
