"""`python -m services.gateway` as `rollwire up` runs it: quiet, healthy, and clean on SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx

from services.devstack.embedded import free_port


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLWIRE_")}
    return {**env, "ROLLWIRE_ADMIN_TOKEN": "main-admin", "ROLLWIRE_SECRET": "main-secret", **extra}


def test_serves_and_exits_cleanly_on_sigterm(nats_url: str) -> None:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.gateway", "--port", str(port), "--nats-url", nats_url],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=_env(),
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, proc.communicate()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the gateway did not become healthy"
            time.sleep(0.1)
        admin = {"authorization": "Bearer main-admin"}
        assert httpx.get(f"http://127.0.0.1:{port}/api/rollouts?limit=1", headers=admin).status_code == 200
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert out == b"" and b"Traceback" not in err, err


def test_unreachable_nats_exits_2_with_a_reason() -> None:
    port = free_port()
    proc = subprocess.run(
        [sys.executable, "-m", "services.gateway", "--port", str(port)],
        capture_output=True,
        env=_env(NATS_URL=f"nats://127.0.0.1:{free_port()}"),
        timeout=30,
    )
    assert proc.returncode == 2
    assert b"no NATS server answers" in proc.stderr and b"Traceback" not in proc.stderr


def test_generated_tokens_are_announced(nats_url: str) -> None:
    from services.gateway.settings import settings_from_env

    settings = settings_from_env({"NATS_URL": nats_url}, announce=False)
    assert settings.admin_token and settings.secret and settings.port == 8080
