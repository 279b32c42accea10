"""Token in, token out: a chat call sent to the engine as a token-id completion, answered as chat.

In continuous prompt mode the proxy builds the prompt ids itself (`services.gateway.proxy.continuity`)
and posts them to the engine's `/completions` (vLLM's `CompletionRequest` with a token-id
`prompt` and `return_token_ids`). This module writes that
body from the chat body the front end built, and reads the answer back into the chat-completions
shape the rest of the pipeline (recording, the front ends' translators) already handles:
`prompt_token_ids`, per-choice `token_ids`, `logprobs.content[].logprob`, and a message parsed
from the sampled text the way vLLM's parsers do (a leading `<think>` block as `reasoning_content`
when the model was registered with a reasoning parser; Hermes `<tool_call>` blocks as tool calls).

Streams are converted chunk by chunk: text is passed on as it comes, except what may still turn
out to be a `<tool_call>` block or the end of reasoning, which is held until it is decided, so the
deltas always add up to the final message.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec

from services.common.toolcalls import (
    THINK_END,
    THINK_START,
    TOOL_CALL_START,
    held_back,
    parse_tool_calls,
    split_reasoning,
)
from services.gateway.proxy import openai_format
from services.gateway.proxy.promptids import IDS_MARKER_JSON, cut_prompt_ids

_SAMPLING = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "n",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
    "response_format",
)


def completion_body(chat: dict[str, Any], prompt_ids: list[int] | msgspec.Raw, model: str) -> dict[str, Any]:
    """The engine's token-in completions body for a chat request (its sampling fields, the given prompt:
    ids, or their JSON array as `msgspec.Raw`)."""
    body: dict[str, Any] = {"model": model, "prompt": prompt_ids, "return_token_ids": True}
    for key in _SAMPLING:
        if chat.get(key) is not None:
            body[key] = chat[key]
    # Always sent: a completion's own default is 16 tokens, a chat's is what the context leaves (null).
    body["max_tokens"] = chat.get("max_completion_tokens", chat.get("max_tokens"))
    top = chat.get("top_logprobs")
    body["logprobs"] = top if isinstance(top, int) and not isinstance(top, bool) else 0
    if chat.get("stream"):
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


class OutputParser:
    """One choice's sampled text, parsed into reasoning, content and tool calls as it grows."""

    def __init__(self, reasoning: bool) -> None:
        self.text = ""
        self._reasoning = reasoning
        self._shown_reasoning = 0
        self._shown_content = 0

    def _split(self) -> tuple[str, int, bool]:
        """(reasoning so far, where content starts or -1, whether reasoning is closed)."""
        if not self._reasoning:
            return "", 0, True
        stripped = self.text.lstrip()
        if not stripped.startswith(THINK_START):
            return ("", -1, False) if THINK_START.startswith(stripped) else ("", 0, True)
        start = len(self.text) - len(stripped) + len(THINK_START)
        end = self.text.find(THINK_END, start)
        if end < 0:
            return self.text[start : len(self.text) - held_back(self.text, (THINK_END,))], -1, False
        return self.text[start:end], end + len(THINK_END), True

    def feed(self, piece: str) -> tuple[str, str]:
        """Add sampled text; (reasoning, content) that can be shown now."""
        self.text += piece
        reasoning, content_start, _closed = self._split()
        new_reasoning = reasoning[self._shown_reasoning :]
        self._shown_reasoning = len(reasoning)
        if content_start < 0:
            return new_reasoning, ""
        body = self.text[content_start:]
        limit = len(body) - held_back(body, (TOOL_CALL_START,))
        if (tool := body.find(TOOL_CALL_START)) >= 0:
            limit = min(limit, tool)
        shown = body[self._shown_content : limit] if limit > self._shown_content else ""
        self._shown_content = max(self._shown_content, limit)
        return new_reasoning, shown

    def finish(self, tools: bool) -> tuple[str, str, list[dict[str, Any]], dict[str, Any]]:
        """(reasoning, content) not shown yet, the tool calls, and the whole message."""
        reasoning, body = split_reasoning(self.text) if self._reasoning else ("", self.text)
        parsed = parse_tool_calls(body) if tools else None
        calls = [msgspec.to_builtins(c) for c in parsed.tool_calls] if parsed is not None else []
        content = (parsed.content or "") if calls and parsed is not None else body
        message: dict[str, Any] = {"role": "assistant", "content": content or None}
        if reasoning:
            message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = calls
        rest_reasoning = reasoning[self._shown_reasoning :]
        rest_content = content[self._shown_content :] if len(content) > self._shown_content else ""
        return rest_reasoning, rest_content, calls, message


def _logprobs(choice: dict[str, Any]) -> dict[str, Any] | None:
    logprobs = choice.get("logprobs")
    if not isinstance(logprobs, dict):
        return None
    tokens = logprobs.get("tokens") or []
    values = logprobs.get("token_logprobs") or []
    return {"content": [{"token": t, "logprob": v, "top_logprobs": []} for t, v in zip(tokens, values, strict=False)]}


def _chat_id(completion: dict[str, Any]) -> str:
    return "chatcmpl-" + str(completion.get("id") or "").removeprefix("cmpl-")


def _finish(reason: Any, calls: list[dict[str, Any]]) -> Any:
    return "tool_calls" if calls and reason == "stop" else reason


_NULL = msgspec.Raw(b"null")
_CUT = msgspec.Raw(IDS_MARKER_JSON)


class _Choice(msgspec.Struct):
    """What `chat_answer` reads of a completion's choice; its prompt ids left as raw JSON."""

    index: Any = None
    text: Any = None
    finish_reason: Any = None
    stop_reason: Any = None
    prompt_token_ids: msgspec.Raw = _NULL
    token_ids: Any = None
    logprobs: Any = None


class _Completion(msgspec.Struct):
    """What `chat_answer` reads of a non-streamed completion."""

    id: Any = None
    created: Any = None
    model: Any = None
    usage: Any = None
    choices: list[_Choice] = []


_decode_completion = msgspec.json.Decoder(_Completion).decode


def decode_completion(content: bytes) -> dict[str, Any]:
    """A non-streamed token-in completion in one pass, each choice's `prompt_token_ids` left raw for the
    proxy's id parser (`promptids.py`); a shape other than vLLM's is decoded as it is. Raises
    `msgspec.DecodeError` for malformed JSON and `msgspec.ValidationError` for JSON that is not an object.

    The last choice's ids (the only one's, as a rule) are cut out before decoding (`cut_prompt_ids`),
    so the decoder does not read them; the answer is decoded whole when the marker left in their place
    is not exactly one choice's `prompt_token_ids`."""
    cut = cut_prompt_ids(content)
    if cut is not None:
        rest, ids = cut
        try:
            answer = _as_dict(_decode_completion(rest))
        except (msgspec.DecodeError, msgspec.ValidationError):
            answer = None  # the cut was not where it looked: decoded whole below, and refused there if bad
        if answer is not None:
            marked = [choice for choice in answer["choices"] if choice["prompt_token_ids"] == _CUT]
            if len(marked) == 1:
                marked[0]["prompt_token_ids"] = msgspec.Raw(ids)
                return answer
    try:
        completion = _decode_completion(content)
    except msgspec.ValidationError:
        return openai_format.decode_completion(content)
    return _as_dict(completion)


def _as_dict(completion: _Completion) -> dict[str, Any]:
    answer = msgspec.structs.asdict(completion)
    answer["choices"] = choices = [msgspec.structs.asdict(choice) for choice in completion.choices]
    for choice in choices:
        if choice["prompt_token_ids"] == _NULL:  # absent or null: none to read
            choice["prompt_token_ids"] = None
    return answer


def chat_answer(completion: dict[str, Any], tools: bool, reasoning: bool) -> dict[str, Any]:
    """A non-streamed token-in completion as vLLM's chat completion (prompt and sampled ids, parsed message)."""
    choices, prompt_ids = [], None
    for position, choice in enumerate(completion.get("choices") or []):
        if not isinstance(choice, dict):
            continue
        prompt_ids = prompt_ids or choice.get("prompt_token_ids")
        parser = OutputParser(reasoning)
        parser.feed(str(choice.get("text") or ""))
        _r, _c, calls, message = parser.finish(tools)
        choices.append(
            {
                "index": choice.get("index", position),
                "message": message,
                "logprobs": _logprobs(choice),
                "finish_reason": _finish(choice.get("finish_reason"), calls),
                "stop_reason": choice.get("stop_reason"),
                "token_ids": choice.get("token_ids") or [],
            }
        )
    return {
        "id": _chat_id(completion),
        "object": "chat.completion",
        "created": completion.get("created") or int(time.time()),
        "model": completion.get("model"),
        "choices": choices,
        "usage": completion.get("usage"),
        "prompt_token_ids": prompt_ids or [],
    }


class ChunkConverter:
    """Turns a token-in completion stream into chat-completion chunks (see the module docstring)."""

    def __init__(self, tools: bool, reasoning: bool) -> None:
        self.tools = tools
        self.reasoning = reasoning
        self.parsers: dict[int, OutputParser] = {}

    def convert(self, chunk: dict[str, Any]) -> dict[str, Any]:
        """The chat chunk for one completion chunk."""
        out: dict[str, Any] = {
            "id": _chat_id(chunk),
            "object": "chat.completion.chunk",
            "created": chunk.get("created") or int(time.time()),
            "model": chunk.get("model"),
            "choices": [self._choice(c, p) for p, c in enumerate(chunk.get("choices") or []) if isinstance(c, dict)],
        }
        for choice in chunk.get("choices") or []:
            if isinstance(choice, dict) and isinstance(choice.get("prompt_token_ids"), list):
                out["prompt_token_ids"] = choice["prompt_token_ids"]
                break
        if "usage" in chunk:
            out["usage"] = chunk["usage"]
        return out

    def _choice(self, choice: dict[str, Any], position: int) -> dict[str, Any]:
        index = int(choice.get("index", position))
        parser = self.parsers.get(index)
        if parser is None:
            parser = self.parsers[index] = OutputParser(self.reasoning)
        reasoning, content = parser.feed(str(choice.get("text") or ""))
        delta: dict[str, Any] = {}
        finish = choice.get("finish_reason")
        if finish is not None:
            rest_reasoning, rest_content, calls, _message = parser.finish(self.tools)
            reasoning, content = reasoning + rest_reasoning, content + rest_content
            if calls:
                delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(calls)]
            finish = _finish(finish, calls)
        if reasoning:
            delta["reasoning_content"] = reasoning
        if content:
            delta["content"] = content
        return {
            "index": index,
            "delta": delta,
            "logprobs": _logprobs(choice),
            "finish_reason": finish,
            "token_ids": choice.get("token_ids") or [],
        }
