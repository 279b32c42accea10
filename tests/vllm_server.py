"""A real vLLM server for the test session: the tiny model, served by vLLM's CPU build (or CUDA build).

`vllm_server` starts one `python -m vllm.entrypoints.openai.api_server` from the environment of
`rollwire vllm install`, the way the stack does (`services.common.vllm.serve_command`: processed
logprobs, the development routes, an API key on every route), on a free port, and shares it
across the session: starting vLLM takes minutes on a small CPU, a request milliseconds. A test
that changes the served weights puts the originals back before it ends (`restore_weights`).

Without vLLM installed the tests that need it skip, saying how to install it; with
ROLLWIRE_REQUIRE_VLLM=1 (CI sets it) they fail instead.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from services.common.vllm import CPU_WORKAROUND_ARGS, VllmServeSettings, serve_command
from services.common.vllm_install import vllm_home, vllm_python
from services.devstack.embedded import free_port

SERVED_NAME = "tiny"
STARTUP_S = 900.0


@dataclass(frozen=True)
class VllmServer:
    """A running vLLM server: its root URL (OpenAI routes under /v1), key, model directory and name."""

    url: str
    api_key: str
    model_dir: Path
    served_name: str
    log: Path

    @property
    def headers(self) -> dict[str, str]:
        """The headers every call to this server needs."""
        return {"authorization": f"Bearer {self.api_key}"}


def _unavailable(reason: str) -> None:
    if os.environ.get("ROLLWIRE_REQUIRE_VLLM") == "1":
        pytest.fail(f"{reason} (ROLLWIRE_REQUIRE_VLLM=1)")
    pytest.skip(reason)


def start_vllm(model_dir: Path, log: Path, api_key: str) -> tuple[subprocess.Popen[bytes], str]:
    """Start vLLM serving `model_dir` as the stack does on CPU (float32, 1 GiB KV cache, whole-prompt prefill)."""
    port = free_port()
    settings = VllmServeSettings(
        executable=str(vllm_python()), dtype="float32", api_key=api_key, extra_args=list(CPU_WORKAROUND_ARGS)
    )
    argv, extra = serve_command(settings, str(model_dir), SERVED_NAME, port)
    env = {**os.environ, **extra, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    with log.open("ab") as out:
        process = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    return process, f"http://127.0.0.1:{port}"


def wait_healthy(process: subprocess.Popen[bytes], url: str, log: Path, timeout_s: float = STARTUP_S) -> None:
    """Wait for `GET /health` to answer 200; fail with the log's tail if vLLM exits or never gets there."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            tail = log.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"vLLM exited with {process.returncode}:\n{tail}")
        try:
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"vLLM did not become healthy within {timeout_s:.0f}s; see {log}")


def stop(process: subprocess.Popen[bytes]) -> None:
    """Terminate vLLM (its whole process group: the engine core is a child) and wait for it."""
    try:
        os.killpg(process.pid, 15)
        process.wait(30)
    except ProcessLookupError:
        return
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, 9)
        process.wait(10)


@pytest.fixture(scope="session")
def vllm_server() -> Iterator[VllmServer]:
    """One real vLLM server serving the tiny model for the whole session (see the module docstring)."""
    from services.common.tinymodel.build import build_tiny_model

    if not vllm_python().exists():
        _unavailable(f"vLLM is not installed in {vllm_home()}: run `rollwire vllm install`")
    with tempfile.TemporaryDirectory(prefix="rollwire-vllm-") as tmp:
        model_dir = build_tiny_model(Path(tmp) / "tiny", seed=0)
        log = Path(tmp) / "vllm.log"
        api_key = "test-engine-key"
        process, url = start_vllm(model_dir, log, api_key)
        try:
            wait_healthy(process, url, log)
            yield VllmServer(url=url, api_key=api_key, model_dir=model_dir, served_name=SERVED_NAME, log=log)
        finally:
            stop(process)
