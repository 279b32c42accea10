"""The sections of `train.toml`, one msgspec struct each, and `TrainConfig`, the whole file.

    [run]        name, out_dir, seed, steps, mode ("sync" | "async"), resume
    [data]       path (JSONL, one rollout input per line), tasks_per_step, rollouts_per_task, shuffle
    [agent]      command (argv), env, timeout_s, concurrency, max_attempts, ..., limits, budget,
                 model_aliases: every field of the run spec's `schemas.runs.AgentSpec`
    [model]      path (a saved transformers model directory), served_name, agents, prompt_mode,
                 reasoning_parser: the first trained policy
    [[policies]] name, path, agents: one more trained policy each (its own weights, engine, optimizer)
    [[frozen]]   name, path or base_url, served_model, agents: a model served for context only
    [validation] path, every, rollouts_per_task, max_tasks, at_start
    [backend]    kind ("cpu" | "verl"), threads, dtype, gradient_checkpointing, lora_rank, lora_alpha,
                 lora_target_modules, lora_adapters (agent role -> adapter name), pack_sequences,
                 logprob_chunk_tokens, gpus (the training ranks' GPUs), gpu_memory_gb
    [engine]     kind ("vllm", the only one), executable, urls (attach) or replicas (start), port,
                 dtype, gpu_memory_utilization, extra_args
    [algorithm]  lr, weight_decay, grad_clip, updates_per_step, micro_batch_tokens, loss_temperature
    [algorithm.adapter]  the adapter's switches (`trainer.core.AdapterConfig`)
    [algorithm.loss]     clip_low, clip_high, ratio_cap, kl_coef (`trainer.loss.PolicyLossConfig`)
    [async]      min_groups, max_staleness, max_groups_in_flight
    [stack]      embedded or external: data_dir, gateway_url, nats_url, engine_url, admin_token
    [metrics]    loggers (csv, tensorboard, wandb, mlflow), prometheus_port, wandb_*, mlflow_*

`agents` routes agent names to a model (an agent no entry names goes to `[model]`). Reading and
checking a file is `trainer.run.load`; the range checks are `trainer.run.checks`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, get_args

import msgspec

from schemas.events import ReasoningParser
from schemas.runs import PROMPT_MODE, AgentSpec, PromptMode
from trainer.core import AdapterConfig

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
    `plot` names more metric columns (an agent's own metric, say) that `reward_curve.png` draws beside
    the training and held-out reward.
    """

    name: str = "run"
    out_dir: str = "runs"
    seed: int = 0
    steps: int = 20
    mode: Mode = "sync"
    resume: bool = True
    keep_weights: int = 3
    prepare: list[str] = []
    plot: list[str] = []


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
    In continuous mode the proxy reads the tokenizer and chat template from `path` (vLLM serves
    none); `reasoning_parser` says the model opens its answers with a
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


EngineKind = Literal["vllm"]


class EngineSection(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """`[engine]`: what serves the policy: vLLM (`kind = "vllm"`, the only kind). It attaches to
    running vLLM servers (`urls`; their key in $ROLLWIRE_ENGINE_KEY), to the embedded stack's
    (`stack.embedded`), or starts `replicas` of them from `executable` (vLLM's Python; "" =
    `rollwire vllm install`'s) on ports from `port`, one GPU each. Every replica is registered with
    the gateway and reloaded inside the phase gate (`services.common.vllm`).
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
    `loss_temperature` must match how the engine reports logprobs (raw, i.e. 1.0, for vLLM's
    default).
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


class PolicySection(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """`[[policies]]`: one more trained model: its registered `name`, starting weights and agents."""

    name: str
    path: str
    agents: list[str] = []


class FrozenSection(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """`[[frozen]]`: a model served for context only: weights at `path` (served by vLLM) or a
    running OpenAI-compatible endpoint at `base_url` (`served_model` names its model there)."""

    name: str
    path: str | None = None
    base_url: str | None = None
    served_model: str | None = None
    agents: list[str] = []


class ValidationSection(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """`[validation]`: every `every` steps, each task of `path` runs `rollouts_per_task` times in `val`
    mode through the same harness; never trained on, its mean reward is `val/reward`. With `at_start`,
    the pass also runs on the starting weights before step 1 (row `step = 0`): the before of before/after."""

    path: str
    every: int = 5
    rollouts_per_task: int = 1
    max_tasks: int | None = None
    at_start: bool = False


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
