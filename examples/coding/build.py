"""The coding example's task pipeline: bugs injected into a real project, kept only when tests catch them.

    python -m examples.coding.build --out examples/coding/data                       (the shipped project)
    python -m examples.coding.build --out DIR --project path/to/repo                 (a user's repository)
    python -m examples.coding.build --out DIR --sdist toolz==1.0.0                   (a PyPI sdist, via pip)

1. the project's test suite runs once: every test that passes is a candidate;
2. the functions the tests reference (names used in the test files) are mutated, one site at a
   time (`mutate.py`), in a seeded order;
3. each mutant runs the tests; it is kept when some passing tests now fail. Those are its
   FAIL_TO_PASS tests; the tests of that run still passing are its PASS_TO_PASS (at most 50);
4. each kept bug becomes a task: a copy of the project with the bug (`repos/<id>/`) and a problem
   statement written from the failing tests' output, as a user reporting the bug would paste it.

`tasks.jsonl` holds what the agent and the evaluator need (`repo`, `problem_statement`,
`FAIL_TO_PASS`, `PASS_TO_PASS`, `test_files`); `bugs.jsonl` holds what was changed, which the
agent never sees.
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

from examples.coding.mutate import Mutation, mutations
from examples.coding.testrun import run_tests

SHIPPED_PROJECT = Path(__file__).parent / "project"
IGNORED = shutil.ignore_patterns("__pycache__", "*.pyc", ".git", ".tox", ".pytest_cache", "*.egg-info", "build", "dist")
MAX_PASS_TO_PASS = 50


class BuildError(RuntimeError):
    """The project cannot be turned into tasks; the message says why."""


def is_test_file(path: Path) -> bool:
    """pytest's default test file names, plus conftest files (which tests depend on)."""
    return path.suffix == ".py" and (
        path.name.startswith("test_") or path.name.endswith("_test.py") or path.name == "conftest.py"
    )


def test_files(repo: Path) -> list[str]:
    """The repository's test files, relative and sorted."""
    return sorted(p.relative_to(repo).as_posix() for p in repo.rglob("*.py") if is_test_file(p))


def source_files(repo: Path) -> list[Path]:
    """Python files that are neither tests nor packaging or docs."""
    skip = {"setup.py", "conftest.py", "noxfile.py"}
    return sorted(
        p for p in repo.rglob("*.py")
        if not is_test_file(p) and p.name not in skip and not {"docs", "tests", "test"} & set(p.relative_to(repo).parts)
    )  # fmt: skip


def referenced_names(repo: Path, files: list[str]) -> set[str]:
    """Every name and attribute the test files use: the functions the tests cover, by name."""
    names: set[str] = set()
    for name in files:
        try:
            tree = ast.parse((repo / name).read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Name):
                names.add(node.id)
            elif isinstance(node, ast.Attribute):
                names.add(node.attr)
            elif isinstance(node, ast.alias):
                names.add(node.name.split(".")[-1])
    return names


def fetch_sdist(spec: str, into: Path) -> Path:
    """Download `spec`'s source distribution with pip and unpack it; returns the project directory."""
    done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                           "-q", "-d", str(into), spec], capture_output=True, text=True)  # fmt: skip
    archives = list(into.glob("*.tar.gz"))
    if done.returncode != 0 or not archives:
        raise BuildError(f"pip could not download an sdist of {spec}: {done.stderr.strip()[-300:]}")
    with tarfile.open(archives[0]) as archive:
        archive.extractall(into / "src", filter="data")
    (project,) = [p for p in (into / "src").iterdir() if p.is_dir()]
    return project


def problem_statement(failing: list[str], output: str) -> str:
    """The issue text: which tests fail and what pytest printed about them (bounded)."""
    lines = [line for line in output.splitlines() if line.strip() and not line.startswith(("=", "-" * 5))]
    excerpt = "\n".join(lines[-30:])[-1500:]
    tests = "\n".join(f"- {t}" for t in failing[:10])
    return f"These tests fail and should pass:\n{tests}\n\npytest says:\n{excerpt}\n\nFix the code, not the tests."


def _try(work: Path, path: Path, mutant: Mutation, baseline: set[str]) -> dict[str, Any] | None:
    original = path.read_text(encoding="utf-8")
    path.write_text(mutant.source, encoding="utf-8")
    try:
        run = run_tests(work, timeout_s=120)
    finally:
        path.write_text(original, encoding="utf-8")
    failing = sorted(run.failed() & baseline)
    if not failing:
        return None
    passing = sorted(run.passed() & baseline)[:MAX_PASS_TO_PASS]
    return {"FAIL_TO_PASS": failing, "PASS_TO_PASS": passing, "output": run.output}


def build(out: Path, project: Path = SHIPPED_PROJECT, *, max_bugs: int = 20, max_tries: int = 60,
          seed: int = 0) -> dict[str, Any]:  # fmt: skip
    """Write up to `max_bugs` tasks (trying at most `max_tries` mutants) into `out`; returns counts and seconds."""
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="rw-coding-") as tmp:
        work = Path(tmp) / "work"
        shutil.copytree(project, work, ignore=IGNORED)
        baseline_run = run_tests(work, timeout_s=600)
        baseline = baseline_run.passed()
        if not baseline:
            raise BuildError(f"no test of {project} passes as shipped:\n{baseline_run.output[-500:]}")
        tests = test_files(work)
        covered = referenced_names(work, tests)
        candidates = [(path, m) for path in source_files(work)
                      for m in mutations(path.read_text(encoding="utf-8"), covered)]  # fmt: skip
        random.Random(seed).shuffle(candidates)
        tasks: list[dict[str, Any]] = []
        bugs: list[dict[str, str]] = []
        tried = 0
        for path, mutant in candidates:
            if len(tasks) >= max_bugs or tried >= max_tries:
                break
            tried += 1
            found = _try(work, path, mutant, baseline)
            if found is None:
                continue
            task_id = f"coding-{len(tasks)}"
            repo = (out / "repos" / task_id).resolve()
            if repo.exists():
                shutil.rmtree(repo)
            shutil.copytree(work, repo, ignore=IGNORED)
            (repo / path.relative_to(work)).write_text(mutant.source, encoding="utf-8")
            tasks.append({"id": task_id, "repo": str(repo), "test_files": tests,
                          "problem_statement": problem_statement(found["FAIL_TO_PASS"], found["output"]),
                          "FAIL_TO_PASS": found["FAIL_TO_PASS"], "PASS_TO_PASS": found["PASS_TO_PASS"]})  # fmt: skip
            bugs.append({"id": task_id, "file": path.relative_to(work).as_posix(), "function": mutant.function,
                         "mutation": mutant.description})  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    (out / "tasks.jsonl").write_text("".join(json.dumps(t) + "\n" for t in tasks), encoding="utf-8")
    (out / "bugs.jsonl").write_text("".join(json.dumps(b) + "\n" for b in bugs), encoding="utf-8")
    return {"tasks": len(tasks), "tried": tried, "candidates": len(candidates), "tests": len(baseline),
            "seconds": round(time.monotonic() - start, 2)}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    """CLI: build tasks from the shipped project, `--project`, or `--sdist`."""
    parser = argparse.ArgumentParser(description="Build SWE-style tasks by injecting bugs the tests catch.")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "data")
    parser.add_argument("--project", type=Path, default=None)
    parser.add_argument("--sdist", default=None, help="a pip requirement, e.g. toolz==1.0.0")
    parser.add_argument("--max-bugs", type=int, default=20)
    parser.add_argument("--max-tries", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        with tempfile.TemporaryDirectory(prefix="rw-sdist-") as tmp:
            project = fetch_sdist(args.sdist, Path(tmp)) if args.sdist else (args.project or SHIPPED_PROJECT)
            report = build(args.out, project, max_bugs=args.max_bugs, max_tries=args.max_tries, seed=args.seed)
    except BuildError as exc:
        raise SystemExit(f"error: {exc}") from None
    print(f"wrote {report['tasks']} tasks ({report['tried']} of {report['candidates']} mutants tried, "
          f"{report['tests']} tests) to {args.out} in {report['seconds']}s")  # fmt: skip


if __name__ == "__main__":
    main()
