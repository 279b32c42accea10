"""The test session's real vLLM server: one, started once, shared by every test that needs a model server.

`vllm_server` starts `python -m vllm.entrypoints.openai.api_server` from the environment of
`rollwire vllm install` (or `$ROLLWIRE_VLLM_PYTHON`), the way the stack does
(`services.common.vllm.serve_command` and `on_this_machine`: processed logprobs, the development
routes, Rollwire's key on every route but `/health`, the Hermes tool parser; on a CPU float32,
whole-prompt prefill and a 1 GiB KV cache), plus what the tests need of vLLM: 20 logprobs, runtime
LoRA (two adapters of rank up to 8 at once) and request chat templates (`--trust-request-chat-template`).
Starting vLLM takes minutes on a small CPU, a request milliseconds, so the session shares it; a test
that changes the served weights puts the originals back before it ends.

The served model (`vllm_model_dir`) is the tiny Qwen2 model with a hidden size of 128, its
tokenizer as vLLM loads it (`_qwen2_pretokenizer`), built once into `~/.cache/rollwire/test-models`
(or `$ROLLWIRE_TEST_MODELS`).

`ROLLWIRE_TEST_VLLM_URL` (with its key in `ROLLWIRE_TEST_VLLM_KEY`) attaches to a server already
running with that model and these flags (`vllm_argv` builds them) instead of starting one. Without
vLLM installed the tests that need it skip, saying how to install it; with ROLLWIRE_REQUIRE_VLLM=1
(CI sets it) they fail instead.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from services.common.tinymodel.build import build_dir_atomically, build_tiny_model
from services.common.vllm import VllmServeSettings, on_this_machine, serve_command
from services.common.vllm_install import vllm_python
from services.devstack.embedded import free_port

SERVED_NAME = "tiny"
API_KEY = "test-engine-key"
STARTUP_S = 900.0
VLLM_PYTHON = Path(os.environ.get("ROLLWIRE_VLLM_PYTHON") or vllm_python())
"""vLLM's Python: `rollwire vllm install`'s environment, or `$ROLLWIRE_VLLM_PYTHON`."""


@dataclass(frozen=True)
class VllmServer:
    """A running vLLM server: its root URL (OpenAI routes under /v1), key, model directory and name."""

    url: str
    api_key: str
    model_dir: Path
    served_name: str
    log: Path | None

    @property
    def headers(self) -> dict[str, str]:
        """The headers every call to this server needs."""
        return {"authorization": f"Bearer {self.api_key}"}

    def post(self, path: str, body: dict[str, object], timeout: float = 120.0) -> httpx.Response:
        """POST `body` to `path` (e.g. `/v1/chat/completions`) with the key."""
        return httpx.post(f"{self.url}{path}", json=body, headers=self.headers, timeout=timeout)


def _unavailable(reason: str) -> None:
    if os.environ.get("ROLLWIRE_REQUIRE_VLLM") == "1":
        pytest.fail(f"{reason} (ROLLWIRE_REQUIRE_VLLM=1)")
    pytest.skip(reason)


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


def served_model_dir() -> Path:
    """The served model: the tiny Qwen2 model (hidden 128: 4 heads of 32), its tokenizer as vLLM loads it; cached."""
    root = Path(os.environ.get("ROLLWIRE_TEST_MODELS", Path.home() / ".cache/rollwire/test-models"))

    def build(staging: Path) -> None:
        build_tiny_model(staging, seed=0, hidden=128, max_positions=4096)
        _qwen2_pretokenizer(staging)

    return build_dir_atomically(root / "tiny-qwen2-h128-qwen2tok-seed0", build)


def vllm_argv(model_dir: Path, port: int, api_key: str = API_KEY) -> tuple[list[str], dict[str, str]]:
    """The test server's command line and extra environment: the stack's (`serve_command` adapted by
    `on_this_machine`) plus the tests' flags (see the module docstring).

    The LoRA rank asked for is 4, which vLLM does not accept as `--max-lora-rank`: `serve_command` rounds it.
    """
    settings = VllmServeSettings(
        executable=str(VLLM_PYTHON), dtype="float32", api_key=api_key, max_logprobs=20,
        gpu_memory_utilization=0.15, max_lora_rank=4, max_loras=2,
        extra_args=["--max-model-len", "2048", "--trust-request-chat-template"],
    )  # fmt: skip
    settings, machine_env = on_this_machine(settings)
    argv, env = serve_command(settings, str(model_dir), SERVED_NAME, port)
    return argv, {**env, **machine_env}


def start_vllm(model_dir: Path, log: Path, api_key: str = API_KEY) -> tuple[subprocess.Popen[bytes], str]:
    """Start the test server's vLLM serving `model_dir` on a free port, its output in `log`; (process, root URL)."""
    port = free_port()
    argv, extra = vllm_argv(model_dir, port, api_key)
    with log.open("ab") as out:
        process = subprocess.Popen(
            argv, env={**os.environ, **extra}, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    return process, f"http://127.0.0.1:{port}"


def wait_healthy(
    process: subprocess.Popen[bytes] | None, url: str, log: Path | None, timeout_s: float = STARTUP_S
) -> None:
    """Wait for `GET /health` to answer 200; fail with the log's tail if vLLM exits or never gets there."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:] if log else ""
            raise RuntimeError(f"vLLM exited with {process.returncode}:\n{tail}")
        try:
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"vLLM did not become healthy within {timeout_s:.0f}s; see {log}")


def stop(process: subprocess.Popen[bytes]) -> None:
    """Terminate vLLM (its whole process group: the engine core is a child) and wait for it."""
    try:
        os.killpg(process.pid, 15)
        process.wait(30)
    except ProcessLookupError:
        return
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, 9)
        process.wait(10)


@pytest.fixture(scope="session")
def vllm_model_dir() -> Path:
    """The served model's directory (see `served_model_dir`)."""
    return served_model_dir()


@pytest.fixture(scope="session")
def vllm_server(vllm_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    """The session's real vLLM server (see the module docstring), started by the first test that asks for it."""
    attached = os.environ.get("ROLLWIRE_TEST_VLLM_URL", "").rstrip("/")
    if attached:
        wait_healthy(None, attached, None)
        key = os.environ.get("ROLLWIRE_TEST_VLLM_KEY", API_KEY)
        yield VllmServer(url=attached, api_key=key, model_dir=vllm_model_dir, served_name=SERVED_NAME, log=None)
        return
    if not VLLM_PYTHON.is_file():
        _unavailable(f"vLLM is not installed ({VLLM_PYTHON} is missing): run `rollwire vllm install`")
    log = tmp_path_factory.mktemp("vllm") / "vllm.log"
    process, url = start_vllm(vllm_model_dir, log)
    try:
        wait_healthy(process, url, log)
        server = VllmServer(url=url, api_key=API_KEY, model_dir=vllm_model_dir, served_name=SERVED_NAME, log=log)
        _warm_up(server)
        yield server
    finally:
        stop(process)


def _warm_up(server: VllmServer) -> None:
    """One chat and one token-in call: a fresh server's first generation takes seconds more than the next
    (measured: over the 2 s upstream timeout of the test gateway), which would land on whichever test is first."""
    for path, body in (
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True}),
        ("/v1/completions", {"prompt": [1, 2, 3], "logprobs": 1}),
    ):
        response = server.post(path, {"model": server.served_name, "max_tokens": 2, "return_token_ids": True, **body})
        assert response.status_code == 200, f"vLLM's warm-up call to {path} failed: {response.text[:500]}"
