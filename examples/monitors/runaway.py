"""Runaway monitor: flag rollouts that make too many model calls or consume too many tokens.

An agent stuck in a loop (the same failing command again and again, a conversation that never
ends) burns GPU time and, once it gets a reward, teaches the policy to ramble. This monitor counts
each rollout's calls and tokens (prompt + response of every call) and publishes one `flag` custom
event per rule the first time a rollout crosses a limit; the trajectory viewer shows it. It also
reports every call the proxy refused because an attempt spent its budget (the run spec's `budget`;
the proxy records a `budget_exceeded` event) as a `budget-exceeded` flag.

    python examples/monitors/runaway.py --nats-url nats://127.0.0.1:14222 --max-calls 50 --max-tokens 200000

A monitor that starts while rollouts are running, or resumes after a restart (`--durable`,
default `runaway`), first counts what each rollout did before it came (`Monitor.earlier`), so its
counts are the rollout's whole history; a rollout's counts are dropped when it ends.
"""

from __future__ import annotations

import argparse

import msgspec

from schemas import TERMINAL_STATUSES, CustomEvent, ModelRequestRecorded, RolloutStatusChanged
from schemas.events import BUDGET_EXCEEDED_EVENT
from schemas.ids import MODEL_REQUEST
from schemas.refs import prompt_length
from services.common.eventstore import StoredEvent
from services.tools.monitor import Monitor, monitor_main

NAME = "runaway"
PATTERN = "rl.*.rollout.*.model_request"
STATUS_PATTERN = "rl.*.rollout.*.status"
BUDGET_PATTERN = "rl.*.rollout.*.event.budget_exceeded"


class Usage(msgspec.Struct):
    calls: int = 0
    tokens: int = 0


_usage: dict[tuple[str, str], Usage] = {}


def _count(usage: Usage, event: ModelRequestRecorded) -> None:
    usage.calls += 1
    usage.tokens += prompt_length(event) + len(event.response_ids)


async def _usage_of(monitor: Monitor, stored: StoredEvent, event: ModelRequestRecorded) -> Usage:
    key = (event.run_id, event.rollout_id or "")
    usage = _usage.get(key)
    if usage is None:
        usage = _usage[key] = Usage()
        subject = MODEL_REQUEST.format(run=event.run_id, rollout=event.rollout_id)
        for earlier in await monitor.earlier(subject, stored.seq):
            if isinstance(earlier.event, ModelRequestRecorded):
                _count(usage, earlier.event)
    return usage


async def handle(monitor: Monitor, stored: StoredEvent) -> None:
    """Count the call; flag the rollout when this call takes it over a limit."""
    event = stored.event
    if isinstance(event, CustomEvent) and event.name == BUDGET_EXCEEDED_EVENT and event.trusted:
        await _report_budget(monitor, event)
        return
    if isinstance(event, RolloutStatusChanged) and event.status in TERMINAL_STATUSES:
        _usage.pop((event.run_id, event.rollout_id or ""), None)
        return
    if not isinstance(event, ModelRequestRecorded):
        return
    usage = await _usage_of(monitor, stored, event)
    before = Usage(calls=usage.calls, tokens=usage.tokens)
    _count(usage, event)
    limits = monitor.options
    crossed = []
    if before.calls <= limits.max_calls < usage.calls:
        crossed.append(("too-many-calls", f"{usage.calls} calls (limit {limits.max_calls})"))
    if before.tokens <= limits.max_tokens < usage.tokens:
        crossed.append(("too-many-tokens", f"{usage.tokens} tokens (limit {limits.max_tokens})"))
    for rule, detail in crossed:
        # Keyed by the rollout: one flag per rollout and rule, however often it is seen.
        appended = await monitor.flag(event, rule=rule, severity="warning", detail=detail, key=event.rollout_id)
        if not appended.duplicate:
            print(f"flag {rule} run={event.run_id} rollout={event.rollout_id}: {detail}", flush=True)


async def _report_budget(monitor: Monitor, event: CustomEvent) -> None:
    """The proxy refused a call of this attempt: its budget is spent."""
    payload = event.payload
    used = f"{payload.get('used')} of {payload.get('limit')}"
    detail = f"attempt {event.attempt_id} spent its {payload.get('budget')} budget ({used})"
    appended = await monitor.flag(
        event,
        rule="budget-exceeded",
        severity="warning",
        detail=detail,
        key=f"{event.attempt_id}-{payload.get('budget')}",
    )
    if not appended.duplicate:
        print(f"flag budget-exceeded run={event.run_id} rollout={event.rollout_id}: {detail}", flush=True)


def _options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-calls", type=int, default=50, help="calls per rollout (default %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=200_000, help="prompt+response tokens per rollout")


if __name__ == "__main__":
    monitor_main(NAME, handle, pattern=[PATTERN, STATUS_PATTERN, BUDGET_PATTERN], doc=__doc__ or "", extra=_options)
