"""Gateway fixtures: the gateway and a fake vLLM upstream, each served by uvicorn in a thread.

Tests isolate themselves by run id: each registers the fake upstream as the model of its own run.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fake_vllm import FakeVLLM
from gw_harness import GatewayHandle, Served, gateway_settings

from services.gateway import create_app


@pytest.fixture(scope="session")
def fake() -> Iterator[FakeVLLM]:
    """The fake vLLM app (its record of served calls); see `fake_url`."""
    app = FakeVLLM()
    with Served(app) as served:
        app.url = served.url
        yield app


@pytest.fixture
def fake_vllm(fake: FakeVLLM) -> FakeVLLM:
    """The fake upstream, reset to defaults for this test."""
    fake.reset()
    return fake


def _served_gateway(nats_url: str) -> Iterator[GatewayHandle]:
    settings = gateway_settings(nats_url)
    with Served(create_app(settings), settings.port) as served:
        handle = GatewayHandle(served, settings)
        yield handle
        handle.admin.close()


@pytest.fixture(scope="session")
def gateway(nats_url: str) -> Iterator[GatewayHandle]:
    """A gateway shared by the session's tests (isolated from each other by run id)."""
    yield from _served_gateway(nats_url)


@pytest.fixture
def second(gateway: GatewayHandle, nats_url: str) -> Iterator[GatewayHandle]:
    """Another gateway replica on the same NATS, with its own caches (for tests of several gateways)."""
    yield from _served_gateway(nats_url)


@pytest.fixture(scope="session")
def qwen3_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model's tokenizer with a Qwen3-style chat template (continuous prompt mode tests)."""
    from continuity_rig import qwen3_model

    return qwen3_model(tmp_path_factory)


@pytest.fixture(scope="session")
def qwen3_vllm(qwen3_model_dir: Path) -> Iterator[Any]:
    """The template-rendering fake vLLM answering the 6-turn script of `continuity_rig`."""
    from continuity_rig import scripted_engine

    app = scripted_engine(qwen3_model_dir)
    with Served(app) as served:
        app.url = served.url
        yield app
