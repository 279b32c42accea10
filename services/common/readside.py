"""The read side's declared interface: the queries behind every `GET /api/...`, and two ways to answer them.

    reader: RolloutReader = StreamRolloutReader(store)       # fold the stream on each query
    reader: RolloutReader = ProjectorReader(projector_url)   # the projector's query API over HTTP

The projector owns the read models: its Postgres reader implements `RolloutReader` and serves it
over HTTP (`services/projector/query.py`); the gateway talks to it through `ProjectorReader` and
never imports the projector. `StreamRolloutReader` answers the same protocol straight from the
stream with the contract's fold: for write paths (an answer that shows the write just made, with
no Postgres on the way) and for a gateway run without a projector.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol
from urllib.parse import quote

import httpx
import msgspec

from schemas.ids import RUN_SUBJECT, check_id
from schemas.rollout import RolloutView, fold, fold_all
from schemas.run import RunView as RunState
from schemas.run import fold as fold_run
from services.common.eventstore import EventStore, StoredEvent

# Subjects a rollout view is folded from (model requests and custom events do not change it).
VIEW_SUFFIXES = ("created", "status", "attempt", "reward")


class RolloutQuery(msgspec.Struct, kw_only=True):
    """Filters of `GET /api/rollouts`; `cursor` is the `created_seq` of the last item already seen."""

    run_id: str | None = None
    statuses: frozenset[str] = frozenset()
    group_id: str | None = None
    mode: str | None = None
    limit: int = 500
    cursor: int = 0


class RunView(msgspec.Struct, kw_only=True):
    """A run's spec (from `RunStarted`) and a summary of its rollouts."""

    run_id: str
    name: str
    config: dict[str, Any]
    started_at: float | None
    """None for a run with events that was never declared (`POST /api/runs`)."""
    seq: int
    rollouts: dict[str, int] = {}


class RolloutReader(Protocol):
    """Queries the rollout API answers; a stream fold now, a Postgres projection later."""

    async def get(self, rollout_id: str, run_id: str | None = None) -> RolloutView | None:
        """One rollout, or None when it does not exist."""
        ...

    async def query(self, query: RolloutQuery) -> list[RolloutView]:
        """Rollouts matching the query, in creation order, after `query.cursor`, at most `limit`."""
        ...

    async def terminal(self, after: int, limit: int) -> tuple[list[RolloutView], int]:
        """Terminal rollouts in completion order from index `after`, and the total count."""
        ...

    async def events(self, rollout_id: str, run_id: str) -> list[StoredEvent]:
        """Every event of one rollout in stream order."""
        ...

    async def run(self, run_id: str) -> RunView | None:
        """A run's spec and summary, or None when no run was started with this id."""
        ...

    async def summary(self, run_id: str) -> Any:
        """A run's totals from the read models (reward mean, tokens, calls), or None without them."""
        ...


class StreamRolloutReader:
    """`RolloutReader` that folds events from the stream on every query (no state of its own)."""

    def __init__(self, store: EventStore) -> None:
        self.store = store

    async def get(self, rollout_id: str, run_id: str | None = None) -> RolloutView | None:
        check_id("rollout_id", rollout_id)
        run = check_id("run_id", run_id) if run_id else "*"
        subjects = [f"rl.{run}.rollout.{rollout_id}.{suffix}" for suffix in VIEW_SUFFIXES]
        return fold_all([stored async for stored in self.store.read(subjects)])

    async def _fold_all(self, run_id: str | None) -> list[RolloutView]:
        run = check_id("run_id", run_id) if run_id else "*"
        filters = [f"rl.{run}.rollout.*.{suffix}" for suffix in VIEW_SUFFIXES]
        views: dict[tuple[str, str], RolloutView | None] = {}
        async for stored in self.store.read(filters):
            key = (stored.event.run_id, stored.event.rollout_id or "")
            views[key] = fold(views.get(key), stored)
        return sorted((v for v in views.values() if v is not None), key=lambda v: v.created_seq)

    async def query(self, query: RolloutQuery) -> list[RolloutView]:
        out: list[RolloutView] = []
        for view in await self._fold_all(query.run_id):
            if view.created_seq <= query.cursor:
                continue
            if query.statuses and view.status not in query.statuses:
                continue
            if query.group_id is not None and view.group_id != query.group_id:
                continue
            if query.mode is not None and view.mode != query.mode:
                continue
            out.append(view)
            if len(out) >= query.limit:
                break
        return out

    async def terminal(self, after: int, limit: int) -> tuple[list[RolloutView], int]:
        done = sorted((v for v in await self._fold_all(None) if v.terminal_seq), key=lambda v: v.terminal_seq)
        return done[after : after + limit], len(done)

    async def events(self, rollout_id: str, run_id: str) -> list[StoredEvent]:
        return await self.store.read_rollout(run_id, rollout_id)

    async def summary(self, run_id: str) -> dict[str, Any] | None:
        return None  # totals are the projection's; the stream fold keeps none

    async def run(self, run_id: str) -> RunView | None:
        check_id("run_id", run_id)
        run: RunState | None = None
        async for stored in self.store.read(RUN_SUBJECT.format(run=run_id)):
            run = fold_run(run, stored)
        counts: dict[str, int] = {}
        for view in await self._fold_all(run_id):
            counts[view.status] = counts.get(view.status, 0) + 1
        if run is None or run.started_seq is None:  # rollouts without a declared run still make a run
            if not counts:
                return None
            return RunView(run_id=run_id, name="", config={}, started_at=None, seq=0, rollouts=counts)
        return RunView(
            run_id=run_id,
            name=run.name,
            config=run.recorded_spec() or {},
            started_at=run.started_at,
            seq=run.started_seq,
            rollouts=counts,
        )


class ReadSideError(RuntimeError):
    """The projector answered a query with an error (or could not be reached): its status and JSON body."""

    def __init__(self, status: int, body: dict[str, Any]) -> None:
        super().__init__(str(body.get("error", f"the projector answered {status}")))
        self.status = status
        self.body = body


class _Terminal(msgspec.Struct):
    views: list[RolloutView]
    total: int


_VIEW = msgspec.json.Decoder(RolloutView)
_VIEWS = msgspec.json.Decoder(list[RolloutView])
_TERMINAL = msgspec.json.Decoder(_Terminal)
_EVENTS = msgspec.json.Decoder(list[StoredEvent])
_RUN = msgspec.json.Decoder(RunView)


class ProjectorReader:
    """`RolloutReader` over the projector's query API (`GET /query/...`, see `services/projector/api.py`).

    `token` is sent as a bearer token (the projector checks it when it has an admin token). A 404
    is `None`; any other error, or a projector that cannot be reached, raises `ReadSideError` with
    the status and body to answer with (503 when unreachable: writes, which go to the stream, still work).
    """

    def __init__(self, base_url: str, *, token: str | None = None, timeout_s: float = 30.0) -> None:
        self.base_url = base_url.rstrip("/")
        self._token = token
        self.client = httpx.AsyncClient(base_url=self.base_url, timeout=timeout_s)

    async def close(self) -> None:
        """Close the connection pool."""
        await self.client.aclose()

    async def forward(self, path: str, query: bytes = b"", *, token: str | None = None) -> httpx.Response:
        """GET `path?query` from the projector as it answers it, with `token` as the bearer (none: no
        credential; a caller's read is relayed with the caller's own token, never this reader's).
        `ReadSideError` 503 when the projector cannot be reached."""
        headers = {"Authorization": f"Bearer {token}"} if token else None
        try:
            return await self.client.get(f"{path}?{query.decode('latin-1')}" if query else path, headers=headers)
        except httpx.HTTPError as exc:
            raise ReadSideError(
                503,
                {"error": f"the projector at {self.base_url} cannot be reached ({exc!r}); writes still work"},
            ) from None

    async def request(self, path: str, params: dict[str, Any] | None = None) -> httpx.Response | None:
        """GET `path` (a query of the reader's own, with its token) from the projector: the response
        when 2xx, None on 404, else `ReadSideError`."""
        query = httpx.QueryParams(params or {})
        response = await self.forward(path, str(query).encode("latin-1"), token=self._token)
        if response.status_code == 404:
            return None
        if response.status_code >= 400:
            try:
                body = response.json()
            except ValueError:
                body = {"error": response.text[:500]}
            raise ReadSideError(response.status_code, body if isinstance(body, dict) else {"error": str(body)})
        return response

    async def ping(self, timeout_s: float = 1.0) -> None:
        """Raise `ReadSideError` unless the projector answers a query (its Postgres included) within `timeout_s`."""
        try:
            async with asyncio.timeout(timeout_s):
                await self.request("/query/position")
        except TimeoutError:
            raise ReadSideError(503, {"error": f"the projector did not answer within {timeout_s:g}s"}) from None

    async def wait_for(self, min_seq: int) -> None:
        """Return once the projection has applied `min_seq` (the projector waits; `ReadSideError` 503 if not)."""
        await self.request("/query/position", {"min_seq": min_seq})

    async def get(self, rollout_id: str, run_id: str | None = None) -> RolloutView | None:
        response = await self.request(f"/query/rollouts/{quote(rollout_id)}", {"run_id": run_id} if run_id else None)
        return None if response is None else _VIEW.decode(response.content)

    async def query(self, query: RolloutQuery) -> list[RolloutView]:
        params: dict[str, Any] = {"limit": query.limit, "cursor": query.cursor, "status": sorted(query.statuses)}
        params.update(
            {k: v for k, v in (("run_id", query.run_id), ("group_id", query.group_id), ("mode", query.mode)) if v}
        )
        response = await self.request("/query/rollouts", params)
        return [] if response is None else _VIEWS.decode(response.content)

    async def terminal(self, after: int, limit: int) -> tuple[list[RolloutView], int]:
        response = await self.request("/query/terminal", {"after": after, "limit": limit})
        if response is None:
            return [], 0
        page = _TERMINAL.decode(response.content)
        return page.views, page.total

    async def events(self, rollout_id: str, run_id: str) -> list[StoredEvent]:
        response = await self.request(f"/query/rollouts/{quote(rollout_id)}/events", {"run_id": run_id})
        return [] if response is None else _EVENTS.decode(response.content)

    async def run(self, run_id: str) -> RunView | None:
        response = await self.request(f"/query/runs/{quote(run_id)}")
        return None if response is None else _RUN.decode(response.content)

    async def summary(self, run_id: str) -> dict[str, Any] | None:
        response = await self.request(f"/api/runs/{quote(run_id)}/summary")
        return None if response is None else msgspec.json.decode(response.content)
