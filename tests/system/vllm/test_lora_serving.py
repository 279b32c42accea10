"""LoRA per role, served by real vLLM: each agent's calls reach its role's adapter, reloads take effect.

Adapters are saved as the trainer saves them (`trainer.backends.lora.save_adapter`: peft's format under
`<weights>/adapters/<name>/`), loaded by the trainer's `VllmEngine` through vLLM's runtime LoRA
routes, registered with the gateway by `register_replicas`, and called through the proxy with
`X-Rollwire-Agent`. Greedy decoding makes each adapter's answer a fingerprint.
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from gw_harness import ADMIN, GatewayHandle
from vllm_rig import SERVED, start_run
from vllm_server import VllmServer

from services.common.gateway_api import GatewayClient
from trainer.backends.lora import save_adapter
from trainer.engines import VllmEngine, register_replicas

ROLES = {"planner": "planner", "coder": "coder"}
# Long enough to fill whole KV blocks, so vLLM's prefix cache holds it between calls.
LONG_PROMPT = "Plan the steps, then write the code. " * 60


def _write_adapters(base_dir: Path, out: Path, seed: int) -> Path:
    """Both role adapters (rank 4, random non-zero B so each changes the answers) in `out/adapters/`."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0)
    peft_model = get_peft_model(model, config, adapter_name="planner")
    peft_model.add_adapter("coder", config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    for name in ROLES.values():
        save_adapter(peft_model, name, out)
    return out


@pytest.fixture(scope="module")
def weights(vllm_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Two saved versions of the two adapters (v1, v2: different weights)."""
    root = tmp_path_factory.mktemp("lora-weights")
    return [_write_adapters(vllm_model_dir, root / f"v{v}", seed=v) for v in (1, 2)]


@pytest.fixture
def engine(vllm_server: VllmServer) -> Iterator[VllmEngine]:
    """The trainer's engine over the session's vLLM server (with its key), one adapter per role."""
    yield VllmEngine(
        [vllm_server.url], SERVED, adapters=sorted(ROLES.values()), roles=ROLES, api_key=vllm_server.api_key
    )


def _greedy(url: str, model: str, content: str, headers: dict[str, str] | None = None) -> dict[str, Any]:
    body = {"model": model, "messages": [{"role": "user", "content": content}], "temperature": 0.0,
            "max_tokens": 12, "logprobs": True, "return_token_ids": True}  # fmt: skip
    answer = httpx.post(f"{url}/chat/completions", json=body, headers=headers or {}, timeout=120)
    assert answer.status_code == 200, answer.text
    choice = answer.json()["choices"][0]
    return {"ids": choice["token_ids"], "logprobs": [c["logprob"] for c in choice["logprobs"]["content"]]}


async def test_each_agent_is_served_by_its_roles_adapter(
    gateway: GatewayHandle, vllm_server: VllmServer, run_id: str, engine: VllmEngine, weights: list[Path]
) -> None:
    client = GatewayClient(gateway.url, ADMIN)
    try:
        await engine.load(weights[0], 1)
        attempt = start_run(gateway, run_id, vllm_server)  # registers the plain model too; replaced below
        await register_replicas(client, engine, run_id, SERVED)
        direct = {
            name: _greedy(f"{vllm_server.url}/v1", name, "Say hi.", vllm_server.headers)
            for name in (SERVED, "planner", "coder")
        }
        assert direct["planner"]["ids"] != direct[SERVED]["ids"] != direct["coder"]["ids"]
        token = {"authorization": f"Bearer {attempt['token']}"}
        for _ in range(50):  # the gateway applies the registration from the stream
            entry = gateway.gw.state.models.get((run_id, SERVED))
            if entry is not None and entry.adapters:
                break
            await asyncio.sleep(0.05)
        for agent, expected in (("planner", "planner"), ("coder", "coder"), ("tester", SERVED)):
            proxied = _greedy(attempt["proxy_base_url"], SERVED, "Say hi.", token | {"x-rollwire-agent": agent})
            assert proxied["ids"] == direct[expected]["ids"], f"agent {agent} was not served by {expected}"
    finally:
        await engine.close()  # unloads the adapters it loaded on a server it attached to
        await client.close()
    listed = {
        m["id"]
        for m in (
            await asyncio.to_thread(httpx.get, f"{vllm_server.url}/v1/models", headers=vllm_server.headers)
        ).json()["data"]
    }
    assert listed == {SERVED}, "the adapters are unloaded when the engine closes"


async def test_an_adapter_reloaded_in_place_serves_its_new_weights(
    vllm_server: VllmServer, engine: VllmEngine, weights: list[Path], tmp_path: Path
) -> None:
    """After an in-place reload, a prompt cached under the old weights is answered by the new ones.

    vLLM keys a cached block by the adapter's name and path (`vllm/v1/core/kv_cache_utils.py`,
    `_gen_lora_extra_hash_keys`), so new weights written to the same directory (a checkpoint
    rewritten, a `latest` directory) would be answered from the old weights' KV without the reset.
    """
    current = tmp_path / "current"
    try:
        shutil.copytree(weights[0], current)
        await engine.load(current, 1)
        base, key = f"{vllm_server.url}/v1", vllm_server.headers
        before = _greedy(base, "planner", LONG_PROMPT, key)
        assert _greedy(base, "planner", LONG_PROMPT, key) == before  # now in the prefix cache
        shutil.rmtree(current)
        shutil.copytree(weights[1], current)
        await engine.load(current, 2)
        after = _greedy(base, "planner", LONG_PROMPT, key)
        # the reference: the same new weights under a name never served, so nothing of it is cached
        await engine.replicas.load_adapters({"planner-fresh": weights[1] / "adapters" / "planner"})
        engine.loaded.add("planner-fresh")
        fresh = _greedy(base, "planner-fresh", LONG_PROMPT, key)
        assert fresh["ids"] != before["ids"], "the new weights answer differently"
        diff = max(abs(a - b) for a, b in zip(after["logprobs"], fresh["logprobs"], strict=True))
        print(f"in-place reload: max |logprob - fresh adapter's| = {diff:.2e}")
        assert after["ids"] == fresh["ids"] and diff < 1e-4, "the reloaded adapter answered from stale cached KV"
    finally:
        await engine.close()
