"""One `rollwire up` stack shared by the operations tests (helpers in `ops_stack.py`)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from ops_stack import Stack, running_stack


@pytest.fixture(scope="package")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """`rollwire up` with every service on free ports, in the foreground as a user runs it."""
    yield from running_stack(tmp_path_factory)
