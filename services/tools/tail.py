"""`rollwire tail`: one line per live event, pretty for people or JSON for pipes.

Pretty: time, run/rollout, type and the event's key fields, with long ids, token lists and text
abbreviated. JSON: exactly the stored event (the same JSON every subscriber gets), one per line.
"""

from __future__ import annotations

import json
import re
import time
from datetime import UTC, datetime
from typing import Any

from schemas import (
    AnyEvent,
    AttemptStarted,
    CustomEvent,
    ModelRegistered,
    ModelRemoved,
    ModelRequestRecorded,
    PhaseChanged,
    RewardReported,
    RolloutCreated,
    RolloutStatusChanged,
    RunStarted,
    encode,
)
from schemas.refs import prompt_length, response_length
from services.common.eventstore import StoredEvent

TAIL_FORMATS = ("pretty", "json")
ID_CHARS = 14
TEXT_CHARS = 60


class BadTime(ValueError):
    """A `--since` value that is neither a time nor a duration; the message shows the forms."""


_DURATION = re.compile(r"^(\d+(?:\.\d+)?)\s*(s|m|h|d)$")
_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_since(text: str, now: float | None = None) -> float:
    """Unix seconds from `90s`/`15m`/`2h`/`1d` (that long ago), an ISO 8601 time, or Unix seconds."""
    value = text.strip()
    match = _DURATION.match(value)
    if match:
        return (time.time() if now is None else now) - float(match.group(1)) * _UNITS[match.group(2)]
    try:
        return float(value)
    except ValueError:
        pass
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise BadTime(
            f"--since {text!r} is not a time; give a duration (90s, 15m, 2h, 1d), an ISO time "
            "(2026-01-31T12:00:00Z) or Unix seconds"
        ) from None
    if parsed.tzinfo is None:
        parsed = parsed.astimezone()  # a time without zone is local time
    return parsed.timestamp()


def short(value: str | None, limit: int = ID_CHARS) -> str:
    """An id or text cut to `limit` characters (with an ellipsis when cut), on one line."""
    if value is None:
        return "-"
    flat = " ".join(value.split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def _message_text(response: dict[str, Any]) -> tuple[str, list[str]]:
    message = response.get("message")
    if not isinstance(message, dict):
        choices = response.get("choices")
        first = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
        message = first.get("message") if isinstance(first.get("message"), dict) else {}
    content = message.get("content") if isinstance(message, dict) else None
    tools = []
    for call in (message.get("tool_calls") if isinstance(message, dict) else None) or []:
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict):
            tools.append(f"{function.get('name', '?')}({short(str(function.get('arguments', '')), 40)})")
    return (content if isinstance(content, str) else ""), tools


def _version(version: int | None) -> str:
    return "-" if version is None else str(version)


def _fields(event: AnyEvent) -> str:
    match event:
        case ModelRequestRecorded():
            text, tools = _message_text(event.response)
            parts = [
                f"call={short(event.call_id, 10)}",
                event.status,
                f"model={event.model or '-'}",
                f"v={_version(event.weights_version)}",
                f"tokens={prompt_length(event)}+{response_length(event)}",
            ]
            if event.finish_reason:
                parts.append(f"finish={event.finish_reason}")
            if event.error:
                parts.append(f"error={short(event.error, TEXT_CHARS)!r}")
            if text:
                parts.append(repr(short(text, TEXT_CHARS)))
            if tools:
                parts.append("tools: " + ", ".join(tools))
            return " ".join(parts)
        case RewardReported():
            extra = [f"name={event.name}"] if event.name else []
            extra += [f"step={event.step}"] if event.step is not None else []
            return " ".join([f"value={event.value:g}", f"source={event.source}", *extra])
        case RolloutStatusChanged():
            arrow = f"{event.previous} → {event.status}" if event.previous else event.status
            reason = f" reason={short(event.reason, TEXT_CHARS)!r}" if event.reason else ""
            return f"{arrow} attempt={short(event.attempt_id)}{reason}"
        case RolloutCreated():
            text = encode_payload(event.input) if isinstance(event.input, dict) else str(event.input)
            return f"group={short(event.group_id)} mode={event.mode} input={short(text, TEXT_CHARS)}"
        case AttemptStarted():
            return f"attempt={short(event.attempt_id)} #{event.sequence} executor={event.executor or '-'}"
        case CustomEvent():
            return f"{event.name} {short(encode_payload(event.payload), TEXT_CHARS * 2)}"
        case ModelRegistered():
            return (
                f"{event.name} {event.base_url} v={event.weights_version if event.weights_version is not None else '-'}"
            )
        case ModelRemoved():
            return event.name
        case PhaseChanged():
            return f"{event.phase} v={_version(event.weights_version)}"
        case RunStarted():
            return f"name={event.name or '-'}"
    return ""


def encode_payload(payload: Any) -> str:
    """A custom event's payload as compact JSON text."""
    return json.dumps(payload, separators=(",", ":"), ensure_ascii=False, default=str)


def pretty(stored: StoredEvent) -> str:
    """One readable line: time, run/rollout, type and the key fields."""
    event = stored.event
    stamp = datetime.fromtimestamp(event.time, tz=UTC).astimezone().strftime("%H:%M:%S.%f")[:-3]
    where = short(event.run_id) + ("/" + short(event.rollout_id) if event.rollout_id else "")
    type_tag = event.__struct_config__.tag
    return f"{stamp} {where} {type_tag} {_fields(event)}".rstrip()


def as_json(stored: StoredEvent) -> str:
    """The stored event's JSON, exactly as subscribers receive it."""
    return encode(stored.event).decode()


def line(stored: StoredEvent, fmt: str) -> str:
    """The tail line of one event in `fmt` (one of `TAIL_FORMATS`)."""
    if fmt == "json":
        return as_json(stored)
    if fmt == "pretty":
        return pretty(stored)
    raise ValueError(f"format {fmt!r} is not one of {', '.join(TAIL_FORMATS)}")
