"""A completion's prompt ids, parsed straight from the engine's JSON into int32 (and from the attempt's
last parse when the prompt extends it), equal what the exact path (decode to Python, validate as
`list[int]`) makes of them, and the answer re-encodes unchanged."""

from __future__ import annotations

import json
import random
from typing import Any

import msgspec
import numpy as np
import pytest

from services.gateway.proxy.openai_format import decode_completion
from services.gateway.proxy.promptids import PromptIdParser, cut_prompt_ids, prompt_token_ids
from services.gateway.proxy.tokenin import decode_completion as decode_token_in

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
        decode_completion(b'{"prompt_token_ids":[1, ,2]}')


@pytest.mark.parametrize(
    ("body", "cut"),
    [
        (b'{"id":"c","prompt_token_ids":[5,60,700],"choices":[]}', True),
        (b'{"choices":[{"index":0}],"usage":{"prompt_tokens":2},"prompt_token_ids":[0,10]}', True),
        (b'{"prompt_token_ids":[1, 2]}', False),  # whitespace (not vLLM's JSON): decoded whole
        (b'{"prompt_token_ids":[01,2]}', True),  # not JSON: refused when the ids are parsed
        (b'{"prompt_token_ids":[0,2,00]}', True),
        (b'{"prompt_token_ids":[1,,2]}', True),
        (b'{"prompt_token_ids":[,1]}', True),
        (b'{"prompt_token_ids":[1,2],}', True),  # cut, but the rest is not JSON: refused by the whole decode
        (b'{"prompt_token_ids":[1,2,],"x":1}', True),
        (b'{"prompt_token_ids":[-1]}', True),  # JSON, not an id: read exactly, refused by the recording
        (b'{"prompt_token_ids":[1,{}]}', True),  # JSON, not ids: none recorded, as before
        (b'{"prompt_token_ids":[1,"2"]}', False),
        (b'{"prompt_token_ids":[[1],[2]]}', False),
        (b'{"prompt_token_ids":[1,2],"choices":[{"prompt_token_ids":[3,4]}]}', True),  # the nested one: whole
        (b'{"prompt_token_ids":[1,2],"note":"\\"prompt_token_ids\\":[9]"}', True),  # quoted: not a key
        (b'{"choices":[{"message":{"content":"say \\"prompt_token_ids\\":[9,9]"}}]}', False),
        (b'{"prompt_token_ids":[1,2],"prompt_token_ids":[3]}', True),  # repeated: the last, as decoders take
    ],
)
def test_an_answer_cut_around_its_ids_decodes_as_the_whole(body: bytes, cut: bool) -> None:
    """The ids are cut out of the answer only as a top-level array without strings, arrays or whitespace;
    either way the answer and its ids read as the whole JSON does, or are refused as the whole is."""
    assert (cut_prompt_ids(body) is not None) is cut
    try:
        whole = EXACT(body)
    except msgspec.DecodeError:
        with pytest.raises(msgspec.DecodeError):
            prompt_token_ids(decode_completion(body).get("prompt_token_ids"))
        with pytest.raises(msgspec.DecodeError):
            PromptIdParser().parse(("r", "ro", "a"), decode_completion(body).get("prompt_token_ids"))
        return
    answer = decode_completion(body)
    assert isinstance(answer.get("prompt_token_ids"), msgspec.Raw) == ("prompt_token_ids" in whole)
    assert EXACT(msgspec.json.encode(answer)) == whole
    assert list(prompt_token_ids(answer.get("prompt_token_ids"))) == _exact(body)


def test_a_vllm_answer_is_decoded_without_reading_its_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's compact answer takes the cut: the decoder that would skip over the ids is not called."""
    from services.gateway.proxy import openai_format

    def unused(content: bytes) -> None:
        raise AssertionError("the whole answer was decoded")

    monkeypatch.setattr(openai_format, "_decode_fields", unused)
    ids = list(range(3, 4000, 7))
    body = msgspec.json.encode({"id": "c", "choices": [{"index": 0}], "usage": None, "prompt_token_ids": ids})
    assert list(prompt_token_ids(decode_completion(body)["prompt_token_ids"])) == ids


def test_a_nested_or_quoted_key_is_not_taken_for_the_ids() -> None:
    nested = b'{"prompt_token_ids":[1,2],"choices":[{"prompt_token_ids":[3,4]}]}'
    assert cut_prompt_ids(nested) is not None  # found, but the marker lands in the choice: decoded whole
    assert list(prompt_token_ids(decode_completion(nested)["prompt_token_ids"])) == [1, 2]
    quoted = b'{"choices":[{"message":{"content":""prompt_token_ids":[9,9]"}}],"prompt_token_ids":[4]}'
    rest, ids = cut_prompt_ids(quoted) or (b"", b"")
    assert ids == b"[4]" and b"[9,9]" in rest


def _raw(ids_json: bytes) -> msgspec.Raw:
    return decode_completion(b'{"prompt_token_ids":' + ids_json + b"}")["prompt_token_ids"]


@pytest.mark.parametrize(
    ("first", "then"),
    [
        (b"[1,2,3]", b"[1,2,3]"),  # the same prompt again
        (b"[1,2,3]", b"[1,2,3,4,5]"),  # the next turn
        (b"[1, 2 ]", b"[1, 2 ,7]"),  # spaced
        (b"[1,2,3]", b"[1,2,34]"),  # not an extension: 3 became 34
        (b"[1,2,3]", b"[1,2]"),  # shorter
        (b"[1,2,3]", b"[1,2,3,-4]"),  # extends with an id outside the contract
        (b"[1,2,3]", b"[1,2,3,2147483648]"),
        (b"[1,2,3]", b"[1,2,3,4.5]"),
        (b"[1,2,3]", b"[9,2,3,4]"),
        (b"[5]", b"[]"),
    ],
)
def test_the_attempts_last_parse_is_reused_only_when_the_ids_are_the_same(first: bytes, then: bytes) -> None:
    parser = PromptIdParser()
    key = ("run", "rollout", "attempt")
    assert list(parser.parse(key, _raw(first))) == list(prompt_token_ids(_raw(first)))
    again = parser.parse(key, _raw(then))
    exact = prompt_token_ids(_raw(then))
    assert type(again) is type(exact) and list(again) == list(exact)


def test_attempts_do_not_share_a_parse_and_a_kept_parse_is_read_only() -> None:
    parser = PromptIdParser()
    first = parser.parse(("r", "x", "a"), _raw(b"[1,2,3]"))
    other = parser.parse(("r", "x", "b"), _raw(b"[1,2,3,4]"))
    assert list(other) == [1, 2, 3, 4]
    assert isinstance(first, np.ndarray) and not first.flags.writeable
    assert list(parser.parse(("r", "x", "a"), _raw(b"[1,2,3,4]"))) == [1, 2, 3, 4]
    assert list(parser.parse(("r", "x", "a"), [8, 9])) == [8, 9]  # a list (token-in answers) as it is


def test_a_long_growing_conversation_parses_to_the_exact_ids() -> None:
    rng = random.Random(3)
    parser = PromptIdParser(max_bytes=1 << 20)
    ids: list[int] = []
    for _turn in range(30):
        ids += [rng.randrange(2**31) for _ in range(rng.randrange(1, 400))]
        got = parser.parse(("r", "x", "a"), _raw(msgspec.json.encode(ids)))
        assert isinstance(got, np.ndarray) and got.tolist() == ids


def test_a_token_in_completions_choice_ids_stay_raw() -> None:
    body = b'{"id":"cmpl","choices":[{"index":0,"text":"hi","prompt_token_ids":[4,5,6],"token_ids":[7]}],"usage":{}}'
    assert decode_completion(body)["choices"][0]["prompt_token_ids"] == [4, 5, 6]
    answer = decode_token_in(body)
    ids = answer["choices"][0]["prompt_token_ids"]
    assert isinstance(ids, msgspec.Raw) and list(prompt_token_ids(ids)) == [4, 5, 6]
    assert answer["choices"][0]["token_ids"] == [7] and answer["id"] == "cmpl" and answer["usage"] == {}
    two = decode_token_in(b'{"choices":[{"text":"x"},{"prompt_token_ids":null},{"prompt_token_ids":[1]}]}')
    assert [c["prompt_token_ids"] for c in two["choices"][:2]] == [None, None]
    assert decode_token_in(b'{"choices":null}') == {"choices": None}  # not vLLM's shape: as it is
    assert decode_token_in(b'{"choices":[1,"x"]}') == {"choices": [1, "x"]}
    with pytest.raises(msgspec.ValidationError):
        decode_token_in(b"[1]")


def test_array_prompts_of_many_calls_in_flight_are_all_remembered() -> None:
    """600 calls compacted with their prompt as an array (their events hold no list) before any is
    acknowledged, as at 600 calls in flight: each is kept for the next call of its attempt to reference."""
    from schemas import ModelRequestRecorded
    from services.common.eventstore import Appended
    from services.gateway.proxy.recording import CallChains

    chains = CallChains()
    calls = []
    for i in range(600):
        prompt = np.arange(100, 164, dtype=np.int32) + i
        event = ModelRequestRecorded(run_id="r", rollout_id=f"x{i}", attempt_id="a", call_id=f"c{i}",
                                     event_id=f"c{i}-0", response_ids=[7, 8], logprobs=[-0.5, -0.5])  # fmt: skip
        (stored,) = chains.compact([event], prompt)
        assert stored.prompt_ref is msgspec.UNSET and stored.packed  # the first of its attempt: in full
        calls.append((event, prompt))
    for seq, (event, prompt) in enumerate(calls, 1):
        chains.remember([event], [Appended(seq=seq)])
        (kept,) = chains.recent(("r", event.rollout_id, "a")) or [None]
        assert kept is not None and kept.tokens.tolist() == [*prompt.tolist(), 7, 8]


@pytest.mark.parametrize("extension", [b"[1,2,,3]", b"[1,2,03]", b"[1,2,3,]"])
def test_an_extension_that_is_not_json_is_refused(extension: bytes) -> None:
    parser, key = PromptIdParser(), ("r", "ro", "a")
    assert list(parser.parse(key, _raw(b"[1,2]"))) == [1, 2]
    with pytest.raises(msgspec.DecodeError):
        parser.parse(key, decode_completion(b'{"prompt_token_ids":' + extension + b"}")["prompt_token_ids"])


def _random_value(rng: random.Random, depth: int) -> Any:
    kind = rng.randrange(7 if depth < 3 else 4)
    if kind == 0:
        return rng.randrange(-5, 2**33)
    if kind == 1:
        return rng.choice(['"prompt_token_ids":[1,2]', "]", "[", "a\\]b", '{"x":[3]}', "plain"])
    if kind == 2:
        return rng.choice([None, True, 1.5])
    if kind == 3:
        return [rng.randrange(0, 100) for _ in range(rng.randrange(0, 4))]
    if kind == 4:
        return [_random_value(rng, depth + 1) for _ in range(rng.randrange(0, 3))]
    keys = ["prompt_token_ids", "choices", "x", "message"]
    return {rng.choice(keys): _random_value(rng, depth + 1) for _ in range(rng.randrange(0, 3))}


def test_random_answers_read_as_their_whole_json() -> None:
    """Answers with the ids' key nested, quoted, repeated or missing, compact or spaced: the cut never
    changes what is read, or what the client gets back."""
    rng = random.Random(33)
    for _ in range(600):
        answer = {key: _random_value(rng, 0) for key in rng.sample(["id", "choices", "usage", "x"], 2)}
        if rng.random() < 0.8:
            answer["prompt_token_ids"] = [rng.randrange(0, 2**31) for _ in range(rng.randrange(1, 20))]
        if rng.random() < 0.3:
            answer["z"] = _random_value(rng, 0)
        body = msgspec.json.encode(answer) if rng.random() < 0.8 else json.dumps(answer).encode()
        decoded = decode_completion(body)
        assert EXACT(msgspec.json.encode(decoded)) == EXACT(body), body
        assert list(prompt_token_ids(decoded.get("prompt_token_ids"))) == _exact(body), body


CHOICE_FIELDS = ("index", "text", "finish_reason", "stop_reason", "token_ids", "logprobs")


def _token_in_answer(rng: random.Random) -> dict[str, Any]:
    """A completion as vLLM answers it, or with its choices' ids nested, quoted, null, missing or not ids."""
    choices = []
    for index in range(rng.randrange(0, 4)):
        choice: dict[str, Any] = {"index": index, "text": rng.choice(["hi", '"prompt_token_ids":[5]', "]"])}
        ids = rng.choice([[rng.randrange(0, 2**31) for _ in range(rng.randrange(1, 30))], None, [1, "2"], [-1]])
        if ids is not None or rng.random() < 0.5:
            choice["prompt_token_ids"] = ids
        choice["token_ids"] = [rng.randrange(0, 100) for _ in range(rng.randrange(0, 4))]
        if rng.random() < 0.3:
            choice["logprobs"] = {"prompt_token_ids": [1, 2], "token_logprobs": [-0.5]}  # a nested key
        if rng.random() < 0.2:
            choice["x"] = _random_value(rng, 1)
        choices.append(choice)
    answer: dict[str, Any] = {"id": "cmpl-1", "model": "m", "choices": choices, "usage": {"prompt_tokens": 3}}
    if rng.random() < 0.2:
        answer["z"] = _random_value(rng, 0)
    return answer


def test_random_token_in_answers_read_as_their_whole_json() -> None:
    """A token-in completion's choices read the same whether its last ids were cut out or not: each
    field as the whole JSON has it, each choice's ids raw JSON of the same value (None when null or absent)."""
    rng = random.Random(34)
    cuts = 0
    for _ in range(600):
        answer = _token_in_answer(rng)
        body = msgspec.json.encode(answer) if rng.random() < 0.8 else json.dumps(answer).encode()
        cuts += cut_prompt_ids(body) is not None
        decoded = decode_token_in(body)
        whole = EXACT(body)
        assert [decoded.get(key) for key in ("id", "model", "usage")] == [
            whole.get(key) for key in ("id", "model", "usage")
        ]
        assert len(decoded["choices"]) == len(whole["choices"]), body
        for got, sent in zip(decoded["choices"], whole["choices"], strict=True):
            assert [got[field] for field in CHOICE_FIELDS] == [sent.get(field) for field in CHOICE_FIELDS], body
            ids = got["prompt_token_ids"]
            assert (None if ids is None else msgspec.json.decode(ids)) == sent.get("prompt_token_ids"), body
    assert cuts > 200  # many were cut (the rest: spaced JSON, ids not plain, no choice with ids)


def test_a_vllm_token_in_answer_is_decoded_without_reading_its_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    """The one choice's ids of a compact completion are cut out: the answer is decoded once, without them."""
    from services.gateway.proxy import tokenin

    decoded: list[bytes] = []
    decode = tokenin._decode_completion
    monkeypatch.setattr(tokenin, "_decode_completion", lambda content: decoded.append(content) or decode(content))
    ids = list(range(3, 40000, 7))
    choice = {"index": 0, "text": "ok", "prompt_token_ids": ids, "token_ids": [1], "logprobs": None}
    answer = decode_token_in(msgspec.json.encode({"id": "cmpl-1", "choices": [choice], "usage": None}))
    assert len(decoded) == 1 and len(decoded[0]) < 200
    assert list(prompt_token_ids(answer["choices"][0]["prompt_token_ids"])) == ids
