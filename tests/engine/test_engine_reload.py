"""Swapping weights in a running engine: versions, outputs, in-flight requests, refused reloads."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from engine_harness import EngineHandle

from services.common.tinymodel.build import build_tiny_model
from services.engine.server import WEIGHTS_VERSION_HEADER

HELLO: list[Any] = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def other_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with other weights (seed 1), same tokenizer."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-seed1"), seed=1)


def _greedy(url: str, max_tokens: int) -> tuple[list[int], int, str]:
    body = {"messages": HELLO, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    response = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    response.raise_for_status()
    data: dict[str, Any] = response.json()
    return data["choices"][0]["token_ids"], data["weights_version"], response.headers[WEIGHTS_VERSION_HEADER]


def _reload(url: str, path: Path, version: int) -> httpx.Response:
    return httpx.post(url + "/reload", json={"path": str(path), "weights_version": version}, timeout=60)


def test_reload_switches_weights_and_version_without_touching_running_requests(
    engine_server: EngineHandle, tiny_model_dir: Path, other_model_dir: Path
) -> None:
    url = engine_server.url
    before, version, header = _greedy(url, 20)
    assert (version, header) == (0, "0")

    response = _reload(url, other_model_dir, 1)
    assert response.status_code == 200, response.text
    assert response.json()["weights_version"] == 1 and response.headers[WEIGHTS_VERSION_HEADER] == "1"
    models = httpx.get(url + "/v1/models").json()["data"]
    assert models[0]["weights_version"] == 1 and models[0]["root"] == str(other_model_dir)
    reference, version, header = _greedy(url, 300)
    assert (version, header) == (1, "1")
    assert reference[:20] != before

    body = {"messages": HELLO, "max_tokens": 300, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    body["stream"] = True
    streamed: list[int] = []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as stream:
        assert stream.headers[WEIGHTS_VERSION_HEADER] == "1"
        lines = stream.iter_lines()
        first = next(line for line in lines if '"token_ids"' in line)  # generation is under way
        assert _reload(url, tiny_model_dir, 2).status_code == 200
        after, version, _ = _greedy(url, 20)  # a request accepted after the reload runs on the new weights
        assert (after, version) == (before, 2)
        for event in [first, *lines]:
            if event.startswith("data: {"):
                for choice in json.loads(event[6:])["choices"]:
                    streamed.extend(choice.get("token_ids", []))
    assert streamed == reference  # the in-flight stream finished on the weights it started with


def test_bad_reloads_are_refused_and_keep_the_current_weights(engine_server: EngineHandle, tmp_path: Path) -> None:
    url = engine_server.url
    version = httpx.get(url + "/health").json()["weights_version"]
    missing = _reload(url, tmp_path / "nothing-here", 9)
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "path"
    other_vocab = build_tiny_model(tmp_path / "small-vocab", seed=0, vocab_size=1024)
    mismatch = _reload(url, other_vocab, 9)
    assert mismatch.status_code == 400 and "vocab_size" in mismatch.json()["error"]["message"]
    malformed = httpx.post(url + "/reload", json={"path": str(tmp_path)}, timeout=10)
    assert malformed.status_code == 400 and malformed.json()["error"]["param"] == "weights_version"
    assert httpx.get(url + "/health").json()["weights_version"] == version
