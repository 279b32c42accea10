"""The rollout API against a real gateway and a real nats-server: shapes, validation, transitions."""

from __future__ import annotations

import asyncio
import itertools

import httpx
import pytest
from gw_harness import ADMIN, GatewayHandle

from schemas.transitions import ALLOWED

STATUSES = ["queuing", "preparing", "running", "requeuing", "succeeded", "failed", "cancelled"]


def test_batch_create_get_and_list(gateway: GatewayHandle, run_id: str) -> None:
    created = gateway.admin.post(
        "/api/rollouts",
        json={
            "rollouts": [
                {"run_id": run_id, "input": {"q": 1}, "group_id": "g1", "metadata": {"k": "v"}, "max_attempts": 3},
                {"run_id": run_id, "input": {"q": 2}, "group_id": "g2", "mode": "val"},
                {"run_id": run_id, "input": "three", "group_id": "g1", "rollout_id": f"{run_id}-fixed"},
            ]
        },
    )
    assert created.status_code == 201, created.text
    body = created.json()
    assert body["seq"] > 0
    first, second, third = body["rollouts"]
    assert third["rollout_id"] == f"{run_id}-fixed"
    assert first["state"] == "queuing" and first["status"]["state"] == "queuing"
    assert first["max_attempts"] == 3 and second["mode"] == "val" and second["is_train"] is False

    got = gateway.admin.get(f"/api/rollouts/{first['rollout_id']}").json()
    assert got["input"] == {"q": 1} and got["group_id"] == "g1" and got["metadata"] == {"k": "v"}
    assert got["run_id"] == run_id and got["attempts"] == [] and got["reward"] is None
    assert got["rollout"]["rollout_id"] == first["rollout_id"]  # Agent Lightning's RolloutDetail wrapper

    listed = gateway.admin.get("/api/rollouts", params={"run_id": run_id, "group_id": "g1"}).json()
    assert [r["rollout_id"] for r in listed] == [first["rollout_id"], third["rollout_id"]]
    page1 = gateway.admin.get("/api/rollouts", params={"run_id": run_id, "limit": 2})
    page2 = gateway.admin.get(
        "/api/rollouts", params={"run_id": run_id, "limit": 2, "cursor": page1.headers["x-next-cursor"]}
    )
    ids = [r["rollout_id"] for r in page1.json() + page2.json()]
    assert ids == [first["rollout_id"], second["rollout_id"], third["rollout_id"]]
    queued = gateway.admin.get("/api/rollouts", params=[("run_id", run_id), ("state_in", "running")]).json()
    assert queued == []


def test_agent_lightning_shapes(gateway: GatewayHandle, run_id: str) -> None:
    rid = f"{run_id}-agl"
    body = [
        {
            "input": {"data_id": "d1"},
            "is_train": False,
            "rollout_id": rid,
            "config": {"timeout_seconds": 60, "local": {"agent_class": "x:Y", "env_map": {}}},
        }
    ]
    created = gateway.admin.post("/api/rollouts", json=body)
    assert created.status_code == 201, created.text
    item = created.json()[0]
    assert item["rollout_id"] == rid and item["is_train"] is False and item["config"]["timeout_seconds"] == 60
    again = gateway.admin.post("/api/rollouts", json=body)  # a known id returns the existing rollout
    assert again.status_code == 201 and again.json()[0]["status"]["created_at"] == item["status"]["created_at"]
    patched = gateway.admin.patch(f"/api/rollouts/{rid}", json={"status": {"state": "running", "last_attempt_id": "0"}})
    assert patched.status_code == 200, patched.text
    assert patched.json()["status"]["last_attempt_id"] == "0"
    listed = gateway.admin.get("/api/rollouts", params=[("state_in", "running"), ("limit", 1000)]).json()
    assert rid in {r["rollout_id"] for r in listed}
    event = gateway.admin.post(
        f"/api/rollouts/{rid}/attempt/0/events", json={"event_type": "reward", "data": {"value": 0.5}}
    )
    assert event.status_code == 201, event.text
    assert event.json()["event_type"] == "reward" and event.json()["data"]["value"] == 0.5
    events = gateway.admin.get(f"/api/rollouts/{rid}/events").json()
    assert [e["event_type"] for e in events] == ["reward"]
    done = gateway.admin.patch(f"/api/rollouts/{rid}", json={"status": {"state": "succeeded"}})
    assert done.status_code == 200 and done.json()["reward"] == 0.5
    terminal = gateway.admin.get("/api/rollouts/terminal", params={"limit": 100000}).json()
    assert rid in {i["rollout_id"] for i in terminal["items"]}
    assert gateway.admin.delete(f"/api/rollouts/{rid}").status_code == 204
    assert gateway.admin.get(f"/api/rollouts/{rid}").status_code == 404


def test_validation_errors_name_the_field(gateway: GatewayHandle, run_id: str) -> None:
    bad_type = gateway.admin.post(
        "/api/rollouts", json={"rollouts": [{"run_id": run_id, "input": 1, "max_attempts": "x"}]}
    )
    assert bad_type.status_code == 422 and bad_type.json()["field"] == "rollouts[0].max_attempts"
    missing = gateway.admin.post("/api/rollouts", json={"rollouts": [{"run_id": run_id}]})
    assert missing.status_code == 422 and "input" in missing.json()["error"]
    malformed = gateway.admin.post("/api/rollouts", content=b"{not json", headers={"content-type": "application/json"})
    assert malformed.status_code == 422 and malformed.json()["field"] == "body"
    bad_id = gateway.admin.post("/api/rollouts", json={"rollouts": [{"run_id": "a.b", "input": 1}]})
    assert bad_id.status_code == 422 and "run_id" in bad_id.json()["field"]
    rid = gateway.create(run_id)[0]["rollout_id"]
    bad_status = gateway.admin.patch(f"/api/rollouts/{rid}", json={"status": "sleeping"})
    assert bad_status.status_code == 422 and bad_status.json()["field"] == "status"
    too_big = gateway.admin.post("/api/rollouts", content=b"[" + b" " * 1_100_000 + b"]")
    assert too_big.status_code == 413
    bad_limit = gateway.admin.get("/api/rollouts", params={"limit": "many"})
    assert bad_limit.status_code == 422 and bad_limit.json()["field"] == "limit"
    assert gateway.admin.get("/api/rollouts/nope-nope").status_code == 404
    assert gateway.admin.get("/api/nowhere").json() == {"error": "Not Found"}


def _into(gateway: GatewayHandle, run_id: str, status: str) -> str:
    rid = gateway.create(run_id)[0]["rollout_id"]
    path = {
        "queuing": [],
        "preparing": ["attempt"],
        "running": ["attempt", "running"],
        "requeuing": ["attempt", "running", "requeuing"],
        "succeeded": ["attempt", "running", "succeeded"],
        "failed": ["attempt", "running", "failed"],
        "cancelled": ["cancelled"],
    }[status]
    for step in path:
        if step == "attempt":
            gateway.attempt(rid)
        else:
            r = gateway.admin.patch(f"/api/rollouts/{rid}", json={"status": step})
            assert r.status_code == 200, r.text
    return rid


def test_transition_table(gateway: GatewayHandle, run_id: str) -> None:
    """Every (current, requested) pair: allowed ones are appended, the rest get 409 with the current state."""
    for current, requested in itertools.product(STATUSES, STATUSES):
        rid = _into(gateway, run_id, current)
        r = gateway.admin.patch(f"/api/rollouts/{rid}", json={"status": requested, "reason": "test"})
        if requested in ALLOWED[current]:
            assert r.status_code == 200, (current, requested, r.text)
            assert r.json()["state"] == requested
        else:
            assert r.status_code == 409, (current, requested, r.text)
            assert r.json()["current"]["status"] == current


async def test_lost_race_has_one_winner(gateway: GatewayHandle, run_id: str) -> None:
    headers = {"authorization": f"Bearer {ADMIN}"}
    async with httpx.AsyncClient(base_url=gateway.url, headers=headers) as client:
        for _ in range(4):
            rid = _into(gateway, run_id, "running")
            results = await asyncio.gather(
                *[
                    client.patch(f"/api/rollouts/{rid}", json={"status": status})
                    for status in ("succeeded", "failed", "cancelled", "requeuing")
                ]
            )
            codes = sorted(r.status_code for r in results)
            assert codes == [200, 409, 409, 409], [r.text for r in results]
            events = gateway.admin.get(f"/api/rollouts/{rid}/events", params={"type": "rollout.status"}).json()
            assert [e["status"] for e in events] == [
                "queuing",
                "preparing",
                "running",
                next(r.json()["state"] for r in results if r.status_code == 200),
            ]


async def test_five_identical_commands_make_one_event(gateway: GatewayHandle, run_id: str) -> None:
    rid = _into(gateway, run_id, "running")
    aid = gateway.admin.get(f"/api/rollouts/{rid}").json()["attempt_id"]
    headers = {"authorization": f"Bearer {ADMIN}", "idempotency-key": f"k-{run_id}"}
    async with httpx.AsyncClient(base_url=gateway.url, headers=headers) as client:
        posts = await asyncio.gather(
            *[
                client.post(f"/api/rollouts/{rid}/attempt/{aid}/events", json={"type": "reward", "value": 1.0})
                for _ in range(5)
            ]
        )
        patches = await asyncio.gather(
            *[client.patch(f"/api/rollouts/{rid}", json={"status": "succeeded"}) for _ in range(5)]
        )
    assert {r.status_code for r in posts} == {201}
    assert len({r.json()["seq"] for r in posts}) == 1
    assert {r.status_code for r in patches} == {200}
    assert len({r.json()["seq"] for r in patches}) == 1
    events = gateway.admin.get(f"/api/rollouts/{rid}/events", params={"type": "reward,rollout.status"}).json()
    assert [e["type"] for e in events].count("reward") == 1
    assert [e.get("status") for e in events if e["type"] == "rollout.status"][-1] == "succeeded"
    assert [e.get("status") for e in events].count("succeeded") == 1
    # a later repeat still answers with the first result; another body under the same key is refused
    again = gateway.admin.patch(
        f"/api/rollouts/{rid}", json={"status": "succeeded"}, headers={"idempotency-key": f"k-{run_id}"}
    )
    assert again.status_code == 200 and again.json()["seq"] == patches[0].json()["seq"]
    other = gateway.admin.patch(
        f"/api/rollouts/{rid}", json={"status": "failed"}, headers={"idempotency-key": f"k-{run_id}"}
    )
    assert other.status_code == 409


def test_idempotent_create_survives_a_fresh_process_cache(gateway: GatewayHandle, run_id: str) -> None:
    body = {"rollouts": [{"run_id": run_id, "input": 1}, {"run_id": run_id, "input": 2}]}
    first = gateway.admin.post("/api/rollouts", json=body, headers={"idempotency-key": f"c-{run_id}"})
    gateway.gw.idempotency._entries.clear()  # as if another gateway process got the retry
    second = gateway.admin.post("/api/rollouts", json=body, headers={"idempotency-key": f"c-{run_id}"})
    assert [r["rollout_id"] for r in first.json()["rollouts"]] == [r["rollout_id"] for r in second.json()["rollouts"]]
    assert len(gateway.admin.get("/api/rollouts", params={"run_id": run_id}).json()) == 2


def test_attempts_tokens_and_retries(gateway: GatewayHandle, run_id: str) -> None:
    rid = gateway.create(run_id, max_attempts=2)[0]["rollout_id"]
    first = gateway.attempt(rid, executor="job-1")
    assert first["sequence"] == 1 and first["token"].startswith("rw1.")
    assert first["proxy_base_url"].endswith(f"/proxy/rollout/{rid}/attempt/{first['attempt_id']}/mode/train/openai/v1")
    assert first["events_url"].endswith(f"/api/rollouts/{rid}/attempt/{first['attempt_id']}/events")
    again = gateway.admin.post(f"/api/rollouts/{rid}/attempts", json={})
    assert again.status_code == 409 and again.json()["current"]["status"] == "preparing"
    agent = httpx.Client(base_url=gateway.url, headers={"authorization": f"Bearer {first['token']}"})
    url = f"/api/rollouts/{rid}/attempt/{first['attempt_id']}/events"
    assert agent.post(url, json={"type": "custom", "name": "note", "payload": {"a": 1}}).status_code == 201
    assert gateway.admin.patch(f"/api/rollouts/{rid}", json={"status": "requeuing", "reason": "oom"}).status_code == 200
    ended = agent.post(url, json={"type": "reward", "value": 1})
    assert ended.status_code == 409, ended.text
    second = gateway.attempt(rid)
    assert second["sequence"] == 2 and second["attempt_id"] != first["attempt_id"]
    gateway.admin.patch(f"/api/rollouts/{rid}", json={"status": "running"})
    gateway.admin.patch(f"/api/rollouts/{rid}", json={"status": "failed"})
    gateway.admin.patch(f"/api/rollouts/{rid}", json={"status": "requeuing"})
    view = gateway.admin.get(f"/api/rollouts/{rid}").json()
    assert view["attempts"] == [first["attempt_id"], second["attempt_id"]] and view["attempt_count"] == 2
    assert view["state"] == "failed"
    used_up = _into(gateway, run_id, "requeuing")
    assert gateway.admin.post(f"/api/rollouts/{used_up}/attempts").status_code == 409  # max_attempts 1
    keyed = gateway.create(run_id)[0]["rollout_id"]
    a = gateway.admin.post(f"/api/rollouts/{keyed}/attempts", headers={"idempotency-key": "x"})
    gateway.gw.idempotency._entries.clear()
    b = gateway.admin.post(f"/api/rollouts/{keyed}/attempts", headers={"idempotency-key": "x"})
    assert a.status_code == b.status_code == 201 and a.json() == b.json()


def test_runs_and_evaluator_rewards(gateway: GatewayHandle, run_id: str) -> None:
    spec = {
        "run_id": run_id,
        "name": "eval-run",
        "backend": "kubernetes",
        "reward_from": "evaluator",
        "max_attempts": 2,
    }
    started = gateway.admin.post("/api/runs", json=spec)
    assert started.status_code == 201, started.text
    assert gateway.admin.post("/api/runs", json=spec).status_code == 200
    conflict = gateway.admin.post("/api/runs", json={**spec, "concurrency": 3})
    assert conflict.status_code == 409
    bad = gateway.admin.post("/api/runs", json={**spec, "concurrency": "many"})
    assert bad.status_code == 422 and bad.json()["field"] == "concurrency"
    rollout = gateway.create(run_id)[0]
    assert rollout["max_attempts"] == 2  # the run's default
    attempt = gateway.attempt(rollout["rollout_id"])
    url = f"/api/rollouts/{rollout['rollout_id']}/attempt/{attempt['attempt_id']}/events"
    agent = httpx.Client(base_url=gateway.url, headers={"authorization": f"Bearer {attempt['token']}"})
    assert agent.post(url, json={"type": "reward", "value": 1.0}).status_code == 403
    evaluator = gateway.admin.post(
        f"/api/rollouts/{rollout['rollout_id']}/attempt/{attempt['attempt_id']}/evaluator-token"
    ).json()["token"]
    reward = httpx.post(
        gateway.url + url,
        json={"type": "reward", "value": 0.25, "name": "tests"},
        headers={"authorization": f"Bearer {evaluator}"},
    )
    assert reward.status_code == 201 and reward.json()["source"] == "evaluator"
    run = gateway.admin.get(f"/api/runs/{run_id}").json()
    assert run["spec"]["reward_from"] == "evaluator" and run["rollouts"] == {"preparing": 1}
    assert gateway.admin.get(f"/api/rollouts/{rollout['rollout_id']}").json()["reward"] == 0.25


def test_models_both_shapes(gateway: GatewayHandle, run_id: str) -> None:
    r = gateway.admin.post(
        "/api/models",
        json={
            "name": "m1",
            "base_url": "http://127.0.0.1:1/v1",
            "run_id": run_id,
            "served_model": "Qwen/Qwen3-0.6B",
            "weights_version": 3,
        },
    )
    assert r.status_code == 201 and r.json()["seq"] > 0
    assert [m.name for m in gateway.gw.state.models_for(run_id, "none")] == ["m1"]
    listed = gateway.admin.get("/api/models", params={"run_id": run_id})
    assert listed.status_code == 200 and listed.json()["models"] == [
        {"name": "m1", "run_id": run_id, "base_url": "http://127.0.0.1:1/v1", "served_model": "Qwen/Qwen3-0.6B",
         "weights_version": 3, "has_api_key": False, "seq": r.json()["seq"]}
    ]  # fmt: skip
    agl = gateway.admin.post(
        "/api/models", json=[{"model": "Qwen/Qwen2.5-7B-Instruct", "endpoint": "http://127.0.0.1:2/v1"}]
    )
    assert agl.status_code == 201 and agl.json()[0]["model"] == "Qwen/Qwen2.5-7B-Instruct"
    gone = gateway.admin.delete("/api/models", params={"name": "m1", "run_id": run_id})
    assert gone.status_code == 200 and gone.json()["removed"] == ["m1"]
    assert gateway.gw.state.models_for(run_id, "none") == []
    assert gateway.admin.delete("/api/models", params={"name": "m1"}).status_code == 404
    assert gateway.admin.post("/api/models", json={"name": "bad.name", "base_url": "x"}).status_code == 422


@pytest.mark.parametrize(
    "body",
    [
        {"type": "reward"},
        {"type": "reward", "value": "high"},
        {"type": "custom"},
        {"value": 1},
        {"event_type": "model_request", "data": {}},
    ],
)
def test_bad_events_are_422(gateway: GatewayHandle, run_id: str, body: dict) -> None:
    rid = _into(gateway, run_id, "running")
    aid = gateway.admin.get(f"/api/rollouts/{rid}").json()["attempt_id"]
    r = gateway.admin.post(f"/api/rollouts/{rid}/attempt/{aid}/events", json=body)
    assert r.status_code == 422, r.text
    assert r.json()["field"]
