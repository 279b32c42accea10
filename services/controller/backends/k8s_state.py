"""What a Job and its pods say about an execution: a pure function to `ExecutionState`.

The Job's conditions decide whether it ended (`Complete`/`SuccessCriteriaMet`: succeeded,
`Failed`/`FailureTarget`: failed); its pods say why, and what a person should do:

    DeadlineExceeded   the Job outlived activeDeadlineSeconds (the attempt's timeout)
    Evicted            the kubelet evicted the pod (node pressure), with the node's message
    OOMKilled          a container exceeded its memory limit
    exit code N        a container failed; the caller adds the last log line (`log_tail`)
    ImagePullBackOff, ErrImagePull, InvalidImageName, CreateContainerConfigError
                       the pod cannot start; reported `pending` with the reason, then `failed`
                       once the pod has been stuck for `stuck_grace_s` (a registry hiccup
                       heals; a wrong image name does not)

A Job that has not ended is `running` once any of its containers runs, `unknown` if its node
stopped reporting, and `pending` otherwise (with a reason when the pod is unschedulable).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

import msgspec

from schemas import FailureCause
from services.controller.backends.base import ExecutionKey, ExecutionState
from services.controller.backends.k8s_template import EVALUATOR_CONTAINER

Obj = dict[str, Any]

STUCK_REASONS = frozenset(
    {
        "ImagePullBackOff",
        "ErrImagePull",
        "InvalidImageName",
        "ErrImageNeverPull",
        "CreateContainerConfigError",
        "CreateContainerError",
    }
)
_PULL_REASONS = frozenset({"ImagePullBackOff", "ErrImagePull", "InvalidImageName", "ErrImageNeverPull"})
MAX_REASON_LINE = 300


class Derived(msgspec.Struct, frozen=True):
    """An execution's state, where its failure log is (pod, container), and when to look again.

    `pods_lag` is True when the Job says it failed but no pod shows the failure yet: Jobs and
    pods are watched separately, so the pod's news may be a moment behind the Job's, and the
    reason would be only the Job's generic "BackoffLimitExceeded".
    """

    state: ExecutionState
    log_source: tuple[str, str] | None = None
    recheck_at: float | None = None
    pods_lag: bool = False


def parse_time(value: str | None) -> float | None:
    """Unix seconds of a Kubernetes RFC 3339 timestamp (None stays None)."""
    if not value:
        return None
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


def last_line(text: str | None) -> str | None:
    """The last non-blank line of a log, cut to a readable length."""
    for line in reversed((text or "").splitlines()):
        if line.strip():
            line = line.strip()
            return line if len(line) <= MAX_REASON_LINE else line[: MAX_REASON_LINE - 3] + "..."
    return None


def derive(
    key: ExecutionKey,
    job: Obj,
    pods: Sequence[Obj],
    *,
    namespace: str,
    agent_container: str,
    now: float,
    stuck_grace_s: float,
    log_tail: str | None = None,
) -> Derived:
    """The state of the execution `key`, from its Job and the Job's pods (see the module docstring)."""
    name = job["metadata"]["name"]
    status = job.get("status") or {}
    conditions = {c.get("type"): c for c in status.get("conditions") or [] if c.get("status") == "True"}
    pod = newest(pods)
    base = ExecutionState(
        key=key,
        phase="pending",
        execution=name,
        started_at=_container_start(pod) if pod else None,
        log_location=f"kubectl logs -n {namespace} job/{name} -c {agent_container}",
    )
    done = conditions.get("Complete") or conditions.get("SuccessCriteriaMet")
    if done is not None:
        finished = parse_time(status.get("completionTime")) or parse_time(done.get("lastTransitionTime"))
        return Derived(
            msgspec.structs.replace(
                base,
                phase="succeeded",
                exit_code=0,
                started_at=base.started_at or parse_time(status.get("startTime")),
                finished_at=finished,
            )
        )
    failed = conditions.get("Failed") or conditions.get("FailureTarget")
    if failed is not None:
        return _failed(base, job, failed, pods, namespace, log_tail)
    if (job.get("spec") or {}).get("suspend"):
        return Derived(msgspec.structs.replace(base, reason="the Job is suspended (spec.suspend)"))
    if pod is None:
        return Derived(base)
    return _from_pod(base, pod, now, stuck_grace_s)


def _from_pod(base: ExecutionState, pod: Obj, now: float, stuck_grace_s: float) -> Derived:
    """The state of a Job that has not ended, from its newest pod."""
    pod_status = pod.get("status") or {}
    if pod_status.get("phase") == "Unknown":
        return Derived(
            msgspec.structs.replace(
                base,
                phase="unknown",
                reason=f"the node of pod {pod['metadata']['name']} stopped reporting (phase Unknown)",
            )
        )
    stuck = _stuck(pod)
    if stuck is not None:
        since = parse_time(pod["metadata"].get("creationTimestamp")) or now
        if now - since >= stuck_grace_s:
            reason = f"{stuck} (stuck for {now - since:.0f}s)"
            cause: FailureCause = "infrastructure"
            failed = msgspec.structs.replace(base, phase="failed", reason=reason, finished_at=now, cause=cause)
            return Derived(failed)
        return Derived(msgspec.structs.replace(base, reason=stuck), recheck_at=since + stuck_grace_s)
    if pod_status.get("phase") in ("Running", "Succeeded", "Failed") or any(
        "running" in (s.get("state") or {}) for s in _statuses(pod)
    ):
        return Derived(msgspec.structs.replace(base, phase="running"))
    for condition in pod_status.get("conditions") or []:
        if condition.get("type") == "PodScheduled" and condition.get("reason") == "Unschedulable":
            return Derived(
                msgspec.structs.replace(base, reason=f"Unschedulable: {condition.get('message', '')}".rstrip(": "))
            )
    return Derived(base)


def newest(pods: Sequence[Obj]) -> Obj | None:
    """The most recently created pod (a Job with backoffLimit 0 has one; eviction races may add one)."""
    if not pods:
        return None
    return max(pods, key=lambda p: (p["metadata"].get("creationTimestamp") or "", p["metadata"]["name"]))


def _failed(
    base: ExecutionState, job: Obj, condition: Obj, pods: Sequence[Obj], namespace: str, log_tail: str | None
) -> Derived:
    status = job.get("status") or {}
    finished = parse_time(condition.get("lastTransitionTime"))
    base = msgspec.structs.replace(
        base, phase="failed", finished_at=finished, started_at=base.started_at or parse_time(status.get("startTime"))
    )
    failed_pods = [p for p in pods if (p.get("status") or {}).get("phase") == "Failed"]
    pod = newest(failed_pods) or newest(pods)
    if condition.get("reason") == "DeadlineExceeded":
        limit = (job.get("spec") or {}).get("activeDeadlineSeconds")
        reason = (
            f"DeadlineExceeded: the attempt ran longer than its {limit}s timeout (activeDeadlineSeconds); "
            "Kubernetes stopped it"
        )
        stuck = _stuck(pod) if pod else None
        return Derived(
            msgspec.structs.replace(
                base,
                reason=f"{reason}; the pod never started: {stuck}" if stuck else reason,
                cause="infrastructure" if stuck else "timeout",
            )
        )
    if pod is not None:
        pod_status = pod.get("status") or {}
        if pod_status.get("reason") == "Evicted":
            node = (pod.get("spec") or {}).get("nodeName") or "its node"
            message = pod_status.get("message") or "no message"
            return Derived(
                msgspec.structs.replace(base, reason=f"Evicted from {node}: {message}", cause="infrastructure")
            )
        exited = _exited(base, pod, namespace, log_tail)
        if exited is not None:
            return exited
        stuck = _stuck(pod)
        if stuck is not None:
            return Derived(msgspec.structs.replace(base, reason=stuck, cause="infrastructure"))
    reason = f"{condition.get('reason') or 'Failed'}: {condition.get('message') or 'the Job failed'}"
    return Derived(msgspec.structs.replace(base, reason=reason), pods_lag=not failed_pods)


def _exited(base: ExecutionState, pod: Obj, namespace: str, log_tail: str | None) -> Derived | None:
    """The failure of the pod's first container that exited non-zero (None when none did): out of
    memory, or its exit code with the last line it wrote."""
    for container, terminated in _terminations(pod):
        code = terminated.get("exitCode")
        if code in (0, None):
            continue
        log_source = (pod["metadata"]["name"], container)
        location = f"kubectl logs -n {namespace} {pod['metadata']['name']} -c {container}"
        cause: FailureCause = "infrastructure" if container == EVALUATOR_CONTAINER else "agent-error"
        if terminated.get("reason") == "OOMKilled":
            cause = "infrastructure"
            reason = (
                f"OOMKilled: container '{container}' ran out of memory and was killed (exit code {code}); "
                "raise its memory limit in the Job template"
            )
        else:
            reason = f"exit code {code} in container '{container}'"
            detail = (terminated.get("message") or "").strip() or last_line(log_tail)
            if detail:
                reason = f"{reason}: {last_line(detail)}"
        return Derived(
            msgspec.structs.replace(
                base, reason=reason, exit_code=code, log_tail=log_tail, log_location=location, cause=cause
            ),
            log_source=log_source,
        )
    return None


def _statuses(pod: Obj) -> list[Obj]:
    status = pod.get("status") or {}
    return [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]


def _terminations(pod: Obj) -> list[tuple[str, Obj]]:
    """(container, terminated state) in run order: init containers first."""
    return [(s["name"], s["state"]["terminated"]) for s in _statuses(pod) if "terminated" in (s.get("state") or {})]


def _container_start(pod: Obj) -> float | None:
    starts = []
    for s in _statuses(pod):
        state = s.get("state") or {}
        started = (state.get("running") or state.get("terminated") or {}).get("startedAt")
        if started:
            starts.append(parse_time(started))
    return min((t for t in starts if t is not None), default=None)


def _stuck(pod: Obj) -> str | None:
    """Why a container of the pod cannot start, for a person; None if none is stuck."""
    images = {c.get("name"): c.get("image") for c in _spec_containers(pod)}
    for s in _statuses(pod):
        waiting = (s.get("state") or {}).get("waiting") or {}
        reason = waiting.get("reason")
        if reason not in STUCK_REASONS:
            continue
        message = (waiting.get("message") or "").strip()
        container = s.get("name")
        if reason in _PULL_REASONS:
            image = s.get("image") or images.get(container) or "?"
            text = f"{reason}: cannot pull image '{image}' for container '{container}'"
            hint = "check the image name and the cluster's image pull secrets"
        else:
            text = f"{reason} in container '{container}'"
            hint = "create the Secret or ConfigMap it refers to, or fix the Job template"
        return f"{text}: {message}; {hint}" if message else f"{text}; {hint}"
    return None


def _spec_containers(pod: Obj) -> list[Obj]:
    spec = pod.get("spec") or {}
    return [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]
