"""How a run's rollouts execute: the run spec the gateway records in `RunStarted.config`.

A run declares its executor once (`POST /api/runs` or the trainer's config); one controller serves
many runs by reading these specs from the stream.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from schemas.ids import check_id

Backend = Literal["local", "kubernetes"]
RewardFrom = Literal["agent", "evaluator"]


class RunSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Executor settings of one run.

    `command` is the agent command for the local backend (argv list, run in a fresh working
    directory per attempt); `job_template` is a Kubernetes Job template (YAML text with
    placeholders) for the kubernetes backend. `evaluator_command`, when set, runs after the agent
    exits, in the same workspace, with an evaluator token; `reward_from` says whose rewards count.
    """

    run_id: str
    name: str = ""
    backend: Backend = "local"
    command: list[str] = []
    job_template: str | None = None
    image: str | None = None
    concurrency: int = 8
    timeout_s: float = 600.0
    max_attempts: int = 1
    retry_backoff_s: float = 1.0
    evaluator_command: list[str] | None = None
    reward_from: RewardFrom = "agent"
    env: dict[str, str] = {}
    train_agents: list[str] = []
    """Agent names whose calls the run trains ([]: every agent)."""
    train_models: list[str] = []
    """Registered model names the run trains ([]: not declared; the trainer's config decides)."""
    agent_models: dict[str, str] = {}
    """Routing: agent name -> the registered model its calls go to, whatever the request's `model` says."""

    def __post_init__(self) -> None:
        check_id("run_id", self.run_id)
        if self.concurrency < 1:
            raise msgspec.ValidationError("concurrency must be at least 1 - at `$.concurrency`")
        if self.max_attempts < 1:
            raise msgspec.ValidationError("max_attempts must be at least 1 - at `$.max_attempts`")
        if self.timeout_s <= 0:
            raise msgspec.ValidationError("timeout_s must be positive - at `$.timeout_s`")
        for i, name in enumerate([*self.train_agents, *self.train_models]):
            check_id(f"train_agents/train_models[{i}]", name)
        for agent, model in self.agent_models.items():
            check_id("agent_models key", agent)
            check_id(f"agent_models[{agent}]", model)
        if self.reward_from == "evaluator" and not self.evaluator_command and self.backend == "local":
            raise msgspec.ValidationError(
                "reward_from is 'evaluator' but no evaluator_command is set - at `$.evaluator_command`"
            )
