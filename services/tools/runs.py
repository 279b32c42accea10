"""`rollwire runs`: the runs on the stream with their sizes.

Rollouts and events per run come from the stream's per-subject message counts (no message is
read). Bytes are counted by reading each run's messages without decoding them, which costs about
as much as a raw read of the stream; the time of a run's last event comes from its last message.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime

import msgspec
import nats.js.errors

from schemas import RunStarted, decode
from schemas.ids import RUN_ALL, RUN_SUBJECT, STREAM_SUBJECTS
from services.common.eventstore import EventStore
from services.tools.source import StreamMissing, subject_counts


class RunSize(msgspec.Struct, kw_only=True):
    """One run: its name (from `RunStarted`), rollouts, events, bytes and last activity."""

    run_id: str
    name: str = ""
    rollouts: int = 0
    events: int = 0
    bytes: int = 0
    first_seq: int = 0
    last_time: float | None = None


async def list_runs(store: EventStore, *, count_bytes: bool = True) -> list[RunSize]:
    """Every run on the stream, oldest first."""
    try:
        counts = await subject_counts(store, STREAM_SUBJECTS)
    except StreamMissing:
        return []
    runs: dict[str, RunSize] = {}
    rollouts: dict[str, set[str]] = {}
    for subject, n in counts.items():
        tokens = subject.split(".")
        run = runs.setdefault(tokens[1], RunSize(run_id=tokens[1]))
        run.events += n
        if len(tokens) > 3 and tokens[2] == "rollout":
            rollouts.setdefault(tokens[1], set()).add(tokens[3])
    for run_id, run in runs.items():
        run.rollouts = len(rollouts.get(run_id, ()))
        await _describe(store, run)
    if count_bytes:
        for run in runs.values():
            async for batch in store.read_raw(RUN_ALL.format(run=run.run_id)):
                run.bytes += sum(len(msg.data) for msg in batch)
    return sorted(runs.values(), key=lambda r: r.first_seq)


async def _describe(store: EventStore, run: RunSize) -> None:
    try:
        last = await store.js.get_last_msg(store.stream, RUN_ALL.format(run=run.run_id))
        first = await store.js.get_msg(store.stream, seq=1, subject=RUN_ALL.format(run=run.run_id), next=True)
    except nats.js.errors.NotFoundError:
        return
    run.first_seq = first.seq or 0
    run.last_time = decode(last.data or b"").time
    try:
        started = decode((await store.js.get_last_msg(store.stream, RUN_SUBJECT.format(run=run.run_id))).data or b"")
    except nats.js.errors.NotFoundError:
        return
    if isinstance(started, RunStarted):
        run.name = started.name


def _size(n: int) -> str:
    value = float(n)
    for unit in ("B", "KB", "MB", "GB"):
        if value < 1000 or unit == "GB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{n} B"


def runs_table(runs: Sequence[RunSize]) -> str:
    """The runs as an aligned table (one line per run) with a total line."""
    if not runs:
        return "no runs on the stream\n"
    header = ["run", "name", "rollouts", "events", "bytes", "last event"]
    rows = [
        [
            r.run_id,
            r.name or "-",
            str(r.rollouts),
            str(r.events),
            _size(r.bytes),
            datetime.fromtimestamp(r.last_time, tz=UTC).astimezone().strftime("%Y-%m-%d %H:%M") if r.last_time else "-",
        ]
        for r in runs
    ]
    rows.append(
        [
            "total",
            "",
            str(sum(r.rollouts for r in runs)),
            str(sum(r.events for r in runs)),
            _size(sum(r.bytes for r in runs)),
            "",
        ]
    )
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = []
    for row in [header, *rows]:
        cells = [c.ljust(w) if i in (0, 1) else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines) + "\n"
