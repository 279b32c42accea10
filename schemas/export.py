"""Export a JSON Schema file per event type into `schemas/json/` (and check they are current)."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec

from schemas.events import ENVELOPE_KEYS, EVENT_TYPES
from schemas.runs import RunSpec

JSON_DIR = Path(__file__).parent / "json"


def render_schemas() -> dict[str, str]:
    """File name → JSON Schema text, one per event type plus the run spec.

    An event's schema requires the envelope keys, which every encoded event carries; every other
    field with a default may be absent (absent means the default, schema version 4).
    """
    out: dict[str, str] = {}
    for event_type in EVENT_TYPES:
        tag = event_type.__struct_config__.tag
        schema = msgspec.json.schema(event_type)
        definition = schema["$defs"][event_type.__name__]
        definition["required"] = [*ENVELOPE_KEYS, *(k for k in definition["required"] if k not in ENVELOPE_KEYS)]
        schema["$comment"] = f"Rollwire event '{tag}' ({event_type.__name__}); see schemas/README.md"
        out[f"{tag}.json"] = json.dumps(schema, indent=2, sort_keys=True) + "\n"
    run_spec = msgspec.json.schema(RunSpec)
    run_spec["$comment"] = "Rollwire run spec (POST /api/runs, RunStarted.spec); see schemas/README.md"
    out["run_spec.json"] = json.dumps(run_spec, indent=2, sort_keys=True) + "\n"
    return out


def export(directory: Path = JSON_DIR) -> list[Path]:
    """Write every schema file, removing stale ones; returns the paths written."""
    directory.mkdir(parents=True, exist_ok=True)
    rendered = render_schemas()
    for stale in directory.glob("*.json"):
        if stale.name not in rendered:
            stale.unlink()
    written = []
    for name, text in rendered.items():
        path = directory / name
        path.write_text(text)
        written.append(path)
    return written


def stale_files(directory: Path = JSON_DIR) -> list[str]:
    """Names of schema files that are missing, extra or out of date (empty when current)."""
    rendered = render_schemas()
    existing = {p.name: p.read_text() for p in directory.glob("*.json")} if directory.exists() else {}
    names = set(rendered) | set(existing)
    return sorted(n for n in names if rendered.get(n) != existing.get(n))
