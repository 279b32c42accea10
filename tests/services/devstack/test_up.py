"""`rollwire up` as a user runs it: a real process, real servers, real signals."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from schemas import RewardReported
from services.common.eventstore import EventStore
from services.devstack.embedded import free_port

ROLLWIRE = [sys.executable, "-m", "services.devstack.cli"]


def start_up(data_dir: Path, *extra: str) -> tuple[subprocess.Popen[str], dict[str, str]]:
    """Start `rollwire up` (infrastructure only) and wait for `ready`; returns the process and endpoints."""
    proc = subprocess.Popen(
        [
            *ROLLWIRE,
            "up",
            "--data-dir",
            str(data_dir),
            "--nats-port",
            "0",
            "--pg-port",
            "0",
            "--services",
            "none",
            *extra,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    endpoints: dict[str, str] = {}
    deadline = time.monotonic() + 90
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        if line.strip() == "ready":
            return proc, endpoints
        if ": " in line:
            key, value = line.strip().split(": ", 1)
            endpoints[key] = value
    proc.kill()
    raise AssertionError(f"rollwire up did not report ready; got {endpoints}")


def stop(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGINT)
    assert proc.wait(30) == 0


async def append_and_count(nats_url: str, run_id: str, append: bool) -> int:
    store = await EventStore.connect(nats_url)
    try:
        if append:
            await store.append(RewardReported(run_id=run_id, rollout_id="ro", value=1.0))
        return len(await store.read_rollout(run_id, "ro"))
    finally:
        await store.close()


def trainer_url(data_dir: Path, endpoints: dict[str, str]) -> str:
    """The NATS URL of the stack's `trainer` user (a writer), from the data dir's credentials."""
    from services.devstack.credentials import load_or_create

    return load_or_create(data_dir).nats_url(endpoints["nats"], "trainer")


def test_up_reports_ready_and_keeps_data_across_restart(tmp_path: Path) -> None:
    data = tmp_path / "stack"
    proc, endpoints = start_up(data)
    try:
        assert endpoints["nats"].startswith("nats://127.0.0.1:")
        assert endpoints["postgres"].startswith("postgresql://")
        assert asyncio.run(append_and_count(trainer_url(data, endpoints), "persist", append=True)) == 1
        second = subprocess.run(
            [*ROLLWIRE, "up", "--data-dir", str(data), "--nats-port", "0", "--pg-port", "0"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert second.returncode == 2
        assert "in use by another running stack" in second.stderr
        assert "Traceback" not in second.stderr
    finally:
        stop(proc)
    proc, endpoints = start_up(data)
    try:
        assert asyncio.run(append_and_count(trainer_url(data, endpoints), "persist", append=False)) == 1
    finally:
        stop(proc)


@pytest.mark.parametrize("flag", ["--nats-port", "--pg-port"])
def test_up_refuses_a_busy_port(tmp_path: Path, flag: str) -> None:
    import socket

    port = free_port()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", port))
        busy.listen()
        other = "--pg-port" if flag == "--nats-port" else "--nats-port"
        result = subprocess.run(
            [*ROLLWIRE, "up", "--data-dir", str(tmp_path / "d"), flag, str(port), other, "0"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0
    assert f"port {port}" in result.stderr and flag in result.stderr


def test_up_refuses_the_removed_embedded_engine(tmp_path: Path) -> None:
    """`--engine embedded` (Rollwire's own CPU engine, removed) is one readable line naming the choice."""
    result = subprocess.run(
        [*ROLLWIRE, "up", "--data-dir", str(tmp_path / "d"), "--engine", "embedded"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and result.stderr.strip().count("\n") == 0, result.stderr
    assert "--engine 'embedded' is not allowed; choose one of: vllm" in result.stderr and "removed" in result.stderr
    assert not (tmp_path / "d").exists()  # refused before anything started


def test_the_engine_tokenizer_is_scoped_to_the_engine_model(tmp_path: Path) -> None:
    """Calls of other models are never decoded with the engine model's tokenizer: vLLM answers to the
    served name only; a hub id (no local directory) gives the projector no tokenizer."""
    from services.devstack.engine_models import tokenizer_args
    from services.devstack.stack_config import StackConfig

    model = tmp_path / "tiny-chat"
    model.mkdir()
    assert tokenizer_args(StackConfig(data_dir=tmp_path, engine_model=model)) == ["--tokenizer", f"tiny={model}"]
    assert tokenizer_args(StackConfig(data_dir=tmp_path, engine_model=Path("Qwen/Qwen3-0.6B"))) == []
    assert tokenizer_args(StackConfig(data_dir=tmp_path, services=("gateway",))) == []


def test_tail_and_runs_find_the_stack_in_its_data_dir(tmp_path: Path) -> None:
    """`rollwire runs` and `rollwire tail` read `<data-dir>/endpoints.json`: a stack on `--nats-port 0`."""
    data = tmp_path / "stack"
    proc, endpoints = start_up(data)
    env = {k: v for k, v in os.environ.items() if k not in ("NATS_URL", "ROLLWIRE_DATA_DIR")}
    try:
        asyncio.run(append_and_count(trainer_url(data, endpoints), "found-by-data-dir", append=True))
        listed = subprocess.run(
            [*ROLLWIRE, "runs", "--data-dir", str(data)], capture_output=True, text=True, timeout=60, env=env
        )
        assert listed.returncode == 0 and "found-by-data-dir" in listed.stdout, listed.stderr
        tail = subprocess.Popen(
            [*ROLLWIRE, "tail", "rl.found-by-data-dir.>", "--from-start", "--format", "json"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**env, "ROLLWIRE_DATA_DIR": str(data)},
        )  # fmt: skip
        try:
            assert tail.stdout is not None
            first = tail.stdout.readline()
            assert '"reward"' in first and "found-by-data-dir" in first, tail.stderr.read() if not first else first
        finally:
            tail.kill()
            tail.wait(10)
    finally:
        stop(proc)


def test_with_vllm_the_projector_starts_before_the_gateway(tmp_path: Path) -> None:
    """The gateway's /healthz waits for the projector: started after it, `rollwire up` never got healthy."""
    from services.common.vllm import VllmServeSettings
    from services.devstack.stack import Stack, StackConfig

    config = StackConfig(data_dir=tmp_path, engine_model=tmp_path, vllm=VllmServeSettings(executable=sys.executable))
    stack = Stack(config, say=lambda _: None)
    specs = stack._service_specs({"gateway": 1, "engine": 2, "projector": 3, "controller": 4})
    assert [spec.name for spec in specs] == ["vllm-0", "projector", "gateway", "controller"]
