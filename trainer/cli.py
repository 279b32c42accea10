"""The trainer's commands: `rollwire train CONFIG.toml` and `rollwire quickstart`.

`register(app)` adds them to the `rollwire` typer app. Heavy imports (torch, transformers) happen
inside the commands, so the rest of the CLI stays fast. A mistake a user can make (a config key,
the dataset, a service that refuses) prints one `error: ...` line and exits 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
from pathlib import Path

import typer

from trainer.clients import ServiceUrls
from trainer.quickstart.options import QuickstartOptions
from trainer.run.sections import ConfigError, StackSection, TrainConfig

DEFAULTS = QuickstartOptions()
"""`rollwire quickstart`'s defaults, as the run defines them."""


def _fail(message: str, code: int = 1) -> typer.Exit:
    print(f"error: {message}", file=sys.stderr)
    return typer.Exit(code)


def _quiet_transformers() -> None:
    """No per-load/save tqdm bars from transformers: each step saves and reloads weights."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def train(
    config: Path = typer.Argument(..., help="The run's TOML config (see examples/quickstart/train.toml)."),
    steps: int | None = typer.Option(None, help="Override run.steps."),
    check: bool = typer.Option(False, "--check", help="Print the GPU layout's memory arithmetic and exit."),
) -> None:
    """Train a model with RL through its agent harness, as CONFIG.toml describes."""
    import msgspec

    from services.common.gateway_api import GatewayError
    from services.common.vllm import ReplicaError
    from services.common.vllm_install import VllmInstallError
    from services.devstack.stack import StackError
    from trainer.checkpoint import CheckpointError
    from trainer.dataset import DatasetError
    from trainer.display import StepDisplay
    from trainer.loop import Trainer, TrainingError
    from trainer.run.load import load_config

    if check:
        _check_only(config)
        return
    _quiet_transformers()
    try:
        loaded = load_config(config)
        if steps is not None:
            loaded = msgspec.structs.replace(loaded, run=msgspec.structs.replace(loaded.run, steps=steps))
    except ConfigError as exc:
        raise _fail(str(exc), 2) from None
    if loaded.backend.gpus and "CUDA_VISIBLE_DEVICES" not in os.environ:  # local rank i trains on gpus[i]
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in loaded.backend.gpus)
    if follows_rank0():
        _follow(loaded)
        return
    if loaded.run.prepare:
        prepared = subprocess.run(loaded.run.prepare, check=False, cwd=config.resolve().parent)
        if prepared.returncode != 0:
            raise _fail(f"run.prepare {loaded.run.prepare} exited with {prepared.returncode}")
    try:
        with contextlib.ExitStack() as stack:
            urls = _stack_urls(stack, loaded)
            with StepDisplay(loaded.run.steps) as display:
                rows = asyncio.run(Trainer(loaded, urls, on_step=display.step).run())
        print(f"{len(rows)} steps done; metrics in {loaded.run_dir / 'metrics.csv'}")
    except (
        StackError,
        GatewayError,
        DatasetError,
        TrainingError,
        CheckpointError,
        ConfigError,
        ReplicaError,
        VllmInstallError,
    ) as exc:
        raise _fail(str(exc)) from None


def _check_only(config: Path) -> None:
    """`rollwire train --check`: the layout's arithmetic, then exit 0 (fits) or 2 (does not, or a bad config)."""
    import tomllib

    import msgspec

    from trainer.layout import check_layout
    from trainer.run.load import config_from_mapping

    try:
        document = tomllib.loads(config.read_text(encoding="utf-8"))
        backend = dict(document.get("backend", {}))
        gpus = backend.pop("gpus", [])  # checked below, with the arithmetic, rather than refused while loading
        loaded = config_from_mapping({**document, "backend": backend}, config.resolve().parent)
        loaded = msgspec.structs.replace(loaded, backend=msgspec.structs.replace(loaded.backend, gpus=gpus))
    except (OSError, tomllib.TOMLDecodeError, ConfigError) as exc:
        raise _fail(f"{config}: {exc}", 2) from None
    lines, problems = check_layout(loaded)
    for line in lines:
        print(line)
    for problem in problems:
        print(f"does not fit: {problem}")
    if problems:
        raise typer.Exit(2)
    print("the layout fits")


def follows_rank0() -> bool:
    """Whether this process is a torchrun rank other than 0: it trains, rank 0 runs the loop."""
    return int(os.environ.get("RANK", "0")) != 0


def _follow(config: TrainConfig) -> None:
    """A rank other than 0: build the backend and do rank 0's calls until it closes."""
    from trainer.backends.factory import build_backend

    backend = build_backend(config)
    backend.follow()


def _stack_urls(stack: contextlib.ExitStack, loaded: TrainConfig) -> ServiceUrls:
    """The services of the run: the embedded stack, started inside `stack` (its vLLM with LoRA when
    the run trains adapters), or the running stack `[stack]` names."""
    from trainer.backends.lora import adapter_names
    from trainer.embedded import embedded_stack

    if not loaded.stack.embedded:
        return _external_urls(loaded.stack)
    return stack.enter_context(
        embedded_stack(
            Path(loaded.stack.data_dir),
            Path(loaded.model.path),
            say=print,
            engine=loaded.engine,
            lora_rank=loaded.backend.lora_rank,
            max_loras=max(len(adapter_names(loaded.backend)), 1),
        )
    )


def _external_urls(stack: StackSection) -> ServiceUrls:
    """Service URLs of a running stack, from the config or the environment (named when missing)."""
    values = {
        "gateway_url": stack.gateway_url or os.environ.get("ROLLWIRE_GATEWAY_URL"),
        "nats_url": stack.nats_url or os.environ.get("NATS_URL"),
        "engine_url": stack.engine_url or os.environ.get("ROLLWIRE_ENGINE_URL"),
        "admin_token": stack.admin_token or os.environ.get("ROLLWIRE_ADMIN_TOKEN"),
    }
    missing = [k for k, v in values.items() if not v]
    if missing:
        raise ConfigError(
            f"stack.embedded is false but {', '.join('stack.' + k for k in missing)} "
            "is not set (nor its environment variable)"
        )
    return ServiceUrls(
        gateway_url=str(values["gateway_url"]),
        nats_url=str(values["nats_url"]),
        engine_url=str(values["engine_url"]),
        admin_token=str(values["admin_token"]),
    )


def quickstart(
    steps: int = typer.Option(DEFAULTS.steps, help="Training steps."),
    seed: int = typer.Option(DEFAULTS.seed, help="Seed of the warm start, the tasks and the sampling."),
    data_dir: Path = typer.Option(DEFAULTS.data_dir, help="Where the embedded stack keeps its data and logs."),
    out: Path = typer.Option(DEFAULTS.out, help="Where the run directory (weights, metrics, curve) goes."),
    mode: str = typer.Option(DEFAULTS.mode, help="sync or async (collocated)."),
    tasks_per_step: int = typer.Option(DEFAULTS.tasks_per_step, help="Tasks per step."),
    rollouts_per_task: int = typer.Option(DEFAULTS.rollouts_per_task, help="Rollouts of each task (one group)."),
    lr: float = typer.Option(DEFAULTS.lr, help="Learning rate."),
    heldout_tasks: int = typer.Option(
        DEFAULTS.heldout_tasks,
        help="Held-out tasks run twice before step 1 and after the last (the before/after); 0: none.",
    ),
    backend: str = typer.Option("cpu", help="Training backend: cpu or verl (needs rollwire[verl])."),
    prompt_mode: str = typer.Option(
        "exact", help="exact (the engine renders prompts) or continuous (the proxy keeps the sampled ids)."
    ),
) -> None:
    """Run RL on a tiny model on this CPU, end to end: stack, agents, updates, a reward curve."""
    from services.common.gateway_api import GatewayError
    from services.devstack.stack import StackError
    from trainer.loop import TrainingError
    from trainer.quickstart.run import run_quickstart

    if mode not in ("sync", "async"):
        raise _fail(f"--mode {mode!r} is not allowed; choose one of: sync, async", 2)
    if prompt_mode not in ("exact", "continuous"):
        raise _fail(f"--prompt-mode {prompt_mode!r} is not allowed; choose one of: exact, continuous", 2)
    if not lr > 0 or heldout_tasks < 0:
        raise _fail("--lr must be above 0 and --heldout-tasks 0 or more", 2)
    _quiet_transformers()
    options = QuickstartOptions(
        steps=steps,
        seed=seed,
        data_dir=data_dir,
        out=out,
        mode=mode,
        tasks_per_step=tasks_per_step,
        rollouts_per_task=rollouts_per_task,
        lr=lr,
        heldout_tasks=heldout_tasks,
        extra={"backend": {"kind": backend}, "model": {"prompt_mode": prompt_mode}},
    )
    try:
        run_quickstart(options, say=lambda line: print(line, flush=True))
    except (StackError, GatewayError, TrainingError, ConfigError) as exc:
        raise _fail(str(exc)) from None


def register(app: typer.Typer) -> None:
    """Add `train` and `quickstart` to the `rollwire` app."""
    app.command()(train)
    app.command()(quickstart)
