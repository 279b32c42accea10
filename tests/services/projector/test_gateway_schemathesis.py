"""The gateway's OpenAPI document against the live gateway: schemathesis, fixed seed, bounded budget.

The gateway runs with the Postgres read side (so `min_seq`, the run summaries and every read are
in the document) and a projector behind it. Every check schemathesis has (`-c all`: server errors,
status codes, content types, response schemas, headers, schema-valid requests accepted and
schema-violating ones rejected) must pass: 0 server errors, 0 conformance failures. A 503 is the
documented answer to a `min_seq` the projection has not reached, so `schemathesis.toml` lists it
as expected; a 500 still fails.
"""

from __future__ import annotations

import asyncio
import shutil
import sys
from pathlib import Path

import pytest
from projector_support import gateway_with_projector, running_projector

from services.devstack.embedded import NatsServer

ADMIN = "fuzz-admin"
SEED = 1
EXAMPLES = 8


def _schemathesis() -> str:
    beside = Path(sys.executable).with_name("schemathesis")
    found = str(beside) if beside.exists() else shutil.which("schemathesis")
    if found is None:
        pytest.fail("schemathesis is not installed (it is in the dev extra: pip install -e '.[dev]')")
    return found


@pytest.mark.slow
async def test_schemathesis_finds_nothing(fresh_nats: NatsServer, database: str, tmp_path: Path) -> None:
    async with running_projector(fresh_nats.url, database, metrics_port=-1):
        with gateway_with_projector(fresh_nats.url, database, ADMIN, min_seq_timeout_s=0.5) as server:
            proc = await asyncio.create_subprocess_exec(
                _schemathesis(), "--config-file", str(Path(__file__).with_name("schemathesis.toml")),
                "run", f"{server.url}/openapi.json",
                "--checks", "all", "--seed", str(SEED), "--max-examples", str(EXAMPLES),
                "--header", f"Authorization: Bearer {ADMIN}", "--exclude-path-regex", "^/proxy/",
                "--report", "junit", "--report-dir", str(tmp_path),
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
            )  # fmt: skip
            out, _ = await asyncio.wait_for(proc.communicate(), 280)
    text = out.decode(errors="replace")
    assert proc.returncode == 0, text[-8000:]
    assert "generated" in text and "failures" not in text.split("SUMMARY")[-1].lower(), text[-4000:]
