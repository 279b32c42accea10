"""The examples' fixtures: one tiny model and one embedded stack shared by every example test."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from services.common.tinymodel.build import ensure_tiny_model
from trainer.clients import ServiceUrls
from trainer.embedded import embedded_stack


@pytest.fixture(scope="session")
def example_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny default model (random weights), built once per session."""
    return ensure_tiny_model(tmp_path_factory.mktemp("example-models"))


@pytest.fixture(scope="session")
def example_stack(example_model: Path) -> Iterator[ServiceUrls]:
    """One embedded stack (nats, Postgres, engine, gateway, projector, controller) for all example runs.

    Its data lives outside pytest's temp root: Postgres runs as another user when tests run as
    root, and a concurrent pytest session resets that root's permissions to owner-only.
    """
    with tempfile.TemporaryDirectory(prefix="rw-examples-") as data:
        with embedded_stack(Path(data), example_model, say=lambda line: None) as urls:
            yield urls
