"""Every route of every HTTP service, through every prefix and path encoding, for every caller short of
the admin: 0 unauthorised successes.

The services are the gateway (with the projector behind it, as `rollwire up` runs them), the
projector's own port and the controller's metrics port. Their routes are read from the apps
themselves (the gateway's and projector's `served_routes`, which their OpenAPI documents are built
from, checked here against the documents; the controller's `/metrics` and health paths), so a new
route cannot escape this test. Each route is aimed at one rollout, V, and its attempt.

Each route is requested as itself and through every prefix a server might resolve it from
(`/ui/`, `/ui/api/`, `/api/`, `/query/`, `/UI/`, another attempt's proxy base URL, ...), walking
back to the root with `..` spelled every way a client, proxy or server may decode it (`%2e`,
`%2E%2E`, `%252e%252e`, overlong UTF-8) and separators likewise (`%2f`, `%252f`, `//`, `\\`), and
with the route itself in other cases and encodings. The requests go over raw sockets: httpx (like
any client) would resolve the dot segments itself. Callers: no token, a wrong token, another
attempt's agent token, V's agent token and V's evaluator token. A success (2xx) is unauthorised
unless the caller may use that route: V's agent its proxy routes, its rollout and events, and
posting events; V's evaluator the same without the proxy; anyone the open paths (health, metrics,
OpenAPI, the viewer's page, `HEAD` on the Anthropic base URL).

As a control, each route is then requested once as itself with the admin token and must succeed:
the requests are valid, so a missing check would show as a success above.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import msgspec
import pytest
from projector_support import ServerThread, running_projector

from services.common.httpserve import HEALTH_PATHS
from services.common.httpserve import serve as serve_metrics_port
from services.common.metrics import METRICS_PATH
from services.devstack.embedded import NatsServer, free_port
from services.gateway import GatewaySettings, create_app
from services.gateway.openapi import served_routes as gateway_routes
from services.projector.api import create_query_app
from services.projector.openapi import served_routes as projector_routes
from services.projector.reader import PostgresRolloutReader

sys.path.insert(0, str(Path(__file__).parents[1] / "gateway"))
from fake_vllm import FakeVLLM

ADMIN = "matrix-admin-token"
DOTS = ["..", "%2e%2e", "%2E%2E", ".%2e", "%252e%252e", "%c0%ae%c0%ae"]
SEPARATORS = ["%2f", "%252f", "//", "%5c", "\\"]
ENCODINGS = [(dot, "/") for dot in DOTS] + [("..", sep) for sep in SEPARATORS]
"""(how `..` is spelled, how `/` is spelled) for the walk back to the root."""
GATEWAY_OPEN = {"/healthz", "/openapi.json", METRICS_PATH, "/ui", "/ui/{path}"}
PROJECTOR_OPEN = {"/healthz", "/health", "/openapi.json", METRICS_PATH, "/ui", "/ui/{path}"}
AGENT_READS = {("GET", "/api/rollouts/{rollout_id}"), ("GET", "/api/rollouts/{rollout_id}/events")}
EVENT_POST = ("POST", "/api/rollouts/{rollout_id}/attempt/{attempt_id}/events")
CHAT = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
ANTHROPIC = {"model": "fake", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
BODIES: dict[tuple[str, str], Any] = {
    ("POST", "/api/rollouts"): {"rollouts": [{"run_id": "{run_id}", "input": 1}]},
    ("PATCH", "/api/rollouts/{rollout_id}"): {"status": "running", "attempt_id": "{attempt_id}"},
    ("POST", "/api/rollouts/{rollout_id}/attempts"): {},
    ("POST", "/api/rollouts/{rollout_id}/attempt/{attempt_id}/evaluator-token"): None,
    EVENT_POST: {"type": "reward", "value": 0.5},
    ("POST", "/api/models"): {"name": "extra", "base_url": "http://127.0.0.1:9/v1", "run_id": "{run_id}"},
    ("DELETE", "/api/models"): None,
    ("DELETE", "/api/rollouts/{rollout_id}"): None,
    ("POST", "/api/runs"): {"run_id": "{run_id}", "command": ["true"]},
    ("POST", "/api/phase"): {"phase": "rollout", "run_id": "{run_id}"},
    ("POST", "chat/completions"): CHAT,
    ("POST", "responses"): {"model": "fake", "input": "hi", "max_output_tokens": 2},
    ("POST", "v1/messages"): ANTHROPIC,
    ("POST", "v1/messages/count_tokens"): ANTHROPIC,
}
"""A valid body for each route that takes one (proxy routes by their last part); the test fails on a route
without one."""
QUERIES = {"/api/models": "name=extra&run_id={run_id}"}
ELSEWHERE = {("POST", "/api/rollouts/{rollout_id}/attempts"): "{run_id}-w"}
"""Routes aimed at another rollout than V: a new attempt can start only from queuing, and V's attempt is live."""
LAST = [
    ("DELETE", "/api/models"),
    ("POST", "/api/rollouts/{rollout_id}/attempts"),
    ("DELETE", "/api/rollouts/{rollout_id}"),
]
"""Admin controls run last, in this order: they remove the model the control registered, end V's attempt, remove V."""


class Target(msgspec.Struct, frozen=True):
    """One route of one service, aimed at V: the method, the route's template and the concrete path."""

    method: str
    template: str
    path: str
    query: str
    body: bytes


async def raw_request(port: int, method: str, target: str, headers: dict[str, str], body: bytes) -> int:
    """Send one HTTP/1.1 request exactly as written (no client-side path normalisation); the status."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        lines = [f"{method} {target} HTTP/1.1", "Host: 127.0.0.1", "Connection: close"]
        lines += [f"{k}: {v}" for k, v in headers.items()]
        if body or method in ("POST", "PATCH"):
            lines += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body)
        await writer.drain()
        status_line = await asyncio.wait_for(reader.readline(), 30)
        with contextlib.suppress(ConnectionError):
            await asyncio.wait_for(reader.read(), 30)  # the whole answer, so the server is never cut off
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
    parts = status_line.split()
    return int(parts[1]) if len(parts) > 1 else 0


def variants(path: str, prefixes: list[str]) -> Iterator[str]:
    """`path` as itself in other spellings, and reached from each prefix by walking back to the root."""
    first, rest = path[1:2], path[2:]
    yield from (path, "/" + path, path.replace("/", "/./"), path.upper(), path.title(), path + "/")
    yield f"/%{ord(first):02x}{rest}" if first else path
    yield "/" + path[1:].replace("/", "%2f") if "/" in path[1:] else path + "%2f"
    for prefix in prefixes:
        depth = prefix.strip("/").count("/") + 1
        for dot, sep in ENCODINGS:
            walk = sep.join([dot] * depth)
            tail = path[1:] if sep in ("\\", "%5c") else path[1:].replace("/", sep)
            yield f"{prefix}{walk}{sep}{tail}"


class Callers:
    """The tokens of the matrix: everyone who is not the admin."""

    def __init__(self, agent: str, evaluator: str, other: str) -> None:
        self.tokens = {"none": None, "wrong": "not-a-token", "other": other, "agent": agent, "evaluator": evaluator}

    @staticmethod
    def headers(token: str | None) -> dict[str, str]:
        return {"Authorization": f"Bearer {token}"} if token else {}


def entitled(service: str, caller: str, method: str, template: str) -> bool:
    """Whether `caller` (aimed at V) may succeed on this route of `service`."""
    if service == "controller" or template in (GATEWAY_OPEN if service == "gateway" else PROJECTOR_OPEN):
        return True
    if service == "gateway" and template.endswith("/anthropic") and method == "HEAD":
        return True  # the Anthropic base URL's connectivity check: 200 for anyone, nothing served
    if service != "gateway" or caller not in ("agent", "evaluator"):
        return False
    if template.startswith("/proxy/"):
        return caller == "agent"
    return (method, template) in AGENT_READS or (method, template) == EVENT_POST


def fill(template: str, ids: dict[str, str]) -> str:
    """The template (a path, query or JSON body) with V's ids in place of `{name}`."""
    for name, value in ids.items():
        template = template.replace("{" + name + "}", value)
    return template


def target(method: str, template: str, ids: dict[str, str]) -> Target:
    key = (method, re.split(r"/openai/v1/|/anthropic/", template)[-1] if template.startswith("/proxy/") else template)
    needs_body = method in ("POST", "PATCH") and not template.endswith("/anthropic")
    assert not needs_body or key in BODIES, f"{method} {template} has no sample body in BODIES: add one"
    sample = BODIES.get(key)
    body = b"" if sample is None else fill(msgspec.json.encode(sample).decode(), ids).encode()
    path = fill(template, {**ids, "rollout_id": fill(ELSEWHERE.get((method, template), ids["rollout_id"]), ids)})
    return Target(method, template, path, fill(QUERIES.get(template, ""), ids), body)


async def prepare(gateway_url: str, fake_url: str, run_id: str) -> tuple[dict[str, str], Callers, int]:
    """V (with a recorded call and a reward), O and their tokens; the stream sequence of the last write."""
    async with httpx.AsyncClient(base_url=gateway_url, headers=Callers.headers(ADMIN), timeout=30) as admin:
        registered = await admin.post("/api/models", json={"name": "fake", "base_url": f"{fake_url}/v1",
                                                           "run_id": run_id})  # fmt: skip
        assert registered.status_code == 201, registered.text
        made = await admin.post("/api/rollouts", json={"rollouts": [
            {"run_id": run_id, "rollout_id": f"{run_id}-v", "input": 1},
            {"run_id": run_id, "rollout_id": f"{run_id}-o", "input": 2},
            {"run_id": run_id, "rollout_id": f"{run_id}-w", "input": 3}]})  # fmt: skip
        assert made.status_code == 201, made.text
        v = (await admin.post(f"/api/rollouts/{run_id}-v/attempts", json={})).json()
        o = (await admin.post(f"/api/rollouts/{run_id}-o/attempts", json={})).json()
        evaluator = await admin.post(f"/api/rollouts/{run_id}-v/attempt/{v['attempt_id']}/evaluator-token")
        agent = {"Authorization": f"Bearer {v['token']}"}
        proxy = urlsplit(v["proxy_base_url"]).path  # the gateway's own port may differ from its settings'
        called = await admin.post(f"{proxy}/chat/completions", json=CHAT, headers=agent)
        assert called.status_code == 200, called.text
        rewarded = await admin.post(urlsplit(v["events_url"]).path, json={"type": "reward", "value": 1.0})
        assert rewarded.status_code == 201, rewarded.text
        params = {"type": "model_request", "min_seq": rewarded.json()["seq"]}
        events = (await admin.get(f"/api/rollouts/{run_id}-v/events", params=params)).json()
    ids = {"run_id": run_id, "rollout_id": f"{run_id}-v", "attempt_id": v["attempt_id"], "mode": "train",
           "agent": "solver", "seq": str(events[0]["seq"]), "path": "index.html"}  # fmt: skip
    ids["other_base"] = urlsplit(o["proxy_base_url"]).path
    return ids, Callers(v["token"], evaluator.json()["token"], o["token"]), rewarded.json()["seq"]


async def run_matrix(
    service: str, port: int, targets: list[Target], prefixes: list[str], callers: Callers
) -> tuple[list[str], int]:
    """Every variant of every target with every caller not entitled to it: the unauthorised successes."""
    jobs = [
        (t, caller, token, path)
        for t in targets
        for caller, token in callers.tokens.items()
        if not entitled(service, caller, t.method, t.template)
        for path in dict.fromkeys(variants(t.path, prefixes))
    ]
    limit = asyncio.Semaphore(16)

    async def one(t: Target, caller: str, token: str | None, path: str) -> str | None:
        async with limit:
            status = await raw_request(port, t.method, f"{path}?{t.query}" if t.query else path,
                                       Callers.headers(token), t.body)  # fmt: skip
        return f"{service}: {t.method} {path} as {caller} -> {status}" if 200 <= status < 300 else None

    found = await asyncio.gather(*(one(*job) for job in jobs))
    return [f for f in found if f], len(jobs)


async def controls(port: int, targets: list[Target]) -> list[str]:
    """Each target as itself with the admin token: what did not succeed (it should all succeed)."""
    ordered = sorted(
        targets, key=lambda t: LAST.index((t.method, t.template)) + 1 if (t.method, t.template) in LAST else 0
    )
    failed = []
    for t in ordered:
        path = f"{t.path}?{t.query}" if t.query else t.path
        status = await raw_request(port, t.method, path, Callers.headers(ADMIN), t.body)
        if not 200 <= status < 400:
            failed.append(f"{t.method} {path} as admin -> {status}")
    return failed


@pytest.mark.slow
async def test_no_route_of_any_service_serves_an_unauthorised_caller(
    fresh_nats: NatsServer, database: str, run_id: str
) -> None:
    fake = FakeVLLM()
    health = lambda: (200, b'{"status": "ok"}')  # noqa: E731 - the controller's port with its real routes
    controller = await serve_metrics_port("controller", "127.0.0.1", 0, health)
    controller_port = controller.sockets[0].getsockname()[1]
    query_app = create_query_app(PostgresRolloutReader(database), admin_token=ADMIN, min_seq_timeout_s=5.0)
    async with running_projector(fresh_nats.url, database):
        with ServerThread(fake) as engine, ServerThread(query_app) as projector:  # type: ignore[arg-type]
            fake.url = engine.url
            settings = GatewaySettings(
                nats_url=fresh_nats.url,
                projector_url=projector.url,
                admin_token=ADMIN,
                secret="s" * 32,
                port=free_port(),
            )
            gateway_app = create_app(settings)
            with ServerThread(gateway_app) as gateway:
                ids, callers, seq = await prepare(gateway.url, engine.url, run_id)
                async with httpx.AsyncClient(timeout=30) as client:
                    assert (
                        await client.get(
                            f"{projector.url}/query/position", params={"min_seq": seq}, headers=Callers.headers(ADMIN)
                        )
                    ).is_success
                    documented = {
                        name: {(m.upper(), p) for p, ops in (await client.get(f"{url}/openapi.json")).json()[
                            "paths"].items() for m in ops}
                        for name, url in (("gateway", gateway.url), ("projector", projector.url))
                    }  # fmt: skip
                served = {
                    "gateway": set(gateway_routes(gateway_app)),
                    "projector": {("GET", p) for p in projector_routes(query_app)},
                    "controller": {("GET", p) for p in (METRICS_PATH, *HEALTH_PATHS)},
                }
                assert documented["gateway"] == served["gateway"], "the gateway's OpenAPI misses a route"
                assert documented["projector"] == served["projector"], "the projector's OpenAPI misses a route"
                made = {name: [target(m, t, ids) for m, t in sorted(routes)] for name, routes in served.items()}
                base = ids["other_base"] + "/"
                common = ["/ui/", "/ui/api/", "/api/", "/query/", "/UI/", "/Ui/Api/"]
                began = time.monotonic()
                plan = [
                    ("gateway", gateway.port, made["gateway"] + made["projector"], [*common, base]),
                    ("projector", projector.port, made["projector"], common),
                    ("controller", controller_port, made["controller"], common),
                ]
                leaks: list[str] = []
                sent = 0
                for service, port, targets, prefixes in plan:
                    found, count = await run_matrix(service, port, targets, prefixes, callers)
                    leaks += found
                    sent += count
                elapsed = time.monotonic() - began
                failed = await controls(gateway.port, made["gateway"]) + await controls(
                    projector.port, made["projector"]
                )
    controller.close()
    print(f"auth matrix: {sent} requests in {elapsed:.1f}s, {len(leaks)} unauthorised successes")
    assert not leaks, f"{len(leaks)} unauthorised successes of {sent}, e.g.:\n" + "\n".join(leaks[:40])
    assert not failed, "controls that should succeed with the admin token did not:\n" + "\n".join(failed)
