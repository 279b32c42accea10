"""Tests against a real vLLM server (its CPU build): one server for the session, started once, shared.

vLLM runs from its own environment, `~/.cache/rollwire/vllm` (or `$ROLLWIRE_VLLM_PYTHON`, the
python of a venv with vLLM). Without it the tests that need the server are skipped, saying so.
`ROLLWIRE_TEST_VLLM_URL` attaches to a server already running with the same model and flags
(`vllm_argv` builds them) instead of starting one.

The model is the tiny Qwen2 model with a hidden size of 128 (4 heads of 32: a head size vLLM's CPU
attention serves; the default tiny model's 40 is refused), built once into `~/.cache/rollwire/test-models`. The
server runs with what Rollwire needs of vLLM: processed logprobs, runtime LoRA (rank 8, two
adapters at once), the development routes, the Hermes tool parser, and request chat templates
(the content-format test renders with a second template).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "gateway"))  # the gateway rigs (gw_harness, ...)

from gw_harness import GatewayHandle, Served, gateway_settings
from vllm_rig import VLLM_PYTHON

from services.common.tinymodel.build import build_dir_atomically, build_tiny_model
from services.common.vllm import VllmServeSettings, serve_command
from services.devstack.embedded import free_port
from services.gateway import create_app

SERVED = "tiny"
START_TIMEOUT_S = 600.0


def vllm_argv(model_dir: Path, port: int) -> list[str]:
    """The test server's command line: Rollwire's own flags (`serve_command`) plus the tests' (see the module
    docstring), run as `python -m vllm.entrypoints.openai.api_server` (the CPU build has no `vllm serve`).

    The LoRA rank asked for is 4, which vLLM does not accept as `--max-lora-rank`: `serve_command` rounds it.
    """
    settings = VllmServeSettings(
        executable="vllm", host="127.0.0.1", dtype="float32", max_logprobs=20, gpu_memory_utilization=0.15,
        max_lora_rank=4, max_loras=2,
        extra_args=["--max-model-len", "2048", "--trust-request-chat-template", "--enable-auto-tool-choice",
                    "--tool-call-parser", "hermes"],
    )  # fmt: skip
    argv, _ = serve_command(settings, str(model_dir), SERVED, port)
    flags = argv[argv.index("--served-model-name") :]
    return [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), *flags]


# What transformers' `Qwen2Tokenizer` (which transformers, and so vLLM, loads for a qwen2 model)
# puts in place of tokenizer.json's pre-tokenizer: digits one by one (transformers/models/qwen2/
# tokenization_qwen2.py). The tiny model's tokenizer.json keeps GPT-2's split, so the gateway
# (which reads tokenizer.json) and vLLM would tokenize " 12" differently; the test model's
# tokenizer.json says what vLLM does.
QWEN2_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def _qwen2_pretokenizer(model_dir: Path) -> None:
    from tokenizers import Regex, Tokenizer, normalizers, pre_tokenizers

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
         pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )  # fmt: skip
    tokenizer.save(str(model_dir / "tokenizer.json"))


@pytest.fixture(scope="session")
def vllm_model_dir() -> Path:
    """The tiny Qwen2 model with head size 32 (hidden 128, 4 heads), its tokenizer as vLLM loads it; cached."""
    root = Path(os.environ.get("ROLLWIRE_TEST_MODELS", Path.home() / ".cache/rollwire/test-models"))

    def build(staging: Path) -> None:
        build_tiny_model(staging, seed=0, hidden=128, max_positions=4096)
        _qwen2_pretokenizer(staging)

    return build_dir_atomically(root / "tiny-qwen2-h128-qwen2tok-seed0", build)


def _wait_healthy(url: str, process: subprocess.Popen[bytes] | None, log: Path | None) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:] if log else ""
            raise RuntimeError(f"vLLM exited with {process.returncode} while starting:\n{tail}")
        try:
            if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"vLLM at {url} did not answer within {START_TIMEOUT_S:.0f}s")


@pytest.fixture(scope="session")
def vllm_url(vllm_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The base URL (no `/v1`) of the session's vLLM server, started once (1-3 minutes on 2 cores)."""
    attached = os.environ.get("ROLLWIRE_TEST_VLLM_URL")
    if attached:
        _wait_healthy(attached.rstrip("/"), None, None)
        yield attached.rstrip("/")
        return
    if not VLLM_PYTHON.is_file():
        pytest.skip(f"vLLM is not installed ({VLLM_PYTHON} is missing): these tests need its CPU build")
    port = free_port()
    log = tmp_path_factory.mktemp("vllm") / "vllm.log"
    env = {**os.environ, **serve_command(VllmServeSettings(), "m", SERVED, port)[1], "VLLM_CPU_KVCACHE_SPACE": "1"}
    with log.open("ab") as out:
        process = subprocess.Popen(vllm_argv(vllm_model_dir, port), env=env, stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, process, log)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()


@pytest.fixture(scope="session")
def gateway(nats_url: str) -> Iterator[GatewayHandle]:
    """A gateway for the session (tests isolate themselves by run id); its upstream timeout fits CPU vLLM."""
    settings = gateway_settings(nats_url, upstream_timeout_s=120.0, phase_hold_timeout_s=120.0)
    with Served(create_app(settings), settings.port) as served:
        handle = GatewayHandle(served, settings)
        yield handle
        handle.admin.close()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The first test to use the server waits for it to start: give this directory's tests 15 minutes."""
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(900))
