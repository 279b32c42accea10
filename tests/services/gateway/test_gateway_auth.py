"""The auth matrix: every endpoint x admin / own-attempt / other-attempt / no token."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
from fake_vllm import FakeVLLM
from gw_harness import ADMIN, GatewayHandle

from schemas import RolloutStatusChanged
from services.common.eventstore import EventStore
from services.gateway.auth import TokenSigner

CHAT = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def _endpoints(run_id: str, rid: str, aid: str) -> list[tuple[str, str, Any, bool]]:
    """(method, path, json body, may an agent of this attempt call it)."""
    proxy = f"/proxy/rollout/{rid}/attempt/{aid}/mode/train/openai/v1"
    return [
        ("POST", "/api/rollouts", {"rollouts": [{"run_id": run_id, "input": 1}]}, False),
        ("GET", "/api/rollouts", None, False),
        ("GET", "/api/rollouts/terminal", None, False),
        ("GET", f"/api/rollouts/{rid}", None, True),
        ("PATCH", f"/api/rollouts/{rid}", {"status": "running"}, False),
        ("DELETE", f"/api/rollouts/{run_id}-never-created", None, False),
        ("POST", f"/api/rollouts/{rid}/attempts", {}, False),
        ("POST", f"/api/rollouts/{rid}/attempt/{aid}/evaluator-token", None, False),
        ("POST", f"/api/rollouts/{rid}/attempt/{aid}/events", {"type": "custom", "name": "note"}, True),
        ("GET", f"/api/rollouts/{rid}/events", None, True),
        ("POST", "/api/models", {"name": "other", "base_url": "http://127.0.0.1:1/v1", "run_id": f"{run_id}x"}, False),
        ("DELETE", "/api/models?name=never-registered", None, False),
        ("POST", "/api/runs", {"run_id": f"{run_id}r"}, False),
        ("GET", f"/api/runs/{run_id}", None, False),
        ("POST", "/api/phase", {"run_id": f"{run_id}p", "phase": "rollout"}, False),
        ("POST", f"{proxy}/chat/completions", CHAT, True),
        ("GET", f"{proxy}/models", None, True),
    ]


def test_auth_matrix(gateway: GatewayHandle, fake_vllm: FakeVLLM, run_id: str) -> None:
    rollout, own = gateway.running(run_id, fake_vllm.url)
    _, other = gateway.running(run_id, fake_vllm.url)
    rid, aid = rollout["rollout_id"], own["attempt_id"]
    tokens = {"none": None, "other": other["token"], "own": own["token"], "admin": ADMIN}
    failures = []
    with httpx.Client(base_url=gateway.url, timeout=10) as client:
        for who, token in tokens.items():
            headers = {"authorization": f"Bearer {token}"} if token else {}
            for method, path, body, agent_ok in _endpoints(run_id, rid, aid):
                r = client.request(method, path, json=body, headers=headers)
                if who == "none":
                    ok = r.status_code == 401
                elif who == "other" or (who == "own" and not agent_ok):
                    ok = r.status_code == 403
                elif who == "own":
                    ok = 200 <= r.status_code < 300
                else:
                    ok = r.status_code not in (401, 403) and r.status_code < 500
                if not ok:
                    failures.append(f"{who} {method} {path}: {r.status_code} {r.text[:120]}")
                assert "error" in r.json() if r.status_code >= 400 else True
        assert client.get("/healthz").json()["status"] == "ok"
    assert not failures, "\n".join(failures)


def test_bad_tokens_are_401(gateway: GatewayHandle, fake_vllm: FakeVLLM, run_id: str) -> None:
    rollout, attempt = gateway.running(run_id, fake_vllm.url)
    url = f"/api/rollouts/{rollout['rollout_id']}/events"
    forged = TokenSigner("not-the-secret").issue("agent", run_id, rollout["rollout_id"], attempt["attempt_id"])
    head, body, sig = attempt["token"].split(".")
    tampered = f"{head}.{body}.{'A' if sig[0] != 'A' else 'B'}{sig[1:]}"
    for token in (forged, tampered, "garbage", ADMIN + "x"):
        r = httpx.get(gateway.url + url, headers={"authorization": f"Bearer {token}"})
        assert r.status_code == 401, (token, r.text)
        assert r.headers["www-authenticate"] == "Bearer"
    assert httpx.get(gateway.url + url, headers={"x-api-key": ADMIN}).status_code == 200  # Agent Lightning's header


def test_token_stops_working_when_the_attempt_ends(gateway: GatewayHandle, fake_vllm: FakeVLLM, run_id: str) -> None:
    rollout, attempt = gateway.running(run_id, fake_vllm.url)
    rid = rollout["rollout_id"]
    headers = {"authorization": f"Bearer {attempt['token']}"}
    chat = attempt["proxy_base_url"] + "/chat/completions"
    assert httpx.post(chat, json=CHAT, headers=headers).status_code == 200
    gateway.admin.patch(f"/api/rollouts/{rid}", json={"status": "running"})
    gateway.admin.patch(f"/api/rollouts/{rid}", json={"status": "succeeded"})
    started = fake_vllm.started
    finished = httpx.post(chat, json=CHAT, headers=headers)
    assert finished.status_code == 409 and finished.json()["error"]["current"]["status"] == "succeeded"
    events = httpx.post(attempt["events_url"], json={"type": "reward", "value": 1}, headers=headers)
    assert events.status_code == 409
    assert fake_vllm.started == started, "a refused call must never be forwarded"
    unknown = chat.replace(f"/attempt/{attempt['attempt_id']}/", "/attempt/nope/")
    assert httpx.post(unknown, json=CHAT, headers={"authorization": f"Bearer {ADMIN}"}).status_code == 404
    missing = chat.replace(f"/rollout/{rid}/", "/rollout/none-such/")
    assert httpx.post(missing, json=CHAT, headers={"authorization": f"Bearer {ADMIN}"}).status_code == 404
    wrong_mode = chat.replace("/mode/train/", "/mode/val/")
    assert httpx.post(wrong_mode, json=CHAT, headers=headers).status_code in (403, 409)
    assert fake_vllm.started == started


async def test_status_written_by_another_service_ends_the_attempt(
    gateway: GatewayHandle, fake_vllm: FakeVLLM, run_id: str, store: EventStore
) -> None:
    """The admission cache follows the stream: a `failed` appended elsewhere refuses the next call."""
    rollout, attempt = gateway.running(run_id, fake_vllm.url)
    headers = {"authorization": f"Bearer {attempt['token']}"}
    chat = attempt["proxy_base_url"] + "/chat/completions"
    async with httpx.AsyncClient(headers=headers) as client:
        assert (await client.post(chat, json=CHAT)).status_code == 200
        last, seq = await store.last_status(run_id, rollout["rollout_id"])
        assert last is not None
        await store.append(
            RolloutStatusChanged(
                run_id=run_id,
                rollout_id=rollout["rollout_id"],
                status="failed",
                previous=last.status,
                attempt_id=attempt["attempt_id"],
                reason="the executor lost the pod",
            ),
            expected_last_subject_seq=seq,
        )
        for _ in range(100):
            refused = await client.post(chat, json=CHAT)
            if refused.status_code == 409:
                break
            await asyncio.sleep(0.02)
        assert refused.status_code == 409 and refused.json()["error"]["current"]["status"] == "failed"


def test_an_agent_token_reads_only_its_live_attempt(gateway: GatewayHandle, fake_vllm: FakeVLLM, run_id: str) -> None:
    rollout, first = gateway.running(run_id, fake_vllm.url, max_attempts=2)
    rid = rollout["rollout_id"]
    first_headers = {"authorization": f"Bearer {first['token']}"}
    assert httpx.post(first["events_url"], json={"type": "reward", "value": 0.25}, headers=first_headers).is_success
    assert httpx.get(f"{gateway.url}/api/rollouts/{rid}", headers=first_headers).status_code == 200
    gateway.admin.patch(f"/api/rollouts/{rid}", json={"status": "running", "attempt_id": first["attempt_id"]})
    retried = gateway.admin.patch(f"/api/rollouts/{rid}", json={"status": "requeuing", "reason": "agent crashed"})
    assert retried.status_code == 200, retried.text
    ended = httpx.get(f"{gateway.url}/api/rollouts/{rid}/events", headers=first_headers)
    assert ended.status_code == 403 and "ended" in ended.json()["error"]
    assert httpx.get(f"{gateway.url}/api/rollouts/{rid}", headers=first_headers).status_code == 403

    second = gateway.attempt(rid)
    headers = {"authorization": f"Bearer {second['token']}"}
    assert httpx.post(second["events_url"], json={"type": "custom", "name": "note"}, headers=headers).is_success
    own = httpx.get(f"{gateway.url}/api/rollouts/{rid}/events", headers=headers)
    assert own.status_code == 200
    assert own.json() and all(e["attempt_id"] == second["attempt_id"] for e in own.json())
    detail = httpx.get(f"{gateway.url}/api/rollouts/{rid}", headers=headers).json()
    assert 0.25 not in [r.get("value") for r in detail.get("rewards", [])]
    admin = gateway.admin.get(f"/api/rollouts/{rid}/events").json()
    assert {e["attempt_id"] for e in admin} == {first["attempt_id"], second["attempt_id"]}
