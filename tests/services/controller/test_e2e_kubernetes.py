"""The controller with the Kubernetes backend: a run with `backend: kubernetes` becomes Jobs.

The Kubernetes API is the fake API server of the backend's own tests (real HTTP, the official
client); it plays the kubelet when the test tells it to. The controller runs in this process,
with the real gateway and NATS.
"""

from __future__ import annotations

import asyncio
import base64
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from controller_rig import ADMIN

from services.common.eventstore import EventStore
from services.common.gateway_api import GatewayClient
from services.controller.backends.base import ExecutionKey
from services.controller.reconciler import Controller
from services.controller.settings import ControllerSettings

sys.path.insert(0, str(Path(__file__).resolve().parent / "k8s"))
from fake_apiserver import FakeApiServer
from k8s_support import NAMESPACE, TEMPLATE

from services.controller.backends.k8s_template import job_name
from services.controller.backends.kubernetes import KubernetesBackend, KubernetesSettings


async def until(check: Callable[[], Any], timeout: float = 30.0) -> Any:
    """Poll `check` (sync or async) until it returns something truthy."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {check}")


@pytest.fixture
def apiserver() -> Any:
    with FakeApiServer() as server:
        yield server


async def test_a_kubernetes_run_executes_as_jobs(
    nats_url: str, gateway_url: str, run_id: str, tmp_path: Path, apiserver: FakeApiServer
) -> None:
    backend = KubernetesBackend(
        KubernetesSettings(
            job_template=TEMPLATE,
            namespace=NAMESPACE,
            image="registry.example/agent:default",
            create_rate=None,
            stuck_grace_s=60.0,
            request_timeout_s=5.0,
        ),
        api_client=apiserver.api_client(),
    )
    store = await EventStore.connect(nats_url)
    gateway = GatewayClient(gateway_url, ADMIN)
    settings = ControllerSettings(
        gateway_url=gateway_url,
        admin_token=ADMIN,
        nats_url=nats_url,
        runs=(run_id,),
        durable=f"controller-{run_id}",
        backends=("kubernetes",),
        executions_dir=tmp_path,
        resync_s=1.0,
    )
    controller = Controller(store, gateway, settings, backends={"kubernetes": backend})
    loop = asyncio.create_task(controller.run())
    admin = httpx.AsyncClient(base_url=gateway_url, headers={"authorization": f"Bearer {ADMIN}"}, timeout=30)

    async def rollout(rid: str) -> dict[str, Any]:
        return (await admin.get(f"/api/rollouts/{rid}")).json()  # type: ignore[no-any-return]

    async def job_of(rid: str, state: str = "preparing") -> str:
        current = await until(lambda: _state(rollout(rid), state))
        return job_name(ExecutionKey(run_id, rid, current["attempt_id"]))

    try:
        spec = {"run_id": run_id, "backend": "kubernetes", "image": "registry.example/agent:7", "max_attempts": 2}
        r = await admin.post("/api/runs", json={**spec, "retry_backoff_s": 0.1})
        assert r.status_code == 201, r.text
        r = await admin.post(
            "/api/rollouts", json={"rollouts": [{"run_id": run_id, "input": {"q": i}} for i in (1, 2)]}
        )
        ok, evicted = (item["rollout_id"] for item in r.json()["rollouts"])

        # Created Jobs wait in `preparing` while their pods are pending.
        ok_job, evicted_job = await job_of(ok), await job_of(evicted)
        await until(lambda: len(apiserver.jobs(NAMESPACE)) == 2)
        container = apiserver.job(ok_job)["spec"]["template"]["spec"]["containers"][0]
        env = {e["name"]: e.get("value") for e in container["env"]}
        refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container["env"] if "valueFrom" in e}
        assert container["image"] == "registry.example/agent:7"
        assert env["ROLLWIRE_ROLLOUT_ID"] == ok and set(refs) == {
            "OPENAI_API_KEY",
            "ANTHROPIC_API_KEY",
            "ROLLWIRE_TOKEN",
        }
        await until(lambda: any(s["metadata"]["name"] == ok_job for s in apiserver.secrets(NAMESPACE)))
        (secret,) = [s for s in apiserver.secrets(NAMESPACE) if s["metadata"]["name"] == ok_job]
        token = base64.b64decode(secret["data"][refs["ROLLWIRE_TOKEN"]["key"]]).decode()
        assert token and token not in json.dumps(apiserver.job(ok_job))  # the token is in the Secret only
        assert base64.b64decode(secret["data"][refs["OPENAI_API_KEY"]["key"]]).decode() == token
        assert env["OPENAI_BASE_URL"].startswith(f"{gateway_url}/proxy/rollout/{ok}/attempt/")
        assert (await rollout(ok))["state"] == "preparing"

        apiserver.set_pod_running(ok_job)
        await until(lambda: _state(rollout(ok), "running"))
        apiserver.set_pod_succeeded(ok_job)
        await until(lambda: _state(rollout(ok), "succeeded"))
        await until(lambda: ok_job not in {j["metadata"]["name"] for j in apiserver.jobs(NAMESPACE)})  # cleaned up

        apiserver.set_pod_running(evicted_job)
        await until(lambda: _state(rollout(evicted), "running"))
        apiserver.evict_pod(evicted_job)
        retry_job = await job_of(evicted)  # requeued, then a second attempt: a second Job
        assert retry_job != evicted_job
        first = (await rollout(evicted))["attempts"][0]
        events = (await admin.get(f"/api/rollouts/{evicted}/events", params={"type": "rollout.status"})).json()
        reasons = [e.get("reason") or "" for e in events if e.get("attempt_id") == first]
        assert any("evict" in reason.lower() for reason in reasons), reasons
        # `preparing` is recorded before the launch: wait for the Job itself before moving its pod.
        await until(lambda: retry_job in {j["metadata"]["name"] for j in apiserver.jobs(NAMESPACE)})
        apiserver.set_pod_running(retry_job)
        apiserver.set_pod_succeeded(retry_job)
        final = await until(lambda: _state(rollout(evicted), "succeeded"))
        assert final["attempt_count"] == 2
    finally:
        controller.stop()
        await asyncio.wait_for(loop, 30)
        await admin.aclose()
        await gateway.close()
        await store.close()


async def _state(pending: Any, state: str) -> dict[str, Any] | None:
    value = await pending
    return value if value.get("state") == state else None
