"""The `rollwire retrain` command's settings: its flags over a TOML file's `[retrain]` table.

    [retrain]
    run = "quickstart-20250101-120000"
    schemes = ["grpo", "rloo", "grpo+norm=token-mean"]   # re-trained one after another
    from_step = 0
    steps = 20
    out = "retrain/"
    run_dir = "runs/quickstart-20250101-120000"
    backend = "cpu"
    save_every = 0
    validation = "val.jsonl"      # fresh `val` rollouts on the re-trained weights (a running stack)
    validation_every = 5

A flag given on the command line wins over the file. Relative paths in the file are relative to
the file's directory.
"""

from __future__ import annotations

import sys
import tomllib
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from services.common.eventstore import EventStore

if TYPE_CHECKING:  # imported when the command runs: they import torch
    from services.tools.retrain import RetrainResult
    from services.tools.retrain_schemes import RetrainScheme


class RetrainSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The `[retrain]` table (every key optional)."""

    run: str | None = None
    schemes: list[str] = []
    from_step: int = 0
    steps: int | None = None
    out: str | None = None
    run_dir: str | None = None
    backend: str | None = None
    save_every: int = 0
    validation: str | None = None
    validation_every: int | None = None


class RetrainUsageError(ValueError):
    """A setting the command cannot take; the message names it."""


def load_settings(path: Path | None) -> RetrainSettings:
    """The `[retrain]` table of `path` (defaults when no file is given), paths resolved against its directory."""
    if path is None:
        return RetrainSettings()
    try:
        document = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise RetrainUsageError(f"--config {path}: {exc}") from None
    try:
        settings = msgspec.convert(document.get("retrain", {}), RetrainSettings)
    except msgspec.ValidationError as exc:
        raise RetrainUsageError(f"--config {path}: [retrain] {exc}") from None
    base = Path(path).parent
    resolved = {k: str(base / v) for k in ("out", "run_dir", "validation") if (v := getattr(settings, k)) is not None}
    return msgspec.structs.replace(settings, **resolved)


def merged_settings(given: Mapping[str, Any], config: Path | None) -> RetrainSettings:
    """The file's settings with every flag that was given (not None) put over them, checked."""
    settings = load_settings(config)
    changes = {k: (str(v) if isinstance(v, Path) else v) for k, v in given.items() if v is not None}
    settings = msgspec.structs.replace(settings, **changes)
    if not settings.run:
        raise RetrainUsageError("name the run to re-train (rollwire retrain RUN, or run = in [retrain])")
    if settings.validation_every is not None and settings.validation_every < 1:
        raise RetrainUsageError("--validation-every must be >= 1")
    if settings.from_step < 0 or (settings.steps is not None and settings.steps < 1) or settings.save_every < 0:
        raise RetrainUsageError("--from-step and --save-every must be >= 0 and --steps >= 1")
    if settings.backend is not None and settings.backend not in ("cpu", "verl"):
        raise RetrainUsageError(f"--backend {settings.backend!r} is not allowed; choose one of: cpu, verl")
    return settings


def retrain_command(
    given: Mapping[str, Any], config: Path | None, fields: Sequence[tuple[str, str, str]], nats_url: str = ""
) -> Callable[[EventStore], Awaitable[list[RetrainResult]]]:
    """The command's work on a connected store: re-train every scheme with a progress bar, then say where it went."""
    from services.tools.retrain import RetrainOptions, retrain_run

    settings = merged_settings(given, config)
    options = RetrainOptions(
        from_step=settings.from_step,
        steps=settings.steps,
        out=Path(settings.out) if settings.out else None,
        run_dir=Path(settings.run_dir) if settings.run_dir else None,
        backend=settings.backend,
        save_every=settings.save_every,
        validation=Path(settings.validation) if settings.validation else None,
        validation_every=settings.validation_every,
        nats_url=nats_url,
    )
    run_id = str(settings.run)

    async def job(store: EventStore) -> list[RetrainResult]:
        from trainer.display import StepDisplay

        shown: list[StepDisplay] = []

        def start(scheme: RetrainScheme, steps: list[int]) -> None:
            for display in shown:
                display.__exit__(None)
            print(f"re-training {run_id} steps {steps[0]}..{steps[-1]} under {scheme.name}", file=sys.stderr)
            shown[:] = [StepDisplay(len(steps), fields=fields).__enter__()]

        try:
            results = await retrain_run(
                store, run_id, settings.schemes, options, on_start=start, on_step=lambda row: shown[0].step(row)
            )
        finally:
            for display in shown:
                display.__exit__(None)
        for result in results:
            print(
                f"{result.scheme}: {len(result.rows)} steps in {result.seconds:.1f}s -> {result.out}", file=sys.stderr
            )
        return results

    return job
