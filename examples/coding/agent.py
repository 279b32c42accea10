"""The coding agent: mini-swe-agent from PyPI, unmodified, on a copy of the task's repository.

    MINI_SWE_AGENT=/path/to/venv/bin/mini python examples/coding/agent.py '{"repo": ..., "problem_statement": ...}'

This launcher only does what a person running mini-swe-agent on an issue would do: copy the
repository into the working directory (`repo/`) and run `mini` there on the problem statement, with
mini-swe-agent's own `mini_textbased.yaml` plus `mini.yaml` (no confirmation, the limits of a CPU
run). mini-swe-agent reaches the model through litellm's `openai/` provider, which reads
`OPENAI_BASE_URL` and `OPENAI_API_KEY`, the variables the controller sets. It exits 0 whatever
mini-swe-agent's own outcome (an exhausted step limit is an outcome, not a crash), so the
evaluator always runs and decides the reward.

mini-swe-agent needs its own environment (its dependencies pin versions Rollwire's do not):
`python -m venv ~/.cache/rollwire/mini-swe-agent && ~/.cache/rollwire/mini-swe-agent/bin/pip install
mini-swe-agent==2.4.6`, and `MINI_SWE_AGENT` names its `mini` (default: `mini` on PATH).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
MINI_CONFIG = HERE / "mini.yaml"


def read_input() -> dict[str, object]:
    """The task: the first argument, else `ROLLWIRE_INPUT`, else the file `ROLLWIRE_INPUT_FILE` names."""
    if len(sys.argv) > 1:
        return dict(json.loads(sys.argv[1]))
    text = os.environ.get("ROLLWIRE_INPUT") or Path(os.environ["ROLLWIRE_INPUT_FILE"]).read_text(encoding="utf-8")
    return dict(json.loads(text))


def main() -> int:
    """Copy the repository, run mini-swe-agent on the issue, leave `result.json`."""
    task = read_input()
    repo = Path("repo").resolve()
    shutil.copytree(str(task["repo"]), repo, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    mini = os.path.expanduser(os.environ.get("MINI_SWE_AGENT", "mini"))
    argv = [mini, "-c", "mini_textbased.yaml", "-c", str(MINI_CONFIG), "-t", str(task["problem_statement"]),
            "-y", "--exit-immediately", "-o", str(Path("trajectory.json").resolve())]  # fmt: skip
    env = {**os.environ, "MSWEA_CONFIGURED": "true", "MSWEA_COST_TRACKING": "ignore_errors",
           "MSWEA_GLOBAL_CONFIG_DIR": str(Path(".mini-swe-agent").resolve()), "LITELLM_LOG": "ERROR"}  # fmt: skip
    done = subprocess.run(argv, cwd=repo, env=env, stdin=subprocess.DEVNULL)
    Path("result.json").write_text(json.dumps({"mini_exit_code": done.returncode}), encoding="utf-8")
    print(f"mini-swe-agent exited with {done.returncode}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
