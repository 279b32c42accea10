"""Run a project's tests with pytest and read each test's outcome from its JUnit XML report.

Shared by the task builder (which tests a bug breaks) and the evaluator (whether the agent fixed
it). Test ids are pytest node ids (`tests/test_text.py::test_chunk`). The project's own pytest
config is used when it has one; otherwise none (`-c /dev/null`), so a config file elsewhere up
the tree cannot change how the tests run.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

CONFIG_FILES = ("pytest.ini", "pyproject.toml", "tox.ini", "setup.cfg")
OUTPUT_LIMIT = 4000


@dataclass
class TestRun:
    """Each test's outcome (`passed`, `failed`, `error`, `skipped`) and the run's output, cut to a bound."""

    outcomes: dict[str, str]
    output: str
    returncode: int

    def passed(self) -> set[str]:
        return {t for t, o in self.outcomes.items() if o == "passed"}

    def failed(self) -> set[str]:
        return {t for t, o in self.outcomes.items() if o in ("failed", "error")}


def _node_id(case: ET.Element, root: Path) -> str:
    """A JUnit testcase as a pytest node id (`classname` is the dotted path plus any class)."""
    classname, name = case.get("classname", ""), case.get("name", "")
    parts = classname.split(".")
    for cut in range(len(parts), 0, -1):
        path = Path(*parts[:cut]).with_suffix(".py")
        if (root / path).is_file():
            return "::".join([path.as_posix(), *parts[cut:], name])
    return f"{classname}::{name}"


def run_tests(repo: Path, tests: list[str] | None = None, timeout_s: float = 300.0,
              python: str = sys.executable) -> TestRun:  # fmt: skip
    """Run `tests` (node ids or paths; all when None) in `repo`; a run past `timeout_s` fails every test."""
    config = next((name for name in CONFIG_FILES if (repo / name).is_file()), os.devnull)
    with tempfile.TemporaryDirectory(prefix="rw-junit-") as tmp:
        report = Path(tmp) / "junit.xml"
        argv = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", ".", "-c", config,
                "--tb=short", f"--junitxml={report}", *(tests or [])]  # fmt: skip
        # Plugins installed next to the runner (asyncio, hypothesis, ...) are not the project's: not loaded.
        env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "PYTHONPATH": str(repo),
               "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}  # fmt: skip
        try:
            done = subprocess.run(argv, cwd=repo, capture_output=True, text=True, timeout=timeout_s, env=env)
        except subprocess.TimeoutExpired:
            return TestRun({t: "error" for t in tests or []}, f"tests timed out after {timeout_s}s", -1)
        outcomes: dict[str, str] = {}
        if report.is_file():
            for case in ET.parse(report).iter("testcase"):
                kinds = {child.tag for child in case}
                outcome = next((k for k in ("failure", "error", "skipped") if k in kinds), "passed")
                outcomes[_node_id(case, repo)] = {"failure": "failed"}.get(outcome, outcome)
        output = (done.stdout + done.stderr)[-OUTPUT_LIMIT:]
        return TestRun(outcomes, output, done.returncode)
