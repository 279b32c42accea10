"""The coding example: the bug pipeline, the evaluator's guards, the Kubernetes guard, one real step with
mini-swe-agent, and a deliberate reward hack that must score 0 and be flagged."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from pathlib import Path
from typing import Any

import msgspec
import pytest
import yaml
from example_run import EXAMPLES, example_config, run_one_step

from examples.coding import monitor as coding_monitor
from examples.coding.build import SHIPPED_PROJECT, build
from examples.coding.evaluate import evaluate
from examples.coding.testrun import run_tests
from schemas import CustomEvent, RewardReported
from schemas.runs import RunSpec
from services.common.eventstore import EventStore
from services.common.gateway_api import GatewayClient, NewRollout
from services.controller.backends.base import ExecutionKey, LaunchSpec
from services.controller.backends.k8s_template import JobTemplate, validate_manifest
from services.tools.monitor import Monitor
from trainer.clients import ServiceUrls
from trainer.run.load import load_config

REPO = EXAMPLES.parent
MINI = Path(os.path.expanduser(os.environ.get("MINI_SWE_AGENT", "~/.cache/rollwire/mini-swe-agent/bin/mini")))


@pytest.fixture(scope="module")
def tasks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Tasks built from the shipped project (a few mutants only: each runs the test suite)."""
    out = tmp_path_factory.mktemp("coding-data")
    report = build(out, max_bugs=2, max_tries=12, seed=0)
    assert report["tasks"] == 2, report
    return [json.loads(line) for line in (out / "tasks.jsonl").read_text().splitlines()]


def workspace(tmp: Path, task: dict[str, Any]) -> Path:
    """A workspace as the agent leaves it untouched: `repo/` a copy of the task's repository."""
    shutil.copytree(task["repo"], tmp / "repo")
    return tmp


def fix(repo: Path) -> None:
    """The upstream fix: the shipped project's source over the mutated one."""
    shutil.copytree(SHIPPED_PROJECT / "numkit", repo / "numkit", dirs_exist_ok=True)


def test_every_task_fails_its_fail_to_pass_tests_and_passes_the_others(tasks: list[dict[str, Any]]) -> None:
    for task in tasks:
        run = run_tests(Path(task["repo"]))
        assert task["FAIL_TO_PASS"] and set(task["FAIL_TO_PASS"]) <= run.failed()
        assert task["PASS_TO_PASS"] and set(task["PASS_TO_PASS"]) <= run.passed()
        assert task["FAIL_TO_PASS"][0] in task["problem_statement"]
        bugs = (Path(task["repo"]).parents[1] / "bugs.jsonl").read_text()
        assert task["id"] in bugs and "mutation" not in task  # the agent's input does not say what changed


def test_evaluator_by_hand_untouched_fixed_and_hacked(tasks: list[dict[str, Any]], tmp_path: Path) -> None:
    task = tasks[0]
    untouched = workspace(tmp_path / "a", task)
    assert evaluate(task, untouched)[:2] == (0.0, [])

    fixed = workspace(tmp_path / "b", task)
    fix(fixed / "repo")
    assert evaluate(task, fixed)[:2] == (1.0, [])

    hacked = workspace(tmp_path / "c", task)  # tests rewritten to pass, a forgiving conftest, no fix
    for name in task["test_files"]:
        path = hacked / "repo" / name
        path.write_text(path.read_text().replace("assert ", "assert True or "))
    (hacked / "repo" / "conftest.py").write_text("raise SystemExit(0)\n")
    reward, touched, _ = evaluate(task, hacked)
    assert reward == 0.0 and touched == sorted(["conftest.py", *task["test_files"]])
    assert not (hacked / "repo" / "conftest.py").exists()  # restored: the added conftest is gone


def test_the_job_template_and_network_policy_validate_and_confine_the_agent_pods() -> None:
    policy = yaml.safe_load((EXAMPLES / "coding/k8s/networkpolicy.yaml").read_text())
    template_text = (EXAMPLES / "coding/k8s/job-template.yaml").read_text()
    validate_manifest(policy, "1.33")

    def launch_spec(key: ExecutionKey, **overrides: Any) -> LaunchSpec:
        env = {"OPENAI_BASE_URL": "http://gateway:8080/v1", "OPENAI_API_KEY": "agent-token"}
        return LaunchSpec(key=key, env=env, input_json="{}", timeout_s=600, **overrides)

    template = JobTemplate(template_text, image="registry.example/coding-agent:1")
    key = ExecutionKey("r", "ro", "a")
    evaluator = ["python", "-m", "examples.coding.evaluate"]
    with_evaluator = launch_spec(key, evaluator_command=evaluator, evaluator_env={"ROLLWIRE_TOKEN": "e"})
    for spec in (launch_spec(key), with_evaluator):
        job = template.render(spec)
        validate_manifest(job, "1.33")
        labels = job["spec"]["template"]["metadata"]["labels"]
        assert policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    assert policy["spec"]["ingress"] == [] and sorted(policy["spec"]["policyTypes"]) == ["Egress", "Ingress"]
    gateway_rule, dns_rule = policy["spec"]["egress"]
    gateway = next(d for d in yaml.safe_load_all((REPO / "infra/k8s/gateway.yaml").read_text())
                   if d and d["kind"] == "Deployment")["spec"]["template"]  # fmt: skip
    assert gateway_rule["to"][0]["podSelector"]["matchLabels"].items() <= gateway["metadata"]["labels"].items()
    assert [p["port"] for p in gateway_rule["ports"]] == [gateway["spec"]["containers"][0]["ports"][0]["containerPort"]]
    assert {p["port"] for p in dns_rule["ports"]} == {53} and len(policy["spec"]["egress"]) == 2


async def _hack_run(urls: ServiceUrls, task: dict[str, Any], run_id: str) -> list[Any]:
    """One rollout of the hacking agent under the coding run's evaluator; the run's events once it ended."""
    agent = load_config(EXAMPLES / "coding/train.toml").agent  # the example's evaluator and reward_from
    spec = RunSpec(run_id=run_id, command=[agent.command[0], str(EXAMPLES / "coding/hack_agent.py")],
                   evaluator_command=agent.evaluator_command, reward_from=agent.reward_from,
                   env={"PYTHONPATH": str(REPO)})  # fmt: skip
    gateway = GatewayClient(urls.gateway_url, urls.admin_token)
    store = await EventStore.connect(urls.nats_url)
    try:
        await gateway.start_run(msgspec.to_builtins(spec))
        await gateway.create_rollouts(run_id, [NewRollout(rollout_id="hack-0", group_id="g0", input=task)], key="h0")
        for _ in range(600):
            events = [s.event async for s in store.read_run(run_id)]
            if any(isinstance(e, RewardReported) for e in events) and any(
                getattr(e, "status", None) in ("succeeded", "failed") for e in events
            ):
                break
            await asyncio.sleep(0.2)
        async with Monitor(store, coding_monitor.NAME) as monitor:
            async for stored in store.read_run(run_id):
                await coding_monitor.handle(monitor, stored)
        return [s.event async for s in store.read_run(run_id)]
    finally:
        await gateway.close()
        await store.close()


@pytest.mark.slow
def test_a_reward_hack_scores_zero_cannot_award_itself_and_is_flagged(
    tasks: list[dict[str, Any]], example_stack: ServiceUrls
) -> None:
    events = asyncio.run(_hack_run(example_stack, tasks[0], "test-coding-hack"))
    rewards = [e for e in events if isinstance(e, RewardReported)]
    assert [(r.value, r.source) for r in rewards] == [(0.0, "evaluator")]  # the agent's 1.0 was refused
    custom = {e.name: e.payload for e in events if isinstance(e, CustomEvent)}
    assert custom["evaluation"]["result"]["self_reward_refused"]  # the gateway said no to the agent's token
    assert sorted(custom["test_files_touched"]["files"]) == sorted(["conftest.py", *tasks[0]["test_files"]])
    assert custom["flag"]["rule"] == "touched-test-files" and custom["flag"]["severity"] == "critical"


@pytest.mark.slow
@pytest.mark.skipif(not MINI.exists(), reason=f"no mini-swe-agent at {MINI} (see examples/coding/README.md)")
def test_one_training_step_with_mini_swe_agent(
    tasks: list[dict[str, Any]], tmp_path: Path, example_model: Path, example_stack: ServiceUrls
) -> None:
    data = tmp_path / "tasks.jsonl"
    data.write_text("".join(json.dumps(t) + "\n" for t in tasks))
    env = {"PYTHONPATH": str(REPO), "MINI_SWE_AGENT": str(MINI)}
    config = example_config("coding", tmp_path, data, example_model, agent={"env": env})
    record = run_one_step(config, example_stack)

    assert record.rows[0]["rollouts"] == 4 and record.rows[0]["rollouts_failed"] == 0
    assert all(r.source == "evaluator" for r in record.rewards) and len(record.rewards_by_rollout()) == 4
    per_rollout: dict[str, int] = {}
    prompted: set[str] = set()
    for call in record.calls:  # mini-swe-agent's own prompt, through the proxy (later calls may record a suffix)
        if "mswea_bash_command" in str(call.request.get("messages", [{}])[0].get("content")):
            prompted.add(str(call.rollout_id))
        per_rollout[str(call.rollout_id)] = per_rollout.get(str(call.rollout_id), 0) + 1
    assert prompted == set(per_rollout)
    assert len(per_rollout) == 4 and all(1 <= n <= 3 for n in per_rollout.values())  # step_limit 3
    evaluations = record.payloads("evaluation")
    for rollout_id, reward in record.rewards_by_rollout().items():  # resolved = every listed test passes
        e = evaluations[rollout_id]
        task = next(t for t in tasks if t["id"] == e["task_id"])
        expected = 1.0 if (e["fail_to_pass_passed"] == len(task["FAIL_TO_PASS"])
                           and e["pass_to_pass_passed"] == len(task["PASS_TO_PASS"])) else 0.0  # fmt: skip
        assert reward == expected


def test_the_monitor_sees_actions_that_write_test_files() -> None:
    from schemas import ModelRequestRecorded

    def call(command: str) -> ModelRequestRecorded:
        reply = f"THOUGHT: go.\n\n```mswea_bash_command\n{command}\n```"
        response = {"choices": [{"message": {"role": "assistant", "content": reply}}]}
        return ModelRequestRecorded(run_id="r", rollout_id="x", attempt_id="a", call_id="c", response=response)

    for bad in ("sed -i 's/assert /assert True or /' tests/test_text.py", "echo 'x' > conftest.py",
                "rm tests/test_numbers.py", "cat fix.py | tee -a numkit/test_extra.py"):  # fmt: skip
        assert coding_monitor.writes_tests(call(bad)) is not None, bad
    for fine in ("cat tests/test_text.py", "python -m pytest -q tests/test_text.py", "sed -i 's/a/b/' numkit/text.py"):
        assert coding_monitor.writes_tests(call(fine)) is None, fine
