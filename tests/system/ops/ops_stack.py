"""The operations tests' stack: one `rollwire up` (every service, vLLM as its engine, JSON access logs),
and scrape helpers.

Starting the stack starts vLLM, which takes minutes on a small loaded CPU; calls are slower there
too, so the waits here are generous (the first test to use the stack waits for it: `conftest.py`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

Sample = tuple[str, frozenset[tuple[str, str]]]
STARTUP_S = 900.0
"""How long `rollwire up` may take to print `ready`: vLLM's start is most of it."""


@dataclass
class Scrape:
    """One scrape of a /metrics endpoint: family types and label names, and every sample's value."""

    types: dict[str, str]
    labels: dict[str, set[str]]
    values: dict[Sample, float]

    def value(self, name: str, **labels: str) -> float:
        """The sample's value (0 when it does not exist yet, as Prometheus' increase() would treat it)."""
        return self.values.get((name, frozenset(labels.items())), 0.0)


def scrape(url: str, key: str = "") -> Scrape:
    """Scrape and parse a /metrics endpoint with prometheus_client's own parser (`key`: vLLM's, which it requires)."""
    response = httpx.get(url, headers={"Authorization": f"Bearer {key}"} if key else {}, timeout=60)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    types: dict[str, str] = {}
    labels: dict[str, set[str]] = {}
    values: dict[Sample, float] = {}
    for family in text_string_to_metric_families(response.text):
        types[family.name] = family.type
        names = labels.setdefault(family.name, set())
        for sample in family.samples:
            names.update(k for k in sample.labels if k != "le")
            values[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return Scrape(types, labels, values)


@dataclass
class Stack:
    """A running `rollwire up`: its data dir, endpoints and admin token."""

    data_dir: Path
    endpoints: dict[str, str]
    token: str

    @property
    def gateway(self) -> str:
        return self.endpoints["gateway"]

    @property
    def engine_key(self) -> str:
        """The key the stack's vLLM requires on every route but `GET /health` (kept in the data dir)."""
        return (self.data_dir / "engine_key").read_text().strip()

    def scrape(self, service: str) -> Scrape:
        """Scrape one service's /metrics (the engine's with its key)."""
        return scrape(self.metrics_urls()[service], self.engine_key if service == "engine" else "")

    def metrics_urls(self) -> dict[str, str]:
        """The /metrics URL of every service (the engine's: vLLM's, which requires `engine_key`)."""
        return {
            "gateway": f"{self.gateway}/metrics",
            "engine": self.endpoints["engine"].removesuffix("/v1") + "/metrics",
            "projector": self.endpoints["projector"],
            "controller": self.endpoints["controller"],
        }

    def admin(self) -> httpx.Client:
        return httpx.Client(base_url=self.gateway, headers={"Authorization": f"Bearer {self.token}"}, timeout=180)


class OwnTemp:
    """A `tmp_path_factory` stand-in outside pytest's base directory, which every pytest run of this
    user resets to 0700: agents running as their own users must traverse the stack's directories."""

    def __init__(self) -> None:
        self.base = Path(tempfile.mkdtemp(prefix="rollwire-ops-"))

    def mktemp(self, name: str) -> Path:
        path = self.base / name
        path.mkdir()
        return path


def running_stack(tmp_path_factory: pytest.TempPathFactory | OwnTemp) -> Iterator[Stack]:
    """`rollwire up` with every service on free ports and its default engine (vLLM, on a free port),
    in the foreground as a user runs it."""
    data = tmp_path_factory.mktemp("ops") / "stack"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLWIRE_")}
    env["ROLLWIRE_ACCESS_LOG"] = "json"
    command = [sys.executable, "-m", "services.devstack.cli", "up", "--data-dir", str(data)]
    command += ["--nats-port", "0", "--pg-port", "0", "--gateway-port", "0", "--vllm-port", "0"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    assert proc.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + STARTUP_S
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line or line.strip() == "ready":
            break
        lines.append(line.strip())
    else:
        proc.kill()
    if proc.poll() is not None or not (data / "endpoints.json").exists():
        proc.kill()
        pytest.fail(f"rollwire up did not start: {lines}")
    try:
        endpoints = json.loads((data / "endpoints.json").read_text())
        yield Stack(data, endpoints, (data / "admin_token").read_text().strip())
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            assert proc.wait(180) == 0
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
