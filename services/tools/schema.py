"""The JSON Schema of `rollwire replay --format json`, generated from the report's Structs.

`report.schema.json` beside this file is the committed copy; `python -m services.tools.schema`
rewrites it, and a test fails when it is stale.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec

from services.tools.replay import ReplayReport

SCHEMA_PATH = Path(__file__).with_name("report.schema.json")


def report_schema() -> dict[str, Any]:
    """The report's JSON Schema (draft 2020-12), with a title and the report version."""
    schema: dict[str, Any] = msgspec.json.schema(ReplayReport)
    # The adapter documents its own config; here it is only the scheme's switches.
    schema["$defs"]["AdapterConfig"]["description"] = "The scheme: the trainer adapter's config (trainer.core)."
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "title": "rollwire replay report", **schema}


def schema_text() -> str:
    """The schema as the committed file holds it."""
    return json.dumps(report_schema(), indent=2, sort_keys=True) + "\n"


if __name__ == "__main__":
    SCHEMA_PATH.write_text(schema_text())
    print(SCHEMA_PATH)
