"""Calls visible from their start: a gateway killed mid-stream leaves its call `aborted`, recorded by
another gateway within the reaper's interval, and the call's marker in `rollwire_inflight` erased."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import nats.js.errors
from fake_vllm import FakeVLLM
from gw_harness import ADMIN, SECRET, GatewayHandle, Served, gateway_settings

from services.common.eventstore import EventStore
from services.devstack.embedded import NatsServer, free_port
from services.gateway import create_app
from services.gateway.proxy.reaper import CALLS

INTERVAL_S = 0.5


def _events(url: str, subject: str) -> list[dict[str, Any]]:
    async def read() -> list[dict[str, Any]]:
        store = await EventStore.connect(url, ensure=False)
        try:
            return [json.loads(m.data) async for b in store.read_raw(subject) for m in b]
        finally:
            await store.close()

    return asyncio.run(read())


def _markers(url: str) -> dict[str, dict[str, Any]]:
    """The in-flight call markers in `rollwire_inflight` (keys `<gateway>.<call id>`), by call id."""

    async def read() -> dict[str, dict[str, Any]]:
        store = await EventStore.connect(url, ensure=False)
        try:
            bucket = await store.js.key_value(CALLS)
            try:
                keys = await bucket.keys()
            except nats.js.errors.NoKeysError:
                return {}
            return {key.split(".", 1)[1]: json.loads((await bucket.get(key)).value or b"{}") for key in keys}
        finally:
            await store.close()

    return asyncio.run(read())


def _messages(url: str) -> int:
    """How many messages the markers' bucket holds: live markers, and the delete markers of the calls that
    ended in the last second."""

    async def read() -> int:
        store = await EventStore.connect(url, ensure=False)
        try:
            return (await store.js.stream_info(f"KV_{CALLS}")).state.messages
        finally:
            await store.close()

    return asyncio.run(read())


def _start_gateway(nats_url: str, port: int, tmp: Path) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "NATS_URL": nats_url,
        "ROLLWIRE_ADMIN_TOKEN": ADMIN,
        "ROLLWIRE_SECRET": SECRET,
        "ROLLWIRE_GATEWAY_PORT": str(port),
        "ROLLWIRE_REAPER_INTERVAL_S": str(INTERVAL_S),
    }
    log = open(tmp / "gateway.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "services.gateway"], env=env, stdout=log, stderr=log)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    raise AssertionError((tmp / "gateway.log").read_text())


def test_kill_9_mid_stream_leaves_the_call_aborted(fake_vllm: FakeVLLM, run_id: str, tmp_path: Path) -> None:
    nats = NatsServer(tmp_path / "nats").start()
    settings = gateway_settings(nats.url, reaper_interval_s=INTERVAL_S)
    port = free_port()
    while port == settings.port:  # neither is bound yet: the two gateways must not be handed one port
        port = free_port()
    victim = _start_gateway(nats.url, port, tmp_path)
    try:
        with Served(create_app(settings), settings.port) as served:
            survivor = GatewayHandle(served, settings)
            rollout, attempt = survivor.running(run_id, fake_vllm.url)
            plain = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
            done = httpx.post(f"{attempt['proxy_base_url']}/chat/completions", json=plain,
                              headers={"authorization": f"Bearer {attempt['token']}"}, timeout=30)  # fmt: skip
            assert done.status_code == 200
            deadline = time.monotonic() + 5
            while _markers(nats.url) and time.monotonic() < deadline:  # a finished call erases its marker
                time.sleep(0.05)
            assert _markers(nats.url) == {}
            while _messages(nats.url) and time.monotonic() < deadline + 3:  # its delete marker expires ...
                time.sleep(0.1)
            assert _messages(nats.url) == 0  # ... and leaves nothing behind in the bucket
            fake_vllm.token_delay_s = 0.2
            base = attempt["proxy_base_url"].replace(survivor.url, f"http://127.0.0.1:{port}")
            body = {"model": "fake", "messages": [{"role": "user", "content": "go"}], "max_tokens": 100, "stream": True}
            headers = {"authorization": f"Bearer {attempt['token']}"}
            with httpx.stream("POST", f"{base}/chat/completions", json=body, headers=headers, timeout=30) as answer:
                assert answer.status_code == 200
                chunks = answer.iter_bytes()  # held open: a dropped iterator closes the stream (a client disconnect)
                next(chunks)  # the stream has begun: the engine is generating
                assert victim.poll() is None, "the victim gateway is not running"
                victim.send_signal(signal.SIGKILL)
                victim.wait(10)
                killed = time.monotonic()
            subject = f"rl.{run_id}.rollout.{rollout['rollout_id']}"
            markers = _markers(nats.url)
            assert len(markers) == 1
            ((call_id, marker),) = markers.items()
            assert marker["rollout_id"] == rollout["rollout_id"]
            assert marker["gateway"] != served.app.state.gateway.reaper.instance  # the victim served it
            aborted: list[dict[str, Any]] = []
            while not aborted and time.monotonic() - killed < 8 * INTERVAL_S + 5:
                time.sleep(0.1)
                aborted = [c for c in _events(nats.url, f"{subject}.model_request") if c.get("status", "ok") != "ok"]
            waited = time.monotonic() - killed
            survivor.admin.close()
        assert [c["call_id"] for c in aborted] == [call_id]
        assert aborted[0]["status"] == "aborted" and "stopped before recording" in aborted[0]["error"]
        assert aborted[0]["attempt_id"] == attempt["attempt_id"]
        assert waited < 8 * INTERVAL_S + 5
        assert _markers(nats.url) == {}  # the reaper erased the marker of the call it ended
        assert not [e for e in _events(nats.url, f"{subject}.>") if e["type"] == "custom"]  # markers are not events
    finally:
        if victim.poll() is None:
            victim.kill()
        nats.stop()
