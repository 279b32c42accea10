"""The training run's settings, read from TOML (`rollwire train CONFIG.toml`).

    [run]        name, out_dir, seed, steps, mode ("sync" | "async"), resume
    [data]       path (JSONL, one rollout input per line), tasks_per_step, rollouts_per_task, shuffle
    [agent]      command (argv), env, timeout_s, concurrency, max_attempts, ..., limits, budget,
                 model_aliases: every field of the run spec's `schemas.runs.AgentSpec`
    [model]      path (a saved transformers model directory), served_name, prompt_mode, reasoning_parser
    [backend]    kind ("cpu" | "verl"), threads, dtype, gradient_checkpointing, lora_rank, lora_alpha,
                 lora_target_modules, lora_adapters (agent role -> adapter name), pack_sequences,
                 logprob_chunk_tokens, gpus (the training ranks' GPUs), gpu_memory_gb
    [engine]     kind ("vllm" | "embedded"); vllm: executable, urls (attach) or replicas (start), port,
                 dtype, gpu_memory_utilization, extra_args
    [algorithm]  lr, weight_decay, grad_clip, updates_per_step, micro_batch_tokens, loss_temperature
    [algorithm.adapter]  the adapter's switches (`trainer.core.AdapterConfig`)
    [algorithm.loss]     clip_low, clip_high, ratio_cap, kl_coef (`trainer.loss.PolicyLossConfig`)
    [async]      min_groups, max_staleness, max_groups_in_flight
    [stack]      embedded or external: data_dir, gateway_url, nats_url, engine_url, admin_token
    [metrics]    loggers (csv, tensorboard, wandb, mlflow), prometheus_port, wandb_*, mlflow_*

A mistake is a `ConfigError` naming the key (`algorithm.adapter.norm`) and, for a choice, the
allowed values; unknown keys are errors too, so a typo never silently falls back to a default.
Relative paths are resolved against the config file's directory.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, get_args

import msgspec

from schemas.events import ReasoningParser
from schemas.runs import PROMPT_MODE, AgentSpec, PromptMode
from trainer.core import AdapterConfig, AdapterConfigError
from trainer.run_sections import FrozenSection, PolicySection, ValidationSection

Mode = Literal["sync", "async"]
BackendKind = Literal["cpu", "verl"]
AVAILABLE_BACKENDS: tuple[str, ...] = get_args(BackendKind)
Dtype = Literal["float32", "bfloat16"]


class ConfigError(ValueError):
    """A setting that cannot be used; the message names the key and what it may be."""


class RunSection(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """`[run]`: the run id (`name`), where its files go (`out_dir/name`), the seed and the step count.

    `resume` continues from the run directory's last checkpoint; `keep_weights` keeps that many
    newest weights versions on disk besides v0 and the checkpoint's (0 keeps all). `prepare` is a
    command `rollwire train` runs once before anything starts (convert a model, build the data),
    with `python` and `{config_dir}` read as in `[agent] command`; a non-zero exit stops the run.
    """

    name: str = "run"
    out_dir: str = "runs"
    seed: int = 0
    steps: int = 20
    mode: Mode = "sync"
    resume: bool = True
    keep_weights: int = 3
    prepare: list[str] = []


class DataSection(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """`[data]`: the task dataset and how many tasks (each run `rollouts_per_task` times) make a step."""

    path: str
    tasks_per_step: int = 8
    rollouts_per_task: int = 4
    shuffle: bool = True


class AgentSection(AgentSpec, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """`[agent]`: how the controller runs the harness once per rollout attempt, and what each attempt
    may spend: every field of the run spec's `schemas.runs.AgentSpec`, with its defaults (`budget`,
    `limits` and `model_aliases` included), and nothing else (the run spec takes them as they are).

    A leading `python` in `command` (and `evaluator_command`) stands for the Python running the
    trainer (its virtualenv). `{config_dir}` in `command`, `evaluator_command` and `env` values is
    the config file's directory, so a config can name the scripts next to it. `job_template` is a
    file (a Kubernetes Job template); the run spec carries its text. `evaluator_command` runs after
    the agent exited 0, in its workspace, with an evaluator token; with `reward_from = "evaluator"`
    only the evaluator's reward counts (the gateway refuses the agent's).
    """


class ModelSection(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """`[model]`: the starting weights (a saved transformers model directory) and the name agents use.

    `prompt_mode`: `exact` (the engine renders each call's messages) or `continuous` (the proxy
    renders prompts itself and keeps the ids the model sampled, so a linear rollout is one sample).
    In continuous mode the proxy reads the tokenizer and chat template from the embedded engine, or
    from `path` when the engine is vLLM; `reasoning_parser` says the model opens its answers with a
    `<think>` block (vLLM's parser names: `qwen3`, `deepseek_r1`).
    """

    path: str
    served_name: str = "policy"
    agents: list[str] = []
    prompt_mode: PromptMode = PROMPT_MODE
    reasoning_parser: ReasoningParser | None = None


class BackendSection(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """`[backend]`: where updates run and what is trained.

    `kind`: `cpu` (torch + transformers in this process) or `verl` (verl's FSDP2 engine; one
    process per GPU under torchrun, rank 0 runs the loop). `dtype` is the parameter dtype of the
    forward pass (`bfloat16` on GPUs; master weights and the optimizer stay float32 under verl).
    `lora_rank > 0` trains a LoRA adapter (peft) on `lora_target_modules` instead of every weight;
    the adapter is what is saved and served. `lora_adapters` maps an agent role to the adapter
    that trains its calls (several roles may share one; empty: one adapter, `default`, for all).
    `pack_sequences` puts a micro-batch's samples back to back in one row (positions restart per
    sample; flash-attn varlen where installed, else sdpa with a block-diagonal mask) instead of
    padded rows; `logprob_chunk_tokens` positions at a time go through the output projection
    (`trainer.logprobs`).
    """

    kind: BackendKind = "cpu"
    threads: int | None = None
    dtype: Dtype = "float32"
    gradient_checkpointing: bool = False
    lora_rank: int = 0
    lora_alpha: int = 16
    lora_target_modules: list[str] = msgspec.field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    lora_adapters: dict[str, str] = {}
    pack_sequences: bool = True
    logprob_chunk_tokens: int = 1024
    gpus: list[int] = []
    """GPU indices of the training ranks, one rank each (empty: a CPU run; the layout is not checked)."""
    gpu_memory_gb: float = 0.0
    """One GPU's memory: with `gpus`, the layout is checked against it (`trainer.layout`)."""


EngineKind = Literal["embedded", "vllm"]


class EngineSection(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """`[engine]`: what serves the policy. `vllm` (the default) attaches to running vLLM servers
    (`urls`; their key in $ROLLWIRE_ENGINE_KEY), to the embedded stack's (`stack.embedded`), or
    starts `replicas` of them from `executable` (vLLM's Python; "" = `rollwire vllm install`'s) on
    ports from `port`, one GPU each. `embedded` is Rollwire's own CPU engine. Every replica is
    registered with the gateway and reloaded inside the phase gate (`services.common.vllm`).
    """

    kind: EngineKind = "vllm"
    executable: str = ""
    urls: list[str] = []
    replicas: int = 1
    port: int = 8100
    dtype: str = "auto"
    """vLLM's `--dtype`; "auto": bfloat16 on a GPU, float32 (the trainer's) on vLLM's CPU build."""
    gpu_memory_utilization: float = 0.85
    extra_args: list[str] = []
    startup_timeout_s: float = 900.0
    gpus: list[int] = []
    """GPU indices the vLLM replicas use, split evenly over `replicas` (each one's tensor-parallel size)."""


class LossSection(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """`[algorithm.loss]`: the clipped policy loss (see `trainer.loss`)."""

    clip_low: float = 0.2
    clip_high: float = 0.28
    ratio_cap: float | None = 3.0
    kl_coef: float = 0.0


class AlgorithmSection(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """`[algorithm]`: optimizer and update settings, plus the adapter and loss subsections.

    `updates_per_step` optimizer steps are taken on each batch (the first is on-policy, later ones
    are clipped); `micro_batch_tokens` bounds one forward pass (gradients accumulate exactly);
    `loss_temperature` must match how the engine reports logprobs (raw, i.e. 1.0, for the
    embedded engine and vLLM's default).
    """

    lr: float = 1e-3
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    updates_per_step: int = 1
    micro_batch_tokens: int = 16384
    loss_temperature: float = 1.0
    adapter: dict[str, Any] = {}
    loss: LossSection = LossSection()


class AsyncSection(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """`[async]`: collocated async. Update once `min_groups` task groups have ended (default: all of a
    step's); keep at most `max_groups_in_flight` groups declared; drop calls more than
    `max_staleness` weights versions behind the weights being trained."""

    min_groups: int | None = None
    max_staleness: int = 1
    max_groups_in_flight: int | None = None


class StackSection(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """`[stack]`: start the embedded stack in `data_dir` (`embedded = true`) or use running services.

    For running services, unset URLs come from ROLLWIRE_GATEWAY_URL, NATS_URL, ROLLWIRE_ENGINE_URL
    and the token from ROLLWIRE_ADMIN_TOKEN.
    """

    embedded: bool = True
    data_dir: str = ".rollwire"
    gateway_url: str | None = None
    nats_url: str | None = None
    engine_url: str | None = None
    admin_token: str | None = None


Logger = Literal["csv", "tensorboard", "wandb", "mlflow"]
WandbMode = Literal["offline", "online", "disabled"]


class MetricsSection(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """`[metrics]`: where each step's row goes besides `metrics.csv` (always written), see `trainer.loggers`.

    `loggers` picks TensorBoard (`tb/`), Weights & Biases (`wandb_mode = "offline"` writes the run under
    the run dir, `wandb sync` uploads it later) and MLflow (`mlflow_tracking_uri`, default a file store
    in the run dir's `mlruns/`). `prometheus_port` serves the trainer's gauges at `/metrics` (0: any
    free port; unset: none).
    """

    loggers: list[Logger] = msgspec.field(default_factory=lambda: ["csv", "tensorboard"])
    prometheus_port: int | None = None
    prometheus_host: str = "127.0.0.1"
    wandb_project: str = "rollwire"
    wandb_entity: str | None = None
    wandb_mode: WandbMode = "offline"
    mlflow_tracking_uri: str | None = None
    mlflow_experiment: str = "rollwire"


class TrainConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A whole training run (see the module docstring for the sections)."""

    data: DataSection
    agent: AgentSection
    model: ModelSection
    run: RunSection = RunSection()
    backend: BackendSection = BackendSection()
    engine: EngineSection = EngineSection()
    algorithm: AlgorithmSection = AlgorithmSection()
    async_: AsyncSection = msgspec.field(default_factory=AsyncSection, name="async")
    policies: list[PolicySection] = []
    frozen: list[FrozenSection] = []
    validation: ValidationSection | None = None
    stack: StackSection = StackSection()
    metrics: MetricsSection = MetricsSection()

    @property
    def adapter(self) -> AdapterConfig:
        """The adapter's switches (validated when the config was loaded)."""
        return AdapterConfig.from_mapping(self.algorithm.adapter)

    @property
    def run_dir(self) -> Path:
        """Where this run's weights, checkpoints and metrics go."""
        return Path(self.run.out_dir) / self.run.name

    def min_groups(self) -> int:
        """Task groups that must have ended before an update (all of a step's by default)."""
        return self.async_.min_groups or self.data.tasks_per_step

    def max_groups_in_flight(self) -> int:
        """Task groups declared and not yet trained on, at most (async mode keeps this many running)."""
        return self.async_.max_groups_in_flight or self.data.tasks_per_step


def _choices(kind: Any) -> tuple[str, ...] | None:
    """The allowed strings of a Literal field type (or of a Literal inside an Optional)."""
    args = get_args(kind)
    if args and all(isinstance(a, str) for a in args):
        return args
    if len(args) == 1:  # list[Literal[...]]
        return _choices(args[0])
    return None


def _decode_error(exc: msgspec.ValidationError) -> ConfigError:
    """msgspec's `... - at $.algorithm.loss.clip_low` as `algorithm.loss.clip_low: ...`, naming allowed values."""
    text = str(exc)
    message, _, where = text.rpartition(" - at `$")
    if not message:
        message, where = text, ""
    section = where.rstrip("`").lstrip(".")
    unknown = re.fullmatch(r"Object contains unknown field `(.+)`", message)
    if unknown:
        keys = ", ".join(f.encode_name for f in msgspec.structs.fields(_struct_at(section)))
        where_text = f"[{section}]" if section else "the top level"
        kind = "key" if section else "section"
        key = _join(section, unknown.group(1))
        return ConfigError(f"{key}: unknown {kind} in {where_text}; the {kind}s are: {keys}")
    missing = re.fullmatch(r"Object missing required field `(.+)`", message)
    if missing:
        return ConfigError(f"{_join(section, missing.group(1))}: required but missing")
    allowed = _allowed_for(section)
    suffix = f"; choose one of: {', '.join(allowed)}" if allowed else ""
    return ConfigError(f"{section}: {message}{suffix}")


def _join(section: str, key: str) -> str:
    return f"{section}.{key}" if section else key


def _struct_at(section: str) -> Any:
    """The Struct type of a dotted section (`algorithm.loss`), or TrainConfig for the top level."""
    struct: Any = TrainConfig
    for part in filter(None, section.split(".")):
        struct = {f.encode_name: f.type for f in msgspec.structs.fields(struct)}[part]
    return struct


def _allowed_for(key: str) -> tuple[str, ...] | None:
    """The allowed values of a choice setting, looked up by its dotted key."""
    if key == "backend.kind":
        return AVAILABLE_BACKENDS
    section, _, name = re.sub(r"\[\d+\]$", "", key).rpartition(".")
    try:
        struct = _struct_at(section)
        fields = {f.encode_name: f.type for f in msgspec.structs.fields(struct)}
    except (KeyError, TypeError):
        return None
    return _choices(fields.get(name))


def _need(ok: bool, key: str, what: str) -> None:
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
    need(engine.kind == "vllm" or not engine.urls, "engine.urls", 'attaches to vLLM servers: set engine.kind = "vllm"')
    need(
        engine.kind == "vllm" or len(set(backend.lora_adapters.values())) <= 1,
        "backend.lora_adapters",
        'several adapters are served by vLLM only: set engine.kind = "vllm"',
    )


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


def _check(config: TrainConfig) -> None:
    """Range checks msgspec's types cannot express, each naming its key."""
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


def _resolve(base: Path, value: str) -> str:
    path = Path(os.path.expanduser(value))
    return str(path if path.is_absolute() else (base / path))


CONFIG_DIR = "{config_dir}"


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


def _command(argv: list[str], base_dir: Path | None) -> list[str]:
    """`python` as this interpreter and `{config_dir}` as the config's directory in one command."""
    where = str(base_dir.resolve()) if base_dir is not None else "."
    argv = [part.replace(CONFIG_DIR, where) for part in argv]
    return [sys.executable, *argv[1:]] if argv[0] == "python" else argv


def _agent_commands(agent: AgentSection, base_dir: Path | None) -> AgentSection:
    """`python` as this interpreter and `{config_dir}` as the config's directory in the agent's settings."""
    where = str(base_dir.resolve()) if base_dir is not None else "."

    def command(argv: list[str] | None) -> list[str] | None:
        return None if argv is None else _command(argv, base_dir)

    return msgspec.structs.replace(
        agent,
        command=command(agent.command) or [],
        evaluator_command=command(agent.evaluator_command),
        env={key: value.replace(CONFIG_DIR, where) for key, value in agent.env.items()},
    )


def config_from_mapping(mapping: Mapping[str, Any], base_dir: Path | None = None) -> TrainConfig:
    """A checked `TrainConfig` from plain data (a parsed TOML document); paths resolved against `base_dir`."""
    try:
        config = msgspec.convert(dict(mapping), TrainConfig, strict=True)
    except msgspec.ValidationError as exc:
        raise _decode_error(exc) from None
    _check(config)
    config = msgspec.structs.replace(config, agent=_agent_commands(config.agent, base_dir))
    if config.run.prepare:
        prepare = _command(config.run.prepare, base_dir)
        config = msgspec.structs.replace(config, run=msgspec.structs.replace(config.run, prepare=prepare))
    if base_dir is not None:
        config = msgspec.structs.replace(
            config,
            run=msgspec.structs.replace(config.run, out_dir=_resolve(base_dir, config.run.out_dir)),
            data=msgspec.structs.replace(config.data, path=_resolve(base_dir, config.data.path)),
            model=msgspec.structs.replace(config.model, path=_resolve(base_dir, config.model.path)),
            stack=msgspec.structs.replace(config.stack, data_dir=_resolve(base_dir, config.stack.data_dir)),
        )
        config = _resolve_models(config, base_dir)
    _check_layout(config)
    return config


def _check_layout(config: TrainConfig) -> None:
    """A declared GPU layout (`backend.gpus`) that cannot fit is refused, naming the numbers."""
    if not config.backend.gpus:
        return
    from trainer.layout import check_layout

    _, problems = check_layout(config)
    if problems:
        raise ConfigError("the GPU layout does not fit (`rollwire train --check` shows the arithmetic): "
                          + "; ".join(problems))  # fmt: skip


def _resolve_models(config: TrainConfig, base_dir: Path) -> TrainConfig:
    """The paths of `[[policies]]`, `[[frozen]]`, `[validation]` and the job template, against `base_dir`."""
    val = config.validation
    template = config.agent.job_template
    return msgspec.structs.replace(
        config,
        policies=[msgspec.structs.replace(p, path=_resolve(base_dir, p.path)) for p in config.policies],
        frozen=[msgspec.structs.replace(f, path=_resolve(base_dir, f.path) if f.path else None) for f in config.frozen],
        validation=msgspec.structs.replace(val, path=_resolve(base_dir, val.path)) if val else None,
        agent=msgspec.structs.replace(config.agent, job_template=_resolve(base_dir, template) if template else None),
    )


def load_config(path: Path) -> TrainConfig:
    """Read and check a TOML config file; `ConfigError` names the file and the bad key."""
    path = Path(path)
    try:
        document = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path} is not valid TOML: {exc}") from None
    try:
        return config_from_mapping(document, path.resolve().parent)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None


def config_to_mapping(config: TrainConfig) -> dict[str, Any]:
    """The config as plain data (what a checkpoint stores and a run records)."""
    return msgspec.to_builtins(config)
