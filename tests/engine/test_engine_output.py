"""Tool-call parsing and the per-choice output builder (text, stops, held-back text, stream parity)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from transformers import PreTrainedTokenizerFast

from services.common.tinymodel.tokenizer import TokenTable
from services.common.toolcalls import parse_tool_calls
from services.engine.output import ChoiceBuilder, TokenDelta
from services.engine.protocol import ChatCompletion as EngineCompletion
from services.engine.protocol import ChatCompletionChunk as EngineChunk
from services.engine.protocol import ChatCompletionRequest, Usage
from services.engine.responses import chunk_choice, encode, final_choice
from services.engine.sampling import SamplingParams

EOS = 2  # <|im_end|> in the tiny tokenizer


def test_parse_single_call_with_content_before() -> None:
    parsed = parse_tool_calls(
        'Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    )
    assert parsed.content == "Checking."
    assert len(parsed.tool_calls) == 1
    call = parsed.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Oslo"}


def test_parse_several_calls_unclosed_last_and_string_arguments() -> None:
    text = (
        '<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
        '<tool_call>\n{"name": "b", "arguments": "{\\"y\\": [2]}"}\n</tool_call>\n'
        '<tool_call>{"name": "c"}'
    )
    parsed = parse_tool_calls(text)
    assert parsed.content is None
    assert [c.function.name for c in parsed.tool_calls] == ["a", "b", "c"]
    assert [json.loads(c.function.arguments) for c in parsed.tool_calls] == [{"x": 1}, {"y": [2]}, {}]
    assert len({c.id for c in parsed.tool_calls}) == 3


@pytest.mark.parametrize(
    "text",
    [
        "<tool_call>not json</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',
        '<tool_call>{"name": 3, "arguments": {}}</tool_call>',
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
        '<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{"name": </tool_call>',
    ],
)
def test_unparsable_tool_call_text_stays_content(text: str) -> None:
    parsed = parse_tool_calls(text)
    assert parsed.tool_calls == ()
    assert parsed.content == text


def test_text_without_tool_calls() -> None:
    assert parse_tool_calls("hello").content == "hello"
    assert parse_tool_calls("").content is None


@pytest.fixture(scope="module")
def table(tiny_tokenizer: PreTrainedTokenizerFast) -> TokenTable:
    """Bytes of every tiny-model token."""
    return TokenTable.build(tiny_tokenizer, len(tiny_tokenizer))


def _builder(
    table: TokenTable, stop: tuple[str, ...] = (), tools: bool = False, max_tokens: int = 10_000
) -> ChoiceBuilder:
    params = SamplingParams(max_tokens=max_tokens, stop=stop)
    return ChoiceBuilder(0, table, params, frozenset({EOS}), parse_tools=tools, want_logprobs=True)


def _feed(builder: ChoiceBuilder, ids: list[int]) -> list[TokenDelta]:
    deltas = []
    for token_id in ids:
        deltas.append(builder.add(token_id, -1.0, [(token_id, -1.0)]))
        if builder.finished:
            break
    return deltas


def test_tool_call_output_streams_the_same_as_it_completes(
    tiny_tokenizer: PreTrainedTokenizerFast, table: TokenTable
) -> None:
    text = 'Let me look.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lima"}}\n</tool_call>'
    ids = [*tiny_tokenizer.encode(text, add_special_tokens=False), EOS]
    builder = _builder(table, tools=True)
    deltas = _feed(builder, ids)
    assert builder.finish_reason == "tool_calls"
    assert builder.token_ids == ids  # the EOS token is part of the sampled output
    assert "".join(d.content for d in deltas) == "Let me look." == builder.content
    assert deltas[-1].tool_calls == builder.tool_calls and len(builder.tool_calls) == 1
    assert all(not d.tool_calls for d in deltas[:-1])

    request = ChatCompletionRequest(messages=[], logprobs=True, return_token_ids=True)
    completion = EngineCompletion(
        id="chatcmpl-x",
        created=0,
        model="m",
        choices=[final_choice(builder, request)],
        usage=Usage(1, len(ids), 1 + len(ids)),
        weights_version=3,
        prompt_token_ids=[1],
    )
    parsed = ChatCompletion.model_validate_json(encode(completion))
    message = parsed.choices[0].message
    assert parsed.choices[0].finish_reason == "tool_calls"
    assert message.tool_calls is not None and message.tool_calls[0].type == "function"
    assert message.tool_calls[0].function.name == "get_weather"
    assert parsed.choices[0].model_extra == {"stop_reason": None, "token_ids": ids}
    assert parsed.choices[0].logprobs is not None and len(parsed.choices[0].logprobs.content or []) == len(ids)
    chunks = [EngineChunk(id="c", created=0, model="m", choices=[chunk_choice(d, request)]) for d in deltas]
    streamed = [ChatCompletionChunk.model_validate_json(encode(c)) for c in chunks]
    assert [t for c in streamed for t in (c.choices[0].model_extra or {})["token_ids"]] == ids
    calls = streamed[-1].choices[0].delta.tool_calls
    assert calls is not None and calls[0].function is not None and calls[0].function.name == "get_weather"


def test_unparsable_tool_call_is_released_as_content_at_the_end(
    tiny_tokenizer: PreTrainedTokenizerFast, table: TokenTable
) -> None:
    text = "Hi <tool_call> oops"
    builder = _builder(table, tools=True)
    deltas = _feed(builder, [*tiny_tokenizer.encode(text, add_special_tokens=False), EOS])
    assert builder.finish_reason == "stop"
    assert "".join(d.content for d in deltas[:-1]) == "Hi "  # held back while the block could be a call
    assert "".join(d.content for d in deltas) == text == builder.content


def test_stop_string_cuts_text_keeps_tokens_and_never_leaks(
    tiny_tokenizer: PreTrainedTokenizerFast, table: TokenTable
) -> None:
    ids = tiny_tokenizer.encode("The answer is 42. STOP here and more", add_special_tokens=False)
    builder = _builder(table, stop=("STOP",))
    deltas = _feed(builder, ids)
    assert builder.finish_reason == "stop" and builder.stop_reason == "STOP"
    assert builder.content == "The answer is 42. "
    assert "".join(d.content for d in deltas) == builder.content
    assert str(tiny_tokenizer.decode(builder.token_ids)).startswith("The answer is 42. STOP")


def test_max_tokens_finishes_with_length(tiny_tokenizer: PreTrainedTokenizerFast, table: TokenTable) -> None:
    builder = _builder(table, max_tokens=3)
    deltas = _feed(builder, tiny_tokenizer.encode("one two three four five", add_special_tokens=False))
    assert len(deltas) == 3 and builder.finish_reason == "length"
    assert deltas[-1].finish_reason == "length"


@settings(max_examples=100, deadline=None, derandomize=True)
@given(
    ids=st.lists(st.integers(min_value=0, max_value=2047), min_size=1, max_size=40),
    stop_from=st.integers(min_value=0, max_value=200),
    stop_len=st.integers(min_value=0, max_value=4),
    tools=st.booleans(),
)
def test_stream_deltas_always_add_up_to_the_final_content(
    tiny_tokenizer: PreTrainedTokenizerFast,
    table: TokenTable,
    ids: list[int],
    stop_from: int,
    stop_len: int,
    tools: bool,
) -> None:
    plain = str(tiny_tokenizer.decode(ids, skip_special_tokens=True))
    stop = plain[stop_from : stop_from + stop_len]
    builder = _builder(table, stop=(stop,) if stop else (), tools=tools, max_tokens=len(ids))
    deltas = _feed(builder, ids)
    assert builder.finished
    assert "".join(d.content for d in deltas) == (builder.content or "")
    assert builder.token_ids == ids[: len(deltas)]
    if builder.finish_reason == "length" and not stop and not tools:
        assert builder.content == plain  # incremental byte decoding equals the tokenizer's decode
