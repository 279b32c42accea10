"""The validation reward of re-trained weights: fresh `val` rollouts through the normal stack.

When a validation set is named, a re-train serves its weights on the stack's engine and runs the
set's tasks as `val` rollouts of a run of its own (`<run>-rt<digest of the scheme>`), through the
gateway and the controller with the run's own agent command, exactly as a live run's validation
pass does (`trainer.validation.ValidationPass`, the trainer's `_serve` sequence: load the
weights on every replica, register them for the run, open its phase with the version). The mean
reward is the step's `val/reward`. The stack's URLs come from the run's `[stack]` section when
it names running services, else from ROLLWIRE_GATEWAY_URL, ROLLWIRE_ENGINE_URL and
ROLLWIRE_ADMIN_TOKEN (what `rollwire up` prints), and the NATS URL the command was given.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from pathlib import Path
from typing import Any

import msgspec

from services.common.eventstore import EventStore
from services.common.gateway_api import GatewayClient
from services.tools.source import ReplayError
from trainer.clients import ServiceUrls, gateway_client
from trainer.engines import ServingEngine, connect_engine, register_replicas
from trainer.rollouts import StatusWatch
from trainer.run.models import trained_adapter, trained_models
from trainer.run.sections import TrainConfig, ValidationSection
from trainer.run.spec import run_spec
from trainer.validation import ValidationPass


def stack_urls(config: TrainConfig, nats_url: str, given: dict[str, str | None] | None = None) -> ServiceUrls:
    """The running stack's URLs: `given`, else the run's `[stack]` section, else the environment.

    The stack's vLLM replicas (`engine_urls`, comma-separated, and their `engine_api_key`; else
    `ROLLWIRE_ENGINE_URLS` and `ROLLWIRE_ENGINE_KEY`) serve the re-trained weights; without them the
    run's `[engine]` section decides (its `urls`, or servers of the validation's own).
    """
    stack = config.stack
    given = given or {}
    values = {
        "gateway_url": given.get("gateway_url") or stack.gateway_url or os.environ.get("ROLLWIRE_GATEWAY_URL"),
        "nats_url": nats_url,
        "engine_url": given.get("engine_url") or stack.engine_url or os.environ.get("ROLLWIRE_ENGINE_URL"),
        "admin_token": given.get("admin_token") or stack.admin_token or os.environ.get("ROLLWIRE_ADMIN_TOKEN"),
    }
    missing = [k for k, v in values.items() if not v]
    if missing:
        names = {
            "gateway_url": "ROLLWIRE_GATEWAY_URL",
            "engine_url": "ROLLWIRE_ENGINE_URL",
            "admin_token": "ROLLWIRE_ADMIN_TOKEN",
        }
        raise ReplayError(
            f"validation needs a running stack (`rollwire up`): set {', '.join(names.get(k, k) for k in missing)}"
        )
    found = {k: str(v) for k, v in values.items()}
    return ServiceUrls(
        gateway_url=found["gateway_url"],
        nats_url=found["nats_url"],
        engine_url=found["engine_url"],
        admin_token=found["admin_token"],
        engine_urls=tuple(
            u for u in (given.get("engine_urls") or os.environ.get("ROLLWIRE_ENGINE_URLS", "")).split(",") if u
        ),
        engine_api_key=given.get("engine_api_key") or os.environ.get("ROLLWIRE_ENGINE_KEY", ""),
    )


def validation_run_id(run_id: str, scheme: str) -> str:
    """The run the validation rollouts of a re-train belong to (an id: no `.`, `*` or `>`)."""
    return f"{run_id}-rt{hashlib.sha256(scheme.encode()).hexdigest()[:10]}"


class RetrainValidation:
    """Serves re-trained weights and runs the validation pass on them (see the module docstring)."""

    def __init__(self, config: TrainConfig, urls: ServiceUrls, run_id: str, section: ValidationSection) -> None:
        self.config = config
        self.urls = urls
        self.run_id = run_id
        self.section = section
        self.adapter = trained_adapter(config.adapter, trained_models(config))
        self.store: EventStore | None = None
        self.gateway: GatewayClient | None = None
        self.engine: ServingEngine | None = None
        self.watch: StatusWatch | None = None

    async def start(self) -> RetrainValidation:
        """Connect to the stack and declare the validation run."""
        self.store = await EventStore.connect(self.urls.nats_url)
        self.gateway = gateway_client(self.urls)
        self.engine = await connect_engine(self.config, self.urls)
        spec: dict[str, Any] = msgspec.to_builtins(run_spec(self.config, self.run_id))
        await self.gateway.start_run(spec)
        self.watch = StatusWatch(self.store, self.run_id)
        await self.watch.start(await self.store.last_sequence())
        return self

    async def validate(self, step: int, weights: Path, version: int) -> dict[str, Any]:
        """Serve `weights` as `version` for the validation run and return the pass's `val/reward` row."""
        assert self.gateway is not None and self.engine is not None and self.store is not None
        assert self.watch is not None
        await self.engine.load(await asyncio.to_thread(weights.resolve), version)
        model = self.config.model
        await register_replicas(
            self.gateway, self.engine, self.run_id, model.served_name, reasoning_parser=model.reasoning_parser
        )
        await self.gateway.set_phase(self.run_id, "rollout", version, key=None)
        passed = ValidationPass(self.section, self.run_id, self.adapter)
        return await passed.run(step, self.gateway, self.watch, self.store)

    async def close(self) -> None:
        """Stop watching and close every connection."""
        if self.watch is not None:
            await self.watch.stop()
        if self.gateway is not None:
            await self.gateway.close()
        if self.engine is not None:
            await self.engine.close()
        if self.store is not None:
            await self.store.close()


def validation_section(config: TrainConfig, path: Path, every: int | None) -> ValidationSection:
    """The pass's settings: the named task file, with the run's `[validation]` counts when it had one."""
    base = config.validation or ValidationSection(path=str(path))
    if not Path(path).is_file():
        raise ReplayError(f"validation set {path} does not exist; name a JSONL file of tasks")
    return msgspec.structs.replace(base, path=str(path), every=every or base.every)
