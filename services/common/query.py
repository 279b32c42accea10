"""Integers in a query string, parsed one way by every service that reads them (the gateway's
rollout API and the projector's query API and viewer), with one wording for a bad value."""

from __future__ import annotations

from schemas.bounds import PAGE_MAX


def int_query(raw: str | None, name: str, default: int, low: int = 0, high: int = PAGE_MAX) -> int:
    """`raw` as an integer in [low, high]; `default` when absent or blank; ValueError naming `name` otherwise."""
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"query parameter {name}={raw!r} is not an integer") from None
    if not low <= value <= high:
        raise ValueError(f"query parameter {name} must be between {low} and {high}")
    return value
