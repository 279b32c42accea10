"""What `rollwire rollouts|attempts|reward|models` need around the gateway's client: where the gateway
is, the admin token, and plain-text tables. Requests go through `services.common.gateway_api`'s
`SyncGatewayClient`; its errors (`GatewayError`) are one line, as the command prints them.

The gateway URL is `--gateway-url` / `ROLLWIRE_GATEWAY_URL`, else the `gateway` of the stack
running in the data dir (`<data-dir>/endpoints.json`, written by `rollwire up`), else
`http://127.0.0.1:18080`. The admin token is `--admin-token` / `ROLLWIRE_ADMIN_TOKEN`, else
`<data-dir>/admin_token` (where `rollwire up` keeps it). The data dir is `--data-dir` /
`ROLLWIRE_DATA_DIR`, default `.rollwire`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from services.devstack import endpoints_file

DEFAULT_GATEWAY_URL = "http://127.0.0.1:18080"
TIMEOUT_S = 30.0
MAX_CELL = 60


class ApiCliError(Exception):
    """What went wrong, as the one line the user sees; `exit_code` 2 for usage errors."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def resolve(gateway_url: str | None, admin_token: str | None, data_dir: Path) -> tuple[str, str]:
    """(gateway URL, admin token) from the flags or environment, else the data dir (module docstring)."""
    url = gateway_url or endpoints_file.read(data_dir).get("gateway") or DEFAULT_GATEWAY_URL
    token = admin_token
    if not token:
        path = data_dir / "admin_token"
        try:
            token = path.read_text().strip()
        except OSError:
            raise ApiCliError(
                f"no admin token: set ROLLWIRE_ADMIN_TOKEN, pass --admin-token, or point --data-dir at the "
                f"data dir of `rollwire up` ({path} does not exist)",
                2,
            ) from None
    return url.rstrip("/"), token


def cell(value: Any, key: str = "", limit: int | None = MAX_CELL) -> str:
    """One value on one line: `-` for nothing, UTC time for `*_at`, JSON for structures, cut to `limit`."""
    if value is None:
        text = "-"
    elif key.endswith("_at") and isinstance(value, int | float):
        text = datetime.fromtimestamp(value, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    elif isinstance(value, float):
        text = repr(round(value, 6))
    elif isinstance(value, str):
        text = value
    else:
        text = json.dumps(value, separators=(",", ":"))
    text = text.replace("\n", " ")
    return text if limit is None or len(text) <= limit else text[: limit - 1] + "…"


def table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str]) -> str:
    """Rows as a plain-text table with a header line (columns padded to their widest cell)."""
    cells = [[cell(row.get(c), c) for c in columns] for row in rows]
    widths = [max([len(c), *(len(r[i]) for r in cells)]) for i, c in enumerate(columns)]
    lines = ["  ".join(c.upper().ljust(w) for c, w in zip(columns, widths, strict=True)).rstrip()]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    return "\n".join(lines)


def fields(record: Mapping[str, Any], keys: Sequence[str]) -> str:
    """One record as `key  value` lines, in the given order (values whole: tokens and URLs are copied)."""
    width = max(len(k) for k in keys)
    return "\n".join(f"{k.ljust(width)}  {cell(record.get(k), k, None)}" for k in keys)
