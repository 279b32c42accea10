"""One `rollwire up` stack shared by the operations tests (helpers in `ops_stack.py`)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from ops_stack import OwnTemp, Stack, running_stack


@pytest.fixture(scope="package")
def stack() -> Iterator[Stack]:
    """`rollwire up` with every service on free ports, in the foreground as a user runs it (agent
    isolation `auto`, as a user gets it; its data dir outside pytest's, see `OwnTemp`)."""
    own = OwnTemp()
    try:
        yield from running_stack(own)
    finally:
        shutil.rmtree(own.base, ignore_errors=True)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The first test to use the stack waits for `rollwire up`, which starts vLLM (minutes on a small
    loaded CPU): give this directory's tests that use it 15 minutes."""
    here = Path(__file__).parent
    for item in items:
        uses_stack = "stack" in getattr(item, "fixturenames", ())
        if here in Path(str(item.fspath)).parents and uses_stack and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(900))
