"""`[[policies]]` and `[[frozen]]` models are served by the engine `[engine] kind` names: vLLM here.

Each gets its own vLLM server (its own slot of ports, and of GPUs where there are any), registered
with the gateway under its name; the trained policy's new weights are reloaded through vLLM's
routes. `[engine] executable` is vLLM's Python, which Rollwire starts as
`python -m vllm.entrypoints.openai.api_server`.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
from gw_harness import ADMIN, GatewayHandle
from vllm_server import VLLM_PYTHON

from services.common.gateway_api import GatewayClient
from services.devstack.embedded import free_port
from trainer.core import AdapterConfig
from trainer.run.load import config_from_mapping
from trainer.run.other_models import OtherModels

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # two vLLM servers start in turn


async def test_policies_and_frozen_models_are_served_by_vllm(
    gateway: GatewayHandle, vllm_model_dir: Path, run_id: str, tmp_path: Path
) -> None:
    port = free_port()
    config = config_from_mapping({
        "run": {"name": "others", "out_dir": str(tmp_path / "runs")},
        "data": {"path": str(tmp_path / "tasks.jsonl")},
        "agent": {"command": ["true"]},
        "model": {"path": str(vllm_model_dir), "served_name": "writer", "agents": ["writer"]},
        "policies": [{"name": "critic", "path": str(vllm_model_dir), "agents": ["critic"]}],
        "frozen": [{"name": "judge", "path": str(vllm_model_dir), "agents": ["judge"]}],
        "engine": {"kind": "vllm", "executable": str(VLLM_PYTHON), "port": port,
                   "dtype": "float32", "gpu_memory_utilization": 0.1, "extra_args": ["--max-model-len", "1024"]},
        "backend": {"threads": 1},
    })  # fmt: skip
    others = OtherModels(config, tmp_path / "run", AdapterConfig())
    client = GatewayClient(gateway.url, ADMIN)
    try:
        others.prepare()
        await others.serve(client, run_id)
        models = {m["name"]: m for m in gateway.admin.get("/api/models", params={"run_id": run_id}).json()["models"]}
        assert {models["critic"]["base_url"], models["judge"]["base_url"]} == {
            f"http://127.0.0.1:{port + 1}/v1",
            f"http://127.0.0.1:{port + 2}/v1",
        }, "slot 1 and 2 of [engine] port (slot 0 is [model]'s)"
        policy = others.policies[0]
        assert policy.vllm is not None and len(others.frozen_vllm) == 1
        keys = {"critic": policy.vllm.api_key, "judge": others.frozen_vllm[0].api_key}  # each server's own
        for name in ("critic", "judge"):
            url, auth = f"{models[name]['base_url']}/models", {"Authorization": f"Bearer {keys[name]}"}
            assert (await asyncio.to_thread(httpx.get, url)).status_code == 401  # no key, no answer
            served = (await asyncio.to_thread(httpx.get, url, headers=auth)).json()["data"]
            assert [(m["id"], m["owned_by"]) for m in served] == [(name, "vllm")]
        await policy.vllm.load(policy.weights(0).resolve(), policy.version)  # the reload sequence through vLLM's routes
    finally:
        await others.close()
        await client.close()
