"""The OpenAI chat-completions wire format as vLLM extends it: what the proxy asks for and strips.

The proxy asks the engine for `return_token_ids` (top-level `prompt_token_ids`, per-choice
`token_ids`) and `logprobs` (`choices[].logprobs.content[].logprob`); in a stream the prompt ids
arrive in the first chunk and `token_ids` as per-chunk deltas. The harness gets back only what it
asked for: the extras are removed unless its own request set them. Pure functions, no I/O.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from typing import Any

import msgspec

from services.gateway.proxy.promptids import IDS_MARKER, PromptIds, cut_prompt_ids, int_list, prompt_token_ids

_decode_fields = msgspec.json.Decoder(dict[str, msgspec.Raw]).decode
_decode_object = msgspec.json.Decoder(dict[str, Any]).decode
_decode_any = msgspec.json.Decoder().decode
_LOGPROB = operator.itemgetter("logprob")


class Wants(msgspec.Struct, frozen=True):
    """Which extras the harness itself asked for (those are left in its response)."""

    token_ids: bool
    logprobs: bool
    usage_chunk: bool


class ChoiceRecord(msgspec.Struct, kw_only=True):
    """What one choice produced: the tokens and logprobs to record, and its message."""

    index: int
    token_ids: list[int] = msgspec.field(default_factory=list)
    logprobs: list[float] = msgspec.field(default_factory=list)
    finish_reason: str | None = None
    role: str = "assistant"
    content: list[str] = msgspec.field(default_factory=list)
    reasoning: list[str] = msgspec.field(default_factory=list)
    tool_calls: dict[int, dict[str, Any]] = msgspec.field(default_factory=dict)
    message: dict[str, Any] | None = None

    def response(self) -> dict[str, Any]:
        """The choice's message as the harness saw it (assembled from deltas when streamed)."""
        if self.message is not None:
            return {"message": self.message}
        message: dict[str, Any] = {"role": self.role, "content": "".join(self.content) if self.content else None}
        if self.reasoning:
            message["reasoning_content"] = "".join(self.reasoning)
        if self.tool_calls:
            message["tool_calls"] = [self.tool_calls[i] for i in sorted(self.tool_calls)]
        return {"message": message}


def prepare_request(body: dict[str, Any], upstream_model: str) -> tuple[dict[str, Any], Wants]:
    """The body to send upstream (model set, token ids and logprobs requested) and what the client wanted."""
    stream_options = body.get("stream_options")
    wants = Wants(
        token_ids=bool(body.get("return_token_ids")),
        logprobs=bool(body.get("logprobs")),
        usage_chunk=isinstance(stream_options, dict) and bool(stream_options.get("include_usage")),
    )
    upstream = dict(body)
    upstream["model"] = upstream_model
    upstream["return_token_ids"] = True
    upstream["logprobs"] = True
    if body.get("stream"):
        upstream["stream_options"] = {
            **(stream_options if isinstance(stream_options, dict) else {}),
            "include_usage": True,
        }
    return upstream, wants


def sampling_params(body: dict[str, Any]) -> dict[str, Any]:
    """The request's `temperature`, `top_p` and `top_k` as recorded on the call (absent: None)."""
    out: dict[str, Any] = {"temperature": None, "top_p": None, "top_k": None}
    for key, kind in (("temperature", float), ("top_p", float), ("top_k", int)):
        value = body.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
            out[key] = kind(value)
    return out


def _logprob_values(choice: dict[str, Any]) -> list[float]:
    logprobs = choice.get("logprobs")
    if not isinstance(logprobs, dict):
        return []
    content = logprobs.get("content")
    if not isinstance(content, list):
        return []
    try:
        values = list(map(_LOGPROB, content))  # in C: 15 against 23 us for 500 tokens
    except (KeyError, TypeError):  # an entry without a logprob, or not an object: read one by one
        values = [item.get("logprob") for item in content if isinstance(item, dict)]
    try:
        return msgspec.convert(values, list[float])
    except msgspec.ValidationError:
        return []


def decode_completion(content: bytes) -> dict[str, Any]:
    """A non-streamed completion's JSON object, its `prompt_token_ids` left raw (`msgspec.Raw`).

    `read_completion` parses those ids straight into an int32 array (`promptids.py`) and encoding
    the answer writes them back as they came, so a long prompt's ids never become Python ints. A
    compact answer's ids are not even skipped over by the decoder (`cut_prompt_ids`).
    Raises `msgspec.DecodeError` for malformed JSON (malformed ids: when they are read) and
    `msgspec.ValidationError` for JSON that is not an object.
    """
    cut = cut_prompt_ids(content)
    if cut is not None:  # the ids are not read by the decoder at all (promptids.py)
        rest, ids = cut
        try:
            answer = _decode_object(rest)
        except (msgspec.DecodeError, msgspec.ValidationError):
            answer = None  # the cut was not where it looked: decoded whole below, and refused there if bad
        if answer is not None and answer.get("prompt_token_ids") == IDS_MARKER:
            answer["prompt_token_ids"] = msgspec.Raw(ids)
            return answer
    fields = _decode_fields(content)
    return {key: value if key == "prompt_token_ids" else _decode_any(value) for key, value in fields.items()}


def read_completion(
    response: dict[str, Any], prompt_ids: Callable[[Any], PromptIds] = prompt_token_ids
) -> tuple[PromptIds, list[ChoiceRecord]]:
    """Prompt ids (read by `prompt_ids`: they may be raw JSON) and per-choice records of a non-streamed completion."""
    records = []
    for position, choice in enumerate(response.get("choices") or []):
        if not isinstance(choice, dict):
            continue
        message = choice.get("message")
        records.append(
            ChoiceRecord(
                index=int(choice.get("index", position)),
                token_ids=int_list(choice.get("token_ids")),
                logprobs=_logprob_values(choice),
                finish_reason=choice.get("finish_reason"),
                message=message if isinstance(message, dict) else None,
            )
        )
    return prompt_ids(response.get("prompt_token_ids")), records


def strip_completion(response: dict[str, Any], wants: Wants) -> None:
    """Remove the extras the client did not ask for from a completion (in place)."""
    if not wants.token_ids:
        response.pop("prompt_token_ids", None)
    for choice in response.get("choices") or []:
        if not isinstance(choice, dict):
            continue
        if not wants.token_ids:
            choice.pop("token_ids", None)
            choice.pop("prompt_token_ids", None)
        if not wants.logprobs:
            choice["logprobs"] = None


class StreamFold:
    """Accumulates a streamed completion chunk by chunk (prompt ids, tokens, logprobs, message)."""

    def __init__(self) -> None:
        self.prompt_ids: list[int] = []
        self.choices: dict[int, ChoiceRecord] = {}
        self.usage: dict[str, Any] | None = None
        self.model: str | None = None

    def feed(self, chunk: dict[str, Any]) -> None:
        """Fold one decoded chunk."""
        if not self.prompt_ids and isinstance(chunk.get("prompt_token_ids"), list):
            self.prompt_ids = int_list(chunk["prompt_token_ids"])
        if isinstance(chunk.get("usage"), dict):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            if not isinstance(choice, dict):
                continue
            index = int(choice.get("index", 0))
            record = self.choices.get(index)
            if record is None:
                record = self.choices[index] = ChoiceRecord(index=index)
            record.token_ids.extend(int_list(choice.get("token_ids")))
            record.logprobs.extend(_logprob_values(choice))
            if choice.get("finish_reason") is not None:
                record.finish_reason = choice["finish_reason"]
            delta = choice.get("delta")
            if isinstance(delta, dict):
                self._delta(record, delta)

    @staticmethod
    def _delta(record: ChoiceRecord, delta: dict[str, Any]) -> None:
        if isinstance(delta.get("role"), str):
            record.role = delta["role"]
        if isinstance(delta.get("content"), str):
            record.content.append(delta["content"])
        reasoning = reasoning_of(delta)
        if reasoning:
            record.reasoning.append(reasoning)
        for call in delta.get("tool_calls") or []:
            if not isinstance(call, dict):
                continue
            slot = record.tool_calls.setdefault(
                int(call.get("index", 0)), {"id": None, "type": "function", "function": {"name": "", "arguments": ""}}
            )
            if call.get("id"):
                slot["id"] = call["id"]
            function = call.get("function")
            if isinstance(function, dict):
                slot["function"]["name"] += function.get("name") or ""
                slot["function"]["arguments"] += function.get("arguments") or ""

    def records(self) -> list[ChoiceRecord]:
        """The choices seen so far, by index."""
        return [self.choices[i] for i in sorted(self.choices)]


def strip_chunk(chunk: dict[str, Any], wants: Wants) -> bool:
    """Remove the extras from one chunk (in place); False when the whole chunk must be dropped."""
    choices = chunk.get("choices")
    if not choices and "usage" in chunk and chunk.get("usage") is not None and not wants.usage_chunk:
        return False
    if not wants.usage_chunk and "usage" in chunk:
        chunk["usage"] = None
    if not wants.token_ids:
        chunk.pop("prompt_token_ids", None)
    for choice in choices or []:
        if not isinstance(choice, dict):
            continue
        if not wants.token_ids:
            choice.pop("token_ids", None)
        if not wants.logprobs and "logprobs" in choice:
            choice["logprobs"] = None
    return True


def reasoning_of(message: dict[str, Any]) -> str:
    """The reasoning text of a message or delta (vLLM's `reasoning_content`, newer `reasoning`)."""
    for key in ("reasoning_content", "reasoning"):
        value = message.get(key)
        if isinstance(value, str) and value:
            return value
    return ""


def finishes(chunk: dict[str, Any]) -> bool:
    """True when the chunk ends a choice (it is held back until the call is recorded)."""
    return any(isinstance(c, dict) and c.get("finish_reason") is not None for c in chunk.get("choices") or [])


def int_usage(usage: Any) -> dict[str, int]:
    """The integer counters of a usage object (nested details are dropped)."""
    if not isinstance(usage, dict):
        return {}
    return {k: v for k, v in usage.items() if isinstance(v, int) and not isinstance(v, bool)}
