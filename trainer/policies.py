"""What a run trains, and the per-model figures of a step: kept out of the loop so the loop stays small.

A run trains one or more models (`[model]` and each `[[policies]]` of the config), each reached
by the agents the config routes to it, and serves `[[frozen]]` models for context only. The
adapter trains exactly the calls to the trained models (by registered name), and of those, the
calls of the selected agents; every other call is context. With several trained models, each
model's calls make its own samples (`RolloutCalls.for_model`): same rollout reward, its own
advantages normalization and loss weights, its own optimizer step and weights versions.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec

from schemas.runs import RunSpec
from trainer.config import ConfigError, TrainConfig
from trainer.core import AdapterConfig, RolloutCalls, StepBatch, rollout_reward

Row = dict[str, Any]


def trained_models(config: TrainConfig) -> list[str]:
    """The registered names of the models the run trains: `[model]`, then each `[[policies]]`."""
    return [config.model.served_name, *(p.name for p in config.policies)]


def agent_routes(config: TrainConfig) -> dict[str, str]:
    """Agent name -> the registered model its calls go to, from every model's `agents`."""
    routes = {agent: config.model.served_name for agent in config.model.agents}
    for policy in config.policies:
        routes |= {agent: policy.name for agent in policy.agents}
    for frozen in config.frozen:
        routes |= {agent: frozen.name for agent in frozen.agents}
    return routes


def run_spec(config: TrainConfig, run_id: str) -> RunSpec:
    """The run spec the trainer declares: how agents execute, and what the run trains and routes where."""
    agent = config.agent
    template = None
    if agent.job_template:
        try:
            template = Path(agent.job_template).read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"agent.job_template: cannot read {agent.job_template}: {exc.strerror}") from None
    adapter = config.adapter
    return RunSpec(
        **{**msgspec.structs.asdict(agent), "job_template": template},
        run_id=run_id,
        name=run_id,
        train_agents=list(adapter.agents),
        train_models=list(adapter.models) or trained_models(config),
        agent_models=agent_routes(config),
        prompt_mode=config.model.prompt_mode,
    )


def trained_adapter(adapter: AdapterConfig, trained_models: Sequence[str]) -> AdapterConfig:
    """The adapter config with `models` set to the run's trained models when the config left it empty."""
    if adapter.models:
        return adapter
    return AdapterConfig.from_mapping({**msgspec.structs.asdict(adapter), "models": tuple(trained_models)})


def failure_row(
    rollouts: Sequence[RolloutCalls], skipped: Sequence[str], batch: StepBatch, adapter: AdapterConfig
) -> Row:
    """The failure policy's figures of a step, and the reward mean counting scored failures."""
    rewards = [r for r in (rollout_reward(x, adapter) for x in rollouts) if r is not None]
    stats = batch.stats
    return {
        "reward_mean": statistics.fmean(rewards) if rewards else None,
        "reward_std": statistics.pstdev(rewards) if len(rewards) > 1 else (0.0 if rewards else None),
        "rollouts_failed_scored": stats.rollouts_failed_scored,
        "rollouts_failed_dropped": stats.rollouts_failed_dropped,
        "rollouts_infra_dropped": sum(1 for reason in skipped if reason == "infrastructure"),
        "groups_skipped": stats.groups_skipped,
        "calls_context": stats.calls_context,
        "calls_deduped": stats.calls_deduped,
    }
