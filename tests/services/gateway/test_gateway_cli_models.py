"""`rollwire models register`: routes a run's proxy calls to an endpoint; a refusal is one line."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
from fake_vllm import FakeVLLM
from gw_harness import ADMIN, GatewayHandle
from typer.testing import CliRunner

from services.devstack.cli import app

CHAT = {"model": "cli-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def test_register_then_proxy_reaches_the_endpoint(gateway: GatewayHandle, fake_vllm: FakeVLLM, run_id: str) -> None:
    env = {"ROLLWIRE_GATEWAY_URL": gateway.url, "ROLLWIRE_ADMIN_TOKEN": ADMIN}
    args = ["models", "register", "cli-model", f"{fake_vllm.url}/v1", "--run-id", run_id]
    for _ in range(2):  # registering again is harmless
        result = CliRunner().invoke(app, args, env=env)
        assert result.exit_code == 0, result.output
        assert "registered cli-model" in result.output
    rollout = gateway.create(run_id)[0]
    attempt = gateway.attempt(rollout["rollout_id"])
    started = fake_vllm.started
    reply = httpx.post(
        attempt["proxy_base_url"] + "/chat/completions",
        json=CHAT,
        headers={"authorization": f"Bearer {attempt['token']}"},
        timeout=10,
    )
    assert reply.status_code == 200, reply.text
    assert fake_vllm.started == started + 1


def test_a_wrong_token_is_one_line(gateway: GatewayHandle) -> None:
    env = {**os.environ, "ROLLWIRE_GATEWAY_URL": gateway.url, "ROLLWIRE_ADMIN_TOKEN": "wrong"}
    command = [sys.executable, "-m", "services.devstack.cli", "models", "register", "x", "http://127.0.0.1:1/v1"]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "401" in lines[0], result.stderr
