"""The tiny model built once into a temp dir, and its tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerFast

from services.common.tinymodel.build import build_tiny_model
from services.common.tinymodel.tokenizer import load_tokenizer


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default tiny model (seed 0), built once for these tests."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"), seed=0)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir: Path) -> PreTrainedTokenizerFast:
    """The tiny model's tokenizer, loaded as `load_tokenizer` loads it."""
    return load_tokenizer(tiny_model_dir)
