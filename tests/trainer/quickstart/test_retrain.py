"""`rollwire retrain` on a real recorded run: the quickstart, shortened, on the embedded stack.

The run (3 steps of 4 tasks x 4 rollouts, every weights version kept) is recorded once on a real
nats-server; each test then starts that server again on the run's stream and re-trains from it.
Under the run's own scheme, from the run's own checkpoints, re-training reproduces the run's
losses and weights step by step; under RLOO instead of GRPO it moves in the same direction, n/(n-1)
times as far (groups of 4: 4/3).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import pytest
from safetensors.torch import load_file
from test_quickstart_e2e import SMOKE_WARM_START
from typer.testing import CliRunner

from services.common.eventstore import EventStore
from services.devstack.cli import app
from services.devstack.embedded import NatsServer
from services.tools.retrain import RetrainOptions, retrain_run
from services.tools.retrain_plot import plot_compare
from services.tools.retrain_source import StepReader
from services.tools.source import index_run
from trainer.embedded import embedded_stack
from trainer.quickstart.run import QuickstartOptions, fork_server, run_quickstart
from trainer.quickstart.task import make_tasks, write_tasks_jsonl
from trainer.quickstart.warmstart import ensure_warm_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]  # the warm start, built once per session, takes minutes

T = TypeVar("T")
RUN = "rt"
STEPS = 3


class Recorded(msgspec.Struct, frozen=True):
    """The recorded run: its directory, its stack's data and the rows it logged, and the model."""

    run_dir: Path
    stack_dir: Path
    rows: list[dict[str, Any]]
    model_dir: Path

    @property
    def nats_dir(self) -> Path:
        """The stream's storage."""
        return self.stack_dir / "nats"


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory, model_cache: Path) -> Recorded:
    """A short quickstart run, recorded on the embedded stack (the stack stops; its stream stays on disk)."""
    model_dir = ensure_warm_model(model_cache, SMOKE_WARM_START)
    tmp = tmp_path_factory.mktemp("retrain")
    options = QuickstartOptions(
        heldout_tasks=0,  # no held-out pass: this is about the steps
        steps=STEPS, data_dir=tmp / "stack", out=tmp / "runs", tasks_per_step=4, rollouts_per_task=4,
        model_dir=model_dir, run_name=RUN,
        extra={"agent": {"env": {"AGENT_SEED": "0", "QUICKSTART_REWARD": "tool"}}, "run": {"keep_weights": 0}},
    )  # fmt: skip
    result = run_quickstart(options, say=lambda line: None)
    assert [row["step"] for row in result.rows] == [1, 2, 3]
    assert all(row["rollouts_failed"] == 0 for row in result.rows)
    return Recorded(result.run_dir, tmp / "stack", result.rows, model_dir)


def on_stream(recorded: Recorded, job: Callable[[EventStore, str], Awaitable[T]]) -> T:
    """Run `job(store, url)` against the recorded run's stream, served by a fresh nats-server."""
    server = NatsServer(recorded.nats_dir).start()

    async def main() -> T:
        store = await EventStore.connect(server.url)
        try:
            return await job(store, server.url)
        finally:
            await store.close()

    try:
        return asyncio.run(main())
    finally:
        server.stop()


def max_weight_difference(a: Path, b: Path) -> float:
    """The largest absolute difference between two saved models' tensors (same names required)."""
    left, right = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert left.keys() == right.keys()
    return max(float((left[name] - right[name]).abs().max()) for name in left)


def test_the_runs_own_scheme_reproduces_its_losses_and_weights_step_by_step(recorded: Recorded, tmp_path: Path) -> None:
    options = RetrainOptions(run_dir=recorded.run_dir, out=tmp_path / "own", save_every=1)
    (result,) = on_stream(recorded, lambda store, url: retrain_run(store, RUN, [], options))
    assert [row["step"] for row in result.rows] == [1, 2, 3]
    for row, live in zip(result.rows, recorded.rows, strict=True):
        assert row["weights_version"] == live["weights_version"]
        assert row["loss"] == pytest.approx(live["loss"], rel=1e-5, abs=1e-8), f"step {row['step']}"
        assert row["grad_norm"] == pytest.approx(live["grad_norm"], rel=1e-5), f"step {row['step']}"
        assert row["approx_kl"] == pytest.approx(live["approx_kl"], abs=1e-6)  # KL to the behaviour policy
        assert row["is_truncated_fraction"] == 0.0
    for version in range(1, STEPS + 1):
        retrained = tmp_path / "own" / "weights" / f"v{version}"
        assert max_weight_difference(retrained, recorded.run_dir / "weights" / f"v{version}") < 1e-6

    # From the run's checkpoint after step 2 (weights v2, its optimizer state): step 3 again.
    late = RetrainOptions(run_dir=recorded.run_dir, out=tmp_path / "late", from_step=3)
    (result,) = on_stream(recorded, lambda store, url: retrain_run(store, RUN, [], late))
    assert [row["step"] for row in result.rows] == [3]
    assert result.rows[0]["loss"] == pytest.approx(recorded.rows[2]["loss"], rel=1e-5, abs=1e-8)
    assert max_weight_difference(tmp_path / "late" / "weights" / "v1", recorded.run_dir / "weights" / "v3") < 1e-6


def test_rloo_takes_grpos_step_four_thirds_as_far_and_the_plot_shows_both_beside_the_run(
    recorded: Recorded, tmp_path: Path
) -> None:
    """Groups of 4: RLOO's advantage is 4/3 of GRPO's on every rollout, so from the same weights the
    first step's loss and gradient norm are 4/3 of GRPO's (the same direction)."""
    options = RetrainOptions(run_dir=recorded.run_dir, out=tmp_path, steps=1)
    grpo, rloo = on_stream(recorded, lambda store, url: retrain_run(store, RUN, ["grpo", "rloo"], options))
    assert grpo.out == tmp_path / "grpo" and rloo.out == tmp_path / "rloo"
    (g,), (r,) = grpo.rows, rloo.rows
    assert g["loss"] != 0.0
    assert r["loss"] == pytest.approx(g["loss"] * 4 / 3, rel=1e-5)
    assert r["grad_norm"] == pytest.approx(g["grad_norm"] * 4 / 3, rel=1e-5)
    assert json.loads((tmp_path / "rloo" / "retrain.json").read_text())["adapter"]["estimator"] == "rloo"

    png = plot_compare([grpo.out, rloo.out], tmp_path / "compare.png")
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_the_reader_holds_one_step_of_calls_at_a_time(recorded: Recorded) -> None:
    async def job(store: EventStore, url: str) -> tuple[list[int], list[int], int, int]:
        index = await index_run(store, RUN)
        reader = StepReader(store, index)
        held, handed, read_when_handed = [], [], []
        async for step, rollouts in reader.read(reader.steps()):
            held.append(reader.held_calls)
            handed.append(sum(len(r.calls) for r in rollouts))
            read_when_handed.append(reader.steps_read)
            assert step == len(held)
        per_step = [sum(e.calls for e in index.rollouts.values() if e.step == s) for s in index.steps]
        assert held == per_step and handed == per_step
        assert read_when_handed == [1, 2, 3]  # lazily: a step is read only when the one before is done
        return held, per_step, reader.peak_calls, sum(e.calls for e in index.rollouts.values())

    _, per_step, peak, total = on_stream(recorded, job)
    assert peak == max(per_step) < total


def test_the_command_retrains_with_a_progress_bar_and_plots_the_comparison(recorded: Recorded, tmp_path: Path) -> None:
    def invoke(args: list[str]) -> Any:
        return on_stream(
            recorded, lambda store, url: asyncio.to_thread(CliRunner().invoke, app, [*args, "--nats-url", url])
        )

    out = tmp_path / "token-mean"
    result = invoke(["retrain", RUN, "--run-dir", str(recorded.run_dir), "--scheme", "norm=token-mean+clip=0.1",
                     "--steps", "2", "--out", str(out)])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "KL(behaviour)" in result.output
    lines = (out / "metrics.csv").read_text().splitlines()
    assert len(lines) == 3 and lines[0].startswith("step,")
    assert (out / "weights" / "v2" / "model.safetensors").is_file()

    bad = invoke(["retrain", RUN, "--run-dir", str(recorded.run_dir), "--scheme", "ppo"])
    assert bad.exit_code == 2 and "error: unknown scheme 'ppo'" in bad.output

    png = tmp_path / "plot.png"
    drawn = CliRunner().invoke(app, ["retrain", "--compare", str(out), "--plot", str(png)])
    assert drawn.exit_code == 0, drawn.output
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_a_validation_set_gets_fresh_rollouts_on_the_retrained_weights_through_the_stack(
    recorded: Recorded, tmp_path: Path
) -> None:
    """The stack up again on the run's data (`rollwire up`), the run's agents behind their fork server."""
    tasks = tmp_path / "val.jsonl"
    tasks.write_bytes(write_tasks_jsonl(make_tasks(3, seed=7)))
    with (
        fork_server(key=f"{recorded.stack_dir.resolve()}/{RUN}"),
        embedded_stack(recorded.stack_dir, recorded.model_dir, lambda line: None) as urls,
    ):
        stack: dict[str, str | None] = {
            "gateway_url": urls.gateway_url, "engine_url": urls.engine_url, "admin_token": urls.admin_token,
            "engine_urls": ",".join(urls.engine_urls), "engine_api_key": urls.engine_api_key,
        }  # fmt: skip
        options = RetrainOptions(run_dir=recorded.run_dir, out=tmp_path / "val", steps=2, validation=tasks,
                                 validation_every=1, stack=stack, nats_url=urls.nats_url)  # fmt: skip

        async def job() -> Any:
            store = await EventStore.connect(urls.nats_url)
            try:
                return await retrain_run(store, RUN, ["rloo"], options)
            finally:
                await store.close()

        (result,) = asyncio.run(job())
    for row in result.rows:
        assert row["val_rollouts"] == 3, row
        assert 0.0 <= row["val/reward"] <= 1.0
    assert "val/reward" in (tmp_path / "val" / "metrics.csv").read_text().splitlines()[0]
