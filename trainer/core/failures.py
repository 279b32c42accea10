"""Why a rollout failed, and whether the policy caused it: the failure policy's one decision.

A failed rollout is evidence about the policy when the policy made it fail: the agent ran past its
timeout (a loop of tool calls, an answer that never ends), exited with an error (a malformed tool
call it could not recover from), or its last call stopped at the length limit (a runaway answer).
Dropping such rollouts leaves the group's baseline computed over the survivors only, so the
behaviour that fails is never discouraged. They are scored with `AdapterConfig.failed_reward`
inside their group instead. A rollout the infrastructure failed (an image that cannot be pulled,
an eviction, a lost node or controller, a launch that never happened) says nothing about the
policy and is dropped. A failure whose reason names no known cause is dropped too.

The reason is the controller's text on the final `failed` status event (`services/controller`:
`decide.py`, `backends/local.py`, `backends/k8s_state.py` write it); the patterns below follow it.
"""

from __future__ import annotations

import re
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


def failure_kind(status: str, reason: str | None, last_finish_reason: str | None = None) -> FailureKind | None:
    """The cause of a rollout's end: None when it succeeded or names no known cause, else its kind.

    Infrastructure patterns are checked first (a pod that never started may also have timed out);
    a policy failure whose last call stopped at the length limit is `length`.
    """
    if status == "succeeded":
        return None
    if status == "cancelled":
        return "infrastructure"
    text = reason or ""
    if _INFRASTRUCTURE.search(text):
        return "infrastructure"
    kind: FailureKind | None = None
    if _TIMEOUT.search(text):
        kind = "timeout"
    elif _AGENT_ERROR.search(text):
        kind = "agent-error"
    if kind is not None and last_finish_reason == "length":
        return "length"
    return kind
