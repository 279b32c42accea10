"""Engine fixtures: the tiny model built once into a temp dir, and an engine serving it over real HTTP."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from engine_harness import MAX_MODEL_LEN, SERVED_NAME, EngineHandle
from transformers import PreTrainedTokenizerFast

from services.common.tinymodel.build import build_tiny_model
from services.common.tinymodel.tokenizer import load_tokenizer
from services.engine.background import BackgroundServer
from services.engine.server import create_app


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default tiny model (seed 0), built once for the engine tests."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"), seed=0)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir: Path) -> PreTrainedTokenizerFast:
    """The tiny model's tokenizer, loaded the way the engine loads it."""
    return load_tokenizer(tiny_model_dir)


@pytest.fixture(scope="module")
def engine_server(tiny_model_dir: Path) -> Iterator[EngineHandle]:
    """An engine over the tiny model on a free port (context limit 1024 so overflow tests stay cheap)."""
    app = create_app(tiny_model_dir, served_name=SERVED_NAME, seed=1234, max_model_len=MAX_MODEL_LEN)
    with BackgroundServer(app) as server:
        yield EngineHandle(server, app.state.engine)
