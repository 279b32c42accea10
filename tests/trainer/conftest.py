"""Trainer fixtures: the tiny model and its tokenizer, built once per session into a temp dir."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from transformers import PreTrainedTokenizerFast

from services.common.tinymodel.build import ensure_tiny_model
from services.common.tinymodel.tokenizer import load_tokenizer


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model cache directory of this session (tiny model, warm starts)."""
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def tiny_model_dir(model_cache: Path) -> Path:
    """The default tiny model (seed 0, random weights)."""
    return ensure_tiny_model(model_cache)


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir: Path) -> PreTrainedTokenizerFast:
    """The tiny model's tokenizer, loaded the way the engine loads it."""
    return load_tokenizer(tiny_model_dir)
