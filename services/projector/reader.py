"""The query side: the gateway's `RolloutReader` answered from the Postgres read models.

    reader = PostgresRolloutReader("postgresql://...")
    view = await reader.get("ro-1")                 # same RolloutView as the stream fold gives
    await reader.wait_for(seq=1234, timeout=5.0)    # read-your-writes: wait until seq is applied

Reads never scan the stream. The rollout views are the ones the projector folded with the
gateway's own `apply`, so this reader and `StreamRolloutReader` answer alike; the contract tests
run both. When Postgres cannot be reached every method raises `ReadModelUnavailable` (the gateway
answers 503); writes go to the stream and are unaffected.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import asyncpg
import msgspec
from msgspec import UNSET

from schemas import ModelRequestRecorded, check_id, from_dict
from schemas.ids import STREAM_NAME
from schemas.rollout import RolloutView
from services.common.eventstore import StoredEvent
from services.common.readside import RolloutQuery, RunView
from services.projector.calls import CallResolver
from services.projector.migrate import migrate
from services.projector.packing import json_column, unpack_float64, unpack_int32
from services.projector.pgstore import NOTIFY_CHANNEL, load_lists, view_from_row

log = logging.getLogger("rollwire.projector.reader")

_CONNECTION_ERRORS = (
    OSError,
    asyncio.TimeoutError,
    asyncpg.PostgresConnectionError,
    asyncpg.InterfaceError,
    asyncpg.CannotConnectNowError,
    asyncpg.TooManyConnectionsError,
    asyncpg.AdminShutdownError,
    asyncpg.UndefinedTableError,
)


class ReadModelUnavailable(RuntimeError):
    """Postgres (the read models) cannot answer; the message says why and what still works."""


class ProjectionBehind(RuntimeError):
    """`min_seq` was not applied within the timeout; carries the sequence that was applied."""

    def __init__(self, wanted: int, applied: int, timeout: float) -> None:
        super().__init__(
            f"the projection has applied the stream up to seq {applied}, not yet {wanted}, after waiting "
            f"{timeout:g}s; retry, or check the projector (its /healthz shows its lag)"
        )
        self.wanted = wanted
        self.applied = applied


class RunSummary(msgspec.Struct, kw_only=True):
    """What a run's rollouts add up to (`GET /api/runs`, `GET /api/runs/{run}`)."""

    run_id: str
    name: str | None
    started: bool
    started_at: float | None
    last_event_at: float
    events: int
    phase: str | None
    weights_version: int | None
    rollouts: int
    by_status: dict[str, int]
    rewarded: int
    reward_mean: float | None
    calls: int
    failed_calls: int
    calls_per_rollout: float | None
    prompt_tokens: int
    response_tokens: int
    tokens_per_rollout: float | None
    samples: int
    flagged: int
    duration_mean_s: float | None


# Rewards are an agent's finite floats: summed as float8, two near its maximum overflow (an error in
# Postgres), so the mean is taken in numeric; a mean of finite values is itself finite.
_SUMMARY_SQL = """
SELECT run.run_id, run.name, run.started_seq, run.started_at, run.last_event_at, run.events, run.phase,
       run.weights_version,
       count(r.rollout_id) AS rollouts,
       count(r.reward) AS rewarded, avg(r.reward::numeric)::float8 AS reward_mean,
       coalesce(sum(r.calls), 0) AS calls, coalesce(sum(r.failed_calls), 0) AS failed_calls,
       avg(r.calls) AS calls_per_rollout,
       coalesce(sum(r.prompt_tokens), 0) AS prompt_tokens, coalesce(sum(r.response_tokens), 0) AS response_tokens,
       avg(r.prompt_tokens + r.response_tokens) AS tokens_per_rollout,
       coalesce(sum(r.samples), 0) AS samples,
       count(*) FILTER (WHERE cardinality(r.flags) > 0) AS flagged,
       avg(r.ended_at - r.created_at) FILTER (WHERE r.ended_at IS NOT NULL) AS duration_mean_s
FROM runs run LEFT JOIN rollouts r ON r.run_id = run.run_id
WHERE {where}
GROUP BY run.run_id
ORDER BY run.last_seq DESC
LIMIT $1
"""


def _summary(row: asyncpg.Record, by_status: dict[str, int]) -> RunSummary:
    def num(value: Any) -> float | None:
        return None if value is None else float(value)

    return RunSummary(
        run_id=row["run_id"],
        name=row["name"],
        started=row["started_seq"] is not None,
        started_at=row["started_at"],
        last_event_at=row["last_event_at"],
        events=row["events"],
        phase=row["phase"],
        weights_version=row["weights_version"],
        rollouts=row["rollouts"],
        by_status=by_status,
        rewarded=row["rewarded"],
        reward_mean=num(row["reward_mean"]),
        calls=int(row["calls"]),
        failed_calls=int(row["failed_calls"]),
        calls_per_rollout=num(row["calls_per_rollout"]),
        prompt_tokens=int(row["prompt_tokens"]),
        response_tokens=int(row["response_tokens"]),
        tokens_per_rollout=num(row["tokens_per_rollout"]),
        samples=int(row["samples"]),
        flagged=row["flagged"],
        duration_mean_s=num(row["duration_mean_s"]),
    )


def call_event(row: asyncpg.Record, calls: CallResolver) -> ModelRequestRecorded:
    """A model call event rebuilt from its `events` + `model_calls` row, its full prompt and request resolved.

    `continuity` is left unset when the row has none, as an exact-mode call is on the stream.
    """
    seq = row["seq"]
    top_k, continuity = row["top_k"], row["continuity"]
    return ModelRequestRecorded(
        run_id=row["run_id"],
        rollout_id=row["rollout_id"],
        attempt_id=row["attempt_id"],
        event_id=row["event_id"],
        schema_version=row["schema_version"],
        time=row["time"],
        call_id=row["call_id"],
        mode=row["mode"],
        status=row["status"],
        choice_index=row["choice_index"],
        model=row["model"],
        weights_version=row["weights_version"],
        prompt_ids=unpack_int32(calls.prompt_ids(seq)),
        response_ids=unpack_int32(row["response_ids"]),
        logprobs=unpack_float64(row["logprobs"]),
        finish_reason=row["finish_reason"],
        request=calls.request(seq),
        response=json_column(row["response"]),
        usage=json_column(row["usage"]),
        latency_s=row["latency_s"],
        error=row["error"],
        agent=row["agent"],
        endpoint=row["endpoint"],
        started_at=row["started_at"],
        temperature=row["temperature"],
        top_p=row["top_p"],
        top_k=None if top_k is None else int(top_k),
        api=row["api"],
        continuity=UNSET if continuity is None else continuity,
    )


def _event_from_row(row: asyncpg.Record, calls: CallResolver) -> StoredEvent:
    kind = row["type"]
    if kind == "model_request":
        event: Any = call_event(row, calls)
    else:
        body = msgspec.json.decode(row["body"]) if row["body"] is not None else {}
        if kind == "reward":
            body.update(value=row["value"], name=row["reward_name"], step=row["step"], source=row["source"])
        elif kind == "custom":
            body.update(name=row["custom_name"], payload=json_column(row["payload"]), source=row["custom_source"])
        if row["body"] is None:
            body.update(
                type=kind,
                run_id=row["run_id"],
                rollout_id=row["rollout_id"],
                attempt_id=row["attempt_id"],
                event_id=row["event_id"],
                schema_version=row["schema_version"],
                time=row["time"],
            )
        event = from_dict(body)
    return StoredEvent(seq=row["seq"], subject=event.subject, event=event)


EVENTS_SQL = """
SELECT e.seq, e.run_id, e.rollout_id, e.attempt_id, e.type, e.event_id, e.schema_version, e.time, e.body,
       m.call_id, m.choice_index, m.mode, m.status, m.model, m.weights_version, m.prompt_ids, m.response_ids,
       m.logprobs, m.finish_reason, m.request, m.response, m.usage, m.latency_s, m.error, m.base_seq,
       m.base_tokens, m.base_text, m.prompt_text, m.response_text, m.request_ref, m.agent, m.endpoint,
       m.started_at, m.temperature, m.top_p, m.top_k, m.api, m.continuity,
       w.value, w.name AS reward_name, w.step, w.source,
       c.name AS custom_name, c.payload, c.source AS custom_source
FROM events e
LEFT JOIN model_calls m ON m.seq = e.seq AND e.type = 'model_request'
LEFT JOIN rewards w ON w.seq = e.seq AND e.type = 'reward'
LEFT JOIN custom_events c ON c.seq = e.seq AND e.type = 'custom'
WHERE e.rollout_id = $1 AND e.run_id = $2 AND e.seq > $3 AND ($4::text[] IS NULL OR e.type = ANY($4))
ORDER BY e.seq
LIMIT $5
"""


class PostgresRolloutReader:
    """`RolloutReader` over the projector's tables, plus run summaries and `wait_for`."""

    def __init__(
        self,
        dsn: str,
        *,
        stream: str = STREAM_NAME,
        min_size: int = 1,
        max_size: int = 10,
        connect_timeout: float = 3.0,
        command_timeout: float = 30.0,
    ) -> None:
        self.dsn = dsn
        self.stream = stream
        self._pool_args = {
            "min_size": min_size,
            "max_size": max_size,
            "timeout": connect_timeout,
            "command_timeout": command_timeout,
        }
        self._pool: asyncpg.Pool | None = None
        self._pool_lock = asyncio.Lock()
        self._applied = 0
        self._advanced = asyncio.Event()
        self._listener: asyncpg.Connection | None = None
        self._down = False

    # ---- connections ------------------------------------------------------------------------

    async def _get_pool(self) -> asyncpg.Pool:
        if self._pool is not None:
            return self._pool
        async with self._pool_lock:
            if self._pool is None:
                pool = await asyncpg.create_pool(self.dsn, **self._pool_args)
                try:
                    async with pool.acquire() as conn:
                        await migrate(conn)
                except BaseException:
                    await pool.close()
                    raise
                self._pool = pool
        return self._pool

    @contextlib.asynccontextmanager
    async def acquire(self) -> AsyncIterator[asyncpg.Connection]:
        """A pooled connection; connection failures become `ReadModelUnavailable`."""
        try:
            pool = await self._get_pool()
            async with pool.acquire(timeout=float(self._pool_args["timeout"])) as conn:
                yield conn
        except _CONNECTION_ERRORS as exc:
            if not self._down:  # one log line per outage; the client's body names no internals
                log.warning("the read models (Postgres) cannot be reached: %s: %s", type(exc).__name__, exc)
            self._down = True
            raise ReadModelUnavailable(
                "the read models (Postgres) cannot be reached; writes still work, "
                "reads will return once Postgres is back"
            ) from None
        else:
            if self._down:
                log.info("the read models (Postgres) answer again")
            self._down = False

    async def ping(self, timeout_s: float = 1.0) -> None:
        """Raise `ReadModelUnavailable` unless Postgres answers within `timeout_s` (for health checks)."""
        try:
            async with asyncio.timeout(timeout_s), self.acquire() as conn:
                await conn.fetchval("SELECT 1")
        except TimeoutError:
            raise ReadModelUnavailable(f"the read models (Postgres) did not answer within {timeout_s:g}s") from None

    async def close(self) -> None:
        """Close the listener and the pool."""
        if self._listener is not None:
            with contextlib.suppress(Exception):
                await self._listener.close()
            self._listener = None
        if self._pool is not None:
            await self._pool.close()
            self._pool = None

    # ---- RolloutReader ----------------------------------------------------------------------

    async def _views(self, conn: asyncpg.Connection, rows: Sequence[asyncpg.Record]) -> list[RolloutView]:
        keys = [(row["run_id"], row["rollout_id"]) for row in rows]
        attempts, rewards = await load_lists(conn, keys) if keys else ({}, {})
        return [view_from_row(row, attempts[key], rewards[key]) for row, key in zip(rows, keys, strict=True)]

    async def get(self, rollout_id: str, run_id: str | None = None) -> RolloutView | None:
        """One rollout (the first created with this id when `run_id` is None), or None."""
        check_id("rollout_id", rollout_id)
        async with self.acquire() as conn:
            rows = await conn.fetch(
                "SELECT * FROM rollouts WHERE rollout_id = $1 AND ($2::text IS NULL OR run_id = $2) "
                "ORDER BY created_seq LIMIT 1",
                rollout_id,
                run_id,
            )
            views = await self._views(conn, rows)
        return views[0] if views else None

    async def query(self, query: RolloutQuery) -> list[RolloutView]:
        """Rollouts matching the query, in creation order, after `query.cursor`, at most `limit`."""
        async with self.acquire() as conn:
            rows = await conn.fetch(
                "SELECT * FROM rollouts WHERE created_seq > $1 AND ($2::text IS NULL OR run_id = $2) "
                "AND ($3::text[] IS NULL OR status = ANY($3)) AND ($4::text IS NULL OR group_id = $4) "
                "AND ($5::text IS NULL OR mode = $5) ORDER BY created_seq LIMIT $6",
                query.cursor,
                query.run_id,
                sorted(query.statuses) if query.statuses else None,
                query.group_id,
                query.mode,
                query.limit,
            )
            return await self._views(conn, rows)

    async def terminal(self, after: int, limit: int) -> tuple[list[RolloutView], int]:
        """Terminal rollouts in completion order from index `after`, and the total count."""
        async with self.acquire() as conn:
            rows = await conn.fetch(
                "SELECT * FROM rollouts WHERE terminal_seq > 0 ORDER BY terminal_seq OFFSET $1 LIMIT $2", after, limit
            )
            total = await conn.fetchval("SELECT count(*) FROM rollouts WHERE terminal_seq > 0")
            return await self._views(conn, rows), int(total)

    async def events(self, rollout_id: str, run_id: str) -> list[StoredEvent]:
        """Every event of one rollout in stream order."""
        return await self.events_page(rollout_id, run_id)

    async def events_page(
        self,
        rollout_id: str,
        run_id: str,
        *,
        after_seq: int = 0,
        types: Sequence[str] | None = None,
        limit: int = 1_000_000,
    ) -> list[StoredEvent]:
        """A rollout's events after `after_seq`, optionally only of some `types`, in stream order."""
        async with self.acquire() as conn:
            rows = await conn.fetch(EVENTS_SQL, rollout_id, run_id, after_seq, list(types) if types else None, limit)
            calls = await CallResolver.load(conn, [row for row in rows if row["type"] == "model_request"])
        return [_event_from_row(row, calls) for row in rows]

    async def run(self, run_id: str) -> RunView | None:
        """A run's spec and its rollouts by status, or None when the stream has no event of this run.

        A run that has events but was never declared (`POST /api/runs`) has an empty spec, no
        `started_at` and `seq` 0: `GET /api/runs` lists it, so `GET /api/runs/{run}` answers it too.
        """
        check_id("run_id", run_id)
        async with self.acquire() as conn:
            row = await conn.fetchrow("SELECT * FROM runs WHERE run_id = $1", run_id)
            if row is None:
                return None
            counts = await self._status_counts(conn, [run_id])
        return RunView(
            run_id=run_id,
            name=row["name"] or "",
            config=json_column(row["config"]) or {},
            started_at=row["started_at"],
            seq=row["started_seq"] or 0,
            rollouts=counts.get(run_id, {}),
        )

    # ---- summaries --------------------------------------------------------------------------

    @staticmethod
    async def _status_counts(conn: asyncpg.Connection, runs: list[str]) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {run: {} for run in runs}
        for row in await conn.fetch(
            "SELECT run_id, status, count(*) AS n FROM rollouts WHERE run_id = ANY($1) GROUP BY run_id, status "
            "ORDER BY run_id, status",
            runs,
        ):
            out[row["run_id"]][row["status"]] = row["n"]
        return out

    async def summaries(self, limit: int = 200) -> list[RunSummary]:
        """Every run seen on the stream (most recently active first), summarised."""
        async with self.acquire() as conn:
            rows = await conn.fetch(_SUMMARY_SQL.format(where="TRUE"), limit)
            counts = await self._status_counts(conn, [row["run_id"] for row in rows])
        return [_summary(row, counts[row["run_id"]]) for row in rows]

    async def summary(self, run_id: str) -> RunSummary | None:
        """One run's summary, or None when the stream has no event of it."""
        check_id("run_id", run_id)
        async with self.acquire() as conn:
            rows = await conn.fetch(_SUMMARY_SQL.format(where="run.run_id = $2"), 1, run_id)
            if not rows:
                return None
            counts = await self._status_counts(conn, [run_id])
        return _summary(rows[0], counts[run_id])

    # ---- read-your-writes -------------------------------------------------------------------

    async def applied_seq(self) -> int:
        """The last stream sequence the projection has applied."""
        async with self.acquire() as conn:
            value = await conn.fetchval("SELECT last_seq FROM projector_position WHERE stream = $1", self.stream)
        self._note(int(value or 0))
        return self._applied

    def _note(self, seq: int) -> None:
        if seq > self._applied:
            self._applied = seq
            self._advanced.set()
            self._advanced = asyncio.Event()

    def _on_notify(self, conn: object, pid: int, channel: str, payload: str) -> None:
        stream, _, seq = payload.rpartition(":")
        if stream == self.stream and seq.isdigit():
            self._note(int(seq))

    async def _listen(self) -> None:
        if self._listener is not None and not self._listener.is_closed():
            return
        with contextlib.suppress(*_CONNECTION_ERRORS):
            self._listener = await asyncpg.connect(self.dsn, timeout=float(self._pool_args["timeout"]))
            await self._listener.add_listener(NOTIFY_CHANNEL, self._on_notify)

    async def wait_for(self, seq: int, timeout: float) -> int:
        """Return the applied sequence once it is at least `seq`; `ProjectionBehind` after `timeout`.

        Notifications from the projector wake the wait at once; a poll every 250 ms covers a lost
        notification connection.
        """
        if seq <= self._applied:
            return self._applied
        deadline = time.monotonic() + timeout
        await self._listen()
        while True:
            advanced = self._advanced
            if await self.applied_seq() >= seq:
                return self._applied
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ProjectionBehind(seq, self._applied, timeout)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(advanced.wait(), min(0.25, remaining))
