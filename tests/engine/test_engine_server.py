"""The engine over real HTTP with the official openai client: vLLM-format extras, streaming, errors."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from engine_harness import MAX_MODEL_LEN, SERVED_NAME, EngineHandle
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from services.engine.server import WEIGHTS_VERSION_HEADER

HELLO: list[Any] = [{"role": "user", "content": "Say hello."}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup_weather",
            "description": "Weather of a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


@pytest.fixture(scope="module")
def client(engine_server: EngineHandle) -> openai.OpenAI:
    """Sync openai client pointed at the engine."""
    return openai.OpenAI(base_url=engine_server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture
async def aclient(engine_server: EngineHandle) -> Any:
    """Async openai client pointed at the engine."""
    async with openai.AsyncOpenAI(base_url=engine_server.url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


def _ids(obj: Any, key: str) -> list[int]:
    extra = obj.model_extra or {}
    value = extra[key]
    assert isinstance(value, list)
    return value


def test_models_lists_the_served_model_with_its_version(engine_server: EngineHandle, client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [SERVED_NAME]
    assert models[0].model_extra is not None
    assert models[0].model_extra["weights_version"] == 0
    assert models[0].model_extra["max_model_len"] == MAX_MODEL_LEN
    response = httpx.get(engine_server.url + "/v1/models")
    assert response.headers[WEIGHTS_VERSION_HEADER] == "0"
    health = httpx.get(engine_server.url + "/health").json()
    assert health["status"] == "ok" and health["weights_version"] == 0


def test_non_stream_returns_token_ids_logprobs_and_usage(
    client: openai.OpenAI, tiny_tokenizer: PreTrainedTokenizerFast
) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model=SERVED_NAME,
        messages=HELLO,
        max_tokens=12,
        logprobs=True,
        top_logprobs=3,
        seed=11,
        extra_body={"return_token_ids": True},
    )
    assert raw.headers[WEIGHTS_VERSION_HEADER] == "0"
    resp = raw.parse()
    assert resp.id.startswith("chatcmpl-") and resp.model == SERVED_NAME and resp.object == "chat.completion"
    prompt_ids = _ids(resp, "prompt_token_ids")
    rendered = tiny_tokenizer.apply_chat_template(HELLO, add_generation_prompt=True, tokenize=False)
    assert prompt_ids == tiny_tokenizer.encode(str(rendered), add_special_tokens=False)
    choice = resp.choices[0]
    token_ids = _ids(choice, "token_ids")
    assert 1 <= len(token_ids) <= 12
    assert choice.finish_reason in ("stop", "length")
    assert choice.message.role == "assistant"
    assert choice.message.content == tiny_tokenizer.decode(token_ids, skip_special_tokens=True)
    assert choice.logprobs is not None and choice.logprobs.content is not None
    entries = choice.logprobs.content
    assert len(entries) == len(token_ids)
    for token_id, entry in zip(token_ids, entries, strict=True):
        assert len(entry.top_logprobs) == 3
        assert entry.logprob <= entry.top_logprobs[0].logprob + 1e-6
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob >= entry.top_logprobs[2].logprob
        assert entry.bytes is not None
        if token_id not in tiny_tokenizer.all_special_ids:
            assert bytes(entry.bytes) == str(tiny_tokenizer.decode([token_id])).encode() or "\ufffd" in entry.token
    assert resp.usage is not None
    assert resp.usage.prompt_tokens == len(prompt_ids)
    assert resp.usage.completion_tokens == len(token_ids)
    assert resp.usage.total_tokens == len(prompt_ids) + len(token_ids)
    assert resp.model_extra is not None and resp.model_extra["weights_version"] == 0


def _nucleus_logprobs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Logprobs [N, V] of the distribution sampled from, recomputed here without the engine's code.

    Temperature first, then the nucleus: per row, the most likely tokens whose probability mass
    before them is below top_p; the rest are impossible; renormalised over the nucleus.
    """
    scaled = logits / temperature
    out = torch.full_like(scaled, float("-inf"))
    for row in range(scaled.shape[0]):
        probs = torch.softmax(scaled[row], dim=-1).tolist()
        order = sorted(range(len(probs)), key=lambda i: -probs[i])
        mass, keep = 0.0, list[int]()
        for i in order:
            if mass >= top_p and keep:
                break
            keep.append(i)
            mass += probs[i]
        kept = scaled[row, keep]
        out[row, keep] = kept - torch.logsumexp(kept, dim=0)
    return out


def test_logprobs_are_those_of_the_distribution_sampled_from(client: openai.OpenAI, tiny_model_dir: Path) -> None:
    temperature, top_p = 0.7, 0.9

    def sample(seed: int) -> Any:
        return client.chat.completions.create(
            model=SERVED_NAME,
            messages=HELLO,
            max_tokens=24,
            n=2,
            logprobs=True,
            temperature=temperature,
            top_p=top_p,
            seed=seed,
            stop=["e"],
            extra_body={"return_token_ids": True},
        )

    # Choices that stop at different steps, so the batch (and its KV cache) shrinks mid-generation:
    # the first seed whose two choices differ in length (which seed does depends on the model's shape).
    resp = next(
        (r for r in map(sample, range(5, 45)) if len({len(_ids(c, "token_ids")) for c in r.choices}) == 2), None
    )
    assert resp is not None, "no seed of 40 gave two choices of different lengths"
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    prompt_ids = _ids(resp, "prompt_token_ids")
    for choice in resp.choices:
        token_ids = _ids(choice, "token_ids")
        assert choice.logprobs is not None and choice.logprobs.content is not None
        reported = torch.tensor([e.logprob for e in choice.logprobs.content])
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt_ids + token_ids])).logits[0].float()
        scores = _nucleus_logprobs(logits[len(prompt_ids) - 1 : -1], temperature, top_p)  # [response, V]
        rescored = scores.gather(1, torch.tensor(token_ids)[:, None])[:, 0]
        assert torch.isfinite(rescored).all()  # every sampled token was inside its nucleus
        assert torch.allclose(reported, rescored, atol=1e-4), (reported - rescored).abs().max()
        raw = torch.log_softmax(logits[len(prompt_ids) - 1 : -1], dim=-1).gather(1, torch.tensor(token_ids)[:, None])
        assert not torch.allclose(reported, raw[:, 0], atol=1e-2)  # the raw T=1 logprob is another number


def test_greedy_is_deterministic_and_is_the_argmax(client: openai.OpenAI, tiny_model_dir: Path) -> None:
    def greedy() -> tuple[list[int], list[int]]:
        resp = client.chat.completions.create(
            model=SERVED_NAME, messages=HELLO, max_tokens=16, temperature=0, extra_body={"return_token_ids": True}
        )
        return _ids(resp, "prompt_token_ids"), _ids(resp.choices[0], "token_ids")

    prompt_ids, first = greedy()
    assert greedy()[1] == first
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt_ids + first])).logits[0]
    assert logits[len(prompt_ids) - 1 : -1].argmax(dim=-1).tolist() == first[: len(first)]


def test_same_seed_same_tokens_different_seed_different_tokens(client: openai.OpenAI) -> None:
    def sample(seed: int) -> list[int]:
        resp = client.chat.completions.create(
            model=SERVED_NAME, messages=HELLO, max_tokens=20, seed=seed, extra_body={"return_token_ids": True}
        )
        return _ids(resp.choices[0], "token_ids")

    assert sample(42) == sample(42)
    assert sample(42) != sample(43)


def test_n_choices_are_sampled_independently(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(
        model=SERVED_NAME, messages=HELLO, max_tokens=10, n=3, seed=9, extra_body={"return_token_ids": True}
    )
    assert [c.index for c in resp.choices] == [0, 1, 2]
    sequences = [_ids(c, "token_ids") for c in resp.choices]
    assert len({tuple(s) for s in sequences}) == 3
    assert resp.usage is not None and resp.usage.completion_tokens == sum(len(s) for s in sequences)


def test_stream_concatenates_to_the_non_stream_result(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {
        "model": SERVED_NAME,
        "messages": HELLO,
        "max_tokens": 15,
        "n": 2,
        "seed": 77,
        "logprobs": True,
        "top_logprobs": 2,
        "stop": ["e"],
        "extra_body": {"return_token_ids": True},
    }
    whole = client.chat.completions.create(**kwargs)
    stream = client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    first = chunks[0]
    assert _ids(first, "prompt_token_ids") == _ids(whole, "prompt_token_ids")
    assert {c.delta.role for c in first.choices} == {"assistant"}
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage is not None and whole.usage is not None
    assert usage_chunk.usage.model_dump() == whole.usage.model_dump()
    for choice in whole.choices:
        parts = [c for chunk in chunks[1:-1] for c in chunk.choices if c.index == choice.index]
        assert "".join(p.delta.content or "" for p in parts) == choice.message.content
        assert [t for p in parts for t in _ids(p, "token_ids")] == _ids(choice, "token_ids")
        streamed_lp = [e.logprob for p in parts if p.logprobs and p.logprobs.content for e in p.logprobs.content]
        assert choice.logprobs is not None and choice.logprobs.content is not None
        assert streamed_lp == [e.logprob for e in choice.logprobs.content]
        assert [p.finish_reason for p in parts if p.finish_reason] == [choice.finish_reason]


async def test_async_client_streams_tokens_as_they_are_generated(aclient: openai.AsyncOpenAI) -> None:
    started = time.perf_counter()
    stream = await aclient.chat.completions.create(
        model=SERVED_NAME,
        messages=HELLO,
        max_tokens=200,
        stream=True,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    arrivals: list[float] = []
    tokens = 0
    async for chunk in stream:
        for c in chunk.choices:
            if (c.model_extra or {}).get("token_ids"):
                tokens += 1
                arrivals.append(time.perf_counter() - started)
    assert tokens == 200
    # Incremental generation: the first token arrives well before the last one.
    assert arrivals[0] < arrivals[-1] / 2


async def test_concurrent_requests_interleave(aclient: openai.AsyncOpenAI, engine_server: EngineHandle) -> None:
    long = asyncio.create_task(
        aclient.chat.completions.create(
            model=SERVED_NAME, messages=HELLO, max_tokens=900, extra_body={"ignore_eos": True}
        )
    )
    async with httpx.AsyncClient() as http:
        while True:  # until the engine reports the long request running (a fast machine starts it at once)
            started = time.perf_counter()
            health = await http.get(engine_server.url + "/health")
            assert time.perf_counter() - started < 1.0  # answered while it generates
            if health.json()["running"] >= 1:
                break
            assert not long.done(), "the long request ended before the engine reported it running"
            await asyncio.sleep(0.01)
    short = await aclient.chat.completions.create(model=SERVED_NAME, messages=HELLO, max_tokens=3)
    assert short.choices[0].message is not None
    assert not long.done()  # the short request did not wait for the long one
    result = await long
    assert result.usage is not None and result.usage.completion_tokens == 900


async def test_concurrent_requests_batched_together_match_running_alone(aclient: openai.AsyncOpenAI) -> None:
    prompts = ["Hi.", "Tell me a long story about the sea and the harbor.", "2+2?", "List three files."]

    async def greedy(text: str, seed: int) -> tuple[list[int], list[float]]:
        resp = await aclient.chat.completions.create(
            model=SERVED_NAME,
            messages=[{"role": "user", "content": text}],
            max_tokens=20,
            temperature=0 if seed % 2 else 1,
            seed=seed,
            logprobs=True,
            extra_body={"return_token_ids": True, "ignore_eos": True},
        )
        choice = resp.choices[0]
        assert choice.logprobs is not None and choice.logprobs.content is not None
        return _ids(choice, "token_ids"), [e.logprob for e in choice.logprobs.content]

    together = await asyncio.gather(*[greedy(text, seed) for seed, text in enumerate(prompts)])
    for seed, (text, (tokens, logprobs)) in enumerate(zip(prompts, together, strict=True)):
        alone_tokens, alone_logprobs = await greedy(text, seed)
        assert tokens == alone_tokens
        assert torch.allclose(torch.tensor(logprobs), torch.tensor(alone_logprobs), atol=1e-4)


def test_tools_and_tool_messages_reach_the_template(
    client: openai.OpenAI, tiny_tokenizer: PreTrainedTokenizerFast
) -> None:
    messages: list[Any] = [
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "lookup_weather", "arguments": '{"city":"Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 18C"},
    ]
    resp = client.chat.completions.create(
        model=SERVED_NAME,
        messages=messages,
        tools=TOOLS,  # type: ignore[arg-type]
        max_tokens=4,
        extra_body={"return_token_ids": True},
    )
    prompt = str(tiny_tokenizer.decode(_ids(resp, "prompt_token_ids")))
    assert "<tools>\n" + json.dumps(TOOLS[0]) + "\n</tools>" in prompt
    assert '<tool_call>\n{"name": "lookup_weather", "arguments": {"city": "Oslo"}}\n</tool_call><|im_end|>' in prompt
    assert "<|im_start|>tool\n<tool_response>\nsunny, 18C\n</tool_response><|im_end|>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


def test_stop_token_ids_and_multi_part_content(client: openai.OpenAI) -> None:
    base = client.chat.completions.create(
        model=SERVED_NAME, messages=HELLO, max_tokens=8, temperature=0, extra_body={"return_token_ids": True}
    )
    token_ids = _ids(base.choices[0], "token_ids")
    parts: list[Any] = [{"type": "text", "text": "Say "}, {"type": "text", "text": "hello."}]
    stopped = client.chat.completions.create(
        model=SERVED_NAME,
        messages=[{"role": "user", "content": parts}],
        max_tokens=8,
        temperature=0,
        extra_body={"return_token_ids": True, "stop_token_ids": [token_ids[2]]},
    )
    choice = stopped.choices[0]
    assert _ids(choice, "token_ids") == token_ids[: token_ids.index(token_ids[2]) + 1]
    assert choice.finish_reason == "stop" and (choice.model_extra or {})["stop_reason"] == token_ids[2]


def _post(url: str, body: Any) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=30)


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({"messages": []}, "messages", "invalid_value"),
        ({}, "messages", "invalid_value"),
        ({"messages": HELLO, "max_tokens": "ten"}, "max_tokens", "invalid_value"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "invalid_value"),
        ({"messages": HELLO, "temperature": -1}, "temperature", "invalid_value"),
        ({"messages": HELLO, "top_p": 0}, "top_p", "invalid_value"),
        ({"messages": HELLO, "top_k": -5}, "top_k", "invalid_value"),
        ({"messages": HELLO, "n": 0}, "n", "invalid_value"),
        ({"messages": HELLO, "n": 1000}, "n", "invalid_value"),
        ({"messages": HELLO, "max_tokens": 0}, "max_tokens", "invalid_value"),
        ({"messages": HELLO, "max_completion_tokens": 5000}, "max_completion_tokens", "context_length_exceeded"),
        ({"messages": HELLO, "top_logprobs": 2}, "top_logprobs", "invalid_value"),
        ({"messages": HELLO, "logprobs": True, "top_logprobs": 50}, "top_logprobs", "invalid_value"),
        ({"messages": HELLO, "stop": [""]}, "stop", "invalid_value"),
        ({"messages": HELLO, "stop_token_ids": [99999]}, "stop_token_ids", "invalid_value"),
        ({"messages": HELLO, "stream_options": {"include_usage": True}}, "stream_options", "invalid_value"),
        ({"messages": HELLO, "tools": TOOLS, "tool_choice": "required"}, "tool_choice", "unsupported_value"),
        ({"messages": HELLO, "tools": [{"type": "function", "function": {}}]}, "tools[0].function", "invalid_value"),
        ({"messages": HELLO, "response_format": {"type": "json_object"}}, "response_format", "unsupported_value"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "messages[0].content[0]",
            "invalid_value",
        ),
        ({"messages": [{"role": "user", "content": "word " * 1500}]}, "messages", "context_length_exceeded"),
    ],
)
def test_bad_requests_get_openai_error_bodies(
    engine_server: EngineHandle, body: dict[str, Any], param: str, code: str
) -> None:
    response = _post(engine_server.url, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["code"] == code
    assert error["type"] == "invalid_request_error" and error["message"]


def test_malformed_json_unknown_model_and_route(engine_server: EngineHandle, client: openai.OpenAI) -> None:
    response = httpx.post(engine_server.url + "/v1/chat/completions", content=b'{"messages": [')
    assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_json"
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="no-such-model", messages=HELLO)  # type: ignore[arg-type]
    assert "no-such-model" in caught.value.message
    missing = httpx.get(engine_server.url + "/v1/nothing")
    assert missing.status_code == 404 and "error" in missing.json()
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=SERVED_NAME, messages=HELLO, temperature=-2)
    assert "temperature" in bad.value.message


def _wait_idle(url: str, timeout: float = 5.0) -> int:
    deadline = time.monotonic() + timeout
    running = -1
    while time.monotonic() < deadline:
        running = int(httpx.get(url + "/health").json()["running"])
        if running == 0:
            return 0
        time.sleep(0.05)
    return running


def test_client_disconnect_stops_generation(engine_server: EngineHandle) -> None:
    body = {"messages": HELLO, "max_tokens": 900, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", engine_server.url + "/v1/chat/completions", json=body, timeout=30) as response:
        lines = response.iter_lines()
        received = [next(lines) for _ in range(6)]
    assert any(line.startswith("data: ") for line in received)
    assert _wait_idle(engine_server.url) == 0
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            engine_server.url + "/v1/chat/completions",
            json={"messages": HELLO, "max_tokens": 900, "ignore_eos": True},
            timeout=0.3,
        )
    assert _wait_idle(engine_server.url) == 0
