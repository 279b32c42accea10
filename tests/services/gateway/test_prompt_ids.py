"""A completion's prompt ids, parsed straight from the engine's JSON into int32, equal what the exact
path (decode to Python, validate as `list[int]`) makes of them, and the answer re-encodes unchanged."""

from __future__ import annotations

import random
from typing import Any

import msgspec
import numpy as np
import pytest

from services.gateway.proxy.openai_format import decode_completion, prompt_token_ids

EXACT = msgspec.json.Decoder(dict[str, Any]).decode


def _exact(body: bytes) -> list[int]:
    value = EXACT(body).get("prompt_token_ids")
    try:
        return msgspec.convert(value, list[int]) if isinstance(value, list) else []
    except msgspec.ValidationError:
        return []


@pytest.mark.parametrize(
    ("ids_json", "fast"),
    [
        (b"[1,2,3]", True),
        (b"[ 1 , 2 ,\n3 ]", True),
        (b"[0,2147483647]", True),
        (b"[7]", True),
        (b"[]", False),
        (b"[ ]", False),
        (b"[-1,2]", False),
        (b"[2147483648]", False),
        (b"[18446744073709551616]", False),
        (b"[1.5,2]", False),
        (b"[1e3]", False),
        (b"[true]", False),
        (b"[[1]]", False),
        (b'"12"', False),
        (b"null", False),
    ],
)
def test_prompt_ids_match_the_exact_path(ids_json: bytes, fast: bool) -> None:
    body = b'{"id":"c","prompt_token_ids":' + ids_json + b',"choices":[]}'
    answer = decode_completion(body)
    ids = prompt_token_ids(answer["prompt_token_ids"])
    assert isinstance(ids, np.ndarray) is fast, ids
    if fast:
        assert ids.dtype == np.int32
    assert list(ids) == _exact(body)
    assert EXACT(msgspec.json.encode(answer)) == EXACT(body)  # what the client gets back


def test_a_long_prompt_of_random_ids_round_trips() -> None:
    rng = random.Random(7)
    ids = [rng.randrange(2**31) for _ in range(5000)]
    body = msgspec.json.encode({"choices": [{"index": 0}], "prompt_token_ids": ids, "usage": {"prompt_tokens": 5000}})
    answer = decode_completion(body)
    parsed = prompt_token_ids(answer["prompt_token_ids"])
    assert isinstance(parsed, np.ndarray) and parsed.tolist() == ids
    assert answer["choices"] == [{"index": 0}] and answer["usage"] == {"prompt_tokens": 5000}


def test_an_answer_without_prompt_ids_or_not_an_object() -> None:
    assert prompt_token_ids(decode_completion(b'{"choices":[]}').get("prompt_token_ids")) == []
    with pytest.raises(msgspec.ValidationError):
        decode_completion(b"[1,2]")
    with pytest.raises(msgspec.DecodeError):
        decode_completion(b'{"prompt_token_ids":[1,,2]}')
