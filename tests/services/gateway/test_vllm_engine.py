"""vLLM as the engine: every replica registered and reloaded inside the phase gate, through vLLM's routes.

Two fake vLLM replicas (`fake_vllm.FakeVLLM`, the routes and bodies of vLLM's source) that stamp
no weights version, a real gateway and NATS, the trainer's `VllmEngine` and `GatewayClient`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from fake_vllm import FakeVLLM, fake_vllm_python
from gw_harness import ADMIN, GatewayHandle, Served

from services.common.gateway_api import GatewayClient
from services.common.vllm import RELOAD_SEQUENCE, ReplicaError, VllmServeSettings, serve_command
from trainer.engines import VllmEngine, register_replicas

SERVED = "policy"


@pytest.fixture
def replicas() -> Iterator[list[FakeVLLM]]:
    """Two fake vLLM servers that, like vLLM, send no weights version."""
    apps = [FakeVLLM(weights_version=None, model=SERVED) for _ in range(2)]
    with Served(apps[0]) as first, Served(apps[1]) as second:
        apps[0].url, apps[1].url = first.url, second.url
        yield apps


def _paths(app: FakeVLLM) -> list[str]:
    return [c["path"] for c in app.control]


async def _agent_call(gateway: GatewayHandle, run_id: str, index: int) -> tuple[Any, str]:
    rollout = gateway.create(run_id)[0]
    attempt = gateway.attempt(rollout["rollout_id"])
    agent: Any = openai.AsyncOpenAI(base_url=attempt["proxy_base_url"], api_key=attempt["token"], max_retries=0)
    call = agent.chat.completions.create(
        model=SERVED, messages=[{"role": "user", "content": f"task {index}"}], max_tokens=3
    )
    return call, rollout["rollout_id"]


def _versions(gateway: GatewayHandle, rollout_id: str) -> list[int | None]:
    events = gateway.admin.get(f"/api/rollouts/{rollout_id}/events", params={"type": "model_request"}).json()
    return [e["weights_version"] for e in events]


async def test_reload_runs_on_every_replica_inside_the_gate(
    gateway: GatewayHandle, replicas: list[FakeVLLM], run_id: str, tmp_path: Path
) -> None:
    client = GatewayClient(gateway.url, ADMIN)
    engine = VllmEngine([r.url for r in replicas], SERVED)
    try:
        await engine.replicas.wait_ready(10)
        for replica in replicas:
            replica.control.clear()
        await register_replicas(client, engine, run_id, SERVED)
        await client.set_phase(run_id, "rollout", 0, key=None)
        for _ in range(100):  # the gateway applies registrations from the stream
            if len(gateway.gw.state.models_for(run_id, "none")) == 2:
                break
            await asyncio.sleep(0.05)
        registered = gateway.gw.state.models_for(run_id, "none")
        assert sorted(m.base_url for m in registered) == sorted(f"{r.url}/v1" for r in replicas)
        assert {m.served_model for m in registered} == {SERVED}

        # calls spread over both replicas, stamped with the phase's version 0
        before: list[str] = []
        while len(before) < 32 and (len(before) < 8 or not all(r.served for r in replicas)):
            # rendezvous hashing: 8 rollouts all land on one of 2 replicas 1 time in 128, so add more until both served
            call, rollout_id = await _agent_call(gateway, run_id, len(before))
            await call
            before.append(rollout_id)
        assert all(r.served for r in replicas), "every replica serves some rollouts"
        assert {v for rid in before for v in _versions(gateway, rid)} == {0}

        await client.set_phase(run_id, "update", 0, key=f"{run_id}-update-1")
        forwarded = [len(r.request_times) for r in replicas]
        held = [await _agent_call(gateway, run_id, 100 + i) for i in range(4)]
        tasks = [asyncio.ensure_future(call) for call, _ in held]
        weights = tmp_path / "weights" / "v1"
        await engine.load(weights, 1)
        await asyncio.sleep(0.2)
        assert not any(t.done() for t in tasks), "a call ran while the replicas were changing weights"
        for replica in replicas:
            assert _paths(replica) == list(RELOAD_SEQUENCE)
            assert replica.control[1]["body"] == {"method": "reload_weights", "kwargs": {"weights_path": str(weights)}}
            assert replica.control[3]["body"] == {"new_version": "1"}
            assert replica.loaded_weights == str(weights) and not replica.paused
        await client.set_phase(run_id, "rollout", 1, key=f"{run_id}-rollout-1")
        await asyncio.wait_for(asyncio.gather(*tasks), 10)
        resumed = max(c["time"] for r in replicas for c in r.control)
        later = [t for r, n in zip(replicas, forwarded, strict=True) for t in r.request_times[n:]]
        assert len(later) == len(held) and min(later) > resumed
        assert {v for _, rid in held for v in _versions(gateway, rid)} == {1}
    finally:
        await engine.close()
        await client.close()


async def test_a_replica_that_fails_to_reload_fails_with_its_name(replicas: list[FakeVLLM], tmp_path: Path) -> None:
    replicas[1].fail_reload = True
    engine = VllmEngine([r.url for r in replicas], SERVED)
    try:
        with pytest.raises(ReplicaError) as raised:
            await engine.load(tmp_path / "v3", 3)
        message = str(raised.value)
        assert replicas[1].url in message and "/collective_rpc" in message and "weights could not be loaded" in message
        assert replicas[0].url not in message
        assert _paths(replicas[0]) == list(RELOAD_SEQUENCE)
        assert _paths(replicas[1]) == list(RELOAD_SEQUENCE[:2]) and replicas[1].paused  # stays out of service
    finally:
        await engine.close()


async def test_lora_adapters_load_in_place_and_unload(replicas: list[FakeVLLM], tmp_path: Path) -> None:
    roles = {"planner": "planner", "coder": "coder", "reviewer": "coder", "critic": "unknown"}
    engine = VllmEngine([r.url for r in replicas], SERVED, adapters=["planner", "coder"], roles=roles)
    try:
        # the endpoint serves the base model; each role's agent is routed to its own adapter
        assert {served for _, served in await engine.endpoints()} == {SERVED}
        assert engine.agent_adapters() == {"planner": "planner", "coder": "coder", "reviewer": "coder"}
        await engine.load(tmp_path / "v1", 1)
        await engine.load(tmp_path / "v2", 2)
        for replica in replicas:
            assert replica.loras == {
                "planner": str(tmp_path / "v2" / "adapters" / "planner"),
                "coder": str(tmp_path / "v2" / "adapters" / "coder"),
            }
            loads = [c for c in replica.control if c["path"] == "/v1/load_lora_adapter"]
            assert len(loads) == 4 and all(c["body"]["load_inplace"] for c in loads)
            assert _paths(replica)[2] == "/reset_prefix_cache" and _paths(replica)[-1] == "/reset_prefix_cache"
            assert "/collective_rpc" not in _paths(replica)
        await engine.replicas.unload_adapters(["coder"])
        assert all(set(r.loras) == {"planner"} for r in replicas)
        with pytest.raises(ReplicaError, match="cannot be found"):
            await engine.replicas.unload_adapters(["coder"])
        single = VllmEngine([replicas[0].url], SERVED, adapters=["default"])
        assert await single.endpoints() == [(f"{replicas[0].url}/v1", "default")] and not single.agent_adapters()
        await single.close()
    finally:
        await engine.close()


def test_serve_command_has_what_the_capture_and_reloads_need() -> None:
    argv, env = serve_command(VllmServeSettings(executable="/opt/vllm/bin/python", max_lora_rank=16, max_loras=2),
                              "/models/base", SERVED, 8123)  # fmt: skip
    assert argv[:5] == ["/opt/vllm/bin/python", "-m", "vllm.entrypoints.openai.api_server", "--model", "/models/base"]
    assert argv[argv.index("--logprobs-mode") + 1] == "processed_logprobs"
    assert argv[argv.index("--served-model-name") + 1] == SERVED and argv[argv.index("--port") + 1] == "8123"
    assert "--enable-lora" in argv and argv[argv.index("--max-lora-rank") + 1] == "16"
    ranks = {rank: serve_command(VllmServeSettings(max_lora_rank=rank), "m", SERVED, 1)[0] for rank in (4, 8, 12, 300)}
    assert {rank: argv[argv.index("--max-lora-rank") + 1] for rank, argv in ranks.items()} == {
        4: "8",
        8: "8",
        12: "16",
        300: "320",
    }  # the ranks vLLM accepts (vllm/config/lora.py)
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "true"


def test_rollwire_up_starts_and_registers_vllm_replicas(tmp_path: Path) -> None:
    """`rollwire up --engine vllm --replicas 2`: two `vllm serve` processes with the capture's flags, registered."""
    import json
    import os
    import subprocess
    import sys

    from services.devstack.embedded import free_port

    executable = fake_vllm_python(tmp_path)  # vLLM's Python, faked
    log, port = tmp_path / "argv.jsonl", free_port()
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("ROLLWIRE_")}, "FAKE_VLLM_LOG": str(log)}
    command = [sys.executable, "-m", "services.devstack.cli", "up", "--data-dir", str(tmp_path / "stack"),
               "--nats-port", "0", "--pg-port", "0", "--gateway-port", "0", "--services", "engine,gateway",
               "--engine", "vllm", "--engine-model", "Qwen/Qwen3-0.6B", "--vllm-executable", str(executable),
               "--replicas", "2", "--vllm-port", str(port)]  # fmt: skip
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.strip())
            if line.strip() == "ready" or len(lines) > 50:
                break
        assert "ready" in lines, lines
        assert f"engine: http://127.0.0.1:{port}/v1 (vLLM replica 0)" in lines
        assert f"engine: http://127.0.0.1:{port + 1}/v1 (vLLM replica 1)" in lines
        started = [json.loads(row) for row in log.read_text().splitlines()]
        assert sorted(s["env"]["CUDA_VISIBLE_DEVICES"] for s in started) == ["0", "1"]
        for record in started:
            argv = record["argv"]
            assert argv[:2] == ["serve", "Qwen/Qwen3-0.6B"] and argv[argv.index("--served-model-name") + 1] == "tiny"
            assert record["env"]["VLLM_SERVER_DEV_MODE"] == "1" and record["env"]["VLLM_API_KEY"]
            assert argv[argv.index("--logprobs-mode") + 1] == "processed_logprobs"
    finally:
        proc.send_signal(2)
        proc.wait(60)
