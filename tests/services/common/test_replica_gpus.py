"""Tensor-parallel replicas each get their own GPUs: `start_replicas` with a fake `vllm` executable.

A fake (standing in for vLLM's Python, which Rollwire starts with `-m
vllm.entrypoints.openai.api_server`), because this machine has no GPU. It follows what vLLM does
with the devices it is shown:
its multiprocessing executor starts one worker per tensor-parallel rank and worker `r` takes the
`r`-th visible device (`vllm/v1/executor/multiproc_executor.py`, `local_rank`), so two replicas that
are shown the same devices would put their ranks on the same GPUs. The fake records the argv and
`CUDA_VISIBLE_DEVICES` it was started with, then exits.
"""

from __future__ import annotations

import json
import stat
import sys
from pathlib import Path

import pytest

from services.common.vllm import ReplicaError, VllmServeSettings, start_replicas

RECORDER = """import json, os, sys
with open(os.environ["FAKE_VLLM_RECORD"], "a") as out:
    out.write(json.dumps({"argv": sys.argv[1:], "devices": os.environ.get("CUDA_VISIBLE_DEVICES")}) + "\\n")
"""


def _fake_vllm(tmp_path: Path) -> Path:
    """vLLM's Python, as Rollwire starts it (`python -m vllm.entrypoints.openai.api_server ...`)."""
    executable = tmp_path / "python"
    executable.write_text(f"#!{sys.executable}\n{RECORDER}")
    executable.chmod(executable.stat().st_mode | stat.S_IEXEC)
    return executable


def _start(tmp_path: Path, replicas: int, extra_args: list[str]) -> list[dict[str, object]]:
    settings = VllmServeSettings(executable=str(_fake_vllm(tmp_path)), extra_args=extra_args)
    started = start_replicas(settings, "/models/base", "policy", replicas, tmp_path / "logs")
    for _, process in started:
        assert process.wait(30) == 0
    rows = [json.loads(line) for line in (tmp_path / "record.jsonl").read_text().splitlines()]
    return sorted(rows, key=lambda row: str(row["argv"][row["argv"].index("--port") + 1]))


def test_each_tensor_parallel_replica_gets_its_own_gpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_VLLM_RECORD", str(tmp_path / "record.jsonl"))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")
    rows = _start(tmp_path, 2, ["--tensor-parallel-size", "4"])
    assert [row["devices"] for row in rows] == ["0,1,2,3", "4,5,6,7"]
    assert all("--logprobs-mode" in row["argv"] for row in rows)  # type: ignore[operator]


def test_replicas_see_slices_of_the_devices_they_were_given(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Started under `CUDA_VISIBLE_DEVICES=4,5,6,7`, two tp=2 replicas split those four (not 0..3)."""
    monkeypatch.setenv("FAKE_VLLM_RECORD", str(tmp_path / "record.jsonl"))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    rows = _start(tmp_path, 2, ["-tp=2"])
    assert [row["devices"] for row in rows] == ["4,5", "6,7"]


def test_a_layout_needing_more_gpus_than_exist_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_VLLM_RECORD", str(tmp_path / "record.jsonl"))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5")
    settings = VllmServeSettings(executable=str(_fake_vllm(tmp_path)), extra_args=["--tensor-parallel-size", "4"])
    with pytest.raises(ReplicaError, match="need 8 GPUs; this machine shows 6"):
        start_replicas(settings, "/models/base", "policy", 2, tmp_path / "logs")
    assert not (tmp_path / "record.jsonl").exists(), "nothing starts when the layout cannot fit"
