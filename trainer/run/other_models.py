"""The run's models besides `[model]`: each `[[policies]]` entry trained beside it, each `[[frozen]]` one served.

A run may train several models (say two agent roles on two models). `[model]` is trained by the
loop as always; every `[[policies]]` entry gets here its own backend (optimizer, weights), its own
vLLM replicas (in their own slot of ports and GPUs, see `trainer.engines.start_vllm`), its own
weights versions under `<run>/policies/<name>/weights/vN`, and its own samples: the step's rollouts
cut to its calls (`RolloutCalls.for_model`), the same rollout rewards, its own advantages and loss
weights. It updates inside the same phase gate as `[model]`, so no call of the run runs while any
model changes weights. `[[frozen]]` models are served (vLLM replicas on `path`, or a running
`base_url`) and registered, never trained. The proxy routes each agent to its model through the run spec.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from pathlib import Path
from typing import Any

import msgspec

from services.common.gateway_api import GatewayClient
from trainer.backends.base import TrainingBackend, UpdateMetrics
from trainer.backends.factory import build_backend
from trainer.core import AdapterConfig, RolloutCalls, StepBatch, build_step
from trainer.engines import VllmEngine, register_replicas, start_vllm
from trainer.run.sections import PolicySection, TrainConfig

Row = dict[str, Any]


class TrainedPolicy:
    """One `[[policies]]` model: backend, engine, versions (see the module docstring)."""

    def __init__(self, config: TrainConfig, policy: PolicySection, root: Path, slot: int = 1) -> None:
        self.name = policy.name
        self.root = root / "policies" / policy.name
        model = msgspec.structs.replace(config.model, path=policy.path, served_name=policy.name, agents=policy.agents)
        self.config = msgspec.structs.replace(config, model=model, policies=[], frozen=[])
        self.slot = slot
        self.backend: TrainingBackend | None = None
        self.vllm: VllmEngine | None = None
        self.version = 0

    def weights(self, version: int) -> Path:
        """The weights directory of one of its versions."""
        return self.root / "weights" / f"v{version}"

    def prepare(self) -> None:
        """Load its weights (its last saved version when the run resumes) and save v0 if new."""
        self.backend = build_backend(self.config)
        marker = self.root / "version.json"
        if marker.is_file():
            self.version = int(json.loads(marker.read_text())["version"])
            self.backend.load_weights(self.weights(self.version))
        else:
            self.backend.save_weights(self.weights(0))

    async def serve(self, gateway: GatewayClient, run_id: str) -> None:
        """Start its vLLM replicas on its current weights and register them for the run under its name."""
        current = self.weights(self.version).resolve()
        self.vllm = await start_vllm(self.config, str(current), self.name, self.root / "vllm", slot=self.slot)
        await register_replicas(gateway, self.vllm, run_id, self.name)

    async def update(self, batch: StepBatch) -> UpdateMetrics | None:
        """Train on its samples; save and serve a new version when the weights changed."""
        assert self.backend is not None and self.vllm is not None
        if not batch.samples:
            return None
        update = await asyncio.to_thread(self.backend.update, batch.samples)
        if update.optimizer_steps:
            self.version += 1
            path = await asyncio.to_thread(self.backend.save_weights, self.weights(self.version))
            await self.vllm.load(path.resolve(), self.version)
            (self.root / "version.json").write_text(json.dumps({"version": self.version}))
        return update

    async def close(self) -> None:
        """Stop its vLLM replicas and release its backend."""
        if self.vllm is not None:
            await self.vllm.close()
        if self.backend is not None:
            await asyncio.to_thread(self.backend.close)


class OtherModels:
    """Every `[[policies]]` and `[[frozen]]` model of a run; empty (and free) for a one-model run."""

    def __init__(self, config: TrainConfig, root: Path, adapter: AdapterConfig) -> None:
        self.config = config
        self.adapter = adapter
        self.policies = [TrainedPolicy(config, p, root, slot=1 + i) for i, p in enumerate(config.policies)]
        self.frozen_vllm: list[VllmEngine] = []
        self.root = root
        self.batches: dict[str, StepBatch] = {}

    def prepare(self) -> None:
        """Load every extra policy's weights (blocking: run it in a thread)."""
        for policy in self.policies:
            policy.prepare()

    async def serve(self, gateway: GatewayClient, run_id: str) -> None:
        """Serve and register every extra policy and every frozen model."""
        for policy in self.policies:
            await policy.serve(gateway, run_id)
        for index, frozen in enumerate(self.config.frozen):
            if frozen.path is None:
                base_url, served = str(frozen.base_url), frozen.served_model or frozen.name
            else:
                slot, log_dir = 1 + len(self.policies) + index, self.root / "frozen" / frozen.name
                engine = await start_vllm(self.config, frozen.path, frozen.name, log_dir, slot=slot)
                self.frozen_vllm.append(engine)
                await register_replicas(gateway, engine, run_id, frozen.name)
                continue
            key = f"{run_id}-frozen-{frozen.name}-{hashlib.sha256(base_url.encode()).hexdigest()[:12]}"
            await gateway.register_model(
                run_id, name=frozen.name, base_url=base_url, served_model=served, weights_version=None, key=key
            )

    def cut(self, rollouts: list[RolloutCalls]) -> None:
        """Build each extra policy's step from its own calls (kept for `update`)."""
        self.batches = {}
        for policy in self.policies:
            config = AdapterConfig.from_mapping({**msgspec.structs.asdict(self.adapter), "models": (policy.name,)})
            self.batches[policy.name] = build_step([r.for_model(policy.name) for r in rollouts], config)

    async def update(self) -> Row:
        """Inside the phase gate: update every extra policy; its figures as `{name}/...` columns."""
        row: Row = {}
        for policy in self.policies:
            batch = self.batches.get(policy.name)
            if batch is None:
                continue
            update = await policy.update(batch)
            stats = batch.stats
            row |= {
                f"{policy.name}/samples": stats.samples,
                f"{policy.name}/merge_ratio": stats.merge_ratio,
                f"{policy.name}/samples_per_rollout": stats.samples_per_rollout_mean,
                f"{policy.name}/weights_version": policy.version,
            }
            if update is not None:
                row |= {
                    f"{policy.name}/loss": update.loss,
                    f"{policy.name}/entropy": update.entropy,
                    f"{policy.name}/grad_norm": update.grad_norm,
                }
        return row

    async def close(self) -> None:
        """Stop every engine this started and release the backends."""
        for policy in self.policies:
            await policy.close()
        for engine in self.frozen_vllm:
            await engine.close()
