"""The calc example: the safe calculator, the symbolic answers, the reward rule, and one real training step."""

from __future__ import annotations

import json
from fractions import Fraction
from pathlib import Path

import pytest
from example_run import example_config, run_one_step

from examples.calc.build import build
from examples.calc.calculator import CalcError, evaluate, run_tool
from examples.calc.reward import score
from trainer.clients import ServiceUrls


def test_calculator_is_exact_and_refuses_everything_but_arithmetic() -> None:
    assert evaluate("(3 * 12 + 2 * 7) * (100 - 20) / 100") == 40
    assert evaluate("0.1 + 0.2") == Fraction(3, 10)
    assert evaluate("7 // 2 + 2 ** 3 - -1") == 12
    assert run_tool("calculator", '{"expression": "(223 - 19) / 5"}') == "40.8"
    for bad in ("__import__('os').system('true')", "x + 1", "2 ** 1000", "1 / 0", "9" * 300, "[1, 2]", "True + 1"):
        with pytest.raises(CalcError):
            evaluate(bad)
    assert run_tool("calculator", "{not json").startswith("error:")
    assert run_tool("shell", "{}").startswith("error:")


def test_every_built_answer_is_the_gold_expression_evaluated(tmp_path: Path) -> None:
    report = build(tmp_path, count=300, seed=3)
    tasks = [json.loads(line) for line in (tmp_path / "tasks.jsonl").read_text().splitlines()]
    assert report["tasks"] == len(tasks) == 300
    for task in tasks:
        assert abs(float(evaluate(task["expression"])) - float(task["answer"])) < 1e-6
    # distractors: every question names more numbers than its expression uses
    assert all(len(t["question"].split()) > 15 for t in tasks)


def test_reward_rule_by_hand() -> None:
    # gold 40.8: (223 - 19) / 5
    assert score("### ANSWER: 40.8", "40.8") == 1.0
    assert score("so ### ANSWER: 40.79", "40.8") == 1.0  # within 1e-2
    assert score("### ANSWER: 40.78", "40.8") == 0.0  # 0.02 away
    assert score("### ANSWER: 204/5", "40.8") == 1.0
    assert score("### ANSWER: 1,250", "1250") == 1.0
    assert score("The answer is 40.8", "40.8") == 1.0  # no penalty by default
    assert score("The answer is 40.8", "40.8", format_penalty=0.2) == pytest.approx(0.8)
    assert score("no idea", "40.8", format_penalty=0.2) == pytest.approx(-0.2)
    assert score(None, "40.8", format_penalty=0.2) == pytest.approx(-0.2)


@pytest.mark.slow
def test_one_training_step_scores_every_rollout_by_the_rule(
    tmp_path: Path, example_model: Path, example_stack: ServiceUrls
) -> None:
    build(tmp_path / "data", count=16, seed=0)
    tasks = {json.loads(line)["question"]: json.loads(line) for line in (tmp_path / "data/tasks.jsonl").open()}
    config = example_config("calc", tmp_path, tmp_path / "data" / "tasks.jsonl", example_model)
    record = run_one_step(config, example_stack)

    assert [row["step"] for row in record.rows] == [1]
    assert record.rows[0]["rollouts"] == 4 and record.rows[0]["rollouts_failed"] == 0
    evaluations = record.payloads("evaluation")
    rewards = record.rewards_by_rollout()
    assert len(rewards) == 4 and all(r.source == "evaluator" for r in record.rewards)
    for call in record.calls:  # every call crossed the proxy with the calculator declared
        assert [t["function"]["name"] for t in call.request["tools"]] == ["calculator"]
        assert call.prompt_ids and call.response_ids
    for rollout_id, reward in rewards.items():
        first = next(c for c in record.calls if c.rollout_id == rollout_id)
        task = tasks[first.request["messages"][1]["content"]]
        assert reward == score(evaluations[rollout_id]["result"].get("answer"), task["answer"])
