"""Access logs: one structured line per HTTP request, on every Rollwire service.

    access method=POST path=/api/rollouts status=201 rollout=- attempt=- latency_ms=3.1 service=gateway
    {"ts": 1764712345.1, "service": "gateway", "method": "POST", "path": "/api/rollouts", "status": 201, ...}

`ROLLWIRE_ACCESS_LOG` switches the format: `text` (the default, key=value), `json` (one JSON object
a line) or `off`. Lines are written straight to stderr (not through `logging`: a line per request
is on the hot path, and a service's logging setup should neither hide nor duplicate them). The rollout and
attempt come from the path (`/api/rollouts/{id}/attempt/{aid}/...`, `/proxy/rollout/{id}/attempt/{aid}/...`);
the query string is left out (it can carry filters nobody asked to keep).
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from typing import TextIO
from urllib.parse import quote

FORMATS = ("text", "json", "off")
MAX_PATH_CHARS = 512
_ROLLOUT = re.compile(r"/rollouts?/([^/]+)(?:/attempts?/([^/]+))?")


class AccessLogError(ValueError):
    """`ROLLWIRE_ACCESS_LOG` has a value other than text, json or off."""


def access_format(env: dict[str, str] | None = None) -> str:
    """The configured format (`text`, `json` or `off`); raises AccessLogError naming the allowed values."""
    raw = (os.environ if env is None else env).get("ROLLWIRE_ACCESS_LOG", "text").strip().lower() or "text"
    if raw not in FORMATS:
        raise AccessLogError(f"ROLLWIRE_ACCESS_LOG={raw!r}: use one of {', '.join(FORMATS)}")
    return raw


def ids_in(path: str) -> tuple[str | None, str | None]:
    """(rollout id, attempt id) named by a request path, where it names them."""
    found = _ROLLOUT.search(path)
    if found is None or found.group(1) in ("terminal",):
        return None, None
    return found.group(1), found.group(2)


class AccessLog:
    """Writes the access line of each request in the configured format."""

    def __init__(self, service: str, fmt: str | None = None, stream: TextIO | None = None) -> None:
        self.service = service
        self.format = fmt if fmt is not None else access_format()
        if self.format not in FORMATS:
            raise AccessLogError(f"access log format {self.format!r}: use one of {', '.join(FORMATS)}")
        self.stream = stream

    @property
    def enabled(self) -> bool:
        """False when access logs are switched off."""
        return self.format != "off"

    def line(self, method: str, path: str, status: int, latency_s: float) -> str:
        """The access line of one request (no trailing newline)."""
        path = path[:MAX_PATH_CHARS]
        if not (path.isprintable() and path.isascii()) or " " in path:  # no spaces or newlines from a client
            path = quote(path, safe="/:@!$&'()*+,;=-._~%")
        rollout, attempt = ids_in(path)
        latency_ms = round(latency_s * 1000, 2)
        if self.format == "json":
            record = {
                "ts": round(time.time(), 3),
                "service": self.service,
                "method": method,
                "path": path,
                "status": status,
                "rollout": rollout,
                "attempt": attempt,
                "latency_ms": latency_ms,
            }
            return json.dumps(record, separators=(",", ":"))
        return (
            f"access method={method} path={path} status={status} rollout={rollout or '-'} "
            f"attempt={attempt or '-'} latency_ms={latency_ms} service={self.service}"
        )

    def write(self, method: str, path: str, status: int, latency_s: float) -> None:
        """Log one request (nothing when switched off)."""
        if self.format != "off":
            (self.stream or sys.stderr).write(self.line(method, path, status, latency_s) + "\n")
