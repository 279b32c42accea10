"""Run an example's `train.toml` for one step on the shared stack, and read back what the run recorded."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from schemas import CustomEvent, ModelRequestRecorded, RewardReported
from services.common.eventstore import EventStore
from trainer.clients import ServiceUrls
from trainer.loop import Trainer
from trainer.run.load import load_config
from trainer.run.sections import TrainConfig

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@dataclass
class RunRecord:
    """One run's step rows and its events, sorted by kind."""

    rows: list[dict[str, Any]]
    calls: list[ModelRequestRecorded]
    rewards: list[RewardReported]
    custom: list[CustomEvent]

    def rewards_by_rollout(self) -> dict[str, float]:
        """The last reward of each rollout."""
        return {str(r.rollout_id): r.value for r in self.rewards}

    def payloads(self, name: str) -> dict[str, dict[str, Any]]:
        """The last custom event `name` of each rollout, by rollout id."""
        return {str(e.rollout_id): e.payload for e in self.custom if e.name == name}


def example_config(name: str, tmp: Path, data: Path, model: Path, **sections: dict[str, Any]) -> TrainConfig:
    """The example's own `train.toml`, pointed at test data, a tiny model and one small step."""
    config = load_config(EXAMPLES / name / "train.toml")

    def replace(section: str, **changes: Any) -> None:
        nonlocal config
        struct = getattr(config, section)
        config = msgspec.structs.replace(config, **{section: msgspec.structs.replace(struct, **changes)})

    replace("run", name=f"test-{name}", out_dir=str(tmp / "runs"), steps=1, resume=False)
    replace("data", path=str(data), tasks_per_step=2, rollouts_per_task=2)
    replace("model", path=str(model))
    for section, changes in sections.items():
        replace(section, **changes)
    return config


async def _events(nats_url: str, run_id: str) -> RunRecord:
    store = await EventStore.connect(nats_url)
    try:
        events = [stored.event async for stored in store.read_run(run_id)]
    finally:
        await store.close()
    return RunRecord(
        rows=[],
        calls=[e for e in events if isinstance(e, ModelRequestRecorded)],
        rewards=[e for e in events if isinstance(e, RewardReported)],
        custom=[e for e in events if isinstance(e, CustomEvent)],
    )


def run_one_step(config: TrainConfig, urls: ServiceUrls) -> RunRecord:
    """Train `config` for its steps through the real services; return the rows and the run's events."""
    rows = asyncio.run(Trainer(config, urls, say=lambda line: None).run())
    record = asyncio.run(_events(urls.nats_url, config.run.name))
    record.rows = rows
    return record
