"""vLLM started with Rollwire's flags reports the logprobs of the distribution it sampled from.

Without `--logprobs-mode processed_logprobs` (in `serve_command` since this test), vLLM returns the
raw model's logprobs (before temperature, top-k, top-p), so at T = 0.7 the recorded behaviour
logprobs and the trainer's differ by far more than 1e-3 and the on-policy ratio is not 1.
The server is started from `serve_command`'s flags (conftest), the reference is the trainer's
own forward in transformers on CPU.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from gw_harness import GatewayHandle
from vllm_rig import SERVED, load_model, nucleus_logprobs, recorded, recorded_calls, start_run, trainer_logprobs
from vllm_server import VllmServer

TOLERANCE = 1e-3
MESSAGES: Any = [{"role": "system", "content": "You add."}, {"role": "user", "content": "What is 2 + 3?"}]


@pytest.fixture(scope="module")
def model(vllm_model_dir: Path) -> torch.nn.Module:
    """The served model in transformers (the trainer's view of the policy)."""
    return load_model(vllm_model_dir)


def _max_diff(left: list[float], right: list[float]) -> float:
    assert len(left) == len(right) and left
    return max(abs(a - b) for a, b in zip(left, right, strict=True))


def test_recorded_logprobs_at_t07_equal_the_trainers(
    gateway: GatewayHandle, vllm_server: VllmServer, run_id: str, model: torch.nn.Module
) -> None:
    """Temperature only: recorded logprobs = log_softmax(logits / 0.7) of the trainer's forward, within 1e-3."""
    attempt = start_run(gateway, run_id, vllm_server)
    agent = openai.OpenAI(base_url=attempt["proxy_base_url"], api_key=attempt["token"], max_retries=0)
    reply = agent.chat.completions.create(model=SERVED, messages=MESSAGES, temperature=0.7, seed=11, max_tokens=24,
                                          logprobs=True)  # fmt: skip
    (call,) = recorded_calls(gateway, attempt["rollout_id"])
    returned = [item.logprob for item in reply.choices[0].logprobs.content]  # type: ignore[union-attr]
    values = [float(v) for v in call.logprobs]
    assert values == pytest.approx(returned, abs=1e-6), "the call records what vLLM returned"
    assert call.temperature == 0.7
    ours = trainer_logprobs(model, list(call.prompt_ids), list(call.response_ids), 0.7)
    raw = trainer_logprobs(model, list(call.prompt_ids), list(call.response_ids), 1.0)
    diff = _max_diff(values, ours)
    print(f"T=0.7: max |recorded - trainer| = {diff:.2e} over {len(ours)} tokens; "
          f"vs raw logprobs {_max_diff(values, raw):.2e}")  # fmt: skip
    assert diff < TOLERANCE
    assert _max_diff(values, raw) > 10 * TOLERANCE, "the raw logprobs are far from the processed ones"


def test_nucleus_logprobs_are_those_of_the_renormalised_nucleus(
    gateway: GatewayHandle, vllm_server: VllmServer, run_id: str, model: torch.nn.Module
) -> None:
    """T = 0.7, top_p 0.9, top_k 20: vLLM's logprobs (and the recorded ones) are the renormalised nucleus's."""
    attempt = start_run(gateway, run_id, vllm_server)
    body = {"model": SERVED, "messages": MESSAGES, "temperature": 0.7, "top_p": 0.9, "top_k": 20, "seed": 5,
            "max_tokens": 24, "logprobs": True}  # fmt: skip
    headers = {"authorization": f"Bearer {attempt['token']}"}
    through = httpx.post(f"{attempt['proxy_base_url']}/chat/completions", json=body, headers=headers, timeout=120)
    assert through.status_code == 200, through.text
    (call,) = recorded_calls(gateway, attempt["rollout_id"])
    (event,) = recorded(gateway, attempt["rollout_id"])
    assert (event.temperature, event.top_p, event.top_k) == (0.7, 0.9, 20), "the nucleus is recorded"
    direct = vllm_server.post("/v1/chat/completions", body | {"return_token_ids": True}).json()
    choice = direct["choices"][0]
    assert (direct["prompt_token_ids"], choice["token_ids"]) == (list(call.prompt_ids), list(call.response_ids))
    returned = [item["logprob"] for item in choice["logprobs"]["content"]]
    values = [float(v) for v in call.logprobs]
    nucleus = nucleus_logprobs(model, list(call.prompt_ids), list(call.response_ids), 0.7, 20, 0.9)
    plain = trainer_logprobs(model, list(call.prompt_ids), list(call.response_ids), 0.7)
    print(f"T=0.7 top_p 0.9 top_k 20: max |vLLM - nucleus| = {_max_diff(returned, nucleus):.2e}, "
          f"|recorded - nucleus| = {_max_diff(values, nucleus):.2e}, "
          f"|recorded - T-only| = {_max_diff(values, plain):.2e}")  # fmt: skip
    assert _max_diff(returned, nucleus) < TOLERANCE
    assert _max_diff(values, nucleus) < TOLERANCE
    assert _max_diff(values, plain) > 10 * TOLERANCE, "the nucleus changes the logprobs"
