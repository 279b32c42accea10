"""`<data-dir>/endpoints.json`: where a running `rollwire up` stack answers, for the CLI and scrapers.

    {"gateway": "http://127.0.0.1:18080", "engine": "http://127.0.0.1:41457/v1",
     "projector": "http://127.0.0.1:44891/metrics", "controller": "http://127.0.0.1:40211/metrics", ...}

Written once the stack is ready, removed when it stops; the admin token stays in its own file
(`<data-dir>/admin_token`, mode 0600), never in this one.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from pathlib import Path

NAME = "endpoints.json"
_SECRET_KEYS = ("admin token",)
_NOTE = re.compile(r" \([^()]*\)$")


def write(data_dir: Path, lines: Iterable[str]) -> Path:
    """Save the `name: url` lines `rollwire up` prints (not the admin token) as JSON, atomically."""
    found: dict[str, str] = {}
    for line in lines:
        name, sep, value = line.partition(": ")
        if sep and name not in _SECRET_KEYS:  # the first replica's, without the printed note: "(vLLM replica 0)"
            found.setdefault(name, _NOTE.sub("", value))
    path = data_dir / NAME
    staging = path.with_name(f".{NAME}.partial")
    staging.write_text(json.dumps(found, indent=2) + "\n")
    os.replace(staging, path)
    return path


def read(data_dir: Path) -> dict[str, str]:
    """The endpoints of the stack last started in `data_dir` ({} when none is running or it is unreadable)."""
    try:
        loaded = json.loads((data_dir / NAME).read_text())
    except (OSError, ValueError):
        return {}
    return {str(k): str(v) for k, v in loaded.items()} if isinstance(loaded, dict) else {}


def remove(data_dir: Path) -> None:
    """Forget the endpoints (the stack stopped)."""
    (data_dir / NAME).unlink(missing_ok=True)
