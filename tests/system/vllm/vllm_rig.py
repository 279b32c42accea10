"""Shared parts of the real-vLLM tests: a run on the gateway, its recorded calls, and the trainer's logprobs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import torch
from gw_harness import GatewayHandle
from reference_sampler import SamplingParams, processed_logprobs
from vllm_server import SERVED_NAME, VllmServer

from schemas import ModelRequestRecorded
from trainer.core.recorded import CallTokens, call_from_event
from trainer.forward import forward_logits
from trainer.loss import token_logprobs

SERVED = SERVED_NAME


def start_run(
    gateway: GatewayHandle, run_id: str, server: VllmServer, mode: str = "exact", **model: Any
) -> dict[str, Any]:
    """A run in prompt `mode` whose model is the vLLM server (the proxy sends its key); a rollout's started attempt."""
    answer = gateway.admin.post("/api/runs", json={"run_id": run_id, "prompt_mode": mode})
    assert answer.status_code in (200, 201), answer.text
    gateway.register_model(
        run_id, f"{server.url}/v1", name=SERVED, served_model=SERVED, api_key=server.api_key, **model
    )
    rollout = gateway.create(run_id)[0]
    return gateway.attempt(rollout["rollout_id"]) | {"rollout_id": rollout["rollout_id"]}


def recorded(gateway: GatewayHandle, rollout_id: str) -> list[ModelRequestRecorded]:
    """The rollout's model calls as the gateway recorded them (full prompts)."""
    items = gateway.admin.get(f"/api/rollouts/{rollout_id}/events", params={"type": "model_request"}).json()
    return [msgspec.convert(item, ModelRequestRecorded) for item in items]


def recorded_calls(gateway: GatewayHandle, rollout_id: str) -> list[CallTokens]:
    """The rollout's calls as the trainer reads them (ids and logprobs as arrays)."""
    return [call_from_event(event) for event in recorded(gateway, rollout_id)]


def trainer_logprobs(model: torch.nn.Module, prompt: list[int], response: list[int], temperature: float) -> list[float]:
    """The trainer's logprob of each response token (its forward and `token_logprobs`, at `temperature`)."""
    ids = torch.tensor([[*prompt, *response]])
    with torch.no_grad():
        logits = forward_logits(model, ids, torch.ones_like(ids))
        values = token_logprobs(logits, ids, temperature=temperature)[0]
    return [float(v) for v in values[len(prompt) - 1 :]]


def nucleus_logprobs(
    model: torch.nn.Module, prompt: list[int], response: list[int], temperature: float, top_k: int, top_p: float
) -> list[float]:
    """Each response token's logprob under the distribution vLLM samples from: logits / T, top-k, then top-p,
    renormalised (`tests/reference_sampler.py`, which follows vLLM's sampler)."""
    ids = torch.tensor([[*prompt, *response]])
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k)
    with torch.no_grad():
        logits = forward_logits(model, ids, torch.ones_like(ids))[0, len(prompt) - 1 : -1]
    return [float(processed_logprobs(row, params)[token]) for row, token in zip(logits, response, strict=True)]


def load_model(model_dir: Path) -> torch.nn.Module:
    """The served model in transformers, fp32 on CPU (what the trainer's CPU backend computes with)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
