"""Postgres side of the projection: load what a batch touches, write its plan, move the position.

`apply_batch` is the exactly-once step. In one transaction it locks the position row, drops the
events at or below the stored sequence (a redelivery or a replay), loads the state the rest
touch, folds them (`fold.fold_batch`), COPYs the append-only rows, upserts the aggregates, and
stores the new position. Either all of it commits or none of it does, so a crash at any point
loses nothing and, since the position moved with the rows, duplicates nothing.

A batch that Postgres refuses for its data (class 22/23/54: a NUL in a string, a value out of
range) is split in halves until the one event at fault is alone; that event becomes a dead
letter and the others are applied (`apply_isolating`).

Folding ahead: while batch N commits, the service folds batch N+1 against N's plan (`load` with
`prior`): rollouts N touched take their state from N's plan, the others from the database, which
N does not change for them. N's rows are materialized before that fold starts, so it cannot
change what N writes. The plan of N+1 is committed (`commit`) only if N committed exactly as
planned, and its transaction still checks that the stored position is the one it assumed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import asyncpg
import msgspec
from msgspec.structs import astuple

from schemas.rollout import AttemptView, RewardView, RolloutView
from services.projector.fold import CallRow, Extras, Loaded, Plan, RolloutKey, fold_batch, needs
from services.projector.incoming import Incoming
from services.projector.packing import json_column

NOTIFY_CHANNEL = "rollwire_projection"
POISON_CLASSES = frozenset({"22", "23", "54"})

# The view's fields that have columns of their own (large JSON written once at creation)...
BULKY_FIELDS = ("input", "metadata", "config")
# ...and those copied into columns for filtering and sorting (the `state` jsonb holds them all).
PROMOTED_FIELDS = (
    "group_id",
    "mode",
    "status",
    "attempt_id",
    "created_at",
    "updated_at",
    "created_seq",
    "terminal_seq",
)
LIST_FIELDS = ("attempts", "rewards")
EXTRA_COLUMNS = Extras.__struct_fields__  # one definition: the Struct's fields are the extra columns
_MUTABLE = ("state", *PROMOTED_FIELDS, *EXTRA_COLUMNS)
ROLLOUT_COLUMNS = ("run_id", "rollout_id", *BULKY_FIELDS, *_MUTABLE)

EVENT_COLUMNS = ("seq", "run_id", "rollout_id", "attempt_id", "type", "event_id", "schema_version", "time", "body")
MODEL_CALL_COLUMNS = CallRow.__struct_fields__  # one definition: the row Struct the fold builds
REWARD_COLUMNS = ("seq", "run_id", "rollout_id", "attempt_id", "time", "value", "name", "step", "source")
CUSTOM_COLUMNS = ("seq", "run_id", "rollout_id", "attempt_id", "time", "name", "payload", "source")
PHASE_COLUMNS = ("seq", "run_id", "phase", "weights_version", "time")
DEAD_LETTER_COLUMNS = ("seq", "subject", "reason", "data")

_KEYS = "SELECT * FROM unnest($1::text[], $2::text[]) AS k(run_id, rollout_id)"

_INSERT_ROLLOUT = (
    f"INSERT INTO rollouts ({', '.join(ROLLOUT_COLUMNS)}) "
    f"VALUES ({', '.join(f'${i + 1}' for i in range(len(ROLLOUT_COLUMNS)))})"
)
_UPDATE_ROLLOUT = (
    f"UPDATE rollouts SET {', '.join(f'{c} = ${i + 3}' for i, c in enumerate(_MUTABLE))} "
    "WHERE run_id = $1 AND rollout_id = $2"
)
_UPSERT_ATTEMPT = """
INSERT INTO attempts (run_id, rollout_id, idx, attempt_id, sequence, started_at, executor, ended,
                      reached_running, ended_as, reason)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)
ON CONFLICT (run_id, rollout_id, attempt_id) DO UPDATE SET
    idx = excluded.idx, sequence = excluded.sequence, started_at = excluded.started_at,
    executor = excluded.executor, ended = excluded.ended, reached_running = excluded.reached_running,
    ended_as = excluded.ended_as, reason = excluded.reason
"""
_UPSERT_STATS = """
INSERT INTO attempt_stats AS s (run_id, rollout_id, attempt_key, calls, failed_calls, prompt_tokens,
                                response_tokens, samples, reward, reward_seq)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)
ON CONFLICT (run_id, rollout_id, attempt_key) DO UPDATE SET
    calls = s.calls + excluded.calls, failed_calls = s.failed_calls + excluded.failed_calls,
    prompt_tokens = s.prompt_tokens + excluded.prompt_tokens,
    response_tokens = s.response_tokens + excluded.response_tokens, samples = s.samples + excluded.samples,
    reward = CASE WHEN excluded.reward_seq IS NULL THEN s.reward ELSE excluded.reward END,
    reward_seq = coalesce(excluded.reward_seq, s.reward_seq)
"""
_UPSERT_CHAINS = """
INSERT INTO sample_chains (run_id, rollout_id, attempt_key, chains) VALUES ($1, $2, $3, $4)
ON CONFLICT (run_id, rollout_id, attempt_key) DO UPDATE SET chains = excluded.chains
"""
_UPSERT_RUN = """
INSERT INTO runs AS r (run_id, name, config, started_at, started_seq, phase, weights_version, phase_seq,
                       events, first_seq, last_seq, last_event_at)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)
ON CONFLICT (run_id) DO UPDATE SET
    name = CASE WHEN r.started_seq IS NULL THEN excluded.name ELSE r.name END,
    config = CASE WHEN r.started_seq IS NULL THEN excluded.config ELSE r.config END,
    started_at = CASE WHEN r.started_seq IS NULL THEN excluded.started_at ELSE r.started_at END,
    started_seq = coalesce(r.started_seq, excluded.started_seq),
    phase = CASE WHEN excluded.phase_seq IS NULL THEN r.phase ELSE excluded.phase END,
    weights_version = CASE WHEN excluded.phase_seq IS NULL THEN r.weights_version ELSE excluded.weights_version END,
    phase_seq = coalesce(excluded.phase_seq, r.phase_seq),
    events = r.events + excluded.events,
    first_seq = least(r.first_seq, excluded.first_seq),
    last_seq = greatest(r.last_seq, excluded.last_seq),
    last_event_at = excluded.last_event_at
"""
_UPSERT_MODEL = """
INSERT INTO models AS m (run_id, name, base_url, served_model, weights_version, registered_at, registered_seq,
                         removed_at, removed_seq)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)
ON CONFLICT (run_id, name) DO UPDATE SET
    base_url = CASE WHEN excluded.registered_seq IS NULL THEN m.base_url ELSE excluded.base_url END,
    served_model = CASE WHEN excluded.registered_seq IS NULL THEN m.served_model ELSE excluded.served_model END,
    weights_version = CASE WHEN excluded.registered_seq IS NULL THEN m.weights_version
                           ELSE excluded.weights_version END,
    registered_at = coalesce(excluded.registered_at, m.registered_at),
    registered_seq = coalesce(excluded.registered_seq, m.registered_seq),
    removed_at = coalesce(excluded.removed_at, m.removed_at),
    removed_seq = coalesce(excluded.removed_seq, m.removed_seq)
"""

_json = msgspec.json.Encoder()


class PositionMoved(RuntimeError):
    """The stored position is not where this projector left it (a rebuild, or another projector)."""

    def __init__(self, stored: int, expected: int) -> None:
        super().__init__(f"stored position is {stored}, expected {expected}: resuming from the stored one")
        self.stored = stored


def is_poison(exc: BaseException, conn: asyncpg.Connection | None = None) -> bool:
    """True when the data itself was refused, so retrying the same rows cannot succeed.

    Decided by what happened, not by which library raised: Postgres refusing a value (data,
    integrity, limit classes), or the driver failing to encode one on a live connection (an
    integer out of a column's range raises OverflowError or asyncpg's DataError client-side),
    is the event's fault. A lost connection, a timeout or any other Postgres error is temporary.
    """
    if isinstance(exc, PositionMoved) or (conn is not None and conn.is_closed()):
        return False
    if isinstance(exc, asyncpg.PostgresError):
        state = getattr(exc, "sqlstate", None)
        return isinstance(state, str) and state[:2] in POISON_CLASSES
    if isinstance(exc, (OSError, TimeoutError, asyncpg.PostgresConnectionError)):
        return False
    if isinstance(exc, asyncpg.InterfaceError) and not isinstance(exc, asyncpg.DataError):
        return False
    return isinstance(exc, (ValueError, TypeError, ArithmeticError))


def view_from_row(row: asyncpg.Record, attempts: list[dict[str, Any]], rewards: list[dict[str, Any]]) -> RolloutView:
    """A rollout view from a `rollouts` row and its attempts' and rewards' rows (as dicts)."""
    fields = msgspec.json.decode(row["state"])
    for name in BULKY_FIELDS:
        fields[name] = json_column(row[name])
    fields["attempts"], fields["rewards"] = attempts, rewards
    return msgspec.convert(fields, RolloutView)


def extras_from_row(row: asyncpg.Record) -> Extras:
    """A rollout's totals from its `rollouts` row."""
    return Extras(**{column: row[column] for column in EXTRA_COLUMNS})


def attempt_fields(row: asyncpg.Record) -> dict[str, Any]:
    """One attempt view's fields from an `attempts` row."""
    return {name: row[name] for name in AttemptView.__struct_fields__}


def reward_fields(row: asyncpg.Record) -> dict[str, Any]:
    """One reward view's fields from a `rewards` row."""
    return {name: row[name] for name in RewardView.__struct_fields__}


async def load_lists(
    conn: asyncpg.Connection, keys: Sequence[RolloutKey]
) -> tuple[dict[RolloutKey, list[dict[str, Any]]], dict[RolloutKey, list[dict[str, Any]]]]:
    """Attempts (in view order) and rewards (after creation, in stream order) of these rollouts."""
    runs, rollouts = [k[0] for k in keys], [k[1] for k in keys]
    attempts: dict[RolloutKey, list[dict[str, Any]]] = {k: [] for k in keys}
    rewards: dict[RolloutKey, list[dict[str, Any]]] = {k: [] for k in keys}
    for row in await conn.fetch(
        f"SELECT a.* FROM attempts a JOIN ({_KEYS}) k USING (run_id, rollout_id) ORDER BY a.idx", runs, rollouts
    ):
        attempts[(row["run_id"], row["rollout_id"])].append(attempt_fields(row))
    for row in await conn.fetch(
        f"SELECT w.* FROM rewards w JOIN ({_KEYS}) k USING (run_id, rollout_id) "
        "JOIN rollouts r USING (run_id, rollout_id) WHERE w.seq > r.created_seq ORDER BY w.seq",
        runs,
        rollouts,
    ):
        rewards[(row["run_id"], row["rollout_id"])].append(reward_fields(row))
    return attempts, rewards


async def load(conn: asyncpg.Connection, items: Sequence[Incoming], prior: Plan | None = None) -> Loaded:
    """The state `items` touch (see `fold.needs` for what is loaded when), as of after `prior`.

    Without `prior` everything comes from the database; with it, rollouts `prior` knows come
    from its plan (see the module docstring) and only the rest, and lists it did not load, are read.
    """
    touched, want_attempts, want_rewards, calls = needs(items)
    loaded = Loaded(views={}, extras={}, with_attempts=set(), with_rewards=set(), chains={})
    known = touched & prior.views.keys() if prior is not None else set()
    if prior is not None:
        for key in known:
            loaded.views[key], loaded.extras[key] = prior.views[key], prior.extras[key]
        loaded.with_attempts = known & prior.with_attempts
        loaded.with_rewards = known & prior.with_rewards
    if touched - known:
        keys = sorted(touched - known)
        rows = await conn.fetch(
            f"SELECT r.* FROM rollouts r JOIN ({_KEYS}) k USING (run_id, rollout_id)",
            [k[0] for k in keys],
            [k[1] for k in keys],
        )
        for row in rows:
            key = (row["run_id"], row["rollout_id"])
            loaded.views[key] = view_from_row(row, [], [])
            loaded.extras[key] = extras_from_row(row)
    present = loaded.views.keys()
    listed_attempts = (want_attempts & present) - loaded.with_attempts
    listed_rewards = (want_rewards & present) - loaded.with_rewards
    if listed_attempts or listed_rewards:
        attempts, rewards = await load_lists(conn, sorted(listed_attempts | listed_rewards))
        for key in listed_attempts:
            listed = msgspec.convert(attempts[key], tuple[AttemptView, ...])
            loaded.views[key] = msgspec.structs.replace(loaded.views[key], attempts=listed)
        for key in listed_rewards:
            given = msgspec.convert(rewards[key], tuple[RewardView, ...])
            loaded.views[key] = msgspec.structs.replace(loaded.views[key], rewards=given)
    loaded.with_attempts |= listed_attempts
    loaded.with_rewards |= listed_rewards
    if prior is not None:
        for akey in calls & prior.chains.keys():
            loaded.chains[akey] = prior.chains[akey]
        calls = calls - prior.chains.keys()
    if calls:
        ckeys = sorted(calls)
        for row in await conn.fetch(
            "SELECT c.* FROM sample_chains c JOIN unnest($1::text[], $2::text[], $3::text[]) "
            "AS k(run_id, rollout_id, attempt_key) USING (run_id, rollout_id, attempt_key)",
            [k[0] for k in ckeys],
            [k[1] for k in ckeys],
            [k[2] for k in ckeys],
        ):
            loaded.chains[(row["run_id"], row["rollout_id"], row["attempt_key"])] = row["chains"]
    return loaded


def _rollout_values(view: RolloutView, extras: Extras) -> dict[str, Any]:
    fields = msgspec.to_builtins(view)
    values = {name: _json.encode(fields.pop(name, None)).decode() for name in BULKY_FIELDS}
    for name in LIST_FIELDS:
        fields.pop(name, None)
    values.update({name: fields.get(name) for name in PROMOTED_FIELDS})
    values.update({name: getattr(extras, name) for name in EXTRA_COLUMNS})
    values.update(run_id=view.run_id, rollout_id=view.rollout_id, state=_json.encode(fields).decode())
    return values


async def _copy(conn: asyncpg.Connection, table: str, columns: Sequence[str], rows: list[tuple[Any, ...]]) -> None:
    if rows:
        await conn.copy_records_to_table(table, records=rows, columns=list(columns))


class Rows(msgspec.Struct):
    """The aggregate rows a plan writes (the append-only ones are already rows in the plan)."""

    inserts: list[tuple[Any, ...]]
    updates: list[tuple[Any, ...]]
    attempts: list[tuple[Any, ...]]
    stats: list[tuple[Any, ...]]
    chains: list[tuple[Any, ...]]
    runs: list[tuple[Any, ...]]
    models: list[tuple[Any, ...]]


def materialize(plan: Plan) -> Plan:
    """Compute every row `plan` writes, now: a later fold may change the views it folded.

    An attempt's, a run's, a model's and an attempt's stats row are its key and its Struct's fields,
    which are in the order of their table's columns (see `AttemptView`, `RunDelta`, `ModelDelta`,
    `StatsDelta`)."""
    inserts, updates = [], []
    for key in sorted(plan.touched):
        values = _rollout_values(plan.views[key], plan.extras[key])
        if key in plan.created:
            inserts.append(tuple(values[c] for c in ROLLOUT_COLUMNS))
        else:
            updates.append((key[0], key[1], *(values[c] for c in _MUTABLE)))
    plan.rows = Rows(
        inserts=inserts,
        updates=updates,
        attempts=[
            (*key, idx, *astuple(a))
            for key in sorted(plan.with_attempts & plan.touched)
            for idx, a in enumerate(plan.views[key].attempts)
        ],
        stats=[(*k, *astuple(d)) for k, d in sorted(plan.stats.items())],
        chains=[(*k, v) for k, v in sorted(plan.chains.items())],
        runs=[(run, *astuple(d)) for run, d in sorted(plan.runs.items())],
        models=[(*k, *astuple(d)) for k, d in sorted(plan.models.items())],
    )
    return plan


_SEQ, _RUN, _ROLLOUT, _BASE = (MODEL_CALL_COLUMNS.index(c) for c in ("seq", "run_id", "rollout_id", "base_seq"))


async def call_rows(conn: asyncpg.Connection, plan: Plan) -> list[tuple[Any, ...]]:
    """The plan's `model_calls` rows, each referencing row whose base row is not there stored in full.

    A referenced row is missing when Postgres refused it (a dead letter) or it belongs to another
    rollout; checked inside the writing transaction, so a stored reference always resolves.
    """
    if not plan.full_calls:
        return plan.model_calls
    where = {row[_SEQ]: (row[_RUN], row[_ROLLOUT]) for row in plan.model_calls}
    wanted = sorted({row[_BASE] for row in plan.model_calls if row[_BASE] is not None} - where.keys())
    if wanted:
        for found in await conn.fetch(
            "SELECT seq, run_id, rollout_id FROM model_calls WHERE seq = ANY($1::bigint[])", wanted
        ):
            where[found["seq"]] = (found["run_id"], found["rollout_id"])
    return [
        plan.full_calls[row[_SEQ]]
        if row[_BASE] is not None and where.get(row[_BASE]) != (row[_RUN], row[_ROLLOUT])
        else row
        for row in plan.model_calls
    ]


async def write(conn: asyncpg.Connection, plan: Plan) -> None:
    """Write a folded batch (inside the caller's transaction)."""
    rows: Rows = plan.rows if plan.rows is not None else materialize(plan).rows
    await _copy(conn, "events", EVENT_COLUMNS, plan.events)
    await _copy(conn, "model_calls", MODEL_CALL_COLUMNS, await call_rows(conn, plan))
    await _copy(conn, "rewards", REWARD_COLUMNS, plan.rewards)
    await _copy(conn, "custom_events", CUSTOM_COLUMNS, plan.custom_events)
    await _copy(conn, "phases", PHASE_COLUMNS, plan.phases)
    await _copy(conn, "dead_letters", DEAD_LETTER_COLUMNS, plan.dead_letters)
    for statement, batch in (
        (_INSERT_ROLLOUT, rows.inserts),
        (_UPDATE_ROLLOUT, rows.updates),
        (_UPSERT_ATTEMPT, rows.attempts),
        (_UPSERT_STATS, rows.stats),
        (_UPSERT_CHAINS, rows.chains),
        (_UPSERT_RUN, rows.runs),
        (_UPSERT_MODEL, rows.models),
    ):
        if batch:
            await conn.executemany(statement, batch)


async def ensure_position(conn: asyncpg.Connection, stream: str) -> int:
    """The stored position of `stream` (creating it at 0)."""
    await conn.execute(
        "INSERT INTO projector_position (stream, last_seq) VALUES ($1, 0) ON CONFLICT (stream) DO NOTHING", stream
    )
    return int(await conn.fetchval("SELECT last_seq FROM projector_position WHERE stream = $1", stream))


async def _lock_position(conn: asyncpg.Connection, stream: str, expected: int | None) -> int:
    stored = await conn.fetchval("SELECT last_seq FROM projector_position WHERE stream = $1 FOR UPDATE", stream)
    stored = int(stored or 0)
    if expected is not None and stored != expected:
        raise PositionMoved(stored, expected)
    return stored


async def _store_position(conn: asyncpg.Connection, stream: str, seq: int) -> None:
    await conn.execute("UPDATE projector_position SET last_seq = $2, updated_at = now() WHERE stream = $1", stream, seq)
    await conn.execute("SELECT pg_notify($1, $2)", NOTIFY_CHANNEL, f"{stream}:{seq}")


class Applied(msgspec.Struct):
    """What a transaction did: the new stored position, dead letters recorded, and the plan it
    applied when one plan covered the whole batch (what the next batch may be folded against)."""

    position: int
    dead: int = 0
    plan: Plan | None = None


async def plan_batch(
    conn: asyncpg.Connection, items: Sequence[Incoming], after_seq: int, prior: Plan | None = None
) -> Plan | None:
    """Fold the items past `after_seq` against the database (and `prior`); None when none are new."""
    fresh = [item for item in items if item.seq > after_seq]
    if not fresh:
        return None
    return materialize(fold_batch(fresh, await load(conn, fresh, prior)))


async def commit(conn: asyncpg.Connection, stream: str, plan: Plan, expected: int) -> Applied:
    """Write a plan folded for the position `expected` (PositionMoved if the stored one differs)."""
    async with conn.transaction():
        await _lock_position(conn, stream, expected)
        await write(conn, plan)
        await _store_position(conn, stream, plan.last_seq)
    return Applied(plan.last_seq, len(plan.dead_letters), plan)


async def apply_batch(
    conn: asyncpg.Connection,
    stream: str,
    items: Sequence[Incoming],
    expected: int | None,
    on_plan: Callable[[Plan], None] | None = None,
) -> Applied:
    """Apply `items` exactly once (see the module docstring).

    `expected` is the position this projector last stored (None: accept whatever is stored);
    `on_plan` sees the plan as soon as it is folded (so the next batch can be folded against it).
    """
    async with conn.transaction():
        stored = await _lock_position(conn, stream, expected)
        plan = await plan_batch(conn, items, stored)
        if plan is None:
            return Applied(stored)
        if on_plan is not None:
            on_plan(plan)
        await write(conn, plan)
        await _store_position(conn, stream, plan.last_seq)
        return Applied(plan.last_seq, len(plan.dead_letters), plan)


async def dead_letter(
    conn: asyncpg.Connection, stream: str, item: Incoming, reason: str, expected: int | None
) -> Applied:
    """Record `item` as a dead letter and move the position past it."""
    async with conn.transaction():
        stored = await _lock_position(conn, stream, expected)
        if item.seq <= stored:
            return Applied(stored)
        await _copy(conn, "dead_letters", DEAD_LETTER_COLUMNS, [(item.seq, item.subject, reason, item.data)])
        await _store_position(conn, stream, item.seq)
        return Applied(item.seq, 1)


async def apply_isolating(
    conn: asyncpg.Connection,
    stream: str,
    items: Sequence[Incoming],
    expected: int | None,
    on_plan: Callable[[Plan], None] | None = None,
) -> Applied:
    """`apply_batch`, splitting the batch around events Postgres refuses, which become dead letters."""
    try:
        return await apply_batch(conn, stream, items, expected, on_plan)
    except Exception as exc:
        if not is_poison(exc, conn):
            raise
        if len(items) == 1:
            code = getattr(exc, "sqlstate", None) or type(exc).__name__
            reason = f"rejected by Postgres ({code}): {exc}"
            return await dead_letter(conn, stream, items[0], reason, expected)
    middle = len(items) // 2
    first = await apply_isolating(conn, stream, items[:middle], expected)
    second = await apply_isolating(conn, stream, items[middle:], first.position)
    return Applied(second.position, first.dead + second.dead)  # split: no single plan to fold against


async def dead_letter_count(conn: asyncpg.Connection) -> int:
    """How many messages could not be projected."""
    return int(await conn.fetchval("SELECT count(*) FROM dead_letters"))
