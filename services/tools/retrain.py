"""`rollwire retrain`: a past run's recorded steps trained again, under other schemes, with no new generation.

    store = await EventStore.connect(url)
    results = await retrain_run(store, "r42", ["rloo", "grpo+norm=token-mean"], RetrainOptions(steps=10))

For each scheme, one after another:

1. the run's files: its directory (`config.json`, `weights/vN`, `checkpoints/`, `metrics.csv`),
   found from `--run-dir` or `runs/<run>`;
2. a backend built by the trainer's own factory (`trainer.backends.base.build_backend`: every backend
   the trainer has) from the run's config, with the scheme's loss settings, loaded with the
   weights the run trained step N with (`--from-step N`; the base model from the first step on)
   and, when the run kept it, the optimizer state of its checkpoint after step N-1;
3. the recorded steps from N on, read one at a time (`services.tools.retrain_source`), each
   rebuilt by the adapter under the scheme (`trainer.core.build_step`, as the trainer and the
   replay build it) and trained with decoupled PPO's estimator (`trainer.retrain`);
4. one row per step in `metrics.csv` (the live run's columns: loss, approx_kl = KL to the
   behaviour policy, entropy, clip fraction, grad norm, ...), weights under `weights/vK`.

`retrain.json` in the output directory records what was re-trained from what, so
`rollwire retrain --compare A B` (`services.tools.retrain_plot`) can put the original run's
curves beside the re-trained ones.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from services.common.eventstore import EventStore
from services.tools.retrain_schemes import RetrainScheme, parse_scheme
from services.tools.retrain_source import StepReader
from services.tools.source import ReplayError, index_run
from trainer.checkpoint import CHECKPOINTS_DIR, RunDir
from trainer.core import AdapterConfig, RolloutCalls, StepBatch, build_step
from trainer.metrics import MetricsLog
from trainer.retrain import ProximalBackend, retrain_update, update_row
from trainer.run.load import config_from_mapping
from trainer.run.sections import TrainConfig

if TYPE_CHECKING:
    from services.tools.retrain_validation import RetrainValidation

Row = dict[str, Any]
RETRAIN_FILE = "retrain.json"


class RetrainOptions(msgspec.Struct, frozen=True, kw_only=True):
    """What to re-train: steps from `from_step` (0: the first), at most `steps`, and where things go."""

    from_step: int = 0
    steps: int | None = None
    out: Path | None = None
    """One scheme: its directory; several: one subdirectory per scheme (default `<run dir>/retrain/`)."""
    run_dir: Path | None = None
    backend: str | None = None
    """The backend kind (default: the run's)."""
    save_every: int = 0
    """Save the weights every this many steps (0: only after the last)."""
    validation: Path | None = None
    """A validation set (JSONL tasks): fresh `val` rollouts on the re-trained weights through the stack."""
    validation_every: int | None = None
    """Validate every this many steps (default: the run's `[validation] every`), and after the last."""
    stack: dict[str, str | None] = {}
    """The running stack for validation: `gateway_url`, `engine_url`, `admin_token` (else the run's, or env)."""
    nats_url: str = ""


class RetrainResult(msgspec.Struct, frozen=True, kw_only=True):
    """One scheme re-trained: where its files are and its rows."""

    scheme: str
    out: Path
    rows: list[Row]
    seconds: float


class RunFiles:
    """A run's directory as `rollwire train` left it: its config, weights versions, checkpoints and metrics."""

    def __init__(self, run_id: str, run_dir: Path | None) -> None:
        self.root = Path(run_dir) if run_dir is not None else Path("runs") / run_id
        path = self.root / "config.json"
        if not path.is_file():
            raise ReplayError(
                f"run directory {self.root} has no config.json; give --run-dir (the run's out_dir/name, "
                "with config.json and weights/)"
            )
        self.config: TrainConfig = config_from_mapping(json.loads(path.read_text()))
        self.dir = RunDir(self.root)
        metrics = self.dir.metrics_csv
        self.rows: list[Row] = MetricsLog(metrics, resume_after=1 << 62).rows if metrics.is_file() else []

    def trained_version(self, step: int) -> int:
        """The weights version the run trained `step` on: the version the step before it ended with (0 first)."""
        before = [r for r in self.rows if isinstance(r.get("step"), int) and r["step"] < step]
        version = before[-1].get("weights_version") if before else 0
        return version if isinstance(version, int) else 0

    def weights(self, version: int) -> Path:
        """The run's weights directory of `version` (raises `ReplayError` when it was pruned)."""
        path = self.dir.weights(version)
        if not path.is_dir():
            kept = sorted(p.name for p in (self.root / "weights").glob("v*"))
            raise ReplayError(
                f"the run kept no weights v{version} ({path}); it has {', '.join(kept) or 'none'}. Re-train from "
                "a step whose weights it kept (a run keeps `run.keep_weights` versions; 0 keeps all)"
            )
        return path

    def checkpoint_state(self, step: int) -> Path:
        """The backend state file of the run's checkpoint after `step` (it may not have been kept)."""
        return self.root / CHECKPOINTS_DIR / f"step-{step}" / "state.pt"

    def optimizer_state(self, step: int) -> dict[str, Any] | None:
        """The backend state of the run's checkpoint after `step` (None when it was not kept)."""
        path = self.checkpoint_state(step)
        if not path.is_file():
            return None
        import torch

        state: dict[str, Any] = torch.load(path, weights_only=True)
        return state


def schemes_for(specs: Sequence[str], files: RunFiles, recorded: dict[str, Any] | None) -> list[RetrainScheme]:
    """The schemes `specs` name on top of the run's recorded adapter config and loss section.

    No spec at all is the run's own scheme (named `run`).
    """
    base = (
        AdapterConfig.from_mapping(dict(recorded))
        if recorded
        else AdapterConfig.from_mapping(files.config.algorithm.adapter)
    )
    loss = files.config.algorithm.loss
    if not specs:
        return [RetrainScheme(name="run", adapter=base, loss=loss)]
    found = [parse_scheme(spec, base, loss) for spec in specs]
    names = [s.slug for s in found]
    if len(set(names)) != len(names):
        raise ReplayError(f"schemes {', '.join(specs)} name the same directory twice; give each once")
    return found


def _backend_config(files: RunFiles, scheme: RetrainScheme, kind: str | None) -> TrainConfig:
    config = files.config
    algorithm = msgspec.structs.replace(config.algorithm, loss=scheme.loss)
    backend = config.backend if kind is None else msgspec.structs.replace(config.backend, kind=kind)
    return msgspec.structs.replace(config, algorithm=algorithm, backend=backend)


def build_retrain_backend(files: RunFiles, scheme: RetrainScheme, first: int, kind: str | None) -> ProximalBackend:
    """The trainer's backend for the run, with the scheme's loss, holding the weights step `first` trained on."""
    from trainer.backends.factory import build_backend

    version = files.trained_version(first)
    weights = files.weights(version)
    config = _backend_config(files, scheme, kind)
    if not Path(config.model.path).is_dir():  # the base model moved: the run's own copy of it
        config = msgspec.structs.replace(
            config, model=msgspec.structs.replace(config.model, path=str(files.weights(0)))
        )
    backend = build_backend(config)
    if not hasattr(backend, "token_logprobs"):
        raise ReplayError(f"backend {config.backend.kind!r} cannot give per-token logprobs; re-train on cpu or verl")
    if version:
        backend.load_weights(weights)
    state = files.optimizer_state(first - 1) if first > 1 else None
    if state is not None:
        backend.load_state(state)
    return backend  # type: ignore[return-value]


def scheme_batch(rollouts: Sequence[RolloutCalls], scheme: RetrainScheme, served: str) -> StepBatch:
    """A step's samples under the scheme, built as the trainer builds them (its model's calls only)."""
    return build_step([r.for_model(served) for r in rollouts], scheme.adapter.for_models((served,)))


def _row(step: int, version: int, trained: int, batch: StepBatch) -> Row:
    stats = batch.stats
    advantages = {s.rollout_id: s.advantage for s in batch.samples}
    return {
        "step": step,
        "weights_version": version,
        "trained_version": trained,
        "rollouts": stats.rollouts,
        "groups": stats.groups,
        "reward_mean": stats.reward_mean,
        "advantage_abs_mean": sum(map(abs, advantages.values())) / len(advantages) if advantages else None,
        "samples": stats.samples,
        "tokens": stats.tokens,
        "response_tokens": stats.response_tokens,
    }


def _write_record(
    out: Path, run_id: str, files: RunFiles, scheme: RetrainScheme, steps: Sequence[int], backend: str
) -> None:
    record = {
        "run_id": run_id,
        "run_dir": str(files.root.resolve()),
        "scheme": scheme.name,
        "adapter": msgspec.to_builtins(scheme.adapter),
        "loss": msgspec.to_builtins(scheme.loss),
        "is_cap": scheme.is_cap,
        "steps": list(steps),
        "weights": f"v{files.trained_version(steps[0])}",
        "optimizer": "fresh"
        if steps[0] <= 1 or not files.checkpoint_state(steps[0] - 1).is_file()
        else f"checkpoints/step-{steps[0] - 1}",
        "backend": backend,
    }
    (out / RETRAIN_FILE).write_text(json.dumps(record, indent=2))


async def retrain_scheme(
    store: EventStore,
    run_id: str,
    scheme: RetrainScheme,
    files: RunFiles,
    reader: StepReader,
    steps: Sequence[int],
    out: Path,
    options: RetrainOptions,
    on_step: Callable[[Row], None] | None = None,
) -> RetrainResult:
    """Re-train `steps` of the run under one scheme into `out` (module docstring, points 2 to 4)."""
    import asyncio

    start = time.monotonic()
    await asyncio.to_thread(out.mkdir, parents=True, exist_ok=True)
    backend = await asyncio.to_thread(build_retrain_backend, files, scheme, steps[0], options.backend)
    kind = options.backend or files.config.backend.kind
    _write_record(out, run_id, files, scheme, steps, kind)
    log = MetricsLog(out / "metrics.csv")
    served = files.config.model.served_name
    version = 0
    validation = await _validation(run_id, scheme, files, options)
    try:
        mark = time.monotonic()
        async for step, rollouts in reader.read(steps):
            read_s = time.monotonic() - mark
            batch = scheme_batch(rollouts, scheme, served)
            update, stats, times = await asyncio.to_thread(retrain_update, backend, batch.samples, scheme.is_cap)
            if update is not None and update.optimizer_steps:
                version += 1
            last = step == steps[-1]
            validate = validation is not None and (last or (len(log.rows) + 1) % validation.section.every == 0)
            weights = out / "weights" / f"v{version}"
            if version and (validate or last or (options.save_every and version % options.save_every == 0)):
                await asyncio.to_thread(backend.save_weights, weights)
            row = _row(step, version, files.trained_version(step), batch) | update_row(update, stats)
            if validation is not None and validate:
                row |= await validation.validate(step, weights if version else files.weights(0), version)
            row |= {f"time_{name}_s": round(seconds, 4) for name, seconds in {"read": read_s, **times}.items()}
            row["time_step_s"] = round(time.monotonic() - mark, 4)
            log.add(row)
            if on_step is not None:
                on_step(row)
            mark = time.monotonic()
    finally:
        log.close()
        await asyncio.to_thread(backend.close)
        if validation is not None:
            await validation.close()
    return RetrainResult(scheme=scheme.name, out=out, rows=log.rows, seconds=time.monotonic() - start)


async def _validation(
    run_id: str, scheme: RetrainScheme, files: RunFiles, options: RetrainOptions
) -> RetrainValidation | None:
    """The validation pass of this re-train, started, when a validation set is named."""
    if options.validation is None:
        return None
    from services.tools.retrain_validation import RetrainValidation, stack_urls, validation_run_id, validation_section

    section = validation_section(files.config, options.validation, options.validation_every)
    urls = stack_urls(files.config, options.nats_url, options.stack)
    return await RetrainValidation(files.config, urls, validation_run_id(run_id, scheme.name), section).start()


def scheme_dirs(files: RunFiles, schemes: Sequence[RetrainScheme], out: Path | None) -> list[Path]:
    """Where each scheme's files go: `out` itself for one scheme, else `out/<scheme>` (default `<run>/retrain`)."""
    if out is not None and len(schemes) == 1:
        return [Path(out)]
    base = Path(out) if out is not None else files.root / "retrain"
    return [base / s.slug for s in schemes]


async def retrain_run(
    store: EventStore,
    run_id: str,
    specs: Sequence[str],
    options: RetrainOptions = RetrainOptions(),
    *,
    on_start: Callable[[RetrainScheme, list[int]], None] | None = None,
    on_step: Callable[[Row], None] | None = None,
) -> list[RetrainResult]:
    """Re-train the run under each scheme of `specs`, one after another (none: the run's own scheme).

    Raises `RunNotFound`, `ReplayError` (no such step, no run directory, weights not kept) or
    `AdapterConfigError` (a wrong scheme), each with a message for the user.
    """
    files = RunFiles(run_id, options.run_dir)
    index = await index_run(store, run_id)
    schemes = schemes_for(specs, files, index.recorded_adapter)
    results = []
    for scheme, out in zip(schemes, scheme_dirs(files, schemes, options.out), strict=True):
        reader = StepReader(store, index, scheme.adapter.selection())
        steps = reader.steps(options.from_step, options.steps)
        if on_start is not None:
            on_start(scheme, steps)
        results.append(await retrain_scheme(store, run_id, scheme, files, reader, steps, out, options, on_step))
    return results
