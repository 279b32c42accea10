"""The adapter's switches: every choice between recorded calls and loss weights, in one Struct.

The live trainer and the replay tool build steps from the same `AdapterConfig`, so a past run can
be recomputed under another merge, advantage or normalization scheme and compared.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, get_args

import msgspec

from trainer.core.advantages import Estimator
from trainer.core.calls import Selection
from trainer.core.merge import MergeMode
from trainer.core.weights import Norm

AdvantageLevel = Literal["rollout", "sample"]


class AdapterConfigError(ValueError):
    """An adapter setting with a value it cannot take; the message names the key and the allowed values."""


def _check_choice(key: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise AdapterConfigError(f"{key} = {value!r} is not allowed; choose one of: {', '.join(allowed)}")


class AdapterConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How calls become weighted samples (see `trainer.core` for each step).

    - merge: `exact` (calls whose prompt extends a sample are appended to it) or `per-call`;
    - advantage_level: group statistics over `rollout`s (default) or over `sample`s (comparison);
    - estimator: `grpo` (group-mean baseline) or `rloo` (leave-one-out mean);
    - scale_std / std_eps: divide advantages by the group's std plus `std_eps`;
    - norm: `rollout-mean` (default), `token-mean` or `seq-mean-token-mean`;
    - max_length: longest sample in tokens (a longer call is dropped, never truncated); None = no limit;
    - missing_reward: `drop` a rollout that reported no reward, or a number to use as its reward;
    - agents / models: the selection, agent names and registered model names whose calls are trained
      (empty: every agent / every model); the other calls are context (`trainer.core.calls`);
    - failed_reward: the reward of a rollout the policy made fail (timeout, agent error, runaway
      length), kept in its group; `drop` drops it (`trainer.core.failures`).
    """

    merge: MergeMode = "exact"
    advantage_level: AdvantageLevel = "rollout"
    estimator: Estimator = "grpo"
    scale_std: bool = False
    std_eps: float = 1e-6
    norm: Norm = "rollout-mean"
    max_length: int | None = None
    missing_reward: float | Literal["drop"] = "drop"
    agents: tuple[str, ...] = ()
    models: tuple[str, ...] = ()
    failed_reward: float | Literal["drop"] = 0.0

    def __post_init__(self) -> None:
        _check_choice("merge", self.merge, get_args(MergeMode))
        _check_choice("advantage_level", self.advantage_level, get_args(AdvantageLevel))
        _check_choice("estimator", self.estimator, get_args(Estimator))
        _check_choice("norm", self.norm, get_args(Norm))
        if not isinstance(self.scale_std, bool):
            raise AdapterConfigError(f"scale_std = {self.scale_std!r} is not allowed; choose true or false")
        if isinstance(self.std_eps, bool) or not isinstance(self.std_eps, int | float) or self.std_eps < 0:
            raise AdapterConfigError(f"std_eps = {self.std_eps!r} is not allowed; give a number >= 0")
        if self.max_length is not None and (
            isinstance(self.max_length, bool) or not isinstance(self.max_length, int) or self.max_length < 1
        ):
            raise AdapterConfigError(
                f"max_length = {self.max_length!r} is not allowed; give a positive token count or null"
            )
        if self.missing_reward != "drop" and (
            isinstance(self.missing_reward, bool) or not isinstance(self.missing_reward, int | float)
        ):
            raise AdapterConfigError(
                f"missing_reward = {self.missing_reward!r} is not allowed; choose 'drop' or a number (the fill reward)"
            )

        for key, names in (("agents", self.agents), ("models", self.models)):
            if not isinstance(names, tuple | list) or not all(isinstance(n, str) and n for n in names):
                raise AdapterConfigError(f"{key} = {names!r} is not allowed; give a list of names ([] = all)")
        if self.failed_reward != "drop" and (
            isinstance(self.failed_reward, bool) or not isinstance(self.failed_reward, int | float)
        ):
            raise AdapterConfigError(
                f"failed_reward = {self.failed_reward!r} is not allowed; choose 'drop' or a number (default 0)"
            )

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, Any]) -> AdapterConfig:
        """Build a config from plain data (a YAML/JSON section, CLI options), naming any bad key."""
        known = set(cls.__struct_fields__)
        unknown = sorted(set(mapping) - known)
        if unknown:
            raise AdapterConfigError(
                f"unknown adapter setting(s) {', '.join(unknown)}; the settings are: {', '.join(cls.__struct_fields__)}"
            )
        values = dict(mapping)
        for key in ("agents", "models"):
            if isinstance(values.get(key), list):
                values[key] = tuple(values[key])
        # Direct construction runs `__post_init__`, whose messages list the allowed values.
        return cls(**values)

    def selection(self) -> Selection:
        """Which calls this config trains (`agents`, `models`)."""
        return Selection(agents=tuple(self.agents), models=tuple(self.models))

    def for_models(self, models: tuple[str, ...]) -> AdapterConfig:
        """This config training only calls to `models`."""
        return AdapterConfig.from_mapping({**msgspec.structs.asdict(self), "models": models})

    def failure_reward(self) -> float | None:
        """The reward of a rollout the policy made fail, or None when such rollouts are dropped."""
        return None if self.failed_reward == "drop" else float(self.failed_reward)

    def fill_reward(self) -> float | None:
        """The reward given to a rollout that reported none, or None when such rollouts are dropped."""
        return None if self.missing_reward == "drop" else float(self.missing_reward)
