"""Local agents cannot read the data dir: a uid of their own as root, namespaces without root.

Each test plants a secret in a data dir whose `executions/` holds the agent's workspace, then
runs an agent that looks for it by path, by walking up, through /proc, and in its environment.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.controller.backends import local_isolation
from services.controller.backends.base import ExecutionKey, LaunchSpec
from services.controller.backends.local import LocalBackend

SNOOP = """
import glob, json, os, pathlib, sys
data = pathlib.Path(sys.argv[1])
seen = []
for path in [data / "admin_token", *(pathlib.Path("../" * n) / "admin_token" for n in range(1, 8))]:
    try:
        seen.append(path.read_text())
    except OSError:
        pass
for environ in glob.glob("/proc/[0-9]*/environ") + glob.glob(f"/proc/[0-9]*/root{data}/admin_token"):
    try:
        seen.append(pathlib.Path(environ).read_bytes().decode(errors="replace"))
    except OSError:
        pass
pathlib.Path("found.json").write_text(json.dumps({
    "secret": any("s3cret" in text for text in seen),
    "input": json.loads(pathlib.Path(os.environ["ROLLWIRE_INPUT_FILE"]).read_text()),
    "uid": os.getuid(),
}))
"""


@pytest.fixture
def data_dir() -> Iterator[Path]:
    """A data dir with a secret, outside pytest's 0700 base (isolated agents must traverse to it)."""
    base = Path(tempfile.mkdtemp(prefix="rollwire-iso-"))
    data = base / "data"
    data.mkdir(mode=0o700)
    (data / "admin_token").write_text("s3cret")
    (data / "admin_token").chmod(0o600)
    try:
        yield data
    finally:
        shutil.rmtree(base, ignore_errors=True)


async def _run_snoop(data: Path, isolation: str) -> dict[str, object]:
    backend = LocalBackend(data / "executions", isolation=isolation, hidden=(data,), poll_s=0.1)
    key = ExecutionKey("run1", "ro1", "at1")
    spec = LaunchSpec(
        key=key, env={"ROLLWIRE_TOKEN": "t"}, input_json='{"q": 1}',
        timeout_s=30, command=[sys.executable, "-c", SNOOP, str(data)],
    )  # fmt: skip
    try:
        await backend.launch(spec)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            states = {s.key: s for s in await backend.list()}
            if states[key].terminal:
                break
            await asyncio.sleep(0.1)
        assert states[key].phase == "succeeded", (states[key], (backend.directory(key) / "stderr.log").read_text())
        return json.loads((backend.directory(key) / "workspace" / "found.json").read_text())  # type: ignore[no-any-return]
    finally:
        await backend.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="isolation 'user' runs agents as other users: root only")
def test_as_root_an_agent_runs_as_its_own_user_and_cannot_read_the_data_dir(data_dir: Path) -> None:
    found = asyncio.run(_run_snoop(data_dir, "user"))
    assert found["uid"] >= local_isolation.AGENT_UID_BASE  # type: ignore[operator]
    assert found["input"] == {"q": 1}  # its own input stays readable
    assert found["secret"] is False
    # without isolation, the same agent reads it (what every agent could do before)
    shutil.rmtree(data_dir / "executions")
    assert asyncio.run(_run_snoop(data_dir, "none"))["secret"] is True


def _as_nobody() -> list[str]:
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("setpriv is needed to run the sandbox as an unprivileged user")
    return [setpriv, "--reuid", "65534", "--regid", "65534", "--clear-groups"]


def test_the_namespace_sandbox_hides_the_data_dir_and_other_processes(data_dir: Path) -> None:
    """What a user who is not root gets (run here as `nobody` when the tests run as root)."""
    prefix = _as_nobody()
    workspace = data_dir / "executions" / "ws"
    workspace.mkdir(parents=True)
    if prefix:
        for path in (data_dir.parent, data_dir):
            shutil.chown(path, 65534, 65534)
        for path in (data_dir / "admin_token", data_dir / "executions", workspace):
            shutil.chown(path, 65534, 65534)
    if subprocess.run([*prefix, sys.executable, "-I", "-S", str(local_isolation.SANDBOX), "--probe"]).returncode:
        pytest.skip("this kernel refuses unprivileged user namespaces")
    # a process of the same user holding a secret in its environment, as a service does
    neighbour = subprocess.Popen([*prefix, "sleep", "60"], env={"PATH": os.environ["PATH"], "X": "s3cret"})
    try:
        config = {"hide": [str(data_dir)], "keep": [str(workspace)], "cwd": str(workspace)}
        code = "import json,os; print(json.dumps([os.getpid(), len([p for p in os.listdir('/proc') if p.isdigit()])]))"
        snoop = SNOOP.replace('json.loads(pathlib.Path(os.environ["ROLLWIRE_INPUT_FILE"]).read_text())', "None")
        result = subprocess.run(
            [*prefix, sys.executable, "-I", "-S", str(local_isolation.SANDBOX), json.dumps(config),
             "sh", "-c", f'{sys.executable} -c "$0" {data_dir} && {sys.executable} -c "$1"; exit 7', snoop, code],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    finally:
        neighbour.kill()
    assert result.returncode == 7, result.stderr  # the command's own exit status
    assert json.loads((workspace / "found.json").read_text())["secret"] is False
    pid, processes = json.loads(result.stdout.strip().splitlines()[-1])
    assert processes <= 4 and pid < 10  # its own PID namespace: /proc shows the sandbox only


def test_an_agent_in_namespace_mode_finds_an_empty_data_dir(data_dir: Path) -> None:
    """The backend's and the supervisor's wiring of the sandbox (as an unprivileged user in real use)."""
    if not local_isolation.namespaces_work():
        pytest.skip("this kernel refuses user namespaces")
    found = asyncio.run(_run_snoop(data_dir, "namespace"))
    assert found["input"] == {"q": 1} and found["secret"] is False
