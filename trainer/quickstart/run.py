"""`rollwire quickstart`: RL on a laptop CPU, end to end, with nothing but the install.

1. build the tiny model and its warm start (cached: `trainer.quickstart.warmstart`);
2. write the task dataset (`trainer.quickstart.task`) into the run directory;
3. start the agent fork server and the embedded stack (nats-server, Postgres, vLLM, gateway,
   projector, controller: child processes, free ports);
4. train: every step runs `tasks_per_step` tasks `rollouts_per_task` times each through the real
   agent harness (`trainer.quickstart.agent`, launched by the controller's local backend), replays
   the recorded calls, updates the model and has the engine serve the new weights;
5. write `reward_curve.png`, print the held-out reward before and after (64 held-out tasks run in
   `val` mode on the starting weights and after the last step), where the metrics, logs and
   trajectory viewer are, and stop.

The warm-started model calls the tool on about a fifth of the tasks, so its reward starts near
0.2; the run shows RL raising the rate of tool use, and the reward with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.devstack.embedded import die_with_parent
from trainer.checkpoint import WEIGHTS_DIR, RunDir
from trainer.display import StepDisplay
from trainer.embedded import embedded_stack
from trainer.loop import Trainer
from trainer.metrics import MetricsLog
from trainer.quickstart.forkserver import DEFAULT_MODULE, launcher_command
from trainer.quickstart.options import QuickstartOptions
from trainer.quickstart.task import make_tasks, write_tasks_jsonl
from trainer.run.load import config_from_mapping
from trainer.run.sections import TrainConfig
from trainer.validation import first_and_last_pass

DATASET_SIZE = 512
HELDOUT_ROLLOUTS = 2
QUICKSTART_FIELDS: tuple[tuple[str, str, str], ...] = (
    ("reward_mean", "reward", "{:.2f}"),
    ("agent_tool_used", "tool use", "{:.2f}"),
    ("samples_per_rollout", "samples/rollout", "{:.2f}"),
    ("merge_ratio", "calls/sample", "{:.2f}"),
    ("entropy", "entropy", "{:.2f}"),
    ("time_step_s", "step", "{:.1f}s"),
)


@dataclass
class QuickstartResult:
    """What a quickstart run produced."""

    run_dir: Path
    rows: list[dict[str, Any]]
    gateway_url: str
    curve: Path
    seconds: float


def quickstart_config(
    options: QuickstartOptions,
    name: str,
    model_dir: Path,
    dataset: Path,
    agent_command: list[str],
    heldout: Path | None = None,
) -> TrainConfig:
    """The training config of a quickstart run named `name`; with `heldout`, the held-out pass runs
    on the starting weights and after the last step (the before and after)."""
    mapping: dict[str, Any] = {
        "run": {
            "name": name,
            "out_dir": str(options.out),
            "seed": options.seed,
            "steps": options.steps,
            "mode": options.mode,
            "resume": False,
            "plot": ["agent_tool_used"],
        },
        "data": {
            "path": str(dataset),
            "tasks_per_step": options.tasks_per_step,
            "rollouts_per_task": options.rollouts_per_task,
        },
        "agent": {
            "command": agent_command,
            "env": {"AGENT_SEED": str(options.seed)},
            "timeout_s": 300.0,
            "concurrency": options.tasks_per_step * options.rollouts_per_task,
        },
        "model": {"path": str(model_dir), "served_name": "policy"},
        "backend": {"kind": "cpu", "threads": 2},
        # token-mean: the decision token (call the tool or answer) weighs the same in a 2-token
        # direct answer as in a 25-token tool call; per-rollout means would make one lucky guess
        # outweigh a dozen successful tool calls.
        "algorithm": {"lr": options.lr, "micro_batch_tokens": 8192, "adapter": {"norm": "token-mean"}},
    }
    if heldout is not None:
        mapping["validation"] = {
            "path": str(heldout),
            "every": options.steps,
            "rollouts_per_task": HELDOUT_ROLLOUTS,
            "at_start": True,
        }
    for section, values in options.extra.items():
        mapping.setdefault(section, {}).update(values)
    return config_from_mapping(mapping)


@contextlib.contextmanager
def fork_server(
    module: str = DEFAULT_MODULE, pythonpath: Sequence[Path] = (), *, key: str | None = None
) -> Iterator[list[str]]:
    """Run an agent fork server for `module` for the duration; yields the agent command that uses it.

    `pythonpath` adds directories the module is imported from (for agents outside the package).
    With `key`, the socket's path (part of the agent command, hence of the run's recorded spec)
    follows from it, so a resumed run launches its agents with the very command it started with.
    """
    if key is None:
        directory = Path(tempfile.mkdtemp(prefix="rw-agents-"))
    else:  # a short path: a Unix socket's path is limited to about 100 bytes
        digest = hashlib.sha256(key.encode()).hexdigest()[:16]
        directory = Path(tempfile.gettempdir()) / f"rw-agents-{os.getuid()}-{digest}"
        directory.mkdir(mode=0o700, exist_ok=True)
    socket_path = directory / "agent.sock"
    with contextlib.suppress(FileNotFoundError):
        socket_path.unlink()  # left by a run that was killed
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join([*map(str, pythonpath), *filter(None, [env.get("PYTHONPATH")])])
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainer.quickstart.forkserver", str(socket_path), module],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
        preexec_fn=die_with_parent,  # a run killed by SIGKILL leaves no fork server behind
        env=env,
    )
    try:
        deadline = time.monotonic() + 120.0
        while not socket_path.exists():
            if proc.poll() is not None:
                error = proc.stderr.read().decode(errors="replace")[-500:] if proc.stderr else ""
                raise RuntimeError(f"the agent fork server exited with code {proc.returncode}: {error}")
            if time.monotonic() > deadline:
                raise RuntimeError("the agent fork server did not start within 120s")
            time.sleep(0.05)
        yield launcher_command(socket_path)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        with contextlib.suppress(OSError):
            socket_path.unlink()
        with contextlib.suppress(OSError):
            directory.rmdir()


def summarize(rows: list[dict[str, Any]]) -> tuple[float | None, float | None]:
    """The training reward at the start (mean of the first two steps) and at the end (mean of the last three)."""
    rewards = [r["reward_mean"] for r in rows if isinstance(r.get("reward_mean"), int | float)]
    if not rewards:
        return None, None
    return statistics.fmean(rewards[:2]), statistics.fmean(rewards[-3:])


def heldout_before_after(log: MetricsLog) -> tuple[float, float] | None:
    """The held-out reward on the starting weights (step 0) and after the last step, if both ran."""
    passes = first_and_last_pass(log)
    if passes is None or passes[0][0] != 0:
        return None
    return passes[0][1], passes[1][1]


def write_datasets(options: QuickstartOptions, run_dir: Path) -> tuple[Path, Path | None]:
    """Write the run's training tasks and (unless `heldout_tasks` is 0) its held-out tasks."""
    run_dir.mkdir(parents=True, exist_ok=True)
    dataset = run_dir / "tasks.jsonl"
    dataset.write_bytes(write_tasks_jsonl(make_tasks(DATASET_SIZE, seed=options.seed)))
    if not options.heldout_tasks:
        return dataset, None
    heldout = run_dir / "heldout.jsonl"
    heldout.write_bytes(write_tasks_jsonl(make_tasks(options.heldout_tasks, seed=options.seed + 1)))
    return dataset, heldout


def say_gain(
    rows: list[dict[str, Any]], log: MetricsLog, heldout_tasks: int, seconds: float, say: Callable[[str], None]
) -> None:
    """Print the training reward's start and end, and the held-out reward before and after."""
    first, last = summarize(rows)
    if first is not None and last is not None:
        say(f"reward: {first:.2f} at the start -> {last:.2f} at the end ({last - first:+.2f}) in {seconds:.0f}s")
    before_after = heldout_before_after(log)
    if before_after is not None:
        before, after = before_after
        say(
            f"held-out reward: {before:.2f} before training -> {after:.2f} after ({after - before:+.2f}), "
            f"{heldout_tasks} tasks x {HELDOUT_ROLLOUTS}"
        )


def run_quickstart(options: QuickstartOptions, say: Callable[[str], None] = print) -> QuickstartResult:
    """Run the whole quickstart (see the module docstring); returns where everything went."""
    from trainer.quickstart.warmstart import WarmStartConfig, ensure_warm_model

    start = time.monotonic()
    say("preparing the tiny model and its warm start (built once, then cached)...")
    model_dir = options.model_dir or ensure_warm_model(
        options.cache_dir, WarmStartConfig(seed=options.seed), progress=say
    )
    say(f"model: {model_dir}")
    name = options.run_name or f"quickstart-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir = options.out / name
    dataset, heldout = write_datasets(options, run_dir)
    with contextlib.ExitStack() as stack:
        command = (
            stack.enter_context(fork_server(key=f"{options.data_dir.resolve()}/{name}"))
            if options.fork_server
            else [sys.executable, "-m", "trainer.quickstart.agent"]
        )
        config = quickstart_config(options, name, model_dir, dataset, command, heldout)
        say("starting the embedded stack...")
        urls = stack.enter_context(embedded_stack(options.data_dir, model_dir, say, config.engine))
        say(
            f"run {config.run.name}: {options.steps} steps of {options.tasks_per_step} tasks x "
            f"{options.rollouts_per_task} rollouts ({config.run.mode})"
        )
        with StepDisplay(options.steps, fields=QUICKSTART_FIELDS) as display:
            rows = asyncio.run(Trainer(config, urls, on_step=display.step, say=say).run())
    paths = RunDir(run_dir)
    log = MetricsLog(paths.metrics_csv, resume_after=options.steps)
    curve = paths.reward_curve  # drawn by the trainer: reward, tool use (`[run] plot`) and held-out reward
    seconds = time.monotonic() - start
    say_gain(rows, log, options.heldout_tasks, seconds, say)
    log.close()
    data_dir = options.data_dir.resolve()
    say(f"reward curve: {curve}")
    say(f"metrics: {paths.metrics_csv} (TensorBoard: tensorboard --logdir {paths.tensorboard})")
    say(f"weights: {paths.root / WEIGHTS_DIR}")
    say(f"logs: {data_dir / 'logs'} (services), {data_dir / 'executions'} (each agent run)")
    say(
        f"trajectory viewer: {urls.gateway_url}/ui while the run was up; to browse it now, run "
        f"`rollwire up --data-dir {options.data_dir}` and open http://127.0.0.1:18080/ui"
    )
    return QuickstartResult(run_dir=run_dir, rows=rows, gateway_url=urls.gateway_url, curve=curve, seconds=seconds)
