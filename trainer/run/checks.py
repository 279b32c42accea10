"""The checks of a `TrainConfig` that msgspec's types cannot express, each naming its key.

`check_settings` runs on the config as written (ranges, choices that depend on each other, the
models' names and agents); `check_gpu_layout` runs once paths are resolved (it reads the model's
`config.json`, `trainer.layout`).
"""

from __future__ import annotations

import importlib.util
import re

from trainer.core import AdapterConfig, AdapterConfigError
from trainer.layout import check_layout
from trainer.run.sections import ConfigError, TrainConfig


def _need(ok: bool, key: str, what: str) -> None:
    """`ConfigError` naming `key` unless `ok`."""
    if not ok:
        raise ConfigError(f"{key}: {what}")


def _check_backend_and_engine(config: TrainConfig) -> None:
    """`[backend]` and `[engine]` checks, each naming its key."""
    need = _need
    backend = config.backend
    need(
        backend.kind != "verl" or importlib.util.find_spec("verl") is not None,
        "backend.kind",
        "'verl' needs verl installed beside Rollwire: pip install 'rollwire[verl]'",
    )
    need(backend.threads is None or backend.threads >= 1, "backend.threads", "must be at least 1")
    need(all(g >= 0 for g in backend.gpus), "backend.gpus", "must be GPU indices (>= 0)")
    need(not backend.gpus or len(set(backend.gpus)) == len(backend.gpus), "backend.gpus", "must not repeat a GPU")
    need(backend.logprob_chunk_tokens >= 1, "backend.logprob_chunk_tokens", "must be at least 1")
    need(backend.lora_rank >= 0, "backend.lora_rank", "must be >= 0 (0 trains every weight)")
    need(backend.lora_alpha > 0, "backend.lora_alpha", "must be positive")
    need(bool(backend.lora_target_modules), "backend.lora_target_modules", "must name at least one module")
    need(
        not backend.lora_adapters or backend.lora_rank > 0,
        "backend.lora_adapters",
        "needs backend.lora_rank > 0 (adapters per role are LoRA adapters)",
    )
    for role, name in backend.lora_adapters.items():
        need(
            bool(re.fullmatch(r"[A-Za-z0-9_-]{1,64}", name)),
            f"backend.lora_adapters.{role}",
            "must be an adapter name of letters, digits, '_' or '-'",
        )
    engine = config.engine
    need(engine.replicas >= 1, "engine.replicas", "must be at least 1")
    need(0.0 < engine.gpu_memory_utilization <= 1.0, "engine.gpu_memory_utilization", "must be in (0, 1]")


def _check_run_and_agent(config: TrainConfig) -> None:
    """`[run]`, `[data]` and `[agent]` checks, each naming its key."""
    need = _need
    need(config.run.steps >= 1, "run.steps", "must be at least 1")
    need(config.run.keep_weights >= 0, "run.keep_weights", "must be >= 0 (0 keeps every version)")
    need(bool(config.run.name) and "/" not in config.run.name, "run.name", "must be a non-empty id without '/'")
    need(config.data.tasks_per_step >= 1, "data.tasks_per_step", "must be at least 1")
    need(config.data.rollouts_per_task >= 1, "data.rollouts_per_task", "must be at least 1")
    agent = config.agent
    k8s = agent.backend == "kubernetes"
    need(bool(agent.command) or k8s, "agent.command", "must name the program to run, as a list of strings")
    need(not k8s or bool(agent.job_template), "agent.job_template", 'is required with agent.backend = "kubernetes"')
    need(agent.retry_backoff_s >= 0, "agent.retry_backoff_s", "must be >= 0")
    _check_models(config)
    need(
        config.agent.evaluator_command is None or bool(config.agent.evaluator_command),
        "agent.evaluator_command",
        "must name the program to run, as a list of strings, or be left out",
    )


def _check_models(config: TrainConfig) -> None:
    """Model names unique, agents routed to at most one model, frozen models served one way, validation in range."""
    names = [config.model.served_name, *(p.name for p in config.policies), *(f.name for f in config.frozen)]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ConfigError(f"policies/frozen: model name {dupes[0]!r} is used twice; each model needs its own name")
    groups = [config.model.agents, *(p.agents for p in config.policies), *(f.agents for f in config.frozen)]
    routed = [agent for group in groups for agent in group]
    twice = sorted({a for a in routed if routed.count(a) > 1})
    if twice:
        raise ConfigError(f"agents: agent {twice[0]!r} is routed to two models; give each agent one model")
    for i, frozen in enumerate(config.frozen):
        if (frozen.path is None) == (frozen.base_url is None):
            raise ConfigError(f"frozen[{i}]: give exactly one of path (weights to serve) or base_url (an endpoint)")
    val = config.validation
    if val is not None and (val.every < 1 or val.rollouts_per_task < 1):
        raise ConfigError("validation.every and validation.rollouts_per_task: must be at least 1")


def check_settings(config: TrainConfig) -> None:
    """Range checks msgspec's types cannot express, each naming its key (`ConfigError`)."""
    need = _need
    _check_run_and_agent(config)
    _check_backend_and_engine(config)
    algo = config.algorithm
    need(algo.lr > 0, "algorithm.lr", "must be positive")
    need(algo.weight_decay >= 0, "algorithm.weight_decay", "must be >= 0")
    need(algo.grad_clip > 0, "algorithm.grad_clip", "must be positive")
    need(algo.updates_per_step >= 1, "algorithm.updates_per_step", "must be at least 1")
    need(algo.micro_batch_tokens >= 1, "algorithm.micro_batch_tokens", "must be at least 1")
    need(algo.loss_temperature > 0, "algorithm.loss_temperature", "must be positive")
    loss = algo.loss
    need(0.0 <= loss.clip_low < 1.0, "algorithm.loss.clip_low", "must be in [0, 1)")
    need(loss.clip_high >= 0.0, "algorithm.loss.clip_high", "must be >= 0")
    need(loss.ratio_cap is None or loss.ratio_cap > 1.0, "algorithm.loss.ratio_cap", "must be > 1, or left out (off)")
    need(loss.kl_coef >= 0.0, "algorithm.loss.kl_coef", "must be >= 0")
    try:
        AdapterConfig.from_mapping(algo.adapter)
    except AdapterConfigError as exc:
        raise ConfigError(f"algorithm.adapter: {exc}") from None
    groups = config.data.tasks_per_step
    need(
        config.async_.min_groups is None or 1 <= config.async_.min_groups <= config.max_groups_in_flight(),
        "async.min_groups",
        "must be between 1 and async.max_groups_in_flight",
    )
    need(config.async_.max_staleness >= 0, "async.max_staleness", "must be >= 0")
    port = config.metrics.prometheus_port
    need(port is None or 0 <= port <= 65535, "metrics.prometheus_port", "must be a port number (0: any free port)")
    need(
        config.async_.max_groups_in_flight is None or config.async_.max_groups_in_flight >= groups,
        "async.max_groups_in_flight",
        f"must be at least data.tasks_per_step ({groups})",
    )


def check_gpu_layout(config: TrainConfig) -> None:
    """A declared GPU layout (`backend.gpus`) that cannot fit is refused, naming the numbers."""
    if not config.backend.gpus:
        return
    _, problems = check_layout(config)
    if problems:
        arithmetic = "`rollwire train --check` shows the arithmetic"
        raise ConfigError(f"the GPU layout does not fit ({arithmetic}): " + "; ".join(problems))
