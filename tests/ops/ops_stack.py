"""The operations tests' stack: one `rollwire up` (every service, JSON access logs), and scrape helpers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

Sample = tuple[str, frozenset[tuple[str, str]]]


@dataclass
class Scrape:
    """One scrape of a /metrics endpoint: family types and label names, and every sample's value."""

    types: dict[str, str]
    labels: dict[str, set[str]]
    values: dict[Sample, float]

    def value(self, name: str, **labels: str) -> float:
        """The sample's value (0 when it does not exist yet, as Prometheus' increase() would treat it)."""
        return self.values.get((name, frozenset(labels.items())), 0.0)


def scrape(url: str) -> Scrape:
    """Scrape and parse a /metrics endpoint with prometheus_client's own parser."""
    response = httpx.get(url, timeout=10)
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

    def metrics_urls(self) -> dict[str, str]:
        """The /metrics URL of every service."""
        return {
            "gateway": f"{self.gateway}/metrics",
            "engine": self.endpoints["engine"].removesuffix("/v1") + "/metrics",
            "projector": self.endpoints["projector"],
            "controller": self.endpoints["controller"],
        }

    def admin(self) -> httpx.Client:
        return httpx.Client(base_url=self.gateway, headers={"Authorization": f"Bearer {self.token}"}, timeout=60)


def running_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """`rollwire up` with every service on free ports, in the foreground as a user runs it."""
    data = tmp_path_factory.mktemp("ops") / "stack"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLWIRE_")}
    env["ROLLWIRE_ACCESS_LOG"] = "json"
    command = [sys.executable, "-m", "services.devstack.cli", "up", "--data-dir", str(data)]
    command += ["--nats-port", "0", "--pg-port", "0", "--gateway-port", "0"]
    command += ["--engine", "embedded"]  # these tests read the embedded engine's own rollwire_engine_* metrics
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    assert proc.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + 180
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
            assert proc.wait(60) == 0
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
