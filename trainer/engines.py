"""The engines that serve the policy while it trains, behind one small interface.

    endpoints()        (OpenAI base URL, served model name) of every replica, for the gateway
    load(dir, v)       serve the weights saved in `dir` as version v on every replica
    close()

`VllmEngine`: `vllm serve` replicas, attached to (`[engine] urls`) or started (`[engine] replicas`),
reloaded through vLLM's routes (`services.common.vllm`): full weights by pause -> reload_weights ->
reset_prefix_cache -> update_weight_version -> resume, LoRA by loading each adapter in place. vLLM
stamps no version on its responses; the gateway's proxy records the version of the phase the call
ran under (calls are held while weights change).

The loop calls `load` inside the phase gate, so no call runs while any replica changes weights.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import secrets
import subprocess
from pathlib import Path
from typing import Protocol

from services.common.gateway_api import GatewayClient
from services.common.vllm import ReplicaError, VllmReplicas, VllmServeSettings, start_replicas
from services.common.vllm_install import ensure_vllm
from services.devstack.embedded import reap_group
from trainer.backends.base import ADAPTERS_DIR
from trainer.backends.lora import adapter_names
from trainer.clients import ServiceUrls
from trainer.run.sections import TrainConfig


class ServingEngine(Protocol):
    """What the loop needs of the serving side (see the module docstring)."""

    async def endpoints(self) -> list[tuple[str, str | None]]:
        """(OpenAI base URL, served model) per replica."""
        ...

    def agent_adapters(self) -> dict[str, str]:
        """Agent name -> the served LoRA adapter its calls go to (empty: every call to the endpoint's model)."""
        ...

    async def load(self, weights_dir: Path, version: int) -> None:
        """Serve saved weights as `version` on every replica."""
        ...

    async def close(self) -> None:
        """Release connections (and servers this engine started)."""
        ...


class VllmEngine:
    """vLLM replicas serving the policy, full weights or LoRA adapters."""

    def __init__(
        self,
        urls: list[str],
        served_name: str,
        *,
        adapters: list[str] | None = None,
        roles: dict[str, str] | None = None,
        processes: list[subprocess.Popen[bytes]] | None = None,
        api_key: str = "",
    ) -> None:
        self.replicas = VllmReplicas(urls, api_key=api_key)
        self.api_key = api_key
        self.served_name = served_name
        self.adapters = adapters or []
        self.roles = dict(roles or {})
        self.processes = processes or []
        self.loaded: set[str] = set()

    async def endpoints(self) -> list[tuple[str, str | None]]:
        """Each replica's `/v1`; with one LoRA adapter, calls go to the adapter's name."""
        served = self.adapters[0] if len(self.adapters) == 1 else self.served_name
        return [(f"{url}/v1", served) for url in self.replicas.urls]

    def agent_adapters(self) -> dict[str, str]:
        """With several adapters, each role's agent -> its adapter (`[backend] lora_adapters`)."""
        return (
            {role: name for role, name in self.roles.items() if name in self.adapters} if len(self.adapters) > 1 else {}
        )

    async def load(self, weights_dir: Path, version: int) -> None:
        """Full weights: the reload sequence on every replica; LoRA: every adapter, in place, on every replica."""
        if self.adapters:
            await self.replicas.load_adapters({name: weights_dir / ADAPTERS_DIR / name for name in self.adapters})
            self.loaded |= set(self.adapters)
        else:
            await self.replicas.reload(weights_dir, version)

    async def close(self) -> None:
        """Unload the adapters it loaded on replicas it attached to, close connections, stop what it started."""
        if self.loaded and not self.processes:
            with contextlib.suppress(ReplicaError):  # a replica already gone keeps nothing
                await self.replicas.unload_adapters(sorted(self.loaded))
        await self.replicas.close()
        for process in self.processes:
            process.terminate()
        for process in self.processes:
            reap_group(process, 30)


async def register_replicas(
    gateway: GatewayClient, engine: ServingEngine, run_id: str, served_name: str, **rendering: str | None
) -> None:
    """Register every replica with the gateway for the run: one model entry each, matched by the served name.

    The proxy picks, among the entries whose name or served model is what the agent asked for,
    one replica per rollout (a hash of its id), so a rollout keeps its replica's prefix cache.
    """
    endpoints = await engine.endpoints()
    adapters = engine.agent_adapters()
    if isinstance(engine, VllmEngine) and engine.api_key:
        rendering = {**rendering, "api_key": engine.api_key}  # the proxy sends it; agents never see it
    for index, (base_url, served) in enumerate(endpoints):
        await gateway.register_model(
            run_id,
            name=served_name if len(endpoints) == 1 else f"{served_name}-r{index}",
            base_url=base_url,
            served_model=served,
            weights_version=None,  # the proxy stamps each call with its phase's version (vLLM stamps none)
            adapters=adapters,
            # The engine's address is part of the key: a resumed run's engine may listen elsewhere,
            # and the same key would be taken for a repeat of the old registration.
            key=f"{run_id}-model-{served_name}-{index}-{hashlib.sha256(base_url.encode()).hexdigest()[:12]}",
            **rendering,
        )


async def connect_engine(config: TrainConfig, urls: ServiceUrls) -> ServingEngine:
    """The policy's vLLM replicas: attached to (`[engine] urls`, else the embedded stack's) or started."""
    lora = config.backend.lora_rank > 0
    attached = list(config.engine.urls) or list(urls.engine_urls)  # given, or the embedded stack's
    return await start_vllm(
        config,
        config.model.path,
        config.model.served_name,
        config.run_dir / "vllm",
        slot=0,
        urls=attached,
        adapters=adapter_names(config.backend) if lora else [],
        api_key=urls.engine_api_key,
        stack_served=not config.engine.urls and bool(urls.engine_urls),
    )


async def start_vllm(
    config: TrainConfig,
    model: str,
    served_name: str,
    log_dir: Path,
    *,
    slot: int,
    urls: list[str] | None = None,
    adapters: list[str] | None = None,
    api_key: str = "",
    stack_served: bool = False,
) -> VllmEngine:
    """vLLM replicas serving `model` as `served_name`: attached to `urls`, else started, and ready.

    The run's models each take a slot: slot k's `[engine] replicas` listen on the k-th block of
    ports from `[engine] port` and run on the k-th block of GPUs, so `[model]`, each `[[policies]]`
    and each `[[frozen]]` model get their own. Attached replicas take `api_key` (else
    `ROLLWIRE_ENGINE_KEY`); started ones get a key of their own. `stack_served`: the embedded
    stack's servers, which answer to their own name.
    """
    section = config.engine
    adapters = adapters or []
    processes: list[subprocess.Popen[bytes]] = []
    replica_urls = list(urls or [])
    api_key = api_key or os.environ.get("ROLLWIRE_ENGINE_KEY", "")
    if not replica_urls:
        api_key = secrets.token_urlsafe(32)
        settings = VllmServeSettings(
            executable=section.executable or str(await asyncio.to_thread(ensure_vllm)),
            port=section.port + slot * section.replicas,
            dtype=section.dtype,
            gpu_memory_utilization=section.gpu_memory_utilization,
            max_lora_rank=config.backend.lora_rank if adapters else 0,
            max_loras=max(len(adapters), 1),
            extra_args=list(section.extra_args),
            api_key=api_key,
        )
        started = start_replicas(
            settings, model, served_name, section.replicas, log_dir, slot=slot, gpus=list(section.gpus)
        )
        replica_urls = [url for url, _ in started]
        processes = [process for _, process in started]
    roles = config.backend.lora_adapters
    engine = VllmEngine(replica_urls, served_name, adapters=adapters, roles=roles, processes=processes, api_key=api_key)
    try:
        await engine.replicas.wait_ready(section.startup_timeout_s)
        if stack_served:
            engine.served_name = await engine.replicas.served_model()
    except BaseException:
        await engine.close()
        raise
    return engine
