"""The `rollwire replay`, `retrain`, `tail`, `export` and `runs` commands (wired into `services.devstack.cli`).

Each is a thin shell over this package. Errors a user can cause (no such run, a wrong scheme, no
server) print one line, `error: ...`, and exit non-zero (2 for a wrong option value, 1 otherwise).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import TypeVar

import typer

from schemas import InvalidId, MalformedEvent
from services.common.eventstore import EventStore, EventStoreError
from services.devstack import endpoints_file
from services.devstack.credentials import local_credentials
from services.devstack.stack import DEFAULT_NATS_PORT
from services.tools.export import EXPORT_FORMATS, ExportUnavailable, export_run
from services.tools.plot import PlotUnavailable
from services.tools.render import FORMATS
from services.tools.retrain_cli import RetrainUsageError
from services.tools.source import ReplayError, RunNotFound, run_exists
from services.tools.tail import TAIL_FORMATS, BadTime, line, parse_since
from trainer.core import AdapterConfigError, MalformedCall

T = TypeVar("T")

DEFAULT_NATS_URL = f"nats://127.0.0.1:{DEFAULT_NATS_PORT}"
NATS_URL = typer.Option(
    None,
    "--nats-url",
    envvar="NATS_URL",
    help="The NATS server (default: the one `rollwire up` started in --data-dir, as its read-only monitor user).",
)
DATA_DIR = typer.Option(
    Path(".rollwire"), "--data-dir", envvar="ROLLWIRE_DATA_DIR", help="The data dir of `rollwire up`."
)


def nats_endpoint(nats_url: str | None, data_dir: Path) -> str:
    """The NATS URL to use: the flag or NATS_URL, else the `nats` entry of `<data-dir>/endpoints.json`
    (a stack started with `--nats-port 0` listens on a port of its choosing), else the default port;
    with the stack's `monitor` user when it is that stack's NATS and names no user."""
    url = nats_url or endpoints_file.read(data_dir).get("nats") or DEFAULT_NATS_URL
    return local_credentials(url, data_dir=data_dir)  # that stack's read-only user, for a URL naming none


class UsageError(ValueError):
    """An option value the command cannot take (exit code 2)."""


_USAGE = (UsageError, AdapterConfigError, BadTime, RetrainUsageError)
_FAILURES = (ReplayError, EventStoreError, InvalidId, MalformedEvent, MalformedCall, PlotUnavailable, ExportUnavailable)


@contextlib.contextmanager
def _one_line_errors() -> Iterator[None]:
    try:
        yield
    except _USAGE as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise typer.Exit(2) from None
    except _FAILURES as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise typer.Exit(1) from None


def _run(url: str, job: Callable[[EventStore], Awaitable[T]]) -> T:
    async def main() -> T:
        store = await EventStore.connect(url, ensure=False, name="rollwire-cli")
        try:
            return await job(store)
        finally:
            await store.close()

    with _one_line_errors():
        return asyncio.run(main())


def _choice(option: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise UsageError(f"{option} {value!r} is not allowed; choose one of: {', '.join(allowed)}")


def _write(data: bytes, out: Path | None) -> None:
    if out is None or str(out) == "-":
        sys.stdout.buffer.write(data)
        sys.stdout.flush()
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(data)
    print(f"wrote {out}", file=sys.stderr)


def replay(
    run: str = typer.Argument(..., help="The run to replay."),
    more: list[str] | None = typer.Argument(None, hidden=True, help="More schemes after --compare."),
    merge: str | None = typer.Option(None, "--merge", help="exact | per-call"),
    advantage: str | None = typer.Option(None, "--advantage", help="Group statistics over: rollout | sample"),
    estimator: str | None = typer.Option(None, "--estimator", help="grpo | rloo"),
    std: bool | None = typer.Option(None, "--std/--no-std", help="Divide advantages by the group's std."),
    norm: str | None = typer.Option(None, "--norm", help="token-mean | seq-mean-token-mean | rollout-mean"),
    step: int | None = typer.Option(None, "--step", help="Only the rollouts the trainer trained in step N."),
    agents: str | None = typer.Option(
        None, "--agents", help="Train only these agents' calls (comma-separated; 'all' = every agent)."
    ),
    models: str | None = typer.Option(
        None, "--models", help="Train only calls to these registered models (comma-separated; 'all' = every model)."
    ),
    compare: list[str] | None = typer.Option(
        None, "--compare", help="Schemes to put side by side (e.g. --compare rollout-mean seq-mean-token-mean)."
    ),
    fmt: str = typer.Option("table", "--format", help="table | json | csv"),
    out: Path | None = typer.Option(None, "--out", help="Write the report to FILE instead of stdout."),
    plot: Path | None = typer.Option(None, "--plot", help="Draw the loss weights per rollout into FILE.png."),
    nats_url: str | None = NATS_URL,
    data_dir: Path = DATA_DIR,
) -> None:
    """Rebuild a past run's samples from its events under other schemes; no agent runs again.

    Options not given take the run's recorded adapter config, else the adapter's defaults.

    A --compare scheme is one or more of merge=.., advantage=.., estimator=.., std|no-std, norm=.. joined by '+'.
    """
    from services.tools.render import render
    from services.tools.replay import replay_run

    with _one_line_errors():
        _choice("--format", fmt, FORMATS)
        if more and not compare:
            raise UsageError(f"unexpected argument(s) {' '.join(more)}; schemes to compare follow --compare")
    from services.tools.schemes import names

    with _one_line_errors():
        selection = {"agents": names("agents", agents), "models": names("models", models)}
    options = {"merge": merge, "advantage": advantage, "estimator": estimator, "std": std, "norm": norm, **selection}
    specs = [*(compare or []), *(more or [])]
    url = nats_endpoint(nats_url, data_dir)
    report = _run(
        url, lambda store: replay_run(store, run, options=options, compare_specs=specs, step=step, nats_url=url)
    )
    _write(render(report, fmt), out)
    if plot is not None:
        from services.tools.plot import plot as draw

        with _one_line_errors():
            draw(report, plot)
        print(f"wrote {plot}", file=sys.stderr)


def tail(
    pattern: str = typer.Argument(..., help="Subject pattern, e.g. 'rl.*.rollout.*.reward' or 'rl.RUN.>'."),
    from_start: bool = typer.Option(False, "--from-start", help="Begin with the oldest stored event."),
    since: str | None = typer.Option(None, "--since", help="Begin at a time: 15m, 2h, 1d ago, an ISO time."),
    fmt: str = typer.Option("pretty", "--format", help="pretty | json (one event per line)"),
    nats_url: str | None = NATS_URL,
    data_dir: Path = DATA_DIR,
) -> None:
    """Print live events matching a subject pattern (Ctrl-C stops)."""
    with _one_line_errors():
        _choice("--format", fmt, TAIL_FORMATS)
        if from_start and since is not None:
            raise UsageError("--from-start and --since exclude each other; give one")
        start_time = parse_since(since) if since is not None else None
        if not pattern.startswith("rl.") and pattern not in (">", "rl.>"):
            raise UsageError(f"pattern {pattern!r} is outside the stream's subjects; they start with 'rl.'")

    async def follow(store: EventStore) -> None:
        # Calls as recorded: `json` prints them as stored (packed arrays stay packed) and `pretty`
        # counts their tokens without making a Python int of each.
        events = store.subscribe(pattern, start="start" if from_start else "new", since=start_time, unpack=False)
        async for stored in events:
            sys.stdout.write(line(stored, fmt) + "\n")
            sys.stdout.flush()

    try:
        _run(nats_endpoint(nats_url, data_dir), follow)
    except BrokenPipeError:  # `rollwire tail ... | head`: the reader left
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def export(
    run: str = typer.Argument(..., help="The run to export."),
    fmt: str = typer.Option("jsonl", "--format", help="jsonl | parquet (parquet needs pyarrow)"),
    out: Path | None = typer.Option(None, "--out", help="File to write (default RUN.FORMAT; - is stdout)."),
    nats_url: str | None = NATS_URL,
    data_dir: Path = DATA_DIR,
) -> None:
    """Write every event of a run to a file for offline analysis."""
    with _one_line_errors():
        _choice("--format", fmt, EXPORT_FORMATS)
        if fmt == "parquet" and out is not None and str(out) == "-":
            raise UsageError("parquet cannot go to stdout; give --out FILE")
    target: Path | None = None if out is not None and str(out) == "-" else (out or Path(f"{run}.{fmt}"))
    url = nats_endpoint(nats_url, data_dir)

    async def job(store: EventStore) -> int:
        if not await run_exists(store, run):
            raise RunNotFound(f"run {run!r} has no events on the stream at {url}; `rollwire runs` lists the runs")
        if target is None:
            n = await export_run(store, run, fmt, sys.stdout.buffer)
            sys.stdout.flush()
            return n
        return await export_run(store, run, fmt, target)

    n = _run(url, job)
    print(f"exported {n} events of run {run}" + (f" to {target}" if target else ""), file=sys.stderr)


def runs(nats_url: str | None = NATS_URL, data_dir: Path = DATA_DIR) -> None:
    """List the runs on the stream with their rollouts, events and bytes."""
    from services.tools.runs import list_runs, runs_table

    found = _run(nats_endpoint(nats_url, data_dir), list_runs)
    sys.stdout.write(runs_table(found))


RETRAIN_FIELDS: tuple[tuple[str, str, str], ...] = (
    ("loss", "loss", "{:.4g}"),
    ("approx_kl", "KL(behaviour)", "{:.2e}"),
    ("entropy", "entropy", "{:.3f}"),
    ("clip_fraction", "clipped", "{:.3f}"),
    ("grad_norm", "grad norm", "{:.3g}"),
    ("val/reward", "val/reward", "{:.3f}"),
    ("time_step_s", "step", "{:.1f}s"),
)


def retrain(
    run: str | None = typer.Argument(None, help="The run to re-train (its events and its run directory)."),
    more: list[str] | None = typer.Argument(None, hidden=True, help="More directories after --compare."),
    scheme: list[str] | None = typer.Option(
        None, "--scheme", help="A scheme to re-train under (repeat for several, run one after another)."
    ),
    from_step: int | None = typer.Option(None, "--from-step", help="Re-train the recorded steps from N on."),
    steps: int | None = typer.Option(None, "--steps", help="Re-train at most M steps."),
    out: Path | None = typer.Option(None, "--out", help="Output directory (several schemes: one subdirectory each)."),
    run_dir: Path | None = typer.Option(None, "--run-dir", help="The run's directory (default runs/RUN)."),
    backend: str | None = typer.Option(None, "--backend", help="cpu | verl (default: the run's)."),
    save_every: int | None = typer.Option(None, "--save-every", help="Save weights every K steps (0: the last)."),
    validation: Path | None = typer.Option(
        None, "--validation", help="Validation tasks (JSONL): fresh val rollouts on the re-trained weights."
    ),
    validation_every: int | None = typer.Option(None, "--validation-every", help="Validate every K steps."),
    config: Path | None = typer.Option(
        None, "--config", help="A TOML file whose \\[retrain] table sets these options."
    ),
    compare: list[str] | None = typer.Option(
        None, "--compare", help="Re-train output directories to plot beside their original runs."
    ),
    plot: Path = typer.Option(Path("retrain-compare.png"), "--plot", help="Where --compare draws its PNG."),
    nats_url: str = NATS_URL,
) -> None:
    """Train a past run's recorded steps again under other schemes; no agent runs again.

    A scheme is one or more of grpo|rloo, std|no-std, norm=token-mean|seq-mean-token-mean|rollout-mean,
    merge=.., advantage=.., clip=.., clip-low=.., clip-high=.., ratio-cap=.., kl=.., is-cap=.. joined by '+'.
    """
    if compare:
        from services.tools.retrain_plot import plot_compare

        with _one_line_errors():
            drawn = plot_compare([Path(d) for d in [*compare, *([run] if run else []), *(more or [])]], plot)
        print(f"wrote {drawn}", file=sys.stderr)
        return
    from services.tools.retrain_cli import retrain_command

    given = {
        "run": run,
        "schemes": scheme or None,
        "from_step": from_step,
        "steps": steps,
        "out": out,
        "run_dir": run_dir,
        "backend": backend,
        "save_every": save_every,
        "validation": validation,
        "validation_every": validation_every,
    }
    with _one_line_errors():
        if more:
            raise UsageError(f"unexpected argument(s) {' '.join(more)}; give schemes with --scheme")
        job = retrain_command(given, config, RETRAIN_FIELDS, nats_url)
    _run(nats_url, job)


def register(app: typer.Typer) -> None:
    """Add this package's commands to the `rollwire` app."""
    app.command("replay")(replay)
    app.command("tail")(tail)
    app.command("export")(export)
    app.command("runs")(runs)
    app.command("retrain")(retrain)
