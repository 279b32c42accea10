"""Fixtures for the Kubernetes backend: a fake API server (real HTTP) and backends talking to it."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest
from fake_apiserver import FakeApiServer
from k8s_support import NAMESPACE, TEMPLATE, StateLog

from services.controller.backends.kubernetes import KubernetesBackend, KubernetesSettings


@pytest.fixture
def apiserver() -> Iterator[FakeApiServer]:
    """A fresh fake Kubernetes API server on a free port."""
    with FakeApiServer() as server:
        yield server


@pytest.fixture
async def make_backend(apiserver: FakeApiServer) -> AsyncIterator[Callable[..., KubernetesBackend]]:
    """Build Kubernetes backends against the fake server (the example template; settings overridable)."""
    made: list[KubernetesBackend] = []

    def make(**overrides: Any) -> KubernetesBackend:
        limiter = overrides.pop("limiter", None)
        settings: dict[str, Any] = {
            "job_template": TEMPLATE,
            "template_source": "infra/k8s/job-template.yaml",
            "namespace": NAMESPACE,
            "image": "registry.example/agent:1",
            "create_rate": None,
            "resync_s": 30.0,
            "stuck_grace_s": 60.0,
            "request_timeout_s": 5.0,
        }
        settings.update(overrides)
        backend = KubernetesBackend(KubernetesSettings(**settings), api_client=apiserver.api_client(), limiter=limiter)
        made.append(backend)
        return backend

    yield make
    for backend in made:
        await backend.close()


@pytest.fixture
async def backend(make_backend: Callable[..., KubernetesBackend]) -> KubernetesBackend:
    """A Kubernetes backend with default test settings."""
    return make_backend()


@pytest.fixture
async def states(backend: KubernetesBackend) -> AsyncIterator[StateLog]:
    """The `watch()` of the `backend` fixture, recorded."""
    log = StateLog(backend)
    yield log
    await log.stop()
