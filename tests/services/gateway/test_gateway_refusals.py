"""Refusals a harness can act on: never retried when permanent, pointing to the right URL, about the right attempt.

- Every permanent refusal (400, 401, 403, 404, 405, 409, 413, 422) says `x-should-retry: false`, in
  every front end's error shape, so the SDKs (which retry a 409 twice, and Claude Code, which retried a
  401 for three minutes) give up at once. Checked with the official SDKs at their default retries.
- The gateway's own URL used as a base URL (what `rollwire up` prints) gets a 404 that names the
  attempt's proxy base URL, in the SDK's own error shape, instead of a bare "Not Found".
- A 409 for a superseded attempt describes that attempt (how it ended), not the new attempt's state.
"""

from __future__ import annotations

from typing import Any

import anthropic
import httpx
import httpx2
import openai
import pytest
from fake_vllm import FakeVLLM
from gw_harness import GatewayHandle

CHAT: Any = [{"role": "user", "content": "hi"}]


class Counted:
    """An HTTP client for the SDKs that counts the requests the SDK sends (its retries included)."""

    def __init__(self) -> None:
        self.sent = 0
        self.client = httpx2.Client(event_hooks={"request": [self._count]}, timeout=30)

    def _count(self, request: object) -> None:
        self.sent += 1


def _ended(gateway: GatewayHandle, run_id: str, fake_vllm: FakeVLLM) -> tuple[dict[str, Any], dict[str, Any]]:
    """A rollout whose first attempt was requeued and replaced by a second: (first, second)."""
    rollout, first = gateway.running(run_id, fake_vllm.url, max_attempts=3)
    rid = rollout["rollout_id"]
    for status in ("running", "requeuing"):
        patched = gateway.admin.patch(f"/api/rollouts/{rid}", json={"status": status, "reason": "node lost"})
        assert patched.status_code == 200, patched.text
    return first, gateway.attempt(rid)


def test_permanent_refusals_are_not_retried_by_the_sdks(
    gateway: GatewayHandle, run_id: str, fake_vllm: FakeVLLM
) -> None:
    first, _ = _ended(gateway, run_id, fake_vllm)
    cases: list[tuple[str, int, Any]] = [
        ("openai chat, ended attempt", 409, lambda c: _openai(first, c).chat.completions.create(
            model="fake", messages=CHAT, max_tokens=2)),
        ("openai responses, ended attempt", 409, lambda c: _openai(first, c).responses.create(
            model="fake", input="hi", max_output_tokens=2)),
        ("openai chat, wrong key", 401, lambda c: _openai(first, c, "wrong").chat.completions.create(
            model="fake", messages=CHAT, max_tokens=2)),
        ("anthropic messages, ended attempt", 409, lambda c: _anthropic(first, c).messages.create(
            model="fake", max_tokens=2, messages=CHAT)),
        ("anthropic messages, wrong key", 401, lambda c: _anthropic(first, c, "wrong").messages.create(
            model="fake", max_tokens=2, messages=CHAT)),
    ]  # fmt: skip
    for name, status, call in cases:
        counted = Counted()
        with pytest.raises((openai.APIStatusError, anthropic.APIStatusError)) as refused:
            call(counted)
        error: Any = refused.value
        assert error.status_code == status, (name, error)
        assert error.response.headers["x-should-retry"] == "false", name
        assert counted.sent == 1, f"{name}: the SDK sent {counted.sent} requests"


def _openai(attempt: dict[str, Any], counted: Counted, key: str | None = None) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=attempt["proxy_base_url"], api_key=key or attempt["token"], http_client=counted.client
    )


def _anthropic(attempt: dict[str, Any], counted: Counted, key: str | None = None) -> anthropic.Anthropic:
    return anthropic.Anthropic(
        base_url=attempt["anthropic_base_url"], api_key=key or attempt["token"], http_client=counted.client
    )


def test_every_permanent_refusal_says_do_not_retry(gateway: GatewayHandle, run_id: str, fake_vllm: FakeVLLM) -> None:
    """On the API (`{"error": ...}`), OpenAI's paths and Anthropic's paths, for each permanent status."""
    first, second = _ended(gateway, run_id, fake_vllm)
    proxy, claude = first["proxy_base_url"], first["anthropic_base_url"]
    live = {"authorization": f"Bearer {second['token']}"}
    old = {"authorization": f"Bearer {first['token']}"}
    big = {"model": "fake", "messages": [{"role": "user", "content": "x" * 1_100_000}]}
    answers = {
        "api 401": httpx.get(f"{gateway.url}/api/rollouts", timeout=10),
        "api 403": httpx.get(f"{gateway.url}/api/rollouts", headers=live, timeout=10),
        "api 404": gateway.admin.get("/api/rollouts/no-such-rollout"),
        "api 405": gateway.admin.put("/api/rollouts"),
        "api 409": gateway.admin.post(f"/api/rollouts/{first['rollout_id']}/attempts", json={}),
        "api 422": gateway.admin.post("/api/rollouts", content=b"{"),
        "openai 400": httpx.post(f"{second['proxy_base_url']}/chat/completions", headers=live, timeout=10,
                                 json={"model": "fake", "messages": CHAT, "n": 10**6}),
        "openai 403": httpx.post(f"{second['proxy_base_url'].replace(second['attempt_id'], first['attempt_id'])}"
                                 "/chat/completions", headers=live, json={"messages": CHAT}, timeout=10),
        "openai 404": httpx.post(f"{proxy}/no-such-route", headers=old, json={}, timeout=10),
        "openai 409": httpx.post(f"{proxy}/responses", headers=old, json={"input": "hi"}, timeout=10),
        "openai 413": httpx.post(f"{second['proxy_base_url']}/chat/completions", headers=live, json=big, timeout=10),
        "openai 422": httpx.post(f"{second['proxy_base_url']}/chat/completions", headers=live, json={}, timeout=10),
        "anthropic 401": httpx.post(f"{claude}/v1/messages", json={}, timeout=10),
        "anthropic 409": httpx.post(f"{claude}/v1/messages", headers=old, json={}, timeout=10),
    }  # fmt: skip
    for name, answer in answers.items():
        assert answer.status_code == int(name.split()[-1]), (name, answer.status_code, answer.text)
        assert answer.headers.get("x-should-retry") == "false", name
        body = answer.json()
        if name.startswith("anthropic"):
            assert body["type"] == "error" and body["error"]["message"], name
        elif name.startswith("openai"):
            assert body["error"]["message"] and body["error"]["type"], name
        else:
            assert isinstance(body["error"], str), name


def test_the_gateway_url_as_a_base_url_names_the_proxy_base_url(gateway: GatewayHandle) -> None:
    """What `rollwire up` prints, with or without `/v1`, given to each SDK: a 404 that says what to use."""
    for base in (gateway.url, f"{gateway.url}/v1"):
        client = openai.OpenAI(base_url=base, api_key="anything", max_retries=0)
        calls: list[Any] = [
            lambda c: c.chat.completions.create(model="m", messages=CHAT),
            lambda c: c.responses.create(model="m", input="hi"),
            lambda c: c.models.list(),
        ]
        for call in calls:
            with pytest.raises(openai.NotFoundError) as missed:
                call(client)
            assert "/openai/v1" in missed.value.message and "OPENAI_BASE_URL" in missed.value.message
            assert missed.value.response.headers["x-should-retry"] == "false"
        claude = anthropic.Anthropic(base_url=base, api_key="anything", max_retries=0)
        with pytest.raises(anthropic.NotFoundError) as missed_anthropic:
            claude.messages.create(model="m", max_tokens=2, messages=CHAT)
        assert "/anthropic" in missed_anthropic.value.message
        assert "ANTHROPIC_BASE_URL" in missed_anthropic.value.message
    other = httpx.get(f"{gateway.url}/no/such/path", timeout=10)  # any other path: the plain API 404
    assert other.status_code == 404 and isinstance(other.json()["error"], str)


def test_a_superseded_attempt_409_describes_that_attempt(
    gateway: GatewayHandle, run_id: str, fake_vllm: FakeVLLM
) -> None:
    first, second = _ended(gateway, run_id, fake_vllm)
    old = {"authorization": f"Bearer {first['token']}"}
    refusals = [
        httpx.post(f"{first['proxy_base_url']}/chat/completions", headers=old, json={"messages": CHAT}, timeout=10),
        httpx.post(first["events_url"], headers=old, json={"type": "reward", "value": 1.0}, timeout=10),
    ]
    for refused in refusals:
        assert refused.status_code == 409, refused.text
        error = refused.json()["error"]
        body = error if isinstance(error, dict) else refused.json()
        message = body["message"] if isinstance(error, dict) else error
        assert f"attempt {first['attempt_id']}" in message and "requeuing: node lost" in message, message
        assert "(preparing)" not in message and f"attempt {second['attempt_id']} replaced it" in message, message
        assert body["attempt"] == {
            "attempt_id": first["attempt_id"],
            "status": "requeuing",
            "reason": "node lost",
            "replaced_by": second["attempt_id"],
        }
        assert body["current"]["attempt_id"] == second["attempt_id"] and body["current"]["status"] == "preparing"
