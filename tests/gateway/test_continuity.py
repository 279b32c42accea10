"""Continuous prompt mode: prompts built from the sampled tokens, so a linear rollout is one sample.

Through the real gateway and the official `openai` client, against a fake vLLM that renders chat
requests with a Qwen3-style template (it drops earlier turns' reasoning and re-serialises tool-call
JSON) and answers token-in completions from the ids it is given (`template_vllm.py`). The same
scripted 6-turn tool loop runs in a run of each prompt mode; the trainer's exact merge then counts
samples per rollout.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from gw_harness import GatewayHandle, Served, gateway_settings
from template_vllm import TemplateVLLM

pytest.importorskip("transformers", reason="the tiny model's tokenizer needs transformers (pip install -e .[train])")

from continuity_rig import TURNS, qwen3_model, recorded, sample_count, scripted_engine, start, tool_loop

from services.gateway import create_app


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model's tokenizer with a Qwen3-style chat template."""
    return qwen3_model(tmp_path_factory)


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Iterator[TemplateVLLM]:
    """The template-rendering fake vLLM, answering the 6-turn script."""
    app = scripted_engine(model_dir)
    with Served(app) as served:
        app.url = served.url  # type: ignore[attr-defined]
        yield app


def test_a_six_turn_tool_loop_is_one_sample_in_continuous_mode_and_splits_in_exact(
    gateway: GatewayHandle, engine: TemplateVLLM, model_dir: Path, run_id: str
) -> None:
    """Exact mode re-renders (reasoning dropped, JSON re-serialised) and splits; continuous keeps the sampled ids."""
    counts = {}
    for mode in ("exact", "continuous"):
        rollout_id, client = start(gateway, f"{run_id}-{mode}", mode, engine, model_dir)
        messages = tool_loop(client)
        assert messages[-1]["content"] == "\n\nThe sum is 12."
        calls = recorded(gateway, rollout_id)
        assert len(calls) == TURNS and all(c.status == "ok" for c in calls)
        counts[mode] = sample_count(calls, rollout_id)
        if mode == "continuous":
            assert [c.continuity for c in calls] == ["fresh: first call of the attempt"] + ["extended"] * (TURNS - 1)
            for earlier, later in itertools.pairwise(calls):
                assert later.prompt_ids[: len(earlier.prompt_ids) + len(earlier.response_ids)] == [
                    *earlier.prompt_ids, *earlier.response_ids
                ]  # fmt: skip
            assert calls[1].response["message"]["reasoning_content"] == "\nstep 1: add again\n"
        else:
            assert not any(c.continuity for c in calls)
    assert counts == {"exact": TURNS, "continuous": 1}


def test_a_streamed_loop_extends_too_and_the_stream_adds_up(
    gateway: GatewayHandle, engine: TemplateVLLM, model_dir: Path, run_id: str
) -> None:
    """Streamed calls are converted chunk by chunk: the harness rebuilds the same tool calls and text."""
    rollout_id, client = start(gateway, run_id, "continuous", engine, model_dir)
    messages = tool_loop(client, stream=True)
    assert messages[-1]["content"] == "\n\nThe sum is 12."
    calls = recorded(gateway, rollout_id)
    assert [c.continuity for c in calls][1:] == ["extended"] * (TURNS - 1)
    assert sample_count(calls, rollout_id) == 1


def test_a_compacting_harness_starts_a_second_chain_and_says_why(
    gateway: GatewayHandle, engine: TemplateVLLM, model_dir: Path, run_id: str
) -> None:
    """Dropping old turns at turn 4: that call is rendered fresh, with the reason; the rest extend it."""
    rollout_id, client = start(gateway, run_id, "continuous", engine, model_dir)
    tool_loop(client, compact_at=4)
    calls = recorded(gateway, rollout_id)
    kinds = [c.continuity for c in calls]
    assert kinds[:4] == ["fresh: first call of the attempt", "extended", "extended", "extended"]
    assert kinds[4] == "fresh: history differs from every earlier call at message 2"
    assert kinds[5] == "extended"
    assert sample_count(calls, rollout_id) == 2


@pytest.fixture
def second(nats_url: str) -> Iterator[GatewayHandle]:
    """Another gateway replica on the same NATS (its own call cache)."""
    settings = gateway_settings(nats_url)
    with Served(create_app(settings), settings.port) as served:
        handle = GatewayHandle(served, settings)
        yield handle
        handle.admin.close()


def test_calls_alternating_between_two_gateways_extend_one_chain(
    gateway: GatewayHandle, second: GatewayHandle, engine: TemplateVLLM, model_dir: Path, run_id: str
) -> None:
    """Round-robin over two replicas: each finds the other's calls on the stream, the chain holds."""
    rollout_id, client = start(gateway, run_id, "continuous", engine, model_dir)
    other = openai.OpenAI(
        base_url=str(client.base_url).replace(gateway.url, second.url), api_key=client.api_key, max_retries=0
    )
    tool_loop(client, other)
    calls = recorded(gateway, rollout_id)
    assert len(calls) == TURNS
    assert [c.continuity for c in calls][1:] == ["extended"] * (TURNS - 1)
    assert sample_count(calls, rollout_id) == 1
