"""A controller killed mid-run and restarted: no execution starts twice, none is forgotten."""

from __future__ import annotations

import signal
import time

from controller_rig import Rig, agent

from services.controller.launch import ATTEMPT_KEY


def test_controller_killed_mid_run_and_restarted(rig: Rig) -> None:
    starts, gate = rig.tmp / "starts.txt", rig.tmp / "gate"
    task = {"gate": str(gate), "starts_file": str(starts)}
    rig.start_run(command=agent("slow_agent.py"), concurrency=3, timeout_s=60, max_attempts=2)
    first = rig.start_controller()
    early = rig.create(*(task for _ in range(4)))
    deadline = time.monotonic() + 30
    while sum(rig.rollout(rid)["state"] == "running" for rid in early) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)
    states = {rid: rig.rollout(rid)["state"] for rid in early}
    assert sorted(states.values()) == ["queuing", "running", "running", "running"], states  # concurrency 3
    (waiting,) = [rid for rid, state in states.items() if state == "queuing"]
    first.stop(signal.SIGKILL)
    late = rig.create(*(task for _ in range(2)))  # while no controller runs
    second = rig.start_controller()
    deadline = time.monotonic() + 30
    while "controller started" not in second.log() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "3 execution(s)" in second.log()  # the running agents were found again
    time.sleep(0.5)
    # Taken over, the three running executions still fill the run's concurrency.
    assert {rig.rollout(rid)["state"] for rid in (waiting, *late)} == {"queuing"}
    gate.touch()  # let every agent finish
    for rid in early + late:
        rollout = rig.wait(rid)
        assert rollout["state"] == "succeeded", rollout
        assert rollout["attempt_count"] == 1, rollout  # the running ones were taken over, not retried
    lines = starts.read_text().split()
    assert len(lines) == 6 and len(set(lines)) == 6, lines  # every attempt started exactly once
    assert second.stop() == 0  # SIGTERM: a clean exit


def test_attempt_started_but_not_launched_is_launched_after_restart(rig: Rig) -> None:
    starts = rig.tmp / "starts.txt"
    rig.start_run(command=agent("slow_agent.py"), timeout_s=60, max_attempts=1)
    (rid,) = rig.create({"seconds": 0.1, "starts_file": str(starts)})
    created_seq = rig.rollout(rid)["cursor"]
    # What a controller that died right after starting the attempt leaves behind: `preparing`, no execution.
    key = ATTEMPT_KEY.format(rollout=rid, created=created_seq, sequence=1)
    r = rig.admin.post(f"/api/rollouts/{rid}/attempts", json={"executor": "local"}, headers={"Idempotency-Key": key})
    assert r.status_code == 201, r.text
    orphan = r.json()["attempt_id"]
    assert rig.rollout(rid)["state"] == "preparing"
    rig.start_controller()
    rollout = rig.wait(rid)
    assert rollout["state"] == "succeeded" and rollout["attempt_count"] == 1, rollout
    assert starts.read_text().split() == [orphan]  # the same attempt ran, once


def test_run_declared_after_its_rollouts_is_picked_up(rig: Rig) -> None:
    starts = rig.tmp / "starts.txt"
    rig.start_controller()
    r = rig.admin.post(
        "/api/rollouts",
        json={"rollouts": [{"run_id": rig.run_id, "input": {"seconds": 0, "starts_file": str(starts)}}]},
    )
    assert r.status_code == 201, r.text
    rid = r.json()["rollouts"][0]["rollout_id"]
    time.sleep(0.5)
    assert rig.rollout(rid)["state"] == "queuing"  # no spec yet: nothing to run it with
    rig.start_run(command=agent("slow_agent.py"))
    assert rig.wait(rid)["state"] == "succeeded"
