"""How every `python -m services.X` reads its settings and runs: typer flags with environment fallbacks.

    app = typer_app(__doc__)

    @app.command()
    def main(nats_url: str = typer.Option("nats://127.0.0.1:4222", envvar="NATS_URL", help="...")) -> None:
        run_async(serve(Settings(nats_url=nats_url)))

    if __name__ == "__main__":
        run_command(app, "rollwire x", "python -m services.x")

Each flag names its environment variable (`envvar=`), so `--help` lists both and a flag wins
over the variable. A setting the service cannot use ends the process with one line on stderr and
exit code 2 (`fail`), never a stack trace.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import sys
from collections.abc import Coroutine, Iterator, Mapping, Sequence
from typing import Any, NoReturn, TypeVar

import typer

T = TypeVar("T")


def typer_app(doc: str | None) -> typer.Typer:
    """A single-command typer app whose help is the module docstring's first paragraph."""
    return typer.Typer(
        help=(doc or "").strip().split("\n\n")[0],
        add_completion=False,
        pretty_exceptions_enable=False,
        context_settings={"help_option_names": ["-h", "--help"]},
    )


def parse_command(app: typer.Typer, argv: Sequence[str], env: Mapping[str, str] | None = None, *, prog: str) -> Any:
    """What `app`'s one command returns for the command line `argv`, reading variables from `env`.

    Without `env` the process environment is read. Usage errors raise `typer.TyperException`
    (its `format_message()` is the one line to print); `--help` prints and raises SystemExit.
    """
    command = typer.main.get_command(app)
    with _environment(env):
        result = command.main(args=list(argv), prog_name=prog, standalone_mode=False)
    if isinstance(result, int) and not isinstance(result, bool):
        raise SystemExit(result)  # `--help` (click returns its exit code instead of raising when not standalone)
    return result


def run_command(app: typer.Typer, name: str, prog: str, argv: Sequence[str] | None = None) -> None:
    """Run `app`'s command on the command line (`sys.argv` by default); a usage error is one line, exit 2."""
    try:
        parse_command(app, sys.argv[1:] if argv is None else argv, prog=prog)
    except typer.TyperException as exc:
        fail(name, exc.format_message())


@contextlib.contextmanager
def _environment(env: Mapping[str, str] | None) -> Iterator[None]:
    """The process environment replaced by `env` for the duration (nothing changes for None)."""
    if env is None:
        yield
        return
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def fail(name: str, message: str, code: int = 2) -> NoReturn:
    """Print `name: error: message` on stderr and exit with `code` (a setting or a dependency to fix)."""
    print(f"{name}: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(code)


def run_async(coro: Coroutine[Any, Any, T]) -> T:
    """Run `coro` on uvloop when it is installed (less CPU per message and request), else on asyncio."""
    if importlib.util.find_spec("uvloop"):
        import uvloop

        return uvloop.run(coro)
    return asyncio.run(coro)
