"""`rollwire export`: a run's events in a file, for offline analysis, and read back.

- `jsonl`: one event per line, as `schemas.encode` writes it (fields at their default left out,
  packed arrays as plain lists; `schemas.decode` reads a line back).
- `parquet` (needs pyarrow): one row per event; the columns are `seq`, `subject` and the union of
  every event type's fields, typed from the event Structs themselves (token ids as list<int64>,
  logprobs as list<double>, numbers and strings as such); free-form fields (`request`, `response`,
  `payload`, `config`, `input`, ...) are JSON text. A field another type lacks is null.

Both are written while the run is read, a row group at a time, so memory does not grow with the
run. API keys of registered models are never exported. `read_export` reads either file back into
typed events (the round trip: export then read gives the run's events).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import IO, Any

import msgspec

from schemas import EVENT_TYPES, AnyEvent, ModelRegistered, decode, encode, from_dict, to_dict
from services.common.eventstore import EventStore, StoredEvent

EXPORT_FORMATS = ("jsonl", "parquet")
ROW_GROUP = 4096


class ExportUnavailable(RuntimeError):
    """An export format whose library is not installed."""


def redact(event: AnyEvent) -> AnyEvent:
    """The event without secrets (a registered model's API key)."""
    if isinstance(event, ModelRegistered) and event.api_key is not None:
        return msgspec.structs.replace(event, api_key=None)
    return event


async def write_jsonl(events: AsyncIterator[StoredEvent], out: IO[bytes]) -> int:
    """Write one event JSON per line; returns how many."""
    n = 0
    async for stored in events:
        out.write(encode(redact(stored.event)))
        out.write(b"\n")
        n += 1
    return n


def _arrow() -> Any:
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError:
        raise ExportUnavailable("parquet export needs pyarrow: pip install pyarrow (or use --format jsonl)") from None
    return pyarrow


def _column_type(pa: Any, info: msgspec.inspect.Type) -> Any:
    """The Arrow type of a field, or None for JSON text (free-form or mixed types)."""
    if isinstance(info, msgspec.inspect.UnionType):
        kinds = [t for t in info.types if not isinstance(t, msgspec.inspect.NoneType)]
        return _column_type(pa, kinds[0]) if len(kinds) == 1 else None
    if isinstance(info, msgspec.inspect.BoolType):
        return pa.bool_()
    if isinstance(info, msgspec.inspect.IntType):
        return pa.int64()
    if isinstance(info, msgspec.inspect.FloatType):
        return pa.float64()
    if isinstance(info, msgspec.inspect.StrType):
        return pa.string()
    if isinstance(info, msgspec.inspect.LiteralType) and all(isinstance(v, str) for v in info.values):
        return pa.string()
    if isinstance(info, msgspec.inspect.ListType):
        item = _column_type(pa, info.item_type)
        return pa.list_(item) if item is not None and not pa.types.is_list(item) else None
    return None


def parquet_schema() -> tuple[Any, set[str]]:
    """The Arrow schema of an export and the names of its JSON-text columns."""
    pa = _arrow()
    types: dict[str, Any] = {}
    json_columns: set[str] = set()
    for event_type in EVENT_TYPES:
        for field in msgspec.inspect.type_info(event_type).fields:  # type: ignore[attr-defined]
            arrow = _column_type(pa, field.type)
            if arrow is None:
                json_columns.add(field.name)
            elif field.name in types and types[field.name] != arrow:
                json_columns.add(field.name)  # one name, two types across events: keep it as JSON
            types.setdefault(field.name, arrow)
    fields = [pa.field("seq", pa.int64()), pa.field("subject", pa.string()), pa.field("type", pa.string())]
    for name, arrow in types.items():
        fields.append(pa.field(name, pa.string() if name in json_columns else arrow))
    return pa.schema(fields), json_columns


def _row(stored: StoredEvent, json_columns: set[str]) -> dict[str, Any]:
    data = to_dict(redact(stored.event))
    row: dict[str, Any] = {"seq": stored.seq, "subject": stored.subject}
    for name, value in data.items():
        row[name] = json.dumps(value, separators=(",", ":")) if name in json_columns else value
    return row


async def write_parquet(events: AsyncIterator[StoredEvent], path: Path) -> int:
    """Write the events as Parquet, `ROW_GROUP` rows at a time; returns how many."""
    pa = _arrow()
    schema, json_columns = parquet_schema()
    n = 0
    rows: list[dict[str, Any]] = []
    with pa.parquet.ParquetWriter(str(path), schema, compression="zstd") as writer:
        async for stored in events:
            rows.append(_row(stored, json_columns))
            n += 1
            if len(rows) >= ROW_GROUP:
                writer.write_table(pa.Table.from_pylist(rows, schema=schema))
                rows = []
        if rows or n == 0:
            writer.write_table(pa.Table.from_pylist(rows, schema=schema))
    return n


async def export_run(store: EventStore, run_id: str, fmt: str, out: Path | IO[bytes]) -> int:
    """Export every event of the run to `out` (a path, or a binary stream for jsonl)."""
    if fmt not in EXPORT_FORMATS:
        raise ValueError(f"export format {fmt!r} is not one of {', '.join(EXPORT_FORMATS)}")
    events = store.read_run(run_id)
    if fmt == "parquet":
        if not isinstance(out, Path):
            raise ValueError("parquet needs a file (--out FILE)")
        return await write_parquet(events, out)
    if isinstance(out, Path):
        with out.open("wb") as handle:
            return await write_jsonl(events, handle)
    return await write_jsonl(events, out)


_FIELDS = {event_type.__struct_config__.tag: tuple(event_type.__struct_fields__) for event_type in EVENT_TYPES}
_UNSET_BY_DEFAULT = {
    event_type.__struct_config__.tag: {f.name for f in msgspec.structs.fields(event_type) if f.default is msgspec.UNSET}
    for event_type in EVENT_TYPES
}
"""Fields absent unless set (their column's null means absent, not an explicit null)."""


def read_export(path: Path) -> Iterator[AnyEvent]:
    """The events of an export file (`.jsonl` or `.parquet`), typed, in order."""
    if path.suffix == ".parquet":
        yield from _read_parquet(path)
        return
    with path.open("rb") as handle:
        for raw in handle:
            if raw.strip():
                yield decode(raw)


def _read_parquet(path: Path) -> Iterator[AnyEvent]:
    pa = _arrow()
    _, json_columns = parquet_schema()
    for batch in pa.parquet.ParquetFile(str(path)).iter_batches():
        for row in batch.to_pylist():
            tag = row["type"]
            data: dict[str, Any] = {"type": tag}
            for name in _FIELDS[tag]:
                value = row.get(name)
                if value is None and name in _UNSET_BY_DEFAULT[tag]:
                    continue
                data[name] = json.loads(value) if name in json_columns and value is not None else value
            yield from_dict(data)
