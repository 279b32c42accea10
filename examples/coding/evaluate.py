"""The coding evaluator: runs after the agent, in its workspace, and reports with the evaluator token.

1. compares the workspace's test files (and pytest config files) with the task's originals and
   reports any the agent touched (custom event `test_files_touched`, which the example monitor
   flags);
2. restores them: originals written back, test or conftest files the agent added removed, so an
   agent that edits tests cannot pass;
3. runs FAIL_TO_PASS and PASS_TO_PASS (`testrun.py`): reward 1 when every one passes, else 0
   (SWE-bench's "resolved").

    python -m examples.coding.evaluate     (the run's evaluator_command, with reward_from = "evaluator")
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from examples.coding.build import is_test_file
from examples.coding.testrun import CONFIG_FILES, run_tests
from examples.evaluate import bounded, read_result
from services import agentkit

TOUCHED_EVENT = "test_files_touched"


def _guarded(repo: Path) -> set[str]:
    """Files that decide how tests run: test files, conftest files and pytest config files."""
    if not repo.is_dir():
        return set()
    found = {p.relative_to(repo).as_posix() for p in repo.rglob("*.py") if is_test_file(p) and p.is_file()}
    return found | {name for name in CONFIG_FILES if (repo / name).is_file()}


def restore_tests(workspace_repo: Path, original_repo: Path) -> list[str]:
    """Put every guarded file back as the task shipped it; returns those that were changed, added or removed."""
    touched = []
    originals, current = _guarded(original_repo), _guarded(workspace_repo)
    for name in sorted(originals | current):
        source, target = original_repo / name, workspace_repo / name
        if name not in originals:
            target.unlink()
            touched.append(name)
            continue
        content = source.read_bytes()
        if not target.is_file() or target.read_bytes() != content:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(content)
            touched.append(name)
    return touched


def evaluate(task: dict[str, Any], workspace: Path) -> tuple[float, list[str], dict[str, Any]]:
    """The reward, the test files the agent touched, and what the test run found."""
    repo = workspace / "repo"
    if not repo.is_dir():
        return 0.0, [], {"error": "the agent left no repo/ directory"}
    touched = restore_tests(repo, Path(task["repo"]))
    wanted = [*task["FAIL_TO_PASS"], *task["PASS_TO_PASS"]]
    run = run_tests(repo, wanted, timeout_s=300)
    passed = run.passed()
    resolved = all(test in passed for test in wanted)
    details = {"fail_to_pass_passed": sum(t in passed for t in task["FAIL_TO_PASS"]),
               "pass_to_pass_passed": sum(t in passed for t in task["PASS_TO_PASS"])}  # fmt: skip
    return (1.0 if resolved else 0.0), touched, details


def main() -> None:
    """Score this attempt's workspace and report."""
    attempt = agentkit.current()
    task = attempt.read_input()
    reward, touched, details = evaluate(task, Path.cwd())
    if touched:
        attempt.emit(TOUCHED_EVENT, {"files": touched[:50]})
    metrics = {"resolved": reward, "tests_touched": float(bool(touched))}
    attempt.emit("metrics", metrics)
    agent_result = bounded(read_result())  # what the agent left, for audit
    attempt.emit(
        "evaluation",
        {"reward": reward, "touched": touched[:50], "result": agent_result, **details, "task_id": task.get("id")},
    )
    attempt.report_reward(reward, name="evaluator")
    print(f"reward={reward} touched={touched} {details}")


if __name__ == "__main__":
    main()
