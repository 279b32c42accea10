"""`rollwire rollouts|attempts|reward|models` as a user runs them against a running `rollwire up`:
the gateway and the admin token found through `--data-dir`, tables by default, JSON with `--json`,
and one readable line (no traceback) for every error."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from ops_stack import Stack

ROLLWIRE = [sys.executable, "-m", "services.devstack.cli"]
CLI_TIMEOUT_S = 300
"""One command's limit: a few seconds each, but a minute and more was seen on 2 cores shared with the
stack's vLLM and other work."""


def rollwire(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("ROLLWIRE_")}
    env = {**clean, **(env or {})}
    return subprocess.run([*ROLLWIRE, *args], capture_output=True, text=True, timeout=CLI_TIMEOUT_S, env=env)


def ok(*args: str, env: dict[str, str] | None = None) -> str:
    result = rollwire(*args, env=env)
    assert result.returncode == 0, result.stderr
    return result.stdout


def as_json(*args: str) -> Any:
    return json.loads(ok(*args, "--json"))


def one_line_error(result: subprocess.CompletedProcess[str], code: int, *words: str) -> None:
    assert result.returncode == code, (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr and result.stderr.strip().count("\n") == 0, result.stderr
    assert result.stderr.startswith("error: ")
    for word in words:
        assert word in result.stderr, result.stderr


def test_rollouts_attempts_reward_and_cancel(stack: Stack) -> None:
    d = ("--data-dir", str(stack.data_dir))
    created = as_json(
        "rollouts", "create", '{"q": "2+2"}', '{"q": "3+3"}', "--run-id", "cli-run", "--group-id", "g1", *d
    )
    ids = [r["rollout_id"] for r in created["rollouts"]]
    assert len(ids) == 2 and all(r["state"] == "queuing" and r["group_id"] == "g1" for r in created["rollouts"])

    table = ok("rollouts", "list", "--run-id", "cli-run", *d).splitlines()
    assert table[0].split() == [
        "ROLLOUT_ID",
        "RUN_ID",
        "GROUP_ID",
        "MODE",
        "STATE",
        "ATTEMPT_COUNT",
        "REWARD",
        "REASON",
    ]
    assert {line.split()[0] for line in table[1:]} == set(ids)
    assert all(line.split()[4] == "queuing" for line in table[1:])
    listed = as_json("rollouts", "list", "--run-id", "cli-run", "--state", "queuing", *d)
    assert [r["rollout_id"] for r in listed] == ids
    page = ok("rollouts", "list", "--run-id", "cli-run", "--limit", "1", *d)
    assert ids[0] in page and ids[1] not in page and "--cursor" in page

    attempt = as_json("attempts", "start", ids[0], *d)
    assert attempt["rollout_id"] == ids[0] and attempt["sequence"] == 1 and attempt["token"].startswith("rw1.")
    shown = ok("attempts", "start", ids[1], *d)
    assert "proxy_base_url" in shown and "/proxy/rollout/" + ids[1] in shown  # URLs printed whole

    rewarded = as_json("reward", ids[0], "0.75", "--name", "pass", *d)
    assert (
        rewarded["value"] == 0.75 and rewarded["source"] == "admin" and rewarded["attempt_id"] == attempt["attempt_id"]
    )
    detail = as_json("rollouts", "show", ids[0], *d)
    assert (
        detail["reward"] == 0.75 and detail["attempt_id"] == attempt["attempt_id"] and detail["input"] == {"q": "2+2"}
    )
    text = ok("rollouts", "show", ids[0], *d)
    assert any(line.split()[:2] == ["reward", "0.75"] for line in text.splitlines())

    cancelled = as_json("rollouts", "cancel", ids[1], "--reason", "not needed", *d)
    assert cancelled["state"] == "cancelled" and cancelled["reason"] == "not needed"
    assert as_json("rollouts", "show", ids[1], *d)["state"] == "cancelled"


def test_models_list_and_register(stack: Stack) -> None:
    d = ("--data-dir", str(stack.data_dir))
    models = as_json("models", "list", *d)["models"]
    # The stack registers each vLLM replica as tiny-r<i>, serving the model `tiny` (the name agents ask for).
    engine = stack.endpoints["engine"]
    assert any(m["name"] == "tiny-r0" and m["served_model"] == "tiny" and m["base_url"] == engine for m in models)
    env = {"ROLLWIRE_GATEWAY_URL": stack.gateway, "ROLLWIRE_ADMIN_TOKEN": stack.token}
    assert "registered other" in ok(
        "models", "register", "other", "http://127.0.0.1:9/v1", "--run-id", "cli-m", env=env
    )
    table = ok("models", "list", "--run-id", "cli-m", *d).splitlines()
    assert table[0].split() == ["RUN_ID", "NAME", "BASE_URL", "SERVED_MODEL", "WEIGHTS_VERSION"]
    assert table[1].split()[:3] == ["cli-m", "other", "http://127.0.0.1:9/v1"] and len(table) == 2


def test_environment_wins_over_the_data_dir(stack: Stack, tmp_path: Path) -> None:
    env = {"ROLLWIRE_GATEWAY_URL": stack.gateway, "ROLLWIRE_ADMIN_TOKEN": stack.token}
    listed = json.loads(ok("models", "list", "--json", "--data-dir", str(tmp_path / "none"), env=env))
    assert listed["models"]
    wrong = {"ROLLWIRE_GATEWAY_URL": stack.gateway, "ROLLWIRE_ADMIN_TOKEN": "not-the-token"}
    one_line_error(rollwire("models", "list", "--data-dir", str(stack.data_dir), env=wrong), 1, "401")


def test_errors_are_one_readable_line(stack: Stack, tmp_path: Path) -> None:
    d = ("--data-dir", str(stack.data_dir))
    one_line_error(rollwire("rollouts", "show", "no-such-rollout", *d), 1, "404", "no-such-rollout")
    one_line_error(rollwire("rollouts", "create", "{not json", *d), 2, "not valid JSON")
    one_line_error(rollwire("rollouts", "create", *d), 2, "no rollout to create")
    one_line_error(rollwire("rollouts", "list", "--state", "sleeping", *d), 2, "--state sleeping", "queuing")
    one_line_error(rollwire("reward", "no-such-rollout", "1", *d), 1, "404")
    one_line_error(rollwire("reward", "x", "1", "--attempt-id", "a", *d), 1, "404")
    created = as_json("rollouts", "create", "{}", "--run-id", "cli-err", *d)["rollouts"][0]["rollout_id"]
    one_line_error(rollwire("reward", created, "1", *d), 1, "has no attempt yet", "rollwire attempts start")
    as_json("rollouts", "cancel", created, *d)
    one_line_error(rollwire("rollouts", "cancel", created, *d), 1, "409")
    one_line_error(rollwire("attempts", "start", created, *d), 1, "409")
    one_line_error(
        rollwire("models", "list", "--data-dir", str(tmp_path / "empty")), 2, "no admin token", "ROLLWIRE_ADMIN_TOKEN"
    )
    (tmp_path / "down").mkdir()
    (tmp_path / "down" / "admin_token").write_text("t")
    down = {"ROLLWIRE_GATEWAY_URL": "http://127.0.0.1:9"}
    one_line_error(rollwire("models", "list", "--data-dir", str(tmp_path / "down"), env=down), 1, "cannot be reached")
