"""Agent Lightning 1.0.2's own local controller drives a rollout through Rollwire's gateway, unchanged.

Agent Lightning 1.0 needs Python >= 3.12, so its controller runs from its own venv (see
`agl_env.py`); without one the test is skipped and says why.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from agl_env import agl_python
from fake_vllm import FakeVLLM
from gw_harness import ADMIN, GatewayHandle, Served, gateway_settings

from services.devstack.embedded import NatsServer
from services.gateway import create_app

AGENT = '''
import os

import httpx
from openai import OpenAI


class Agent:
    """An Agent Lightning agent: one model call through the proxy, then a reward."""

    def run(self) -> None:
        client = OpenAI(base_url=os.environ["AGL_OPENAI_BASE_URL"], api_key=os.environ["AGL_KEY"])
        answer = client.chat.completions.create(
            model="fake-model", messages=[{"role": "user", "content": os.environ["QUESTION"]}], max_tokens=4
        )
        value = 1.0 if answer.choices[0].message.content else 0.0
        reply = httpx.post(os.environ["AGL_EVENT_URL"], json={"event_type": "reward", "data": {"value": value}},
                           headers={"authorization": "Bearer " + os.environ["AGL_KEY"]})
        reply.raise_for_status()
'''


@pytest.mark.slow
def test_agent_lightning_controller_drives_a_rollout(
    fresh_nats: NatsServer, fake_vllm: FakeVLLM, tmp_path: Path
) -> None:
    python, reason = agl_python()
    if python is None:
        pytest.skip(reason)
    (tmp_path / "agl_agent.py").write_text(AGENT)
    settings = gateway_settings(fresh_nats.url)
    with Served(create_app(settings), settings.port) as served:
        gateway = GatewayHandle(served, settings)
        models = gateway.admin.post("/api/models", json=[{"model": "fake-model", "endpoint": f"{fake_vllm.url}/v1"}])
        assert models.status_code == 201, models.text
        rid = "agl-rollout-1"
        created = gateway.admin.post(
            "/api/rollouts",
            json=[
                {
                    "rollout_id": rid,
                    "input": {"question": "what is 2+2?"},
                    "config": {
                        "timeout_seconds": 60,
                        "local": {"agent_class": "agl_agent:Agent", "env_map": {"QUESTION": "input.question"}},
                    },
                }
            ],
        )
        assert created.status_code == 201, created.text
        env = {**os.environ, "PYTHONPATH": str(tmp_path)}
        controller = subprocess.Popen(
            [
                str(python),
                "-m",
                "agentlightning.controller",
                "runner_type=local",
                f"agl_server.url={gateway.url}",
                f"agl_server.key={ADMIN}",
                "local_runner.poll_interval=0.2",
                "local_runner.maximum_size=2",
                "hydra.run.dir=.",
                "hydra.output_subdir=null",
            ],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        try:
            deadline = time.monotonic() + 90
            state = ""
            while time.monotonic() < deadline and controller.poll() is None:
                state = gateway.admin.get(f"/api/rollouts/{rid}").json()["state"]
                if state in ("succeeded", "failed"):
                    break
                time.sleep(0.2)
        finally:
            controller.send_signal(signal.SIGTERM)
            try:
                output = controller.communicate(timeout=20)[0].decode(errors="replace")
            except subprocess.TimeoutExpired:
                controller.kill()
                output = controller.communicate()[0].decode(errors="replace")
        assert state == "succeeded", output[-3000:]
        rollout = gateway.admin.get(f"/api/rollouts/{rid}").json()
        assert rollout["attempts"] == ["0"] and rollout["reward"] == 1.0
        events = gateway.admin.get(f"/api/rollouts/{rid}/events").json()
        assert [e["event_type"] for e in events] == ["model_request", "reward"]
        call = events[0]
        assert call["attempt_id"] == "0" and call["status"] == "ok"
        assert call["response_ids"] == fake_vllm.served[0]["token_ids"]
        assert call["prompt_ids"] == fake_vllm.served[0]["prompt_ids"]
        triplets = gateway.admin.get(f"/api/rollouts/{rid}/events", params={"format": "triplet"}).json()
        assert triplets[0]["data"]["response_token_ids"] == fake_vllm.served[0]["token_ids"]
        gateway.admin.close()
        assert httpx.get(f"{gateway.url}/healthz").status_code == 200
