"""The engine's token-in completions (`POST /v1/completions`, vLLM's shape) over real HTTP with the openai client."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest
from engine_harness import SERVED_NAME, EngineHandle
from transformers import PreTrainedTokenizerFast

HELLO: list[Any] = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def client(engine_server: EngineHandle) -> openai.OpenAI:
    """Sync openai client pointed at the engine."""
    return openai.OpenAI(base_url=engine_server.url + "/v1", api_key="unused", max_retries=0)


def _prompt(tokenizer: PreTrainedTokenizerFast) -> list[int]:
    text = tokenizer.apply_chat_template(HELLO, add_generation_prompt=True, tokenize=False)
    return list(tokenizer.encode(str(text), add_special_tokens=False))


def test_token_in_equals_the_chat_endpoint_on_the_same_prompt(
    client: openai.OpenAI, tiny_tokenizer: PreTrainedTokenizerFast
) -> None:
    """The same ids and seed through /v1/completions sample what /v1/chat/completions samples."""
    prompt = _prompt(tiny_tokenizer)
    extra = {"return_token_ids": True}
    chat = client.chat.completions.create(
        model=SERVED_NAME, messages=HELLO, max_tokens=12, seed=7, logprobs=True, extra_body=extra
    ).model_dump()
    done = client.completions.create(
        model=SERVED_NAME, prompt=prompt, max_tokens=12, seed=7, logprobs=0, extra_body=extra
    ).model_dump()
    assert chat["prompt_token_ids"] == prompt
    choice = done["choices"][0]
    assert choice["prompt_token_ids"] == prompt
    assert choice["token_ids"] == chat["choices"][0]["token_ids"]
    assert choice["logprobs"]["token_logprobs"] == [e["logprob"] for e in chat["choices"][0]["logprobs"]["content"]]
    assert len(choice["logprobs"]["tokens"]) == len(choice["token_ids"])
    assert done["usage"]["prompt_tokens"] == len(prompt)
    assert done["usage"]["completion_tokens"] == len(choice["token_ids"])


def test_stream_concatenates_to_the_whole_answer(
    client: openai.OpenAI, tiny_tokenizer: PreTrainedTokenizerFast
) -> None:
    """Streamed chunks: prompt ids once per choice, then token ids and text that add up to the answer."""
    prompt = _prompt(tiny_tokenizer)
    extra = {"return_token_ids": True}
    whole = client.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=10, seed=3, n=2, extra_body=extra)
    chunks = list(
        client.completions.create(
            model=SERVED_NAME, prompt=prompt, max_tokens=10, seed=3, n=2, stream=True, extra_body=extra,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    for index in range(2):
        parts = [c for chunk in chunks for c in chunk.model_dump()["choices"] if c["index"] == index]
        assert parts[0]["prompt_token_ids"] == prompt
        assert all(p.get("prompt_token_ids") is None for p in parts[1:])
        assert [t for p in parts for t in p["token_ids"]] == whole.model_dump()["choices"][index]["token_ids"]
        assert "".join(p["text"] for p in parts) == whole.choices[index].text
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens == len(prompt)


def test_bad_prompts_are_refused_naming_the_field(engine_server: EngineHandle) -> None:
    """Empty or out-of-vocabulary prompts and echo get OpenAI's 400 naming the parameter."""
    url = engine_server.url + "/v1/completions"
    vocab = engine_server.engine.weights.vocab_size
    for body, param in (
        ({"prompt": []}, "prompt"),
        ({"prompt": [1, vocab]}, "prompt"),
        ({"prompt": [1, 2], "echo": True}, "echo"),
        ({"prompt": [1, 2], "logprobs": 99}, "logprobs"),
        ({"prompt": "x", "max_tokens": "many"}, "max_tokens"),
        ({"prompt": [1, 2], "response_format": {"type": "json_object"}}, "response_format"),
    ):
        response = httpx.post(url, json=body)
        assert response.status_code == 400, body
        assert response.json()["error"]["param"] == param


def test_tokenizer_route_serves_what_the_engine_renders_with(
    engine_server: EngineHandle, client: openai.OpenAI
) -> None:
    """GET /v1/tokenizer: a gateway rendering with what it serves gets the chat endpoint's prompt ids."""
    from services.gateway.proxy.render import ChatRenderer

    files = httpx.get(engine_server.url + "/v1/tokenizer").json()
    assert files["eos_token_ids"] == sorted(engine_server.engine.eos_token_ids)
    chat = client.chat.completions.create(
        model=SERVED_NAME, messages=HELLO, max_tokens=1, extra_body={"return_token_ids": True}
    ).model_dump()
    assert ChatRenderer.from_files(files).prompt_ids(HELLO, None, {}) == chat["prompt_token_ids"]
