"""The stack's engine: its vLLM replicas as child processes, the tiny default model, the tokenizer
the projector decodes its calls with, and its registration with the gateway as the default model.

`rollwire model register` uses `register_model` directly; `stack` the rest.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import httpx
import msgspec

from services.common.vllm import (
    ReplicaError,
    find_executable,
    on_this_machine,
    replica_devices,
    serve_command,
    tensor_parallel_size,
    visible_gpus,
)
from services.devstack import credentials
from services.devstack.embedded import free_port
from services.devstack.stack_config import DEFAULT_MODEL_NAME, ChildService, Endpoints, StackConfig, StackError


def register_model(
    gateway_url: str,
    admin_token: str,
    name: str,
    base_url: str,
    *,
    served_model: str | None = None,
    run_id: str | None = None,
    timeout_s: float = 30.0,
    api_key: str | None = None,
) -> None:
    """Register an OpenAI-compatible endpoint with the gateway (idempotent: same call, same result).

    Raises `StackError` with the gateway's answer when it refuses, or when it cannot be reached.
    """
    body = {"name": name, "base_url": base_url, "served_model": served_model or name}
    if run_id:
        body["run_id"] = run_id
    key_body = dict(body)
    if api_key:
        body["api_key"] = api_key
    key = "register-" + hashlib.sha256(json.dumps(key_body, sort_keys=True).encode()).hexdigest()[:32]
    try:
        response = httpx.post(
            f"{gateway_url.rstrip('/')}/api/models",
            json=body,
            headers={"Authorization": f"Bearer {admin_token}", "Idempotency-Key": key},
            timeout=timeout_s,
        )
    except httpx.HTTPError as exc:
        raise StackError(f"the gateway at {gateway_url} cannot be reached: {exc}") from None
    if response.status_code >= 300:
        raise StackError(f"registering {name} with the gateway failed ({response.status_code}): {response.text[:200]}")


class VllmReplicas(msgspec.Struct, frozen=True):
    """The stack's vLLM servers: one child each, on consecutive (or free) ports, all requiring `api_key`."""

    children: list[ChildService]
    ports: list[int]
    api_key: str


def vllm_replicas(config: StackConfig, data_dir: Path, say: Callable[[str], None]) -> VllmReplicas:
    """One vLLM server per replica, each on its own GPUs, each requiring the stack's engine key.

    vLLM is installed first when missing (`rollwire vllm install`); without a model the stack
    serves the tiny default model; without CUDA the weights stay float32 (the trainer's dtype,
    so recorded logprobs match its own) and the KV cache gets 1 GiB unless VLLM_CPU_KVCACHE_SPACE
    says otherwise. Ports: consecutive from `vllm.port`, or free ones when it is 0.
    """
    from services.common.vllm_install import VllmInstallError, ensure_vllm

    settings = config.vllm
    try:
        if not settings.executable:
            settings = msgspec.structs.replace(settings, executable=str(ensure_vllm(say)))
        executable = find_executable(settings.executable)
    except (ReplicaError, VllmInstallError) as exc:
        raise StackError(str(exc), 2) from None
    api_key, _ = credentials.read_or_create_secret(data_dir / "engine_key", "ROLLWIRE_ENGINE_KEY")
    settings, machine_env = on_this_machine(msgspec.structs.replace(settings, executable=executable, api_key=api_key))
    model = str(config.engine_model or tiny_model())
    count = config.vllm_replicas
    ports = [settings.port + i for i in range(count)] if settings.port else [free_port() for _ in range(count)]
    try:
        devices = replica_devices(count, tensor_parallel_size(settings.extra_args), visible_gpus())
    except ReplicaError as exc:
        raise StackError(str(exc), 2) from None
    children = []
    for index, port in enumerate(ports):
        argv, env = serve_command(settings, model, DEFAULT_MODEL_NAME, port)
        child = ChildService(
            f"vllm-{index}",
            [],
            command=argv,
            env={**machine_env, **env, "CUDA_VISIBLE_DEVICES": devices[index]},
            health_url=f"http://{settings.host}:{port}/health",
            endpoint=f"engine: http://{settings.host}:{port}/v1 (vLLM replica {index})",
            startup_s=900.0,
        )
        children.append(child)
    return VllmReplicas(children=children, ports=ports, api_key=api_key)


def register_replicas(endpoints: Endpoints) -> None:
    """Register every vLLM replica (with its key) as a default model; a rollout sticks to one replica."""
    assert endpoints.gateway_url is not None
    for index, url in enumerate(endpoints.engine_urls):
        register_model(
            endpoints.gateway_url,
            endpoints.admin_token,
            f"{DEFAULT_MODEL_NAME}-r{index}",
            url,
            served_model=DEFAULT_MODEL_NAME,
            api_key=endpoints.engine_api_key,
        )


def tiny_model() -> Path:
    """The tiny default model's directory (built on first use)."""
    from services.common.tinymodel.build import ensure_tiny_model  # torch: only when the stack builds it

    return ensure_tiny_model()


def tokenizer_args(config: StackConfig) -> list[str]:
    """The engine model's tokenizer, scoped to that model, so the projection (and the viewer) has call text.

    Scoped by the name vLLM serves it as (the registered name): calls of any other model are not
    decoded with it. A hub id (no local directory) gets none.
    """
    if "engine" not in config.services:
        return []
    model = config.engine_model if config.engine_model is not None else tiny_model()
    return ["--tokenizer", f"{DEFAULT_MODEL_NAME}={model}"] if Path(model).is_dir() else []
