"""Which agent of a multi-agent harness made a call: the proxy path's `agent/{name}` or a header.

    /proxy/rollout/{rid}/attempt/{aid}/mode/{m}/agent/{name}/openai/v1/...   (the base URL names it)
    X-Rollwire-Agent: {name}                                                  (for a fixed base URL)

One function reads both, so every front end (chat completions today, other APIs later) gets the
same name and the same errors; the name travels in the admitted call's context and is recorded on
each `model_request` event. The run spec's `agent_models` routes a named agent to its model.
"""

from __future__ import annotations

from schemas import InvalidId, check_id
from services.gateway.errors import ApiError

AGENT_HEADER = b"x-rollwire-agent"
AGENT_SEGMENT = "agent"


def split_agent(parts: list[str]) -> tuple[str | None, list[str]]:
    """The path's `agent/{name}` segment pair (after the mode) and the parts without it."""
    if len(parts) > 6 and parts[5] == AGENT_SEGMENT:
        return parts[6], [*parts[:5], *parts[7:]]
    return None, parts


def agent_name(from_path: str | None, from_header: str | None) -> str | None:
    """The call's agent name (None when neither names one); a 422 for a bad or conflicting name."""
    header = from_header.strip() if from_header is not None else None
    for where, value in (("the proxy path's agent/{name}", from_path), ("the X-Rollwire-Agent header", header)):
        if value is None:
            continue
        try:
            check_id("agent name", value)
        except InvalidId as exc:
            raise ApiError(422, f"{where}: {exc}", field="agent") from None
    if from_path is not None and header and header != from_path:
        raise ApiError(
            422,
            f"the path names agent {from_path!r} but the X-Rollwire-Agent header names {header!r}; send one name",
            field="agent",
        )
    return from_path if from_path is not None else (header or None)
