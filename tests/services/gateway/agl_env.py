"""Where Agent Lightning 1.0.2 lives for the comparison test and benchmark: its own venv (Python >= 3.12).

Agent Lightning 1.0 needs Python 3.12 or newer, so it cannot share Rollwire's environment. The
venv is looked up in `ROLLWIRE_AGL_PYTHON` (a Python with `agentlightning==1.0.2` installed) or
in the user cache (`~/.cache/rollwire/agl-1.0.2`); `setup()` creates the latter with the first
Python >= 3.12 it finds (`python3.12`/`python3.13` on PATH, or pyenv's versions).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

AGL_VERSION = "1.0.2"


def venv_dir() -> Path:
    """The cached venv's directory."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "rollwire" / f"agl-{AGL_VERSION}"


def agl_python() -> tuple[Path | None, str]:
    """A Python that has Agent Lightning 1.0.2, or None and the reason there is none."""
    explicit = os.environ.get("ROLLWIRE_AGL_PYTHON")
    candidates = [Path(explicit)] if explicit else [venv_dir() / "bin" / "python"]
    for python in candidates:
        if python.exists():
            probe = subprocess.run([str(python), "-c", "import agentlightning.server.app"], capture_output=True)
            if probe.returncode == 0:
                return python, ""
            return None, f"{python} cannot import agentlightning: {probe.stderr.decode()[-300:]}"
    base = find_python312()
    if base is None:
        return None, "Agent Lightning 1.0.2 needs Python >= 3.12 and none is installed here"
    return None, (
        f"no Agent Lightning {AGL_VERSION} venv at {venv_dir()}; create it with "
        "`python bench/bench_proxy.py --setup-agl` (or set ROLLWIRE_AGL_PYTHON)"
    )


def _runs(python: Path) -> bool:
    """Whether `python` starts (a pyenv shim for a version that is not selected does not)."""
    probe = subprocess.run([str(python), "-c", "import sys; assert sys.version_info >= (3, 12)"], capture_output=True)
    return probe.returncode == 0


def find_python312() -> Path | None:
    """The first Python >= 3.12 interpreter on this machine that actually runs, if any."""
    candidates = [Path(found) for name in ("python3.14", "python3.13", "python3.12") if (found := shutil.which(name))]
    pyenv = Path(os.environ.get("PYENV_ROOT") or Path.home() / ".pyenv") / "versions"
    if pyenv.is_dir():
        for version in sorted(pyenv.iterdir(), reverse=True):
            parts = version.name.split(".")
            if len(parts) >= 2 and parts[0] == "3" and parts[1].isdigit() and int(parts[1]) >= 12:
                candidates.append(version / "bin" / "python")
    return next((python for python in candidates if python.exists() and _runs(python)), None)


def setup() -> Path:
    """Create the cached venv with `agentlightning==1.0.2` (minutes: it downloads from PyPI)."""
    base = find_python312()
    if base is None:
        raise RuntimeError("Agent Lightning 1.0.2 needs Python >= 3.12 and none is installed here")
    target = venv_dir()
    target.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([str(base), "-m", "venv", str(target)], check=True)
    subprocess.run(
        [str(target / "bin" / "pip"), "install", "-q", f"agentlightning=={AGL_VERSION}", "openai"], check=True
    )
    return target / "bin" / "python"
