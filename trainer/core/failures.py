"""Why a rollout failed, and whether the policy caused it: the failure policy's one decision.

A failed rollout is evidence about the policy when the policy made it fail: the agent ran past its
timeout (a loop of tool calls, an answer that never ends), exited with an error (a malformed tool
call it could not recover from), or its last call stopped at the length limit (a runaway answer).
Dropping such rollouts leaves the group's baseline computed over the survivors only, so the
behaviour that fails is never discouraged. They are scored with `AdapterConfig.failed_reward`
inside their group instead. A rollout the infrastructure failed (an image that cannot be pulled,
an eviction, a lost node or controller, a launch that never happened) says nothing about the
policy and is dropped. A failure whose reason names no known cause is dropped too.

The cause comes from what the controller knows, not from text: the final status event's `cause`
(`schemas.FailureCause`), which the controller sets from structured facts (which phase of the
execution ended and how: its exit code or signal, the container's termination reason, the
controller's own timeout). An evaluator's crash or timeout, a local OOM kill, a launch that never
happened are `infrastructure` there. The agent's log, which a failed status's `reason` may quote,
never decides. A policy-looking failure whose last recorded call the endpoint failed (the gateway
recorded a 5xx or an unreachable engine: `endpoint_failed`) is `infrastructure` too: the agent
exited because the engine was down.

Events written before `cause` existed fall back to patterns over the controller's own words: the
`reason` up to the log excerpt (`LOG_EXCERPT`) the controller appends.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Literal

FailureKind = Literal["timeout", "agent-error", "length", "infrastructure"]
POLICY_FAILURES: tuple[FailureKind, ...] = ("timeout", "agent-error", "length")

_INFRASTRUCTURE = re.compile(
    r"ImagePull|ErrImage|InvalidImageName|Evicted|Unschedulable|never started|not launched|stopped reporting|"
    r"supervisor died|deleted before it finished|removed from the backend|OOMKilled|CreateContainer|"
    r"has no execution",
    re.IGNORECASE,
)
_TIMEOUT = re.compile(r"timed out|DeadlineExceeded", re.IGNORECASE)
_AGENT_ERROR = re.compile(r"exited with code|exit code|killed by SIG", re.IGNORECASE)


LOG_EXCERPT = "\nlast lines of the log:"
"""Where a failed status's `reason` stops being the controller's words (`services/controller/decide.py`)."""
ENDPOINT_FAILED = ("the model endpoint", "HTTP 5")
"""How the gateway's record of a call the endpoint failed begins (502 or 504 of the proxy, a 5xx of the engine)."""


def endpoint_failed(error: str | None) -> bool:
    """True when a failed call's recorded error is the endpoint's failure (engine down, 5xx, timeout),
    not a refusal of what the agent sent."""
    return error is not None and error.startswith(ENDPOINT_FAILED)


def failure_kind(
    status: str,
    reason: str | None,
    last_finish_reason: str | None = None,
    cause: str | None = None,
    endpoint_down: bool = False,
) -> FailureKind | None:
    """The cause of a rollout's end: None when it succeeded or names no known cause, else its kind.

    `cause` is the controller's classification (used when given); `endpoint_down` says the
    attempt's last call failed at the endpoint. A policy failure whose last call stopped at the
    length limit is `length`.
    """
    if status == "succeeded":
        return None
    if status == "cancelled" or cause == "infrastructure":
        return "infrastructure"
    kind: FailureKind | None
    if cause in ("timeout", "agent-error"):
        kind = "timeout" if cause == "timeout" else "agent-error"
    else:
        kind = _from_words((reason or "").split(LOG_EXCERPT, 1)[0])
    if kind == "agent-error" and endpoint_down:
        return "infrastructure"
    if kind in ("timeout", "agent-error") and last_finish_reason == "length":
        return "length"
    return kind


def held_by_updates(start: float, end: float, updates: Sequence[tuple[float, float]]) -> bool:
    """True when the span [start, end] overlaps an update phase (`(began, ended)` pairs): in async
    mode the phase gate held the attempt's calls for part of its time limit."""
    return any(began < end and ended > start for began, ended in updates)


def _from_words(text: str) -> FailureKind | None:
    """The kind named by the controller's words (events without a `cause`): infrastructure first."""
    if _INFRASTRUCTURE.search(text):
        return "infrastructure"
    if _TIMEOUT.search(text):
        return "timeout"
    if _AGENT_ERROR.search(text):
        return "agent-error"
    return None
