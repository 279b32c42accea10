"""Reading `model_calls` rows back in full: references to earlier rows resolved in memory.

A row with `base_seq` stores only what its call added to an earlier row of its rollout (see
`fold.CallRow` and migration 003). Readers hand the rows they fetched to `CallResolver.load`,
which reads every earlier row those rows depend on, and not already fetched, in one recursive
query; `prompt_ids`, `prompt_text` and `request` then return the full values, each computed once
per row and kept for the rows that continue it.

    resolver = await CallResolver.load(conn, rows)   # rows: records with `STORED_COLUMNS`
    full_prompt = resolver.prompt_ids(row["seq"])

Why this is not `schemas.refs.Resolver`: it resolves stored rows, not events. A row points at an
earlier row by its sequence (`base_seq`), its text continues that row's by characters
(`base_text`), and the rows it depends on are fetched from Postgres in one query; the rule for ids
and requests is the contract's (`schemas.refs.resolve_request`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

import asyncpg
import msgspec

from schemas.refs import CallRef, resolve_request
from services.projector.incoming import RequestRef
from services.projector.packing import json_column

log = logging.getLogger("rollwire.projector.calls")

STORED_COLUMNS = (
    "seq",
    "base_seq",
    "base_tokens",
    "base_text",
    "prompt_ids",
    "response_ids",
    "prompt_text",
    "response_text",
    "request",
    "request_ref",
)
"""The columns `CallResolver` reads of each row (a query may alias them: `m.seq AS seq`)."""

_ANCESTORS = f"""
WITH RECURSIVE chain(seq) AS (
    SELECT unnest($1::bigint[])
  UNION
    SELECT m.base_seq FROM model_calls m JOIN chain c ON m.seq = c.seq WHERE m.base_seq IS NOT NULL
)
SELECT {", ".join(f"m.{c}" for c in STORED_COLUMNS)} FROM model_calls m JOIN chain USING (seq)
"""

_ref = msgspec.json.Decoder(RequestRef)


class CallResolver:
    """Full prompt ids, prompt text and request of fetched `model_calls` rows."""

    def __init__(self, rows: Iterable[Mapping[str, Any]]) -> None:
        self.rows: dict[int, Mapping[str, Any]] = {row["seq"]: row for row in rows if row["seq"] is not None}
        self._ids: dict[int, bytes] = {}
        self._texts: dict[int, str | None] = {}
        self._requests: dict[int, Any] = {}

    @classmethod
    async def load(cls, conn: asyncpg.Connection, rows: Iterable[Mapping[str, Any]]) -> CallResolver:
        """A resolver over `rows` plus every earlier row they reference (one query, only when needed)."""
        resolver = cls(rows)
        wanted = {row["base_seq"] for row in resolver.rows.values() if row["base_seq"] is not None}
        missing = sorted(wanted - resolver.rows.keys())
        if missing:
            for row in await conn.fetch(_ANCESTORS, missing):
                resolver.rows.setdefault(row["seq"], row)
        return resolver

    def _chain(self, seq: int, done: Mapping[int, Any]) -> list[Mapping[str, Any]]:
        """The rows from the first one not yet resolved (or stored in full) down to `seq`, oldest first."""
        chain: list[Mapping[str, Any]] = []
        row = self.rows.get(seq)
        while row is not None and row["seq"] not in done:
            chain.append(row)
            base = row["base_seq"]
            if base is None:
                break
            row = self.rows.get(base)
            if row is None:  # cannot happen for rows the projector wrote (pgstore.call_rows checks)
                log.warning("model call row %s references row %s, which is missing", chain[-1]["seq"], base)
        chain.reverse()
        return chain

    def prompt_ids(self, seq: int) -> bytes:
        """The call's full prompt ids, packed int32."""
        for row in self._chain(seq, self._ids):
            base = row["base_seq"]
            new = bytes(row["prompt_ids"])
            if base is not None and base in self._ids:
                earlier = self._ids[base] + bytes(self.rows[base]["response_ids"])
                new = earlier[: 4 * row["base_tokens"]] + new
            self._ids[row["seq"]] = new
        return self._ids.get(seq, b"")

    def prompt_text(self, seq: int) -> str | None:
        """The call's full prompt text (None when it was not decoded, or the row it continues was not)."""
        for row in self._chain(seq, self._texts):
            text: str | None = row["prompt_text"]
            base = row["base_seq"]
            if text is not None and base is not None and row["base_text"] > 0:
                earlier = self._texts.get(base)
                response = self.rows[base]["response_text"] if base in self.rows else None
                text = None if earlier is None else (earlier + (response or ""))[: row["base_text"]] + text
            self._texts[row["seq"]] = text
        return self._texts.get(seq)

    def request(self, seq: int) -> Any:
        """The call's full request, decoded."""
        for row in self._chain(seq, self._requests):
            request = json_column(row["request"])
            ref = row["request_ref"]
            if ref is not None and row["base_seq"] is not None and isinstance(request, dict):
                earlier = self._requests.get(row["base_seq"])
                stored = _ref.decode(ref)
                how = CallRef(event_id="", same=stored.same, prefix=stored.prefix)
                request = resolve_request(request, how, earlier if isinstance(earlier, dict) else {})
            self._requests[row["seq"]] = request
        return self._requests.get(seq)
