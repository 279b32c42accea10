"""`endpoints.json` keeps what `rollwire up` prints as plain values: URLs without the notes after them."""

from __future__ import annotations

from pathlib import Path

from services.devstack import endpoints_file


def test_urls_without_notes_first_replica_and_no_secret(tmp_path: Path) -> None:
    lines = [
        "nats: nats://127.0.0.1:4222",
        "credentials: /data dir/credentials.json",
        "engine: http://127.0.0.1:8100/v1 (vLLM replica 0)",
        "engine: http://127.0.0.1:8101/v1 (vLLM replica 1)",
        "admin token: secret",
        "ready",
    ]
    endpoints_file.write(tmp_path, lines)
    assert endpoints_file.read(tmp_path) == {
        "nats": "nats://127.0.0.1:4222",
        "credentials": "/data dir/credentials.json",
        "engine": "http://127.0.0.1:8100/v1",
    }
