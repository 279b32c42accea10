"""How a run's rollouts execute: the run spec the gateway records in `RunStarted.spec`.

A run declares its executor once (`POST /api/runs` or the trainer's config); one controller serves
many runs by reading these specs from the stream.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from schemas.bounds import Count, Positive, check_int
from schemas.ids import Id, check_id

Backend = Literal["local", "kubernetes"]
RewardFrom = Literal["agent", "evaluator"]
PromptMode = Literal["exact", "continuous"]
DEFAULT_BYTES = 32 * 1024 * 1024
"""An attempt's byte budget when its run sets none: room for many logs, not for filling the store."""


class CallLimits(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What one model call through the proxy may ask for; a call over a limit is refused with a 400.

    Each choice of a call is recorded with the call's whole request, so `n` multiplies what a call
    writes; `max_tokens` bounds what one answer may cost (a larger request is lowered to it, not
    refused); tools and messages bound the request.
    """

    max_n: Positive = 8
    max_tokens: Positive = 131_072
    max_tools: Count = 128
    max_messages: Positive = 2_048


class AttemptBudget(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What one attempt may spend through the proxy (None: no limit).

    `calls`: model calls; `tokens`: prompt + response tokens of its calls (those the client
    abandoned included); `bytes`: the size of its failed and aborted call records and of the custom
    events its agent and evaluator post (32 MiB unless set; null for none); `wall_s`: seconds since
    the attempt started, on the event stream's clock. A call or event over budget is refused and
    recorded as a `budget_exceeded` custom event of the attempt.
    """

    calls: Positive | None = None
    tokens: Positive | None = None
    bytes: Positive | None = DEFAULT_BYTES
    wall_s: Annotated[float, msgspec.Meta(gt=0)] | None = None


PROMPT_MODE: PromptMode = "exact"
"""A run's prompt mode when it sets none (the trainer's `[model].prompt_mode` takes the same default)."""


class AgentSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How a run's rollouts execute and what each may spend: the part of a run spec a trainer's
    `[agent]` section sets (`trainer.run.sections.AgentSection` is this struct, so a field added here can
    be set in `train.toml` and reaches the run with no other edit).

    `command` is the agent command for the local backend (argv list, run in a fresh working
    directory per attempt); `job_template` is a Kubernetes Job template (YAML text with
    placeholders) for the kubernetes backend. `evaluator_command`, when set, runs after the agent
    exits, in the same workspace, with an evaluator token; `reward_from` says whose rewards count.
    `limits` bounds each model call and `budget` each attempt (enforced by the proxy).
    `model_aliases` maps model names a harness sends (Claude Code's `claude-sonnet-4-5`) to a
    model registered for the run; a name neither registered nor aliased goes to any of the run's.
    """

    backend: Backend = "local"
    command: list[str] = []
    job_template: str | None = None
    image: str | None = None
    concurrency: Positive = 8
    timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 600.0
    max_attempts: Positive = 1
    retry_backoff_s: float = 1.0
    evaluator_command: list[str] | None = None
    reward_from: RewardFrom = "agent"
    env: dict[str, str] = {}
    limits: CallLimits = msgspec.field(default_factory=CallLimits)
    budget: AttemptBudget = msgspec.field(default_factory=AttemptBudget)
    model_aliases: dict[str, str] = {}

    def __post_init__(self) -> None:
        check_int("concurrency", self.concurrency, 1, optional=False)
        check_int("max_attempts", self.max_attempts, 1, optional=False)
        if not self.timeout_s > 0:
            raise msgspec.ValidationError("timeout_s must be positive - at `$.timeout_s`")
        if self.reward_from == "evaluator" and not self.evaluator_command and self.backend == "local":
            raise msgspec.ValidationError(
                "reward_from is 'evaluator' but no evaluator_command is set - at `$.evaluator_command`"
            )


class RunSpec(AgentSpec, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Executor settings of one run: how its rollouts execute (`AgentSpec`), what it trains and routes.

    `prompt_mode`: `exact` forwards each call's messages and the engine renders the prompt;
    `continuous` has the proxy render prompts itself, reusing an earlier call's prompt + sampled
    ids verbatim where the conversation continues it (token in, token out: one sample per chain).
    """

    run_id: Id
    name: str = ""
    train_agents: list[Id] = []
    """Agent names whose calls the run trains ([]: every agent)."""
    train_models: list[Id] = []
    """Registered model names the run trains ([]: not declared; the trainer's config decides)."""
    agent_models: dict[Id, Id] = {}
    """Routing: agent name -> the registered model its calls go to, whatever the request's `model` says."""
    prompt_mode: PromptMode = PROMPT_MODE

    def __post_init__(self) -> None:
        check_id("run_id", self.run_id)
        super().__post_init__()
        for i, name in enumerate([*self.train_agents, *self.train_models]):
            check_id(f"train_agents/train_models[{i}]", name)
        for agent, model in self.agent_models.items():
            check_id("agent_models key", agent)
            check_id(f"agent_models[{agent}]", model)
