"""Agent names on the proxy: the path's `agent/{name}` or `X-Rollwire-Agent`, recorded and routed."""

from __future__ import annotations

from typing import Any

import httpx
import openai
from fake_vllm import FakeVLLM
from gw_harness import GatewayHandle

MESSAGES: Any = [{"role": "user", "content": "hello there"}]


def _calls(gateway: GatewayHandle, rollout_id: str) -> list[dict[str, Any]]:
    events = gateway.admin.get(f"/api/rollouts/{rollout_id}/events", params={"type": "model_request"})
    assert events.status_code == 200, events.text
    return sorted(events.json(), key=lambda c: c["seq"])  # type: ignore[no-any-return]


def test_agent_names_are_recorded_and_routed(gateway: GatewayHandle, fake_vllm: FakeVLLM, run_id: str) -> None:
    spec = {"run_id": run_id, "command": ["true"], "agent_models": {"checker": "judge"},
            "train_agents": ["writer"], "train_models": ["fake"]}  # fmt: skip
    assert gateway.admin.post("/api/runs", json=spec).status_code == 201
    gateway.register_model(run_id, f"{fake_vllm.url}/v1", name="judge", served_model="judge-served")
    rollout, attempt = gateway.running(run_id, fake_vllm.url)
    base = attempt["proxy_base_url"]
    assert base.endswith("/openai/v1")
    writer_url = base.removesuffix("/openai/v1") + "/agent/writer/openai/v1"
    writer: Any = openai.OpenAI(base_url=writer_url, api_key=attempt["token"])
    writer.chat.completions.create(model="fake", messages=MESSAGES, max_tokens=3, temperature=0.7, top_p=0.9)
    # a harness that cannot vary its URL names the agent in a header; the run routes it to the judge
    checker: Any = openai.OpenAI(base_url=base, api_key=attempt["token"],
                                 default_headers={"X-Rollwire-Agent": "checker"})  # fmt: skip
    checker.chat.completions.create(model="fake", messages=MESSAGES, max_tokens=2)
    plain: Any = openai.OpenAI(base_url=base, api_key=attempt["token"])
    plain.chat.completions.create(model="fake", messages=MESSAGES, max_tokens=2)
    models = httpx.get(f"{writer_url}/models", headers={"Authorization": f"Bearer {attempt['token']}"})
    assert models.status_code == 200

    calls = _calls(gateway, rollout["rollout_id"])
    assert [(c["agent"], c["endpoint"]) for c in calls] == [("writer", "fake"), ("checker", "judge"), (None, "fake")]
    assert [r["model"] for r in fake_vllm.requests] == ["fake", "judge-served", "fake"]
    assert (calls[0]["temperature"], calls[0]["top_p"], calls[0]["top_k"]) == (0.7, 0.9, None)
    assert calls[1]["temperature"] is None
    assert all(c["started_at"] <= c["time"] for c in calls)


def test_bad_or_conflicting_agent_names_are_422(gateway: GatewayHandle, fake_vllm: FakeVLLM, run_id: str) -> None:
    _rollout, attempt = gateway.running(run_id, fake_vllm.url)
    base = attempt["proxy_base_url"].removesuffix("/openai/v1")
    auth = {"Authorization": f"Bearer {attempt['token']}"}
    body = {"model": "fake", "messages": MESSAGES, "max_tokens": 2}
    bad = httpx.post(f"{base}/agent/a*b/openai/v1/chat/completions", json=body, headers=auth)
    error = bad.json()["error"]  # in OpenAI's shape, as every proxy refusal
    assert bad.status_code == 422 and error["field"] == "agent" and "'*'" in error["message"]
    both = httpx.post(f"{base}/agent/writer/openai/v1/chat/completions", json=body,
                      headers={**auth, "X-Rollwire-Agent": "checker"})  # fmt: skip
    message = both.json()["error"]["message"]
    assert both.status_code == 422 and "writer" in message and "checker" in message
    spaced = httpx.post(f"{base}/openai/v1/chat/completions", json=body, headers={**auth, "X-Rollwire-Agent": "a b"})
    assert spaced.status_code == 422
    anthropic = httpx.post(f"{base}/agent/a*b/anthropic/v1/messages", json=body, headers=auth)
    assert anthropic.status_code == 422 and anthropic.json()["type"] == "error"  # Anthropic's shape
    assert fake_vllm.requests == []  # nothing was forwarded


def test_an_agent_routed_to_a_model_with_replicas_reaches_one(
    gateway: GatewayHandle, fake_vllm: FakeVLLM, run_id: str
) -> None:
    """A routed model served by several replicas (registered `judge-r0`, `judge-r1`, as the trainer
    names them) is reached by the routed agent: it was a 503 "not registered" when the route named
    the model and only replica names were registered."""
    spec = {"run_id": run_id, "command": ["true"], "agent_models": {"checker": "judge"}}
    assert gateway.admin.post("/api/runs", json=spec).status_code == 201
    for index in range(2):
        gateway.register_model(run_id, f"{fake_vllm.url}/v1", name=f"judge-r{index}", served_model="judge-served")
    rollout, attempt = gateway.running(run_id, fake_vllm.url)
    checker: Any = openai.OpenAI(base_url=attempt["proxy_base_url"], api_key=attempt["token"],
                                 default_headers={"X-Rollwire-Agent": "checker"}, max_retries=0)  # fmt: skip
    checker.chat.completions.create(model="fake", messages=MESSAGES, max_tokens=2)
    calls = _calls(gateway, rollout["rollout_id"])
    assert [c["agent"] for c in calls] == ["checker"] and calls[0]["endpoint"] in ("judge-r0", "judge-r1"), calls
    assert fake_vllm.requests[-1]["model"] == "judge-served"
