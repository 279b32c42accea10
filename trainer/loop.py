"""The training loop: declare rollouts, wait for them to end, replay them, update, serve the new weights.

One step, in both modes:

1. declare task groups through the gateway: each task of the dataset runs `rollouts_per_task`
   times under one group id (the unit of the advantage baseline);
2. wait, on the run's status subjects, until enough groups have ended;
3. replay each ended rollout's events and build the step's samples with `trainer.core`;
4. switch the gateway's phase to `update` (new model calls are held, calls in flight finish),
   take the optimizer step, save the weights as version v+1 (safetensors), make the engine serve
   them (`POST /reload`), and switch the phase back to `rollout` with v+1, which releases the
   held calls; the engine stamps every later call with v+1 and the proxy records it;
5. checkpoint, and log the step's metrics.

**sync**: each step declares `tasks_per_step` groups and waits for all of them.
**async** (collocated): up to `max_groups_in_flight` groups run at all times and the step waits
only for `min_groups` of them; rollouts still running keep going across the update and finish on
the new weights, so their calls carry both versions. Calls more than `max_staleness` versions
behind the weights being trained are dropped before merging (their tokens stay in later prompts
as context, never trained), and the loss's ratio clipping bounds what the kept ones contribute.

Every write to the gateway has an idempotency key derived from the run and the step, and
rollout ids follow from the number of tasks consumed, so a run resumed from its checkpoint
re-declares the very same rollouts instead of new ones.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec

from schemas.events import TERMINAL_STATUSES, CustomEvent
from services.common.eventstore import EventStore
from services.common.gateway_api import GatewayClient, NewRollout
from trainer.backends.base import TrainingBackend, UpdateMetrics
from trainer.backends.factory import build_backend
from trainer.checkpoint import InFlightGroup, RunDir, TrainerState
from trainer.clients import ServiceUrls, gateway_client
from trainer.core import (
    TRAIN_STEP_EVENT,
    RolloutCalls,
    StepBatch,
    build_step,
    drop_stale_calls,
    rollout_reward,
    sample_row,
)
from trainer.dataset import TaskOrder, load_jsonl
from trainer.engines import ServingEngine, connect_engine, register_replicas
from trainer.loggers import open_sinks, tensorboard_dir
from trainer.metrics import MetricsLog, plot_curves
from trainer.relaunch import wait_relaunching
from trainer.rollouts import ReplayedGroup, StatusWatch, replay_group, update_spans
from trainer.run.load import config_to_mapping
from trainer.run.models import trained_adapter, trained_models
from trainer.run.other_models import OtherModels
from trainer.run.sections import TrainConfig
from trainer.run.spec import run_spec
from trainer.step_row import step_row
from trainer.validation import VAL_REWARD, ValidationPass, first_and_last_pass

Row = dict[str, Any]


class TrainingError(RuntimeError):
    """The run cannot go on; the message says why and where to look."""


def _digest(text: str, length: int = 12) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:length]


class Trainer:
    """Runs the loop of the module docstring for one `TrainConfig` against running services."""

    def __init__(
        self,
        config: TrainConfig,
        urls: ServiceUrls,
        *,
        on_step: Callable[[Row], None] | None = None,
        say: Callable[[str], None] = print,
    ) -> None:
        self.config = config
        self.urls = urls
        self.on_step = on_step
        self.say = say
        self.run_id = config.run.name
        self.run_dir = RunDir(config.run_dir)
        self.tasks = load_jsonl(Path(config.data.path))
        self.order = TaskOrder(len(self.tasks), config.run.seed, config.data.shuffle)
        self.metrics: MetricsLog | None = None
        self.backend: TrainingBackend | None = None
        self.adapter = trained_adapter(config.adapter, trained_models(config))
        self.others = OtherModels(config, self.run_dir.root, self.adapter)
        self._others_row: Row = {}
        self.validation = ValidationPass(config.validation, self.run_id, self.adapter) if config.validation else None
        self._resumed = False

    # ---- setup ---------------------------------------------------------------------------------

    def _prepare(self) -> TrainerState:
        """Load the model (from the checkpoint when resuming) and write the run's config."""
        config = self.config
        self.run_dir.ensure()
        (self.run_dir.root / "config.json").write_text(json.dumps(config_to_mapping(config), indent=2))
        resumed = self.run_dir.latest_checkpoint() if config.run.resume else None
        self.backend = build_backend(config)
        self.others.prepare()
        if resumed is not None:
            state, backend_state = resumed
            self.backend.load_weights(self.run_dir.weights(state.weights_version))
            self.backend.load_state(backend_state)
            self.say(f"resuming {self.run_id} after step {state.step} (weights v{state.weights_version})")
            self._resumed = True
        else:
            state = TrainerState(run_id=self.run_id, step=0, weights_version=0, tasks_consumed=0)
            self.backend.save_weights(self.run_dir.weights(0))
        self.metrics = MetricsLog(
            self.run_dir.metrics_csv,
            tensorboard_dir(config, self.run_dir.tensorboard),
            resume_after=state.step if resumed is not None else None,
            sinks=open_sinks(config, self.say),
        )
        return state

    def run_spec(self) -> dict[str, Any]:
        """The run's executor settings, as the gateway records them (`RunSpec`, `trainer.run.spec.run_spec`)."""
        return msgspec.to_builtins(run_spec(self.config, self.run_id))

    # ---- the loop ------------------------------------------------------------------------------

    async def run(self) -> list[Row]:
        """Train for the configured number of steps (continuing a checkpoint if there is one)."""
        state = await asyncio.to_thread(self._prepare)
        store = await EventStore.connect(self.urls.nats_url)
        gateway = gateway_client(self.urls)
        engine = await connect_engine(self.config, self.urls)
        watch = StatusWatch(store, self.run_id)
        rows: list[Row] = []
        in_flight = list(state.in_flight)
        try:
            await gateway.start_run(self.run_spec())
            await self._serve(engine, gateway, state.weights_version)
            await self.others.serve(gateway, self.run_id)
            await watch.start(await store.last_sequence())
            if in_flight:
                await watch.adopt(r for g in in_flight for r in g.rollout_ids)
            started = time.monotonic() - state.elapsed_s
            if self.validation is not None and self.validation.section.at_start and state.step == 0:
                await self._validate_at_start(gateway, watch, store)
            for step in range(state.step + 1, self.config.run.steps + 1):
                state, in_flight, row = await self._step(step, state, in_flight, store, gateway, engine, watch, started)
                rows.append(row)
            for group in in_flight:
                for rollout_id in group.rollout_ids:
                    if rollout_id not in watch.ended:
                        await gateway.cancel_rollout(rollout_id, "the training run finished")
            self._finish()
        finally:
            await watch.stop()
            await self.others.close()
            await gateway.close()
            await engine.close()
            await store.close()
            if self.metrics is not None:
                self.metrics.close()
            if self.backend is not None:
                await asyncio.to_thread(self.backend.close)
        return rows

    async def _validate_at_start(self, gateway: GatewayClient, watch: StatusWatch, store: EventStore) -> None:
        """The validation pass on the starting weights, recorded as step 0 (`[validation] at_start`)."""
        assert self.validation is not None and self.metrics is not None
        row: Row = {"step": 0, "weights_version": 0}
        row |= await self.validation.run(0, gateway, watch, store)
        self.metrics.add(row)
        held = row.get(VAL_REWARD)
        self.say(f"held-out reward before training: {'none' if held is None else f'{held:.3f}'}")

    def _finish(self) -> None:
        """The reward curve (`reward_curve.png`: training and held-out reward per step) and held-out before/after."""
        if self.metrics is None or not self.metrics.rows:
            return
        keys = ("reward_mean", *self.config.run.plot, VAL_REWARD)
        curve = plot_curves(self.metrics, self.run_dir.reward_curve, keys, title=self.run_id)
        line = f"reward curve: {curve}"
        if (passes := first_and_last_pass(self.metrics)) is not None:
            (first, before), (last, after) = passes
            line += f"; held-out reward {before:.3f} (step {first}) -> {after:.3f} (step {last})"
        self.say(line)

    async def _serve(self, engine: ServingEngine, gateway: GatewayClient, version: int) -> None:
        """Make every engine replica serve the run's current weights and route the run's calls to them."""
        await engine.load(self.run_dir.weights(version).resolve(), version)
        model = self.config.model
        tokenizer = model.path if model.prompt_mode == "continuous" else None  # vLLM serves no tokenizer
        reasoning = model.reasoning_parser
        await register_replicas(
            gateway, engine, self.run_id, model.served_name, tokenizer=tokenizer, reasoning_parser=reasoning
        )
        # No idempotency key: a resumed run must reopen a gate its crash may have left closed.
        await gateway.set_phase(self.run_id, "rollout", version, key=None)

    def _declare(self, state: TrainerState, in_flight: list[InFlightGroup]) -> tuple[list[InFlightGroup], int]:
        """New groups to top the run up to its target of groups in flight; returns them and the task count."""
        config = self.config
        target = config.data.tasks_per_step if config.run.mode == "sync" else config.max_groups_in_flight()
        consumed = state.tasks_consumed
        fresh: list[InFlightGroup] = []
        while len(in_flight) + len(fresh) < target:
            group_id = f"{self.run_id}-g{consumed}"
            fresh.append(
                InFlightGroup(
                    group_id=group_id,
                    rollout_ids=[f"{group_id}-r{j}" for j in range(config.data.rollouts_per_task)],
                    task_index=consumed,
                    created_version=state.weights_version,
                )
            )
            consumed += 1
        return fresh, consumed

    async def _step(
        self,
        step: int,
        state: TrainerState,
        in_flight: list[InFlightGroup],
        store: EventStore,
        gateway: GatewayClient,
        engine: ServingEngine,
        watch: StatusWatch,
        started: float,
    ) -> tuple[TrainerState, list[InFlightGroup], Row]:
        """One step of the module docstring: declare, wait, replay, update and serve, checkpoint."""
        assert self.metrics is not None
        step_start = time.monotonic()
        version = state.weights_version
        in_flight, consumed = await self._top_up(step, state, in_flight, gateway, watch)
        need = self.config.data.tasks_per_step if self.config.run.mode == "sync" else self.config.min_groups()
        # The first step after a resume relaunches the rollouts a crash lost (`trainer.relaunch`).
        suspect = {r for g in in_flight for r in g.rollout_ids} if self._resumed else set()
        self._resumed = False
        in_flight, ended = await wait_relaunching(
            watch, store, gateway, self.run_id, step, in_flight, need, suspect, self._task_input
        )
        in_flight = [g for g in in_flight if g not in ended]
        waited = time.monotonic()
        replayed, batch, stale = await self._gather(step, state, ended, store)
        times: dict[str, float] = {"wait": waited - step_start, "replay": time.monotonic() - waited}
        update, new_version = await self._train_and_serve(step, version, batch, gateway, engine, times)
        done = time.monotonic()
        times["step"] = done - step_start
        state = TrainerState(
            run_id=self.run_id,
            step=step,
            weights_version=new_version,
            tasks_consumed=consumed,
            in_flight=in_flight,
            elapsed_s=done - started,
        )
        await asyncio.to_thread(self._checkpoint, state)
        row = step_row(step, new_version, replayed, batch, stale, version, update, times, self.adapter)
        row |= self._others_row
        if self.validation is not None and self.validation.due(step):
            row |= await self.validation.run(step, gateway, watch, store)
        row["elapsed_s"] = round(time.monotonic() - started, 3)
        self.metrics.add(row)
        if self.on_step is not None:
            self.on_step(row)
        return state, in_flight, row

    async def _top_up(
        self,
        step: int,
        state: TrainerState,
        in_flight: list[InFlightGroup],
        gateway: GatewayClient,
        watch: StatusWatch,
    ) -> tuple[list[InFlightGroup], int]:
        """Declare the groups that bring the run up to its target in flight; returns them all and the task count."""
        fresh, consumed = self._declare(state, in_flight)
        if not fresh:
            return in_flight, consumed
        declared = [
            NewRollout(
                rollout_id=rollout_id,
                group_id=group.group_id,
                input=self._task_input(group.task_index),
                metadata={"task_index": group.task_index, "step": step, "group_size": len(group.rollout_ids)},
            )
            for group in fresh
            for rollout_id in group.rollout_ids
        ]
        key = f"{self.run_id}-declare-{fresh[0].task_index}-{fresh[-1].task_index}"
        for record in await gateway.create_rollouts(self.run_id, declared, key=key):
            status = record.get("state")
            if status in TERMINAL_STATUSES:  # declared before a crash, already over
                watch.ended[str(record["rollout_id"])] = str(status)
        return in_flight + fresh, consumed

    def _task_input(self, task_index: int) -> Any:
        """The input of the task at `task_index` of the run's task order."""
        return self.tasks[self.order.index(task_index)]

    async def _gather(
        self, step: int, state: TrainerState, ended: Sequence[InFlightGroup], store: EventStore
    ) -> tuple[list[ReplayedGroup], StepBatch, int]:
        """Replay the ended groups and build the step's samples; records what was trained and writes the samples."""
        config = self.config
        updates = await update_spans(store, self.run_id) if config.run.mode == "async" else []
        select = self.adapter.selection()
        replayed = [await replay_group(store, self.run_id, group, select, updates) for group in ended]
        rollouts = [r for g in replayed for r in g.rollouts]
        if replayed and not rollouts and (step == 1 or state.step == 0):
            reasons = sorted({reason for g in replayed for reason in g.skipped.values()})
            raise TrainingError(
                f"no rollout of step {step} succeeded ({', '.join(reasons)}); check the agent command "
                "and its logs under the stack's data dir (executions/)"
            )
        stale = 0
        if config.run.mode == "async":
            rollouts, stale = drop_stale_calls(rollouts, state.weights_version, config.async_.max_staleness)
        main = self.config.model.served_name  # each trained model learns from its own calls only
        batch = build_step([r.for_model(main) for r in rollouts], self.adapter.for_models((main,)))
        self.others.cut(rollouts)
        await self._record_step(store, step, state.weights_version, rollouts)
        await asyncio.to_thread(self._write_samples, step, rollouts, batch)
        return replayed, batch, stale

    async def _train_and_serve(
        self,
        step: int,
        version: int,
        batch: StepBatch,
        gateway: GatewayClient,
        engine: ServingEngine,
        times: dict[str, float],
    ) -> tuple[UpdateMetrics | None, int]:
        """Inside the phase gate: update, save v+1 and make every replica serve it; returns the update and version.

        A replica that fails to load the new weights fails the step with the engine's error, and the
        gate stays closed: no call runs on weights the trainer cannot vouch for.
        """
        assert self.backend is not None
        update: UpdateMetrics | None = None
        new_version = version
        mark = time.monotonic()
        await gateway.set_phase(self.run_id, "update", version, key=f"{self.run_id}-update-{step}")
        times["drain"] = time.monotonic() - mark
        mark = time.monotonic()
        if batch.samples:
            update = await asyncio.to_thread(self.backend.update, batch.samples)
            times["update"] = time.monotonic() - mark
            mark = time.monotonic()
        if update is not None and update.optimizer_steps:  # else nothing changed: no new version
            new_version = version + 1
            path = await asyncio.to_thread(self.backend.save_weights, self.run_dir.weights(new_version))
            times["save"] = time.monotonic() - mark
            mark = time.monotonic()
            await engine.load(path.resolve(), new_version)
        self._others_row = await self.others.update()  # the run's other trained models, same gate
        await gateway.set_phase(self.run_id, "rollout", new_version, key=f"{self.run_id}-rollout-{step}")
        times["reload"] = time.monotonic() - mark
        return update, new_version

    async def _record_step(self, store: EventStore, step: int, version: int, rollouts: Sequence[RolloutCalls]) -> None:
        """A `train_step` custom event on each rollout this step trains: what `rollwire replay --step` reads.

        The payload carries everything the replay needs to rebuild the step exactly: the step, the
        weights version trained, the staleness limit applied (async) and the adapter config. Event
        ids follow from run, rollout and step, so a step retried after a crash records nothing twice.
        """
        config = self.config
        payload = {
            "step": step,
            "weights_version": version,
            "max_staleness": config.async_.max_staleness if config.run.mode == "async" else None,
            "adapter": msgspec.to_builtins(self.adapter),
        }
        await store.append_many(
            CustomEvent(
                run_id=self.run_id,
                rollout_id=rollout.rollout_id,
                name=TRAIN_STEP_EVENT,
                payload=payload,
                event_id=_digest(f"{self.run_id}/{rollout.rollout_id}/{step}", 32),
            )
            for rollout in rollouts
        )

    def _write_samples(self, step: int, rollouts: Sequence[RolloutCalls], batch: StepBatch) -> None:
        """The step's samples as `rollwire replay --format json` reports them, for audit and comparison."""
        rewards = {r.rollout_id: rollout_reward(r, self.adapter) for r in rollouts}
        rows = (
            sample_row(
                s, step=step, reward=rewards[s.rollout_id] or 0.0, advantage=s.advantage, token_weight=s.token_weight
            )
            for s in batch.samples
        )
        path = self.run_dir.samples(step)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"".join(msgspec.json.encode(row) + b"\n" for row in rows))

    def _checkpoint(self, state: TrainerState) -> None:
        assert self.backend is not None
        self.run_dir.save_checkpoint(state, self.backend.state())
        keep = self.config.run.keep_weights
        self.run_dir.prune(keep_checkpoints=2, keep_weights=keep, protect={0, state.weights_version})
