"""The writer checks a call against the contract's own bounds before recording it `ok`.

An engine (a fake here: these are injected faults, see `fake_vllm.py`) that answers a token id
(sampled or of the prompt) of 2^32 or -1, a usage count of 2^63 or a weights-version header of 3e9
used to get its call recorded `ok` in a form `schemas.decode` refuses (and every reader after it
stopped there), or, for the weights version, lost unrecorded after generation with a 500. Now such
a call is recorded `failed` with the reason (without the values that do not fit), every event stays
readable, and the agent gets a 502 naming what was wrong.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from fake_vllm import FakeVLLM
from gw_harness import GatewayHandle

from schemas import ModelRequestRecorded
from services.common.eventstore import EventStore


def _calls(url: str, run_id: str) -> list[ModelRequestRecorded]:
    """Every call of the run, decoded by the contract (raises if one is refused)."""

    async def read() -> list[ModelRequestRecorded]:
        store = await EventStore.connect(url, ensure=False)
        try:
            return [s.event async for s in store.read(f"rl.{run_id}.rollout.*.model_request")]  # type: ignore[misc]
        finally:
            await store.close()

    return asyncio.run(read())


@pytest.mark.parametrize(
    ("fault", "value", "stream"),
    [
        ("forge_token", 2**32, False),
        ("forge_token", -1, False),
        ("forge_token", -1, True),
        ("forge_prompt_token", 2**31, False),
        ("forge_prompt_token", -1, False),
        ("forge_prompt_token", 2**64, False),
        ("forge_prompt_token", -1, True),
        ("forge_usage", 2**63 - 1, False),
        ("weights_version", 3_000_000_000, False),
        ("weights_version", 3_000_000_000, True),
    ],
)
def test_an_answer_outside_the_contract_is_recorded_failed_and_readable(
    gateway: GatewayHandle, fake_vllm: FakeVLLM, nats_url: str, run_id: str, fault: str, value: int, stream: bool
) -> None:
    _, attempt = gateway.running(run_id, fake_vllm.url)
    setattr(fake_vllm, fault, value)
    try:
        body: dict[str, Any] = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        headers = {"authorization": f"Bearer {attempt['token']}"}
        url = f"{attempt['proxy_base_url']}/chat/completions"
        if stream:
            with httpx.stream("POST", url, json={**body, "stream": True}, headers=headers, timeout=30) as answer:
                text = answer.read().decode()
            assert "outside the bounds" in text, text
            assert "[DONE]" not in text
        else:
            answer = httpx.post(url, json=body, headers=headers, timeout=30)
            assert answer.status_code == 502, answer.text
            assert "outside the bounds" in answer.json()["error"]["message"]
    finally:
        fake_vllm.weights_version = 7
    calls = _calls(nats_url, run_id)  # every event decodes
    assert [(c.status, c.prompt_ids, c.response_ids) for c in calls] == [("failed", [], [])], calls
    assert calls[0].error is not None and "outside the bounds" in calls[0].error
    assert calls[0].usage == {} and calls[0].weights_version in (None, 7)


@pytest.mark.parametrize("compact", [True, False])
@pytest.mark.parametrize("bad", [2**31, 2**32, -1, -(2**40)])
def test_token_ids_outside_the_contract_are_refused_in_both_record_formats(compact: bool, bad: int) -> None:
    """The packed (version 2) and the full-list (version 1) encodings refuse the same ids."""
    from services.gateway.proxy.recording import CallChains, OutOfBounds

    def call(response: list[int], prompt: list[int]) -> ModelRequestRecorded:
        return ModelRequestRecorded(run_id="r", rollout_id="x", attempt_id="a", call_id="c", prompt_ids=prompt,
                                    response_ids=response, logprobs=[-0.5] * len(response))  # fmt: skip

    chains = CallChains(compact=compact)
    assert chains.compact([call([5, 2**24 + 1], [1, 2])])  # a wide vocabulary is fine
    with pytest.raises(OutOfBounds):
        chains.compact([call([5, bad], [1, 2])])
    with pytest.raises(OutOfBounds):
        chains.compact([call([5], [bad, 2])])
