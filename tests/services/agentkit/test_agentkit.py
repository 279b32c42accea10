"""The agent helper: its environment contract, and its calls against the real gateway."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from controller_rig import Rig

from services.agentkit import AgentkitError, Attempt

BASE = {
    "ROLLWIRE_ROLLOUT_ID": "ro1",
    "ROLLWIRE_ATTEMPT_ID": "a1",
    "ROLLWIRE_EVENTS_URL": "http://127.0.0.1:9/api/rollouts/ro1/attempt/a1/events",
    "OPENAI_API_KEY": "token",
}


def test_a_missing_variable_is_named() -> None:
    with pytest.raises(AgentkitError, match="ROLLWIRE_ATTEMPT_ID is not set"):
        Attempt.from_env({k: v for k, v in BASE.items() if k != "ROLLWIRE_ATTEMPT_ID"})
    with pytest.raises(AgentkitError, match="no token"):
        Attempt.from_env({k: v for k, v in BASE.items() if k != "OPENAI_API_KEY"})


def test_input_comes_from_the_variable_or_else_the_file(tmp_path: Path) -> None:
    assert Attempt.from_env({**BASE, "ROLLWIRE_INPUT": '{"q": 1}'}).read_input() == {"q": 1}
    big = tmp_path / "input.json"
    big.write_text(json.dumps({"q": "x" * 100_000}))
    assert len(Attempt.from_env({**BASE, "ROLLWIRE_INPUT_FILE": str(big)}).read_input()["q"]) == 100_000
    with pytest.raises(AgentkitError, match="input is unknown"):
        Attempt.from_env(BASE).read_input()


def test_events_and_rewards_reach_the_gateway_with_the_right_token(rig: Rig) -> None:
    rig.start_run(command=["true"], evaluator_command=["true"], reward_from="evaluator")
    (rid,) = rig.create({"q": 1})
    grant = rig.admin.post(f"/api/rollouts/{rid}/attempts", json={}).json()
    env = {
        "ROLLWIRE_ROLLOUT_ID": rid,
        "ROLLWIRE_ATTEMPT_ID": grant["attempt_id"],
        "ROLLWIRE_EVENTS_URL": grant["events_url"],
        "OPENAI_API_KEY": grant["token"],
    }
    agent = Attempt.from_env(env)
    agent.emit("note", {"step": 1})
    with pytest.raises(AgentkitError, match="403"):  # the run takes rewards from its evaluator only
        agent.report_reward(1.0)
    token = rig.admin.post(f"/api/rollouts/{rid}/attempt/{grant['attempt_id']}/evaluator-token").json()["token"]
    Attempt.from_env({**env, "ROLLWIRE_TOKEN": token}).report_reward(0.5, name="graded")
    (reward,) = rig.events(rid, "reward")
    assert (reward["value"], reward["name"], reward["source"]) == (0.5, "graded", "evaluator")
    assert [e["payload"] for e in rig.events(rid, "custom") if e["name"] == "note"] == [{"step": 1}]
