"""Small pure parts of the controller: settings, the agent's environment, backend instances, subjects."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from schemas.runs import RunSpec
from services.common.gateway_api import AttemptGrant
from services.controller.launch import attempt_env, evaluator_env
from services.controller.settings import SettingsError, parse
from services.controller.state import backend_id, subjects
from services.controller.view import Rollout

ENV = {"ROLLWIRE_GATEWAY_URL": "http://gw:8080", "ROLLWIRE_ADMIN_TOKEN": "admin", "ROLLWIRE_DATA_DIR": "/data"}


def test_settings_come_from_flags_then_environment() -> None:
    settings = parse(["--run", "r1", "--run", "r2", "--backends", "local"], ENV)
    assert settings.runs == ("r1", "r2") and settings.backends == ("local",)
    assert settings.executions_dir == Path("/data/executions") and settings.local_capacity == 32
    assert parse(["--gateway-url", "http://x"], ENV).gateway_url == "http://x"


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        ([], {**ENV, "ROLLWIRE_GATEWAY_URL": ""}, "ROLLWIRE_GATEWAY_URL"),
        ([], {**ENV, "ROLLWIRE_ADMIN_TOKEN": ""}, "ROLLWIRE_ADMIN_TOKEN"),
        (["--backends", "docker"], ENV, "allowed: local, kubernetes"),
        (["--run", "a.b"], ENV, "may not contain"),
        (["--local-capacity", "0"], ENV, "must be positive"),
    ],
)
def test_bad_settings_are_named(argv: list[str], env: dict[str, str], message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        parse(argv, env)


def test_help_prints_the_flags_and_exits_0() -> None:
    """`python -m services.controller --help` prints usage; typer's exit code is not taken as the settings."""
    root = Path(__file__).resolve().parents[3]
    env = {**os.environ, "PYTHONPATH": str(root)}
    done = subprocess.run(
        [sys.executable, "-m", "services.controller", "--help"], cwd=root, env=env, capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "--gateway-url" in done.stdout and "Traceback" not in done.stderr


def test_the_agent_gets_its_contract_and_the_evaluator_not_the_agents_token() -> None:
    rollout = Rollout(run_id="r1", rollout_id="ro1", mode="val", group_id="g1")
    spec = RunSpec(run_id="r1", env={"OPENAI_API_KEY": "overridden", "EXTRA": "1"})
    grant = AttemptGrant(
        attempt_id="a1", token="tok", proxy_base_url="http://p/v1", events_url="http://e", sequence=2,
        anthropic_base_url="http://p/anthropic",
    )  # fmt: skip
    env = attempt_env(rollout, spec, grant)
    assert env["OPENAI_API_KEY"] == env["ROLLWIRE_TOKEN"] == env["ANTHROPIC_API_KEY"] == "tok" and env["EXTRA"] == "1"
    assert env["ANTHROPIC_BASE_URL"] == "http://p/anthropic"
    assert env["OPENAI_AGENTS_DISABLE_TRACING"] == "1"  # the Agents SDK uploads no traces to OpenAI
    traced = RunSpec(run_id="r1", env={"OPENAI_AGENTS_DISABLE_TRACING": "0"})
    assert attempt_env(rollout, traced, grant)["OPENAI_AGENTS_DISABLE_TRACING"] == "0"  # a run may opt in
    assert (env["OPENAI_BASE_URL"], env["ROLLWIRE_EVENTS_URL"]) == ("http://p/v1", "http://e")
    assert (env["ROLLWIRE_ATTEMPT_SEQUENCE"], env["ROLLWIRE_MODE"], env["ROLLWIRE_GROUP_ID"]) == ("2", "val", "g1")
    judge = evaluator_env(env, "eval-tok")
    assert judge["ROLLWIRE_TOKEN"] == "eval-tok" and "tok" not in judge.values()
    assert "OPENAI_BASE_URL" not in judge and "ANTHROPIC_BASE_URL" not in judge


def test_each_job_template_gets_its_own_backend_instance() -> None:
    assert backend_id(RunSpec(run_id="r1")) == "local"
    assert backend_id(RunSpec(run_id="r1", backend="kubernetes")) == "kubernetes"
    one = backend_id(RunSpec(run_id="r1", backend="kubernetes", job_template="a: 1"))
    assert one.startswith("kubernetes:") and one == backend_id(
        RunSpec(run_id="r2", backend="kubernetes", job_template="a: 1")
    )
    assert one != backend_id(RunSpec(run_id="r1", backend="kubernetes", job_template="a: 2"))


def test_subjects_cover_specs_and_rollout_lifecycles() -> None:
    assert subjects(()) == ["rl.*.run", "rl.*.rollout.*.created", "rl.*.rollout.*.attempt", "rl.*.rollout.*.status"]
    assert subjects(("r1",))[0] == "rl.r1.run"
