"""Claude Code and Codex CLI, unmodified and headless, through the proxy against a scripted model.

Both are installed from npm into `~/.cache/rollwire/npm` (or `$ROLLWIRE_NPM_CACHE`) on first use
and reused after; the tests are skipped, with the reason, when npm or the package cannot be had.
Each harness gets only a base URL, the attempt token and a model name, runs with its
non-essential traffic off and a fresh HOME, and must finish a turn that calls one tool (the
scripted model asks for `echo` through the harness's shell tool) and answers after its result:
it exits 0 and every call it made is a recorded `model_request` event. Refused (a wrong key, an
ended attempt), Claude Code must give up after one request.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from fake_vllm import FakeVLLM
from gw_harness import GatewayHandle
from test_gateway_proxy import _calls
from vllm_server import VllmServer

NPM_CACHE = Path(os.environ.get("ROLLWIRE_NPM_CACHE", Path.home() / ".cache" / "rollwire" / "npm"))
PACKAGES = {"claude": "@anthropic-ai/claude-code", "codex": "@openai/codex"}
MARKER = "rollwire-tool-ran"


def _installed(command: str) -> Path:
    """The harness's executable, installed from npm into the cache when missing (skip if impossible)."""
    binary = NPM_CACHE / "node_modules" / ".bin" / command
    if binary.exists():
        return binary
    if shutil.which("npm") is None:
        pytest.skip(f"npm is not installed, so {PACKAGES[command]} cannot be installed")
    NPM_CACHE.mkdir(parents=True, exist_ok=True)
    try:
        done = subprocess.run(
            ["npm", "install", "--prefix", str(NPM_CACHE), "--no-audit", "--no-fund", PACKAGES[command]],
            capture_output=True, text=True, timeout=600, check=False,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        pytest.skip(f"npm install {PACKAGES[command]} took over 600 s (registry unreachable?)")
    if done.returncode != 0 or not binary.exists():
        pytest.skip(f"npm install {PACKAGES[command]} failed (registry unreachable?): {done.stderr[-500:]}")
    return binary


def _env(home: Path, **extra: str) -> dict[str, str]:
    """A clean environment: PATH, a fresh HOME, no proxy or credential variables of ours."""
    return {"PATH": os.environ.get("PATH", ""), "HOME": str(home), "LANG": "C.UTF-8", **extra}


def _run(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(args, env=env, cwd=cwd, capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, f"exit {done.returncode}\nstdout: {done.stdout[-3000:]}\nstderr: {done.stderr[-3000:]}"
    return done


def _recorded(gateway: GatewayHandle, rollout_id: str, fake: FakeVLLM, api: str) -> list[dict[str, Any]]:
    calls = _calls(gateway, rollout_id)
    assert len(calls) == len(fake.served) > 0
    assert all(c["status"] == "ok" and c["api"] == api and c["prompt_ids"] and c["response_ids"] for c in calls)
    served = {tuple(s["prompt_ids"]): s for s in fake.served}
    for call in calls:
        assert call["response_ids"] == served[tuple(call["prompt_ids"])]["token_ids"]
    return calls


def test_claude_code_headless_turn_with_a_tool_call(
    gateway: GatewayHandle, fake_vllm: FakeVLLM, run_id: str, tmp_path: Path
) -> None:
    claude = _installed("claude")
    # Claude Code asks for up to 64,000 tokens a turn (within the default per-call limit, 131072)
    spec = {"run_id": run_id, "limits": {"max_tokens": 64_000}}
    assert gateway.admin.post("/api/runs", json=spec).status_code == 201
    rollout, attempt = gateway.running(run_id, fake_vllm.url)
    fake_vllm.tool_script = {"Bash": f'{{"command": "echo {MARKER}", "description": "say it"}}'}
    fake_vllm.answer_tokens = 6
    env = _env(
        tmp_path / "home",
        ANTHROPIC_BASE_URL=attempt["anthropic_base_url"],
        ANTHROPIC_API_KEY=attempt["token"],
        CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
        DISABLE_TELEMETRY="1",
        DISABLE_ERROR_REPORTING="1",
        DISABLE_AUTOUPDATER="1",
    )
    (tmp_path / "home").mkdir()
    done = _run(
        [str(claude), "-p", "Run echo with the Bash tool, then say done.", "--allowedTools", "Bash",
         "--output-format", "json", "--max-turns", "4"],
        env, tmp_path,
    )  # fmt: skip
    calls = _recorded(gateway, rollout["rollout_id"], fake_vllm, "messages")
    results = [
        m for c in calls for m in c["request"]["messages"] if m["role"] == "tool" and MARKER in str(m["content"])
    ]
    assert results, "the tool's result never reached the model"
    assert '"is_error":false' in done.stdout.replace(" ", "")


CODEX_SHELL = {
    "exec_command": f'{{"cmd": "echo {MARKER}"}}',
    "shell_command": f'{{"command": "echo {MARKER}"}}',
    "shell": f'{{"command": ["echo", "{MARKER}"]}}',
}


def test_codex_exec_turn_with_a_tool_call(
    gateway: GatewayHandle, fake_vllm: FakeVLLM, run_id: str, tmp_path: Path
) -> None:
    codex = _installed("codex")
    rollout, attempt = gateway.running(run_id, fake_vllm.url)
    fake_vllm.tool_script = CODEX_SHELL
    fake_vllm.answer_tokens = 6
    home = tmp_path / "home"
    (home / ".codex").mkdir(parents=True)
    env = _env(home, CODEX_HOME=str(home / ".codex"), ROLLWIRE_TOKEN=attempt["token"])
    provider = (
        f'{{name="rollwire", base_url="{attempt["proxy_base_url"]}", env_key="ROLLWIRE_TOKEN", wire_api="responses"}}'
    )
    _run(
        [str(codex), "exec", "-m", "fake", "-c", "model_provider=rollwire",
         "-c", f"model_providers.rollwire={provider}",
         "-c", "check_for_update_on_startup=false", "-c", "analytics.enabled=false", "-c", "feedback.enabled=false",
         "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox",
         "Run echo in the shell, then say done."],
        env, tmp_path,
    )  # fmt: skip
    calls = _recorded(gateway, rollout["rollout_id"], fake_vllm, "responses")
    results = [
        m for c in calls for m in c["request"]["messages"] if m["role"] == "tool" and MARKER in str(m["content"])
    ]
    assert results, "the tool's result never reached the model"


WRAPPER = Path(__file__).resolve().parents[3] / "examples" / "codex" / "codex.sh"


def test_codex_exec_with_the_controllers_environment_through_the_wrapper(
    gateway: GatewayHandle, fake_vllm: FakeVLLM, run_id: str, tmp_path: Path
) -> None:
    """Only OPENAI_BASE_URL and OPENAI_API_KEY, as the controller sets them, and Codex's default model:
    `examples/codex/codex.sh` builds the provider config, and the turn runs through the proxy."""
    codex = _installed("codex")
    rollout, attempt = gateway.running(run_id, fake_vllm.url)
    fake_vllm.tool_script = CODEX_SHELL
    fake_vllm.answer_tokens = 6
    home = tmp_path / "home"
    (home / ".codex").mkdir(parents=True)
    env = _env(
        home, CODEX_HOME=str(home / ".codex"), CODEX=str(codex),
        OPENAI_BASE_URL=attempt["proxy_base_url"], OPENAI_API_KEY=attempt["token"],
    )  # fmt: skip
    _run(
        ["sh", str(WRAPPER), "exec", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox",
         "Run echo in the shell, then say done."],
        env, tmp_path,
    )  # fmt: skip
    calls = _recorded(gateway, rollout["rollout_id"], fake_vllm, "responses")
    assert any(m["role"] == "tool" and MARKER in str(m["content"]) for c in calls for m in c["request"]["messages"])


def _refused_messages(gateway: GatewayHandle) -> float:
    """POSTs to any proxy messages route the gateway refused so far (401 or 409), from its /metrics."""
    total = 0.0
    for line in httpx.get(f"{gateway.url}/metrics", timeout=10).text.splitlines():
        if line.startswith("rollwire_http_requests_total{") and 'method="POST"' in line and "messages" in line:
            if 'status="401"' in line or 'status="409"' in line:
                total += float(line.rsplit(" ", 1)[1])
    return total


def test_claude_code_stops_at_the_first_permanent_refusal(
    gateway: GatewayHandle, fake_vllm: FakeVLLM, run_id: str, tmp_path: Path
) -> None:
    """A wrong key (401) or an ended attempt (409): one request and a prompt exit, where Claude Code once
    retried a 401 eleven times over about three minutes (the refusals now say `x-should-retry: false`)."""
    claude = _installed("claude")
    rollout, attempt = gateway.running(run_id, fake_vllm.url)
    ended = gateway.admin.patch(f"/api/rollouts/{rollout['rollout_id']}", json={"status": "cancelled"})
    assert ended.status_code == 200, ended.text
    for key in ("not-a-token", attempt["token"]):
        home = tmp_path / f"home-{len(key)}"
        home.mkdir()
        env = _env(
            home, ANTHROPIC_BASE_URL=attempt["anthropic_base_url"], ANTHROPIC_API_KEY=key,
            CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1", DISABLE_TELEMETRY="1", DISABLE_ERROR_REPORTING="1",
            DISABLE_AUTOUPDATER="1",
        )  # fmt: skip
        before = _refused_messages(gateway)
        began = time.monotonic()
        done = subprocess.run(
            [str(claude), "-p", "say done", "--output-format", "json", "--max-turns", "1"],
            env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        took = time.monotonic() - began
        assert done.returncode != 0 or '"is_error":true' in done.stdout.replace(" ", ""), done.stdout[-2000:]
        assert _refused_messages(gateway) - before == 1, f"Claude Code sent {_refused_messages(gateway) - before}"
        assert took < 60, f"Claude Code took {took:.0f} s to give up"


@pytest.mark.timeout(1200)  # the first test to use the session's vLLM server waits for it to start
def test_claude_code_on_a_short_engine_context_is_told_what_to_change(
    gateway: GatewayHandle, vllm_server: VllmServer, run_id: str, tmp_path: Path
) -> None:
    """Real vLLM (the session's server: 2048 positions) against Claude Code's first call (a prompt of
    about 37k tokens, max_tokens 64000): refused before generation with a 400 in Messages' shape whose
    message names the engine's context setting (`--max-model-len`), and Claude Code exits after that one
    request. vLLM refuses the max_tokens first ("cannot be greater than max_model_len=2048")."""
    claude = _installed("claude")
    gateway.register_model(
        run_id, f"{vllm_server.url}/v1", served_model=vllm_server.served_name, api_key=vllm_server.api_key
    )
    rollout = gateway.create(run_id)[0]
    attempt = gateway.attempt(rollout["rollout_id"])
    home = tmp_path / "home"
    home.mkdir()
    env = _env(
        home, ANTHROPIC_BASE_URL=attempt["anthropic_base_url"], ANTHROPIC_API_KEY=attempt["token"],
        CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1", DISABLE_TELEMETRY="1", DISABLE_ERROR_REPORTING="1",
        DISABLE_AUTOUPDATER="1",
    )  # fmt: skip
    began = time.monotonic()
    done = subprocess.run(
        [str(claude), "-p", "say done", "--output-format", "json", "--max-turns", "1"],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    took = time.monotonic() - began
    assert '"api_error_status":400' in done.stdout.replace(" ", ""), done.stdout[-2000:]
    assert "max_model_len=2048" in done.stdout and "--max-model-len" in done.stdout, done.stdout
    (call,) = _calls(gateway, rollout["rollout_id"])
    assert call["status"] == "failed" and call.get("response_ids", []) == [] and call["api"] == "messages"
    assert took < 60, f"Claude Code took {took:.0f} s to give up"
