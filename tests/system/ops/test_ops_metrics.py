"""Every service's /metrics during a short `rollwire up` run: families, labels, and counters that move
by exactly what the run did (agents that succeed and fail, proxy calls streamed and not, a call to a
dead endpoint, a call held at the phase gate); and one JSON access line per request. The engine is
vLLM: its own `vllm:*` families, scraped with the stack's engine key."""

from __future__ import annotations

import json
import re
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
from ops_stack import Scrape, Stack, scrape

from services.devstack.embedded import free_port

AGENT = Path(__file__).with_name("ops_agent.py")
CHAT = "chat_completions"

FAMILIES: dict[str, dict[str, tuple[str, set[str]]]] = {
    "gateway": {
        "rollwire_http_requests": ("counter", {"service", "method", "route", "status"}),
        "rollwire_http_request_duration_seconds": ("histogram", {"service", "method", "route"}),
        "rollwire_gateway_proxy_calls": ("counter", {"front_end", "status"}),
        "rollwire_gateway_proxy_call_duration_seconds": ("histogram", {"front_end"}),
        "rollwire_gateway_proxy_time_to_first_token_seconds": ("histogram", {"front_end"}),
        "rollwire_gateway_recorded_calls": ("counter", {"status"}),
        "rollwire_gateway_record_failures": ("counter", set()),
        "rollwire_gateway_phase_held_calls": ("gauge", set()),
        "rollwire_gateway_phase_holds": ("counter", set()),
        "rollwire_gateway_phase_hold_seconds": ("histogram", set()),
        "rollwire_gateway_idempotency_cache_entries": ("gauge", set()),
        "rollwire_gateway_idempotency_cache_bytes": ("gauge", set()),
        "process_cpu_seconds": ("counter", set()),
    },
    "engine": {  # vLLM's own (`vllm/v1/metrics/loggers.py`), one series per engine core and served model
        "vllm:generation_tokens": ("counter", {"engine", "model_name"}),
        "vllm:prompt_tokens": ("counter", {"engine", "model_name"}),
        "vllm:request_success": ("counter", {"engine", "model_name", "finished_reason"}),
        "vllm:num_requests_running": ("gauge", {"engine", "model_name"}),
        "vllm:num_requests_waiting": ("gauge", {"engine", "model_name"}),
        "vllm:iteration_tokens_total": ("histogram", {"engine", "model_name"}),
        "vllm:e2e_request_latency_seconds": ("histogram", {"engine", "model_name"}),
        "vllm:time_to_first_token_seconds": ("histogram", {"engine", "model_name"}),
        "vllm:inter_token_latency_seconds": ("histogram", {"engine", "model_name"}),
    },
    "controller": {
        "rollwire_http_requests": ("counter", {"service", "method", "route", "status"}),
        "rollwire_controller_executions": ("gauge", {"backend", "state"}),
        "rollwire_controller_status_changes": ("counter", {"backend", "status"}),
        "rollwire_controller_launches": ("counter", {"backend"}),
        "rollwire_controller_retries": ("counter", {"backend"}),
        "rollwire_controller_failures": ("counter", {"backend", "reason"}),
        "rollwire_controller_queue_to_running_seconds": ("histogram", {"backend"}),
    },
    "projector": {
        "rollwire_http_requests": ("counter", {"service", "method", "route", "status"}),
        "rollwire_projector_lag_events": ("gauge", {"stream"}),
        "rollwire_projector_lag_seconds": ("gauge", {"stream"}),
        "rollwire_projector_applied_seq": ("gauge", {"stream"}),
        "rollwire_projector_events": ("counter", {"stream"}),
    },
}


def scrape_all(stack: Stack) -> dict[str, Scrape]:
    return {name: stack.scrape(name) for name in stack.metrics_urls()}


def wait_terminal(
    admin: httpx.Client, rollout_ids: list[str], watch: Callable[[], None] = lambda: None, timeout: float = 400
) -> dict[str, dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while True:
        found = {rid: admin.get(f"/api/rollouts/{rid}").json() for rid in rollout_ids}
        if all(r.get("state") in ("succeeded", "failed", "cancelled") for r in found.values()):
            return found
        assert time.monotonic() < deadline, {rid: r.get("state") for rid, r in found.items()}
        watch()
        time.sleep(0.1)


def manual_attempt(admin: httpx.Client, run_id: str) -> dict[str, Any]:
    """A rollout of a run no controller executes, with an attempt started by hand (its token and URL)."""
    created = admin.post("/api/rollouts", json={"rollouts": [{"run_id": run_id, "input": {}}]})
    assert created.status_code == 201, created.text
    rid = created.json()["rollouts"][0]["rollout_id"]
    attempt = admin.post(f"/api/rollouts/{rid}/attempts", json={})
    assert attempt.status_code == 201, attempt.text
    return attempt.json()  # type: ignore[no-any-return]


def test_agents_succeeding_and_failing_move_the_controller_counters(stack: Stack) -> None:
    before = scrape_all(stack)
    with stack.admin() as admin:
        spec = {"run_id": "ops-agents", "command": [sys.executable, str(AGENT)], "max_attempts": 2, "timeout_s": 180}
        assert admin.post("/api/runs", json=spec).status_code in (200, 201)
        items = [{"run_id": "ops-agents", "input": {"fail": False}}, {"run_id": "ops-agents", "input": {"fail": True}}]
        created = admin.post("/api/rollouts", json={"rollouts": items})
        ok, bad = (r["rollout_id"] for r in created.json()["rollouts"])
        running: list[float] = []
        executions = ("rollwire_controller_executions", {"backend": "local", "state": "running"})
        watch = lambda: running.append(scrape(stack.endpoints["controller"]).value(executions[0], **executions[1]))  # noqa: E731
        ended = wait_terminal(admin, [ok, bad], watch)
    assert ended[ok]["state"] == "succeeded" and ended[bad]["state"] == "failed", ended
    assert max(running) >= 1  # agents showed as running executions while they ran
    time.sleep(0.5)
    after = scrape_all(stack)
    c0, c1 = before["controller"], after["controller"]

    def moved(name: str, **labels: str) -> float:
        return c1.value(name, **labels) - c0.value(name, **labels)

    assert moved("rollwire_controller_launches_total", backend="local") == 3  # one, then two attempts
    assert moved("rollwire_controller_retries_total", backend="local") == 1
    assert moved("rollwire_controller_failures_total", backend="local", reason="exit_code") == 2
    assert moved("rollwire_controller_status_changes_total", backend="local", status="succeeded") == 1
    assert moved("rollwire_controller_status_changes_total", backend="local", status="requeuing") == 1
    assert moved("rollwire_controller_status_changes_total", backend="local", status="failed") == 1
    assert moved("rollwire_controller_status_changes_total", backend="local", status="running") == 3
    assert moved("rollwire_controller_queue_to_running_seconds_count", backend="local") == 3
    # Three streamed agent calls crossed the proxy and were recorded; each reached its first token.
    g0, g1 = before["gateway"], after["gateway"]
    calls = ("rollwire_gateway_proxy_calls_total", {"front_end": CHAT, "status": "200"})
    assert g1.value(calls[0], **calls[1]) - g0.value(calls[0], **calls[1]) == 3
    ttft = "rollwire_gateway_proxy_time_to_first_token_seconds_count"
    assert g1.value(ttft, front_end=CHAT) - g0.value(ttft, front_end=CHAT) == 3
    rewards = {"service": "gateway", "method": "POST", "status": "201"}
    rewards["route"] = "/api/rollouts/{rollout_id}/attempt/{attempt_id}/events"
    posted = g1.value("rollwire_http_requests_total", **rewards) - g0.value("rollwire_http_requests_total", **rewards)
    assert posted == 1 + 3  # the agent's reward, and the controller's log link of each of the three attempts


def test_proxy_calls_a_failure_and_the_engine_counters(stack: Stack) -> None:
    """Three calls through the proxy, one streamed and one by an agent named in the path, and one to a
    dead endpoint: the gateway's counters (the agent's call on its API's front end and route), and
    vLLM's, which move by exactly the tokens the three calls' usage reports."""
    with stack.admin() as admin:
        attempt = manual_attempt(admin, "ops-proxy")
        broken_url = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there
        registered = admin.post("/api/models", json={"name": "dead", "base_url": broken_url, "run_id": "ops-broken"})
        assert registered.status_code == 201, registered.text
        broken = manual_attempt(admin, "ops-broken")
    before = scrape_all(stack)
    client = openai.OpenAI(base_url=attempt["proxy_base_url"], api_key=attempt["token"], max_retries=0, timeout=180)
    plain = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "a"}], max_tokens=5)
    chunks = list(
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "b"}], max_tokens=6, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    named = openai.OpenAI(
        base_url=attempt["proxy_base_url"].replace("/openai/v1", "/agent/planner/openai/v1"),
        api_key=attempt["token"], max_retries=0, timeout=180,
    )  # fmt: skip
    planner = named.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "d"}], max_tokens=4)
    usage = [plain.usage, chunks[-1].usage, planner.usage]
    dead = openai.OpenAI(base_url=broken["proxy_base_url"], api_key=broken["token"], max_retries=0)
    try:
        dead.chat.completions.create(model="dead", messages=[{"role": "user", "content": "c"}], max_tokens=5)
        raise AssertionError("a call to a dead endpoint succeeded")
    except openai.APIStatusError as exc:
        assert exc.status_code == 502
    after = scrape_all(stack)
    g0, g1 = before["gateway"], after["gateway"]

    def moved(scrapes: tuple[Scrape, Scrape], name: str, **labels: str) -> float:
        return scrapes[1].value(name, **labels) - scrapes[0].value(name, **labels)

    gw = (g0, g1)
    assert moved(gw, "rollwire_gateway_proxy_calls_total", front_end=CHAT, status="200") == 3
    assert moved(gw, "rollwire_gateway_proxy_calls_total", front_end=CHAT, status="502") == 1
    assert moved(gw, "rollwire_gateway_proxy_calls_total", front_end="other", status="200") == 0
    assert moved(gw, "rollwire_gateway_proxy_call_duration_seconds_count", front_end=CHAT) == 4
    assert moved(gw, "rollwire_gateway_proxy_time_to_first_token_seconds_count", front_end=CHAT) == 1
    assert moved(gw, "rollwire_gateway_recorded_calls_total", status="ok") == 3
    assert moved(gw, "rollwire_gateway_recorded_calls_total", status="failed") == 1
    assert moved(gw, "rollwire_gateway_record_failures_total") == 0
    route = "/proxy/rollout/{rollout_id}/attempt/{attempt_id}/mode/{mode}/openai/v1/chat/completions"
    assert moved(gw, "rollwire_http_requests_total", service="gateway", method="POST", route=route, status="502") == 1
    assert moved(gw, "rollwire_http_requests_total", service="gateway", method="POST", route=route, status="200") == 3
    en = (before["engine"], after["engine"])
    assert all(u is not None for u in usage)
    generated = sum(u.completion_tokens for u in usage if u is not None)
    prompt = sum(u.prompt_tokens for u in usage if u is not None)
    served = {"engine": "0", "model_name": "tiny"}
    assert moved(en, "vllm:generation_tokens_total", **served) == generated
    assert moved(en, "vllm:prompt_tokens_total", **served) == prompt
    ended = sum(moved(en, "vllm:request_success_total", **served, finished_reason=r) for r in ("stop", "length"))
    assert ended == 3
    assert moved(en, "vllm:e2e_request_latency_seconds_count", **served) == 3
    assert moved(en, "vllm:time_to_first_token_seconds_count", **served) == 3
    # One engine step per generated token (the calls ran one after the other); the first token of each
    # call comes from its prefill step, the others each after an inter-token gap.
    assert moved(en, "vllm:iteration_tokens_total_count", **served) == generated
    assert moved(en, "vllm:inter_token_latency_seconds_count", **served) == generated - 3
    computed = moved(en, "vllm:request_prefill_kv_computed_tokens_sum", **served)  # the prompt, less cached blocks
    assert 0 < computed <= prompt
    assert moved(en, "vllm:iteration_tokens_total_sum", **served) == computed + generated
    assert after["engine"].value("vllm:num_requests_running", **served) == 0
    assert after["engine"].value("vllm:num_requests_waiting", **served) == 0


def test_a_call_held_at_the_phase_gate_is_counted(stack: Stack) -> None:
    with stack.admin() as admin:
        attempt = manual_attempt(admin, "ops-phase")
        before = stack.scrape("gateway")
        key = {"Idempotency-Key": "ops-update"}
        closed = admin.post("/api/phase", json={"run_id": "ops-phase", "phase": "update"}, headers=key)
        assert closed.status_code == 200, closed.text
        client = openai.OpenAI(base_url=attempt["proxy_base_url"], api_key=attempt["token"], max_retries=0, timeout=180)
        answers: list[Any] = []
        call = threading.Thread(
            target=lambda: answers.append(
                client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=2)
            )
        )
        call.start()
        deadline = time.monotonic() + 120
        while stack.scrape("gateway").value("rollwire_gateway_phase_held_calls") != 1:
            assert time.monotonic() < deadline, "the held call never showed in rollwire_gateway_phase_held_calls"
            time.sleep(0.05)
        time.sleep(0.3)
        key = {"Idempotency-Key": "ops-rollout"}
        opened = admin.post("/api/phase", json={"run_id": "ops-phase", "phase": "rollout"}, headers=key)
        assert opened.status_code == 200, opened.text
        call.join(180)
    assert answers and answers[0].choices
    after = stack.scrape("gateway")
    assert after.value("rollwire_gateway_phase_held_calls") == 0
    assert after.value("rollwire_gateway_phase_holds_total") - before.value("rollwire_gateway_phase_holds_total") == 1
    hold = "rollwire_gateway_phase_hold_seconds_sum"
    assert after.value(hold) - before.value(hold) >= 0.3
    assert after.value("rollwire_gateway_idempotency_cache_entries") >= 2
    assert after.value("rollwire_gateway_idempotency_cache_bytes") > 0


def test_every_service_writes_json_access_lines(stack: Stack) -> None:
    """Rollwire's services write JSON access lines; vLLM, the engine, its own (uvicorn's) lines."""
    with stack.admin() as admin:
        attempt = manual_attempt(admin, "ops-logs")
        assert admin.get(f"/api/rollouts/{attempt['rollout_id']}").status_code == 200
    for service in ("gateway", "engine", "projector", "controller"):
        stack.scrape(service)  # at least one request each
    time.sleep(0.3)
    engine_log = (stack.data_dir / "logs" / "vllm-0.log").read_text(errors="replace")
    assert re.search(r'"GET /metrics HTTP/1\.1" 200', engine_log), engine_log[-2000:]
    lines: dict[str, list[dict[str, Any]]] = {}
    for service in ("gateway", "projector", "controller"):
        for raw in (stack.data_dir / "logs" / f"{service}.log").read_text().splitlines():
            if raw.startswith("{") and '"latency_ms"' in raw:
                record = json.loads(raw)
                lines.setdefault(record["service"], []).append(record)
        assert any(r["path"] == "/metrics" and r["status"] == 200 for r in lines[service]), service
    for records in lines.values():
        for record in records:
            assert set(record) == {"ts", "service", "method", "path", "status", "rollout", "attempt", "latency_ms"}
    rid, aid = attempt["rollout_id"], attempt["attempt_id"]
    started = [r for r in lines["gateway"] if r["path"] == f"/api/rollouts/{rid}/attempts"]
    assert started and started[0]["method"] == "POST" and started[0]["status"] == 201 and started[0]["rollout"] == rid
    shown = [r for r in lines["gateway"] if r["path"] == f"/api/rollouts/{rid}" and r["method"] == "GET"]
    assert shown and shown[0]["rollout"] == rid and shown[0]["attempt"] is None
    proxied = [r for r in lines["gateway"] if r["path"].startswith("/proxy/") and r["attempt"] is not None]
    assert proxied, "no access line for a proxy call"
    assert aid  # the attempt ids in proxy lines come from their paths


def test_every_family_is_exported_with_its_labels(stack: Stack) -> None:
    """Last in this file, after traffic; the bounded label sets exist at 0 from the start anyway."""
    scrapes = scrape_all(stack)
    for service, families in FAMILIES.items():
        for name, (kind, labels) in families.items():
            assert scrapes[service].types.get(name) == kind, (service, name, scrapes[service].types.get(name))
            found = scrapes[service].labels[name]
            assert found == labels, (service, name, found)
    # Each service exports only its own families (the projector imports gateway modules, not its metrics).
    assert not any(n.startswith("rollwire_gateway_") for n in scrapes["projector"].types)
    assert not any(n.startswith("vllm:") for n in scrapes["gateway"].types)
