"""The architecture as an import check: services meet only through events and HTTP.

An AST scan of every module (function-level imports included) fails when:
- a deployable service (`services/{gateway,projector,controller}`) imports another one's modules
  (they share only `schemas`, `services.common` and `services.agentkit`);
- the shared library (`services/common`) imports a service, or the agent-side helper (`services/agentkit`)
  imports anything of the project (it is copied next to an agent on its own);
- the contract (`schemas`) imports `services` or `trainer`;
- the trainer's pure core (`trainer/core`) imports an I/O library (NATS, Postgres, HTTP, sockets) or `services`;
- the trainer's modules import each other in a circle (`import_circles`).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ("gateway", "projector", "controller")
IO_LIBRARIES = (
    "nats", "asyncpg", "psycopg", "httpx", "requests", "aiohttp", "urllib.request", "http.client", "socket",
    "fastapi", "starlette", "uvicorn", "services",
)  # fmt: skip


def imports(path: Path, root: Path = ROOT) -> list[tuple[int, str]]:
    """(line, module) of every import in a file, relative imports resolved against its package."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = ".".join(path.relative_to(root).with_suffix("").parts[:-1])
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parent = ".".join(parts[: len(parts) - node.level + 1])
                base = f"{parent}.{base}" if base else parent
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def violations(root: Path = ROOT) -> list[str]:
    """Every import that breaks the architecture, as `path:line imports module (why)`."""
    rules: list[tuple[str, tuple[str, ...], str]] = []
    for service in SERVICES:
        others = tuple(f"services.{s}" for s in SERVICES if s != service)
        rules.append((f"services/{service}", others, "a service imports another service's modules"))
    shared_forbidden = tuple(f"services.{s}" for s in (*SERVICES, "devstack", "tools"))
    rules.append(("services/common", (*shared_forbidden, "services.agentkit"), "the shared library imports a service"))
    rules.append(
        ("services/agentkit", (*shared_forbidden, "services.common"), "the agent-side helper imports beyond httpx")
    )
    rules.append(("schemas", ("services", "trainer"), "the contract imports services or the trainer"))
    rules.append(("trainer/core", IO_LIBRARIES, "the trainer's pure core imports I/O"))
    out: list[str] = []
    for folder, forbidden, why in rules:
        for path in sorted((root / folder).rglob("*.py")):
            flagged: set[int] = set()  # one finding per import statement
            for line, module in imports(path, root):
                if line not in flagged and any(_within(module, prefix) for prefix in forbidden):
                    flagged.add(line)
                    out.append(f"{path.relative_to(root)}:{line} imports {module} ({why})")
    return out


def test_services_meet_only_through_events_and_http() -> None:
    found = violations()
    assert not found, "\n".join(found)


@pytest.mark.parametrize(
    ("path", "source", "why"),
    [
        ("services/gateway/bad.py", "from services.projector.reader import PostgresRolloutReader\n", "another service"),
        ("services/projector/bad.py", "def f():\n    import services.gateway.api.views\n", "another service"),
        ("services/controller/bad.py", "from ..gateway import app\n", "another service"),
        ("services/common/bad.py", "from services.gateway import app\n", "shared library"),
        ("schemas/bad.py", "import trainer.core.merge\n", "contract"),
        ("trainer/core/bad.py", "import httpx\n", "pure core"),
        ("trainer/core/bad2.py", "from nats.js import api\n", "pure core"),
    ],
)
def test_the_check_catches_each_kind_of_violation(tmp_path: Path, path: str, source: str, why: str) -> None:
    target = tmp_path / path
    target.parent.mkdir(parents=True)
    target.write_text(source)
    found = violations(tmp_path)
    assert len(found) == 1 and found[0].startswith(path), found
    assert why.split()[-1] in found[0]


def _module_names(root: Path, folder: str) -> dict[str, Path]:
    """Dotted name -> file of every module under `folder` (a package by its own name)."""
    names: dict[str, Path] = {}
    for path in (root / folder).rglob("*.py"):
        parts = path.relative_to(root).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def import_circles(root: Path = ROOT, folder: str = "trainer") -> list[list[str]]:
    """Every set of modules under `folder` that import each other in a circle (function-level and
    TYPE_CHECKING imports included). An import names the most specific module it reaches, so a
    package's `__init__` re-exporting its modules makes no circle with them."""
    modules = _module_names(root, folder)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for _, imported in imports(path, root):
            while imported and imported not in modules:
                imported = imported.rpartition(".")[0]
            if imported and imported != name:
                graph[name].add(imported)
    reaches = {name: _reachable(graph, name) for name in graph}
    circles = {frozenset(n for n in reaches[name] if name in reaches[n]) for name in graph if name in reaches[name]}
    return sorted(sorted(c) for c in circles)


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    """The modules `start` imports, directly or through others (itself only when in a circle)."""
    seen: set[str] = set()
    todo = list(graph[start])
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo += graph[name]
    return seen


def test_the_trainer_has_no_import_circles() -> None:
    assert import_circles() == []


def test_the_circle_check_catches_a_circle(tmp_path: Path) -> None:
    files = {
        "trainer/__init__.py": "",
        "trainer/a.py": "from trainer.b import f\n",
        "trainer/b.py": "def f():\n    from trainer import a\n",
        "trainer/pkg/__init__.py": "from trainer.pkg.c import g\n",
        "trainer/pkg/c.py": "import trainer.b\n\ndef g(): ...\n",
    }
    for path, source in files.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(source)
    assert import_circles(tmp_path) == [["trainer.a", "trainer.b"]]
