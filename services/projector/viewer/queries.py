"""What the trajectory viewer shows, read from the projector's tables.

Three levels: runs (summaries), a run's rollouts (one row each, sortable and filterable), and one
rollout's timeline (every event in order, model calls with their prompt, response, tool calls
and per-token logprobs). Two flags are relative to the run and so computed here rather than by
the projector: `long` (calls or tokens over 3x the run's median) and `many-samples` (the harness
rewrote history, so the rollout splits into many training samples).
"""

from __future__ import annotations

import math
import time
from typing import Any

import asyncpg
import msgspec

from services.projector.calls import CallResolver
from services.projector.flags import MEANINGS
from services.projector.incoming import full_body
from services.projector.packing import json_column, unpack_float64, unpack_int32
from services.projector.reader import PostgresRolloutReader

SORTS = {
    "created": "created_seq",
    "status": "status",
    "reward": "reward",
    "attempts": "attempts",
    "calls": "calls",
    "samples": "samples",
    "tokens": "(prompt_tokens + response_tokens)",
    "duration": "(coalesce(ended_at, extract(epoch FROM now())) - created_at)",
    "flags": "cardinality(flags)",
    "updated": "last_seq",
}
RELATIVE_MEANINGS = {
    "long": "calls or tokens more than 3x the run's median",
    "many-samples": "more than 3 training samples: the harness rewrote the conversation",
}
LIVE_WINDOW_S = 60.0
MAX_TOKENS_SHOWN = 4096


class ViewerQueryError(ValueError):
    """A viewer request with a parameter it cannot use; the message lists the allowed values."""


def _finite(value: float | None) -> float | None:
    return value if value is None or math.isfinite(value) else None


MANY_SAMPLES = 3
"""More training samples than this in a rollout: the harness rewrote the conversation (`many-samples`)."""


def long_limits(median_calls: float, median_tokens: float) -> tuple[float, float]:
    """Calls and tokens above which a rollout is `long`: 3x the run's medians (none while the median is 0).

    The table's filter (SQL) and its flags (Python) both use these, so a filtered row always shows why.
    """
    if not median_calls:
        return math.inf, math.inf
    return 3 * median_calls, 3 * max(median_tokens, 1.0)


async def runs(reader: PostgresRolloutReader) -> dict[str, Any]:
    """Every run, most recently active first, with its summary and whether it is live."""
    now = time.time()
    out = []
    for summary in await reader.summaries():
        item = msgspec.to_builtins(summary)
        item["live"] = (
            now - summary.last_event_at < LIVE_WINDOW_S
            and summary.by_status.keys() - {"succeeded", "failed", "cancelled"} != set()
        )
        out.append(item)
    return {"runs": out, "applied_seq": await reader.applied_seq()}


def _rollout_item(row: Any, calls_limit: float, tokens_limit: float, now: float) -> dict[str, Any]:
    """One row of the rollouts table, with the relative flags (`long`, `many-samples`) added."""
    tokens = row["prompt_tokens"] + row["response_tokens"]
    flags = list(row["flags"])
    if row["calls"] > calls_limit or tokens > tokens_limit:
        flags.append("long")
    if row["samples"] > MANY_SAMPLES:
        flags.append("many-samples")
    end = row["ended_at"] if row["ended_at"] is not None else now
    return {
        "rollout_id": row["rollout_id"],
        "group_id": row["group_id"],
        "mode": row["mode"],
        "status": row["status"],
        "reward": _finite(row["reward"]),
        "attempts": row["attempts"],
        "calls": row["calls"],
        "failed_calls": row["failed_calls"],
        "samples": row["samples"],
        "prompt_tokens": row["prompt_tokens"],
        "response_tokens": row["response_tokens"],
        "created_at": row["created_at"],
        "ended_at": row["ended_at"],
        "duration_s": end - row["created_at"],
        "flags": flags,
        "last_seq": row["last_seq"],
    }


async def rollouts(
    reader: PostgresRolloutReader,
    run_id: str,
    *,
    sort: str = "created",
    desc: bool = False,
    status: str | None = None,
    flagged: bool = False,
    search: str | None = None,
    limit: int = 200,
    offset: int = 0,
) -> dict[str, Any]:
    """One page of a run's rollouts with the run's medians, for the rollouts table."""
    if sort not in SORTS:
        raise ViewerQueryError(f"cannot sort by {sort!r}; choose one of {', '.join(SORTS)}")
    order = f"{SORTS[sort]} {'DESC' if desc else 'ASC'} NULLS LAST, created_seq"
    async with reader.acquire() as conn:
        medians = await conn.fetchrow(
            "SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY calls) AS calls, "
            "percentile_cont(0.5) WITHIN GROUP (ORDER BY prompt_tokens + response_tokens) AS tokens, "
            "count(*) AS total FROM rollouts WHERE run_id = $1",
            run_id,
        )
        median_calls = float(medians["calls"] or 0)
        median_tokens = float(medians["tokens"] or 0)
        calls_limit, tokens_limit = long_limits(median_calls, median_tokens)
        where = (
            "run_id = $1 AND ($2::text IS NULL OR status = $2) AND ($3::text IS NULL OR rollout_id ILIKE $3 "
            "OR group_id ILIKE $3) AND (NOT $4 OR cardinality(flags) > 0 OR calls > $5::float8 OR "
            f"(prompt_tokens + response_tokens) > $6::float8 OR samples > {MANY_SAMPLES})"
        )
        args = (run_id, status, f"%{search}%" if search else None, flagged, calls_limit, tokens_limit)
        rows = await conn.fetch(
            f"SELECT * FROM rollouts WHERE {where} ORDER BY {order} LIMIT $7 OFFSET $8", *args, limit, offset
        )
        matching = await conn.fetchval(f"SELECT count(*) FROM rollouts WHERE {where}", *args)
    now = time.time()
    items = [_rollout_item(row, calls_limit, tokens_limit, now) for row in rows]
    return {
        "run_id": run_id,
        "total": medians["total"],
        "matching": matching,
        "median_calls": median_calls,
        "median_tokens": median_tokens,
        "rollouts": items,
        "meanings": MEANINGS | RELATIVE_MEANINGS,
    }


async def rollout(reader: PostgresRolloutReader, run_id: str, rollout_id: str) -> dict[str, Any] | None:
    """One rollout: its view, totals and attempts (with each attempt's totals)."""
    view = await reader.get(rollout_id, run_id)
    if view is None:
        return None
    async with reader.acquire() as conn:
        row = await conn.fetchrow("SELECT * FROM rollouts WHERE run_id = $1 AND rollout_id = $2", run_id, rollout_id)
        stats = {
            r["attempt_key"]: dict(r)
            for r in await conn.fetch(
                "SELECT * FROM attempt_stats WHERE run_id = $1 AND rollout_id = $2", run_id, rollout_id
            )
        }
    data = msgspec.to_builtins(view)
    data["reward"] = view.reward
    for name in (
        "calls",
        "failed_calls",
        "prompt_tokens",
        "response_tokens",
        "samples",
        "custom_events",
        "ended_at",
        "last_seq",
        "last_event_at",
    ):
        data[name] = row[name]
    data["flags"] = list(row["flags"])
    for attempt in data["attempts"]:
        found = stats.get(attempt["attempt_id"], {})
        for name in ("calls", "failed_calls", "prompt_tokens", "response_tokens", "samples", "reward"):
            attempt[name] = found.get(name)
    data["meanings"] = MEANINGS | RELATIVE_MEANINGS
    return data


def _message_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts
        return "\n".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return "" if content is None else msgspec.json.encode(content).decode()


def _reply(response: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
    """The reply's text and tool calls. The gateway records `{"message": {...}}` (the choice's message);
    the chat-completions shape (`{"choices": [{"message": ...}]}`) is read too."""
    message = response.get("message") if isinstance(response, dict) else None
    if not isinstance(message, dict):
        choices = response.get("choices") if isinstance(response, dict) else None
        first = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
        message = first.get("message")
    if not isinstance(message, dict):
        message = {}
    tools = []
    for call in message.get("tool_calls") or []:
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict):
            tools.append({"id": call.get("id"), "name": function.get("name"), "arguments": function.get("arguments")})
    return _message_text(message.get("content")), tools


def _shown(message: Any) -> dict[str, Any]:
    return {"role": message.get("role"), "content": _message_text(message.get("content")), "name": message.get("name")}


def _new_messages(messages: list[Any], seen: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages a call adds to the attempt's previous call: all of them when the previous call's
    messages are not a prefix of this one's (a new conversation, however many messages it has)."""
    shown = [_shown(m) for m in messages if isinstance(m, dict)]
    return shown[len(seen) :] if shown[: len(seen)] == seen else shown


def _call_item(
    row: asyncpg.Record, seen_messages: list[dict[str, Any]], calls: CallResolver
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    request = calls.request(row["seq"]) or {}
    messages = request.get("messages") if isinstance(request, dict) else None
    messages = messages if isinstance(messages, list) else []
    new = _new_messages(messages, seen_messages)
    text, tools = _reply(json_column(row["response"]) or {})
    ids = unpack_int32(row["response_ids"])[:MAX_TOKENS_SHOWN]
    logprobs = [_finite(v) for v in unpack_float64(row["logprobs"])[:MAX_TOKENS_SHOWN]]
    pieces = row["response_pieces"]
    return {
        "call_id": row["call_id"],
        "model": row["model"],
        "status": row["status"],
        "mode": row["mode"],
        "weights_version": row["weights_version"],
        "finish_reason": row["finish_reason"],
        "latency_s": row["latency_s"],
        "error": row["error"],
        "prompt_tokens": row["prompt_tokens"],
        "response_tokens": row["response_tokens"],
        "new_sample": row["new_sample"],
        "flags": list(row["flags"]),
        "new_messages": new,
        "messages_total": len(messages),
        "response_text": text or row["response_text"],
        "tool_calls": tools,
        "response_ids": ids,
        "logprobs": logprobs,
        "response_pieces": list(pieces[:MAX_TOKENS_SHOWN]) if pieces is not None else None,
        "has_prompt_text": row["has_prompt_text"],
        "continuity": row["continuity"],
    }, [_shown(m) for m in messages if isinstance(m, dict)]


TIMELINE_SQL = """
SELECT e.seq, e.type, e.time, e.attempt_id, e.body, m.call_id, m.model, m.status, m.mode, m.weights_version,
       m.finish_reason, m.latency_s, m.error, m.prompt_tokens, m.response_tokens, m.new_sample, m.flags,
       m.request, m.response, m.response_ids, m.logprobs, m.response_pieces, m.response_text,
       m.prompt_text IS NOT NULL AS has_prompt_text, m.base_seq, m.request_ref, m.continuity,
       w.value, w.name AS reward_name, w.source, w.step, c.name AS custom_name, c.payload, c.source AS custom_source
FROM events e
LEFT JOIN model_calls m ON m.seq = e.seq AND e.type = 'model_request'
LEFT JOIN rewards w ON w.seq = e.seq AND e.type = 'reward'
LEFT JOIN custom_events c ON c.seq = e.seq AND e.type = 'custom'
WHERE e.run_id = $1 AND e.rollout_id = $2 AND e.seq > $3
ORDER BY e.seq
LIMIT $4
"""


async def timeline(
    reader: PostgresRolloutReader, run_id: str, rollout_id: str, *, after_seq: int = 0, limit: int = 2000
) -> dict[str, Any]:
    """A rollout's events after `after_seq`, each rendered for the timeline."""
    async with reader.acquire() as conn:
        rows = await conn.fetch(TIMELINE_SQL, run_id, rollout_id, after_seq, limit)
        # Each attempt's last earlier call with messages, to show only the messages new since then.
        earlier = await conn.fetch(
            "SELECT DISTINCT ON (attempt_id) attempt_id, seq, base_seq, request, request_ref "
            "FROM model_calls WHERE run_id = $1 AND rollout_id = $2 AND seq <= $3 "
            "AND (jsonb_typeof(request->'messages') = 'array' OR request_ref->'same' ? 'messages') "
            "ORDER BY attempt_id, seq DESC",
            run_id,
            rollout_id,
            after_seq,
        )
        calls = await CallResolver.load(conn, [*earlier, *(row for row in rows if row["type"] == "model_request")])
    seen_messages: dict[str | None, list[dict[str, Any]]] = {}
    for row in earlier:
        messages = (calls.request(row["seq"]) or {}).get("messages")
        seen_messages[row["attempt_id"]] = (
            [_shown(m) for m in messages if isinstance(m, dict)] if isinstance(messages, list) else []
        )
    items: list[dict[str, Any]] = []
    for row in rows:
        item: dict[str, Any] = {
            "seq": row["seq"],
            "type": row["type"],
            "time": row["time"],
            "attempt_id": row["attempt_id"],
        }
        if row["type"] == "model_request":
            details, seen = _call_item(row, seen_messages.get(row["attempt_id"], []), calls)
            seen_messages[row["attempt_id"]] = seen
            item.update(details)
        elif row["type"] == "reward":
            item.update(value=_finite(row["value"]), name=row["reward_name"], source=row["source"], step=row["step"])
        elif row["type"] == "custom":
            item.update(name=row["custom_name"], payload=json_column(row["payload"]), source=row["custom_source"])
        else:
            body = full_body(row["body"])
            for name in ("status", "previous", "reason", "sequence", "executor", "input", "group_id", "mode"):
                if name in body:
                    item[name] = body[name]
        items.append(item)
    return {"events": items, "last_seq": items[-1]["seq"] if items else after_seq}


async def call(reader: PostgresRolloutReader, seq: int) -> dict[str, Any] | None:
    """One model call in full: the whole request, the prompt text and ids, the response."""
    async with reader.acquire() as conn:
        row = await conn.fetchrow("SELECT * FROM model_calls WHERE seq = $1", seq)
        if row is None:
            return None
        calls = await CallResolver.load(conn, [row])
    return {
        "seq": seq,
        "run_id": row["run_id"],
        "rollout_id": row["rollout_id"],
        "continuity": row["continuity"],
        "request": calls.request(seq),
        "response": json_column(row["response"]),
        "usage": json_column(row["usage"]),
        "prompt_text": calls.prompt_text(seq),
        "prompt_ids": unpack_int32(calls.prompt_ids(seq)),
        "response_ids": unpack_int32(row["response_ids"]),
        "logprobs": [_finite(v) for v in unpack_float64(row["logprobs"])],
    }
