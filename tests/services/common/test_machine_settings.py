"""`on_this_machine`: which dtype and flags a vLLM replica gets on a CPU machine and on a GPU machine.

The GPU machine is a stand-in `nvidia-smi` on PATH printing what `nvidia-smi -L` prints on one
(NVIDIA's documented `-L` line format); nothing else of CUDA is needed by the function under test.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from services.common.vllm import CPU_WORKAROUND_ARGS, VllmServeSettings, on_this_machine


def _nvidia_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, script: str) -> None:
    smi = tmp_path / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\n{script}\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")


@pytest.fixture
def gpu_machine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _nvidia_smi(tmp_path, monkeypatch, "echo 'GPU 0: NVIDIA H200 (UUID: GPU-00000000-0000-0000-0000-000000000000)'")


@pytest.fixture
def cpu_machine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _nvidia_smi(tmp_path, monkeypatch, "echo 'NVIDIA-SMI has failed' >&2; exit 9")


@pytest.mark.usefixtures("cpu_machine")
def test_cpu_auto_is_the_trainers_float32_and_an_explicit_dtype_is_kept() -> None:
    auto, env = on_this_machine(VllmServeSettings())
    assert auto.dtype == "float32"
    assert all(arg in auto.extra_args for arg in CPU_WORKAROUND_ARGS)
    assert "VLLM_CPU_KVCACHE_SPACE" in env
    explicit, _ = on_this_machine(VllmServeSettings(dtype="bfloat16"))
    assert explicit.dtype == "bfloat16"


@pytest.mark.usefixtures("gpu_machine")
def test_gpu_auto_is_bfloat16_and_no_cpu_flags() -> None:
    auto, env = on_this_machine(VllmServeSettings())
    assert (auto.dtype, env) == ("bfloat16", {})
    assert not any(arg in auto.extra_args for arg in CPU_WORKAROUND_ARGS)
    assert on_this_machine(VllmServeSettings(dtype="float16"))[0].dtype == "float16"
