"""No payload wall: with NATS's default 1 MB limit and with `rollwire up`'s 8 MB, a call is recorded or
refused before the engine generates, with a non-retryable error in the API's shape; never a 503."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from fake_vllm import FakeVLLM
from gw_harness import GatewayHandle, Served, gateway_settings

from services.common.eventstore import EventStore
from services.devstack.embedded import NatsServer
from services.gateway import create_app


@pytest.fixture(params=[None, "8MB"], ids=["nats-default-1MB", "rollwire-up-8MB"])
def limited(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[GatewayHandle, NatsServer]]:
    server = NatsServer(tmp_path / "nats", max_payload=request.param).start()
    try:
        settings = gateway_settings(server.url, max_body_bytes=64 << 20, upstream_timeout_s=60.0)
        with Served(create_app(settings), settings.port) as served:
            handle = GatewayHandle(served, settings)
            yield handle, server
            handle.admin.close()
    finally:
        server.stop()


def _calls(url: str, run_id: str) -> list[dict[str, Any]]:
    async def read() -> list[dict[str, Any]]:
        store = await EventStore.connect(url, ensure=False)
        try:
            return [json.loads(m.data) async for b in store.read_raw(f"rl.{run_id}.rollout.*.model_request") for m in b]
        finally:
            await store.close()

    return asyncio.run(read())


def test_a_huge_prompt_is_refused_before_generation_and_a_long_answer_is_recorded(
    limited: tuple[GatewayHandle, NatsServer], fake_vllm: FakeVLLM, run_id: str
) -> None:
    gateway, server = limited
    _rollout, attempt = gateway.running(run_id, fake_vllm.url)
    client: Any = openai.OpenAI(base_url=attempt["proxy_base_url"], api_key=attempt["token"])
    huge = [{"role": "user", "content": "x" * 2_000_000}]
    for stream in (False, True):
        with pytest.raises(openai.APIStatusError) as refused:
            answer = client.chat.completions.create(model="fake", messages=huge, max_tokens=16, stream=stream)
            if stream:
                list(answer)
        assert refused.value.status_code == 413
        error = refused.value.body
        assert isinstance(error, dict) and "max_payload" in error["message"]
    assert fake_vllm.started == 0  # refused before the engine, and not retried by the client
    long = client.chat.completions.create(
        model="fake", messages=[{"role": "user", "content": "write"}], max_tokens=30_000
    )
    assert long.usage is not None and long.usage.completion_tokens == 30_000
    calls = _calls(server.url, run_id)
    assert [c.get("status", "ok") for c in calls] == ["failed", "failed", "ok"]  # absent: the default
    for failed in calls[:2]:
        assert "max_payload" in failed["error"]
        if server.max_payload is None:  # the request copy does not fit in 1 MB: its size is kept instead
            assert failed["request"]["omitted"]["bytes"] > 2_000_000
        else:
            assert failed["request"]["messages"] == huge
    assert fake_vllm.started == 1
