"""The contract between the controller and an executor: how an attempt becomes a running agent.

The controller owns no state. It reads what should run from the event stream and what does run
from its backend, and acts on the difference. A backend is therefore a thin, honest adapter to
one executor (Kubernetes Jobs, local processes): it starts executions, lists and watches them,
and stops or deletes them. It never decides about retries, attempts or rollout status; those are
the controller's.

One execution per attempt, named by `ExecutionKey(run_id, rollout_id, attempt_id)`. Every method
is keyed by it, and every method is safe to repeat:

    launch(spec)     start the execution of `spec.key`; launching a key that exists is a no-op
    list()           every execution this backend owns, as the executor reports it now
    watch()          the state of each execution as it changes (a snapshot first, then changes)
    cancel(key)      stop and delete one execution; an unknown key is a no-op
    cleanup(keep)    delete every execution whose rollout is not in `keep`; returns how many
    close()          release connections and threads; executions keep running

What the agent receives (every backend, same names; see `services/agentkit/`):

    the `LaunchSpec.env` variables as given (OPENAI_BASE_URL, OPENAI_API_KEY, ANTHROPIC_BASE_URL,
    ANTHROPIC_API_KEY, ROLLWIRE_TOKEN,
    ROLLWIRE_EVENTS_URL, ROLLWIRE_RUN_ID, ROLLWIRE_ROLLOUT_ID, ROLLWIRE_ATTEMPT_ID, ...), plus
    ROLLWIRE_INPUT       `input_json` itself, when it is at most `INPUT_ENV_LIMIT` bytes
    ROLLWIRE_INPUT_FILE  a file holding `input_json` (always set)

If `evaluator_command` is set, the evaluator runs after the agent has exited 0, in the agent's
workspace, with `evaluator_env` (its own token) instead of the agent's `env`; the execution
succeeds only if both exit 0. The agent never sees the evaluator's token.

Errors are sorted the way an operator acts on them (as in kopf): `TemporaryBackendError` means
"try the same call again after `retry_after` seconds" (the executor is unreachable, throttling,
or out of quota), `PermanentBackendError` means "record the reason and stop": repeating the call
cannot succeed until a person changes something (a bad template, missing permissions), and the
message says what to change.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Collection
from typing import Literal, Protocol, runtime_checkable

import msgspec

from schemas import FailureCause

ExecutionPhase = Literal["pending", "running", "succeeded", "failed", "unknown"]
TERMINAL_PHASES: frozenset[str] = frozenset({"succeeded", "failed"})

INPUT_ENV = "ROLLWIRE_INPUT"
INPUT_FILE_ENV = "ROLLWIRE_INPUT_FILE"
INPUT_ENV_LIMIT = 32 * 1024
"""Inputs up to this many bytes are also passed in the ROLLWIRE_INPUT variable (environments are small)."""


class RolloutKey(msgspec.Struct, frozen=True):
    """A rollout of a run: what `cleanup` keeps."""

    run_id: str
    rollout_id: str


class ExecutionKey(msgspec.Struct, frozen=True):
    """The one execution of one attempt of a rollout. Hashable; equal keys name the same execution."""

    run_id: str
    rollout_id: str
    attempt_id: str

    @property
    def rollout(self) -> RolloutKey:
        """The rollout this execution belongs to."""
        return RolloutKey(self.run_id, self.rollout_id)


class LaunchSpec(msgspec.Struct, frozen=True, kw_only=True):
    """Everything a backend needs to start one attempt's execution.

    `command` replaces the agent's command (None: the backend's default, e.g. the Job template's).
    `timeout_s` is a hard limit enforced by the executor itself, so it holds even while no
    controller runs. `labels` are extra executor labels (Kubernetes label syntax), for a person's
    `kubectl get -l`. `image` fills the Kubernetes template's `{{ image }}`; other backends ignore it.
    """

    key: ExecutionKey
    env: dict[str, str]
    input_json: str
    timeout_s: float
    command: list[str] | None = None
    evaluator_command: list[str] | None = None
    evaluator_env: dict[str, str] | None = None
    labels: dict[str, str] = {}
    image: str | None = None


class ExecutionState(msgspec.Struct, frozen=True, kw_only=True):
    """One execution as the executor reports it.

    `reason` is for a person, and says what to do when it can: "exit code 3 in container 'agent':
    <last log line>", "OOMKilled: ...", "DeadlineExceeded: ...", "ImagePullBackOff: cannot pull
    image 'x' ...", "Evicted from node n: ...". A `pending` execution may carry a reason too (it is
    stuck: unschedulable, image not pulled yet). Times are Unix seconds. `log_location` tells a
    person where the whole log is (a command or a path); `log_tail` holds the last lines of a
    failed execution's log.

    An execution that cannot start (an image that cannot be pulled, for longer than the
    backend's grace period) is reported `failed` although the executor may still hold it:
    `cancel` or `cleanup` releases it.

    `deleted` is True on the last state `watch` reports for an execution that no longer exists
    (cancelled, cleaned up, expired, or deleted by a person). If it had not finished, its phase
    is `failed` with a reason saying so; otherwise it keeps its final phase. `list` never
    returns deleted executions.
    """

    key: ExecutionKey
    phase: ExecutionPhase
    reason: str | None = None
    exit_code: int | None = None
    started_at: float | None = None
    finished_at: float | None = None
    log_location: str | None = None
    log_tail: str | None = None
    execution: str | None = None
    deleted: bool = False
    cause: FailureCause | None = None
    """A failed execution's cause as the backend knows it from structured facts (which phase ended,
    how, its exit code or signal, the container's termination reason), never from log text."""

    @property
    def terminal(self) -> bool:
        """True once the execution has ended (succeeded or failed)."""
        return self.phase in TERMINAL_PHASES


class BackendError(Exception):
    """A backend call failed; see the two subclasses for what to do about it."""


class TemporaryBackendError(BackendError):
    """The call may succeed if repeated later: retry after `retry_after` seconds."""

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class PermanentBackendError(BackendError):
    """Repeating the call cannot help until a person changes something; the message says what."""


@runtime_checkable
class ExecutionBackend(Protocol):
    """What every executor implements. See the module docstring for the rules all methods share.

    `name` goes into `AttemptStarted.executor` ("kubernetes", "local"). `capacity` is the most
    executions that may be unfinished at once (None: no limit); the controller keeps to it when it
    launches, the backend does not queue.
    """

    name: str
    capacity: int | None

    async def launch(self, spec: LaunchSpec) -> None:
        """Start the execution of `spec.key` (idempotent: an existing execution is left as it is).

        Returning means the executor has accepted the execution, not that it runs yet.
        Raises `TemporaryBackendError` or `PermanentBackendError`.
        """
        ...

    async def list(self) -> list[ExecutionState]:
        """Every execution this backend owns, finished or not, as the executor reports it now."""
        ...

    async def cancel(self, key: ExecutionKey) -> None:
        """Stop the execution of `key` and delete it; a key with no execution is not an error."""
        ...

    async def cleanup(self, keep: Collection[RolloutKey]) -> int:
        """Delete every execution (finished or not) whose rollout is not in `keep`; return the count."""
        ...

    def watch(self) -> AsyncIterator[ExecutionState]:
        """Yield the current state of every execution, then each state change as it happens.

        States are levels, not edges: a state may repeat, and one consumer may miss intermediate
        states but always gets the latest. Changes of one execution come in order. Iteration
        ends when the backend is closed. Several watchers may run at once. Executor errors do
        not end the iteration: the backend retries (and re-lists) by itself.
        """
        ...

    async def close(self) -> None:
        """Release connections, threads and watchers. Executions are left running."""
        ...
