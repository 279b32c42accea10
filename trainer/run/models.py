"""The models a run trains and serves, and which agent's calls go to which.

A run trains one or more models (`[model]` and each `[[policies]]` of the config), each reached
by the agents the config routes to it, and serves `[[frozen]]` models for context only. The
adapter trains exactly the calls to the trained models (by registered name), and of those, the
calls of the selected agents; every other call is context. With several trained models, each
model's calls make its own samples (`RolloutCalls.for_model`): same rollout reward, its own
advantages normalization and loss weights, its own optimizer step and weights versions
(`trainer.run.other_models`).
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from trainer.core import AdapterConfig
from trainer.run.sections import TrainConfig


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


def trained_adapter(adapter: AdapterConfig, trained_models: Sequence[str]) -> AdapterConfig:
    """The adapter config with `models` set to the run's trained models when the config left it empty."""
    if adapter.models:
        return adapter
    return AdapterConfig.from_mapping({**msgspec.structs.asdict(adapter), "models": tuple(trained_models)})
