"""The controller end to end on the local backend: a real gateway, real agent processes.

The happy path with a real `openai` agent runs through `rollwire up` (test_e2e_stack.py).
"""

from __future__ import annotations

import json
import socketserver
import sys
import threading
import time
from pathlib import Path

import pytest
from controller_rig import Child, Rig, _wait_http, agent, base_env

from services.devstack.embedded import free_port
from trainer.core import failure_kind


def test_a_crashing_agent_is_retried_then_failed_with_its_reason(rig: Rig) -> None:
    rig.start_run(command=agent("crash_agent.py"), max_attempts=2, retry_backoff_s=0.2, timeout_s=30)
    rig.start_controller()
    (rid,) = rig.create({"question": "?"})
    rollout = rig.wait(rid)
    assert rollout["state"] == "failed" and rollout["attempt_count"] == 2
    reason = rollout["reason"]
    assert reason.startswith("agent exited with code 3"), reason
    assert "ValueError: the tool returned nothing" in reason  # the log's last lines
    assert "gave up after 2 of 2 attempt(s)" in reason
    logs = [e for e in rig.events(rid, "custom") if e["name"] == "log"]
    assert len(logs) == 2  # each attempt's log is linked from the rollout


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_a_hanging_agent_times_out_and_its_process_group_dies(rig: Rig) -> None:
    rig.start_run(command=agent("hang_agent.py"), timeout_s=2, max_attempts=1)
    rig.start_controller()
    pid_file = rig.tmp / "hang.json"
    (rid,) = rig.create({"pid_file": str(pid_file)})
    rollout = rig.wait(rid)
    assert rollout["state"] == "failed" and rollout["reason"].startswith("timed out after 2s"), rollout
    pids = json.loads(pid_file.read_text())
    assert pids["pgid"] == pids["pid"]  # the agent leads its own process group
    deadline = time.monotonic() + 5
    while (_alive(pids["pid"]) or _alive(pids["child"])) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pids["pid"]) and not _alive(pids["child"])


@pytest.mark.parametrize("how", ["cancel", "delete"])
def test_a_cancelled_or_deleted_rollout_stops_its_execution(rig: Rig, how: str) -> None:
    rig.start_run(command=agent("hang_agent.py"), timeout_s=60)
    rig.start_controller()
    pid_file = rig.tmp / "hang.json"
    (rid,) = rig.create({"pid_file": str(pid_file)})
    rig.wait(rid, ("running",))
    while not pid_file.exists():
        time.sleep(0.05)
    pids = json.loads(pid_file.read_text())
    if how == "cancel":
        r = rig.admin.patch(f"/api/rollouts/{rid}", json={"status": "cancelled", "reason": "by hand"})
        assert r.status_code == 200, r.text
    else:  # the rollout's events are purged: no event says so, the periodic reconcile notices
        assert rig.admin.delete(f"/api/rollouts/{rid}").status_code == 204
    deadline = time.monotonic() + 15
    while (_alive(pids["pid"]) or _alive(pids["child"])) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pids["pid"]) and not _alive(pids["child"])


def test_an_evaluator_runs_after_the_agent_and_only_it_reports_the_reward(rig: Rig) -> None:
    write_answer = [sys.executable, "-c", "open('answer.txt', 'w').write('the answer is 4')"]
    rig.start_run(command=write_answer, evaluator_command=agent("evaluator.py"), reward_from="evaluator")
    rig.start_controller()
    right, wrong = rig.create({"answer": "4"}, {"answer": "5"})
    for rid, value in ((right, 1.0), (wrong, 0.0)):
        rollout = rig.wait(rid)
        assert rollout["state"] == "succeeded", rollout
        (reward,) = rig.events(rid, "reward")
        assert (reward["value"], reward["source"], reward["name"]) == (value, "evaluator", "evaluator")


def test_an_agents_sdk_agent_with_default_settings_runs_through_the_responses_api(rig: Rig) -> None:
    """Only the attempt's environment variables: the SDK's default provider speaks the Responses API."""
    rig.start_run(command=agent("agents_sdk_agent.py"), timeout_s=60, env={"OPENAI_AGENTS_DISABLE_TRACING": "1"})
    rig.start_controller()
    (rid,) = rig.create({"question": "what is x?"})
    rollout = rig.wait(rid, timeout=60)
    assert rollout["state"] == "succeeded", rollout
    calls = rig.events(rid, "model_request")
    assert [(c["api"], c["status"]) for c in calls] == [("responses", "ok"), ("responses", "ok")]
    assert calls[0]["response"]["message"]["tool_calls"][0]["function"]["name"] == "look_up"
    assert [m["role"] for m in calls[1]["request"]["messages"]] == ["system", "user", "assistant", "tool"]
    assert all(c["prompt_ids"] and c["response_ids"] for c in calls)
    assert rig.events(rid, "reward")[0]["value"] == 1.0


class _RecordingProxy:
    """An HTTP(S) proxy that refuses everything and remembers each request line (`CONNECT host:443 ...`)."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def _handler(self) -> type[socketserver.StreamRequestHandler]:
        lines = self.lines

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                lines.append(self.rfile.readline(4096).decode(errors="replace").strip())
                self.wfile.write(b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")

        return Handler

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_an_agents_sdk_agent_sends_nothing_but_its_model_calls(rig: Rig) -> None:
    """The controller sets OPENAI_AGENTS_DISABLE_TRACING=1: the SDK uploads no traces to OpenAI (which
    it otherwise does at exit, with the attempt token as its API key). Every request to a host other
    than the proxy goes through a recording HTTP(S) proxy, which must see none."""
    proxy = _RecordingProxy()
    try:
        env = {"HTTPS_PROXY": proxy.url, "HTTP_PROXY": proxy.url, "NO_PROXY": "127.0.0.1,localhost"}
        rig.start_run(command=agent("agents_sdk_agent.py"), timeout_s=60, env=env)
        rig.start_controller()
        (rid,) = rig.create({"question": "what is x?"})
        rollout = rig.wait(rid, timeout=60)
        assert rollout["state"] == "succeeded", rollout
        assert len(rig.events(rid, "model_request")) == 2
        assert proxy.lines == []
    finally:
        proxy.close()


_PRINT_EVICTED = "import sys; print('Evicted: the pod was OOMKilled, ImagePullBackOff'); sys.exit(3)"


@pytest.mark.parametrize(
    ("command", "evaluator", "kind"),
    [
        # the agent's log cannot turn its own failure into a dropped one
        ([sys.executable, "-c", _PRINT_EVICTED], None, "agent-error"),
        # the evaluator crashing is not the policy's doing (the agent exited 0)
        (["true"], [sys.executable, "-c", "raise SystemExit('evaluator exited with code 7')"], "infrastructure"),
        # a SIGKILL the controller did not send: the kernel's OOM killer
        ([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"], None, "infrastructure"),
    ],
)
def test_the_failure_cause_comes_from_the_controller_not_the_log(
    rig: Rig, command: list[str], evaluator: list[str] | None, kind: str
) -> None:
    """The final status carries the controller's `cause`, which the trainer's failure rule reads."""
    rig.start_run(command=command, evaluator_command=evaluator, reward_from="evaluator" if evaluator else "agent")
    rig.start_controller()
    (rid,) = rig.create({"question": "?"})
    assert rig.wait(rid)["state"] == "failed"
    final = rig.events(rid, "rollout.status")[-1]
    assert final["status"] == "failed"
    assert failure_kind(final["status"], final.get("reason"), cause=final.get("cause")) == kind, final


_NEEDS_THE_GATEWAY = """
import json, os, sys, time
import httpx
go = json.load(open(os.environ["ROLLWIRE_INPUT_FILE"]))["go"]
while not os.path.exists(go):
    time.sleep(0.05)
try:
    httpx.post(os.environ["OPENAI_BASE_URL"] + "/chat/completions", timeout=5,
               headers={"authorization": "Bearer " + os.environ["OPENAI_API_KEY"]},
               json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
except httpx.TransportError as exc:
    sys.exit(f"the model is unreachable: {exc!r}")
"""


def test_an_agent_failing_because_the_gateway_is_down_is_not_the_policys(
    nats_url: str, upstream: str, run_id: str, tmp_path: Path
) -> None:
    """The gateway stops while the agent runs; the agent exits 1 on its next call. The controller,
    which found the gateway unreachable then, classifies the failure `infrastructure`."""
    port = free_port()
    args = [sys.executable, "-m", "services.gateway", "--port", str(port), "--nats-url", nats_url]
    url = f"http://127.0.0.1:{port}"
    gateway = Child("gateway", args, base_env(), tmp_path / "gateway-1.log")
    _wait_http(f"{url}/healthz", gateway)
    rig = Rig(url, nats_url, upstream, run_id, tmp_path)
    try:
        rig.start_run(command=[sys.executable, "-c", _NEEDS_THE_GATEWAY], timeout_s=60, max_attempts=1)
        rig.start_controller()
        go = tmp_path / "go"
        (rid,) = rig.create({"go": str(go)})
        rig.wait(rid, ("running",))
        gateway.stop()
        go.touch()
        time.sleep(3)  # the agent exits 1; the controller cannot report it yet
        gateway = Child("gateway", args, base_env(), tmp_path / "gateway-2.log")
        _wait_http(f"{url}/healthz", gateway)
        assert rig.wait(rid, timeout=60)["state"] == "failed"
        final = rig.events(rid, "rollout.status")[-1]
        assert "the model is unreachable" in final["reason"], final
        assert failure_kind(final["status"], final["reason"], cause=final.get("cause")) == "infrastructure", final
    finally:
        rig.close()
        gateway.stop()
