"""What the controller does to a rollout: start an attempt and launch it, mark it running or ended,
kill or cancel it, and link the attempt's logs.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence

import msgspec

from schemas.events import LOG_EVENT
from schemas.runs import RunSpec
from services.common.retry import Backoff, retry_async
from services.controller import metrics
from services.controller.backends.base import (
    ExecutionBackend,
    ExecutionKey,
    ExecutionState,
    LaunchSpec,
    PermanentBackendError,
    RolloutKey,
    TemporaryBackendError,
)
from services.controller.decide import (
    Action,
    Forget,
    Kill,
    MarkEnded,
    MarkRunning,
    Relaunch,
    Start,
    after_failure,
    timeout_s,
)
from services.controller.gateway import (
    AttemptGrant,
    GatewayConflict,
)
from services.controller.pool import BackendPool
from services.controller.state import backend_id
from services.controller.view import NOT_LAUNCHED, Attempt, Rollout

log = logging.getLogger("rollwire.controller")

ATTEMPT_KEY = "rollwire-controller:{rollout}:{created}:{sequence}"
ECHO_TIMEOUT_S = 5.0
LAUNCH_RETRIES = 3
GATEWAY_DOWN_GRACE_S = 10.0
"""How soon after an agent's failed exit a gateway found unreachable still explains it."""
UNAVAILABLE_BACKOFF = Backoff(initial=0.5, maximum=30.0)
"""Delay before retrying a command the gateway, a backend or NATS could not take now."""


AGENT_DEFAULTS = {"OPENAI_AGENTS_DISABLE_TRACING": "1"}
"""Variables every agent gets unless its run's `env` sets them (see `attempt_env`)."""


def attempt_env(rollout: Rollout, spec: RunSpec, grant: AttemptGrant) -> dict[str, str]:
    """The agent's environment: defaults, the run's `env`, then the attempt's contract (which wins).

    The one default, `OPENAI_AGENTS_DISABLE_TRACING=1`, keeps the OpenAI Agents SDK from uploading
    traces to OpenAI's servers with the attempt token as the API key (its tracing is on by default
    and exports to api.openai.com whatever the base URL); a run's `env` may turn it back on.
    """
    env = {
        **AGENT_DEFAULTS,
        **spec.env,
        "OPENAI_BASE_URL": grant.proxy_base_url,
        "OPENAI_API_KEY": grant.token,
        "ANTHROPIC_BASE_URL": grant.anthropic_base_url,
        "ANTHROPIC_API_KEY": grant.token,
        "ROLLWIRE_TOKEN": grant.token,
        "ROLLWIRE_EVENTS_URL": grant.events_url,
        "ROLLWIRE_RUN_ID": rollout.run_id,
        "ROLLWIRE_ROLLOUT_ID": rollout.rollout_id,
        "ROLLWIRE_ATTEMPT_ID": grant.attempt_id,
        "ROLLWIRE_ATTEMPT_SEQUENCE": str(grant.sequence),
        "ROLLWIRE_MODE": rollout.mode,
    }
    if rollout.group_id:
        env["ROLLWIRE_GROUP_ID"] = rollout.group_id
    return env


AGENT_ONLY = ("OPENAI_API_KEY", "OPENAI_BASE_URL", "ANTHROPIC_API_KEY", "ANTHROPIC_BASE_URL")


def evaluator_env(agent: dict[str, str], token: str) -> dict[str, str]:
    """The evaluator's environment: the agent's, minus the agent's token and proxy, plus its own token."""
    env = {k: v for k, v in agent.items() if k not in AGENT_ONLY}
    env["ROLLWIRE_TOKEN"] = token
    return env


def _with_attempt(view: Rollout, grant: AttemptGrant) -> Rollout:
    """The view as it will be once the stream shows the attempt just started."""
    if any(a.attempt_id == grant.attempt_id for a in view.attempts):
        return view
    attempt = Attempt(attempt_id=grant.attempt_id, sequence=grant.sequence, started_at=time.time())
    return msgspec.structs.replace(view, attempts=(*view.attempts, attempt), status="preparing")


class Launcher(BackendPool):
    """Part of `Controller` (`reconciler.py`); see the module docstring."""

    async def _act(self, key: RolloutKey, actions: Sequence[Action]) -> None:
        for action in actions:
            match action:
                case Kill(attempt_id=aid, reason=reason):
                    log.info("stopping rollout %s attempt %s: %s", key.rollout_id, aid, reason)
                    await self._cancel(key, aid)
                    self.stats["killed"] += 1
                case Forget(attempt_id=aid):
                    await self._cancel(key, aid)
                    self._logged.discard(aid)
                case MarkRunning(attempt_id=aid):
                    await self._set_status(key, "running", aid, None)
                    self._link_logs(key, aid)
                    self.stats["running"] += 1
                case MarkEnded(attempt_id=aid, status=status, reason=reason, cause=cause):
                    if cause == "agent-error" and self._gateway_down_for(key, aid):
                        cause = "infrastructure"
                    await self._set_status(key, status, aid, reason, cause)
                    if aid is not None:
                        self._link_logs(key, aid)
                    self.stats[status] += 1
                    if status != "succeeded":
                        log.info("rollout %s attempt %s -> %s: %s", key.rollout_id, aid, status, reason)
                case Relaunch():
                    spec = self.specs.get(key.run_id)
                    if not isinstance(spec, RunSpec):
                        return
                    bid = backend_id(spec)
                    backend = await self._ensure_backend(bid)
                    if backend is None:
                        self._retry_later(key, self.settings.resync_s)
                        return
                    await self._start(key, spec, bid, backend, action)
                case Start():
                    raise AssertionError("starts are admitted by _admit")

    async def _cancel(self, key: RolloutKey, attempt_id: str) -> None:
        execution = ExecutionKey(key.run_id, key.rollout_id, attempt_id)
        backend = self.backends.get(self.owner.get(execution, ""))
        if backend is not None:
            await backend.cancel(execution)
        self.executions.get(key, {}).pop(attempt_id, None)
        self.owner.pop(execution, None)
        self.seen_at.pop(execution, None)

    def _gateway_down_for(self, key: RolloutKey, attempt_id: str | None) -> bool:
        """Whether this controller found the gateway unreachable while the attempt's execution ran or
        just after it exited (`GATEWAY_DOWN_GRACE_S`): the agent's error may be the gateway's."""
        state = self.executions.get(key, {}).get(attempt_id) if attempt_id else None
        down = self.gateway.unreachable_at
        if state is None or not down or state.finished_at is None:
            return False
        return (state.started_at or 0.0) <= down <= state.finished_at + GATEWAY_DOWN_GRACE_S

    async def _set_status(
        self, key: RolloutKey, status: str, attempt_id: str | None, reason: str | None, cause: str | None = None
    ) -> None:
        idem = f"rollwire-controller:{key.rollout_id}:{attempt_id or '-'}:{status}"
        began = time.monotonic()
        seq = await self.gateway.set_status(
            key.rollout_id, status, attempt_id=attempt_id, reason=reason, key=idem, cause=cause
        )
        spec = self.specs.get(key.run_id)
        backend = spec.backend if isinstance(spec, RunSpec) else "unknown"
        metrics.status_written(key.run_id, key.rollout_id, backend, status, reason)
        log.debug("rollout %s -> %s in %.0f ms", key.rollout_id, status, (time.monotonic() - began) * 1000)
        self._awaiting[key] = (seq, time.time() + ECHO_TIMEOUT_S)

    def _link_logs(self, key: RolloutKey, attempt_id: str) -> None:
        """Link the execution's logs from the rollout: a custom event `log`, once per attempt.

        Posted in the background, after the status change it accompanies, so it never delays one.
        """
        if attempt_id in self._logged:
            return
        state = self.executions.get(key, {}).get(attempt_id)
        if state is None or not state.log_location:
            return
        self._logged.add(attempt_id)
        self._spawn(self._post_log(key, attempt_id, state))

    async def _post_log(self, key: RolloutKey, attempt_id: str, state: ExecutionState) -> None:
        execution = ExecutionKey(key.run_id, key.rollout_id, attempt_id)
        body = {
            "type": "custom",
            "name": LOG_EVENT,
            "payload": {
                "attempt_id": attempt_id,
                "backend": self.owner.get(execution),
                "log_location": state.log_location,
                "execution": state.execution,
            },
        }
        try:
            await self.gateway.post_event(key.rollout_id, attempt_id, body, f"rollwire-controller:{attempt_id}:log")
        except Exception as exc:
            log.warning("could not link the logs of rollout %s attempt %s: %s", key.rollout_id, attempt_id, exc)

    async def _start(
        self, key: RolloutKey, spec: RunSpec, bid: str, backend: ExecutionBackend, relaunch: Relaunch | None
    ) -> None:
        """Start (or, after a restart, resume) an attempt and launch its execution."""
        view = self.rollouts[key]
        if spec.backend == "local" and not spec.command:
            reason = f"run {spec.run_id} sets no command: the local backend needs RunSpec.command (an argv list)"
            attempt_id = view.current.attempt_id if view.current else None
            await self._set_status(key, "failed", attempt_id, reason, "infrastructure")
            return
        sequence = relaunch.sequence if relaunch else len(view.attempts) + 1
        idem = ATTEMPT_KEY.format(rollout=key.rollout_id, created=view.created_seq, sequence=sequence)
        began = time.monotonic()
        try:
            grant = await self.gateway.start_attempt(key.rollout_id, backend.name, idem)
        except GatewayConflict:
            if relaunch is None:
                raise
            # The preparing attempt was not started under this controller's key: nobody can
            # launch it with its token, so it ends here.
            await self._refresh(key)
            view = self.rollouts.get(key, view)
            if view.status == "preparing" and view.current and view.current.attempt_id == relaunch.attempt_id:
                reason = f"attempt {relaunch.sequence} has no execution and was not started by this controller"
                await self._end(key, view, reason)
            return
        started = time.monotonic()
        self._awaiting[key] = (grant.seq, time.time() + ECHO_TIMEOUT_S)
        if relaunch is not None and grant.attempt_id != relaunch.attempt_id:
            raise GatewayConflict(f"relaunch of {relaunch.attempt_id} got attempt {grant.attempt_id}", None)
        launch = await self._launch_spec(key, view, spec, grant)
        try:  # a TemporaryBackendError past the retries leaves it preparing: the next look relaunches it
            await retry_async(
                lambda: backend.launch(launch),
                backoff=UNAVAILABLE_BACKOFF,  # a backend's own `retry_after` wins
                transient=(TemporaryBackendError,),
                retries=LAUNCH_RETRIES - 1,
            )
        except PermanentBackendError as exc:
            with_attempt = _with_attempt(view, grant)
            await self._end(key, with_attempt, f"cannot launch attempt {grant.sequence}: {exc}")
            return
        self.stats["launched"] += 1
        queued = view.status_time if view.status in ("queuing", "requeuing") else None
        metrics.launched(key.run_id, key.rollout_id, bid, grant.sequence, queued)
        log.debug(
            "rollout %s attempt %s launched in %.0f ms (start attempt %.0f ms)",
            key.rollout_id,
            grant.sequence,
            (time.monotonic() - began) * 1000,
            (started - began) * 1000,
        )
        known = self.executions.setdefault(key, {}).get(grant.attempt_id)
        if known is None or (known.phase == "failed" and (known.reason or "").startswith(NOT_LAUNCHED)):
            # Until the backend's watch reports it: counted against capacity, never relaunched.
            self._on_state(bid, ExecutionState(key=launch.key, phase="pending"))

    async def _launch_spec(self, key: RolloutKey, view: Rollout, spec: RunSpec, grant: AttemptGrant) -> LaunchSpec:
        """What the backend runs for a granted attempt: the agent (command, environment, input), the evaluator."""
        env = attempt_env(view, spec, grant)
        eval_env = None
        if spec.evaluator_command:
            eval_env = evaluator_env(env, await self.gateway.evaluator_token(key.rollout_id, grant.attempt_id))
        return LaunchSpec(
            key=ExecutionKey(key.run_id, key.rollout_id, grant.attempt_id),
            env=env,
            input_json=json.dumps(view.input),
            timeout_s=timeout_s(view, spec),
            command=list(spec.command) or None,
            evaluator_command=list(spec.evaluator_command) if spec.evaluator_command else None,
            evaluator_env=eval_env,
            image=spec.image,
        )

    async def _end(self, key: RolloutKey, view: Rollout, reason: str) -> None:
        step = after_failure(view, reason, "infrastructure")  # a launch that could not happen
        await self._set_status(key, step.status, step.attempt_id, step.reason, step.cause)
