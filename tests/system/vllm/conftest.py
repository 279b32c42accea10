"""Tests against a real vLLM server (its CPU build): the session's server (`tests/vllm_server.py`) and a gateway.

The first test to use the server waits for it to start (1-3 minutes on 2 cores); without vLLM
installed the tests that need it skip, saying so.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "services" / "gateway"))  # the gateway rigs (gw_harness, ...)

from gw_harness import GatewayHandle, Served, gateway_settings

from services.gateway import create_app


@pytest.fixture(scope="session")
def gateway(nats_url: str) -> Iterator[GatewayHandle]:
    """A gateway for the session (tests isolate themselves by run id); its upstream timeout fits CPU vLLM."""
    settings = gateway_settings(nats_url, upstream_timeout_s=120.0, phase_hold_timeout_s=120.0)
    with Served(create_app(settings), settings.port) as served:
        handle = GatewayHandle(served, settings)
        yield handle
        handle.admin.close()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The first test to use the server waits for it to start: give this directory's tests 15 minutes."""
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(900))
