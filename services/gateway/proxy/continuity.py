"""Continuous prompt mode: prompts built from the tokens the model sampled, not re-rendered from messages.

For a call of a run with `prompt_mode = "continuous"`, the proxy looks among the attempt's earlier
`ok` calls (every open chain, so parallel sub-agents each extend their own) for one whose request
messages plus the assistant message it answered are the start of this call's messages. Messages
are compared as the harness sends them, up to what a harness may change without changing the
conversation: text parts joined, `None` and `""` content alike, an assistant turn's surrounding
whitespace, and tool-call arguments compared as parsed JSON (re-serialised with other spacing or
key order they still match). Found, the prompt is that call's prompt ids + sampled ids verbatim,
followed by only the new messages rendered with the model's chat template
(`ChatRenderer.suffix_ids`); the call is recorded with `continuity: "extended"`. Not found
(history compacted, truncated or rewritten, other tools, a first call), the whole conversation is
rendered and a new chain starts: `continuity: "fresh: <why>"`.

The earlier calls come from the gateway's call cache (`CallChains`). An attempt it does not hold
(another gateway replica served it, this one restarted), or one where the conversation shows an
assistant turn later than any cached call answered, is read from the event stream instead, so the
lookup does not depend on which replica served the earlier calls. The tokenizer and template
come from the model's registration (`tokenizer`: a model directory on the gateway's host; vLLM
serves neither).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from schemas import ModelRequestRecorded
from services.gateway.proxy.call import Call
from services.gateway.proxy.limits import ProxyRefusal
from services.gateway.proxy.recording import PER_ATTEMPT, AttemptKey, CallChains, RecordedCall
from services.gateway.proxy.render import ChatRenderer, RenderError, template_arguments, text_content
from services.gateway.proxy.tokenin import completion_body

if TYPE_CHECKING:
    from services.gateway.context import Gateway
    from services.gateway.state import ModelEntry

_encode = msgspec.json.Encoder().encode


class Plan(msgspec.Struct, frozen=True):
    """The prompt a call is sent with and how it relates to the attempt's earlier calls.

    `prompt`: its ids as the JSON array the engine is sent (a kept render's, not encoded again),
    `size` of them. `partial`: the conversation holds an assistant turn after the call it extends
    (or none was found), so the calls looked at may lack a later one (another replica's, or evicted)."""

    prompt: bytes
    size: int
    continuity: str
    partial: bool = False


def canonical(message: Any) -> Any:
    """What must be equal for two messages to be the same turn (see the module docstring)."""
    if not isinstance(message, dict):
        return message
    calls = [
        (c["function"].get("name"), template_arguments(c["function"].get("arguments")))
        for c in message.get("tool_calls") or []
        if isinstance(c, dict) and isinstance(c.get("function"), dict)
    ]
    text: Any
    try:
        text = text_content(message.get("content"))
    except RenderError:  # not text: compared as sent
        text = message.get("content")
    if message.get("role") == "assistant" and isinstance(text, str):
        return ("assistant", text.strip(), calls)
    return (message.get("role"), text, calls, message.get("tool_call_id"), message.get("name"))


def _settings(request: dict[str, Any]) -> tuple[Any, Any]:
    return request.get("tools") or None, request.get("chat_template_kwargs") or None


def _covered(messages: list[Any], earlier: RecordedCall) -> int:
    """How many leading messages of `messages` equal the earlier call's messages + its answer."""
    turns = [*(earlier.request.get("messages") or []), earlier.reply]
    count = 0
    for mine, theirs in zip(messages, turns, strict=False):
        if theirs is None or canonical(mine) != canonical(theirs):
            break
        count += 1
    return count


def plan(renderer: ChatRenderer, request: dict[str, Any], earlier: list[RecordedCall]) -> Plan:
    """The prompt for `request`: an earlier call's ids extended, or a fresh render (RenderError if it fails)."""
    messages = list(request.get("messages") or [])
    tools, kwargs = _settings(request)
    reason = _new_conversation(earlier)
    if earlier and _has_assistant_turn(messages):
        best: tuple[int, RecordedCall] | None = None
        differs = 0
        for call in earlier:
            if call.reply is None or _settings(call.request) != (tools, kwargs):
                continue
            size = len(call.request.get("messages") or []) + 1
            covered = _covered(messages, call)
            if covered == size and (best is None or size > best[0]):
                best = (size, call)
            differs = max(differs, covered)
        last_turn = max(i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "assistant")
        if best is not None:
            size, call = best
            tokens = call.tokens.tolist()
            last = tokens[-1] if len(tokens) > call.prompt_len else None
            suffix = renderer.suffix_ids(messages[size:], tools, dict(kwargs or {}), last)
            if suffix is not None:
                ids = tokens + suffix
                return Plan(_encode(ids), len(ids), "extended", partial=size - 1 < last_turn)
            reason = "the chat template cannot render turns after a sampled one"
        elif any(_settings(c.request) == (tools, kwargs) for c in earlier):
            reason = f"history differs from every earlier call at message {differs}"
        else:
            reason = "tools or chat_template_kwargs differ from every earlier call"
    rendered = renderer.prompt_json(messages, tools, dict(kwargs or {}))
    return Plan(*rendered, f"fresh: {reason}", partial=_has_assistant_turn(messages))


def kept_plan(renderer: ChatRenderer, request: dict[str, Any], earlier: list[RecordedCall]) -> Plan | None:
    """`plan` of a conversation with no assistant turn (a group's shared first prompt) when its render is
    kept, else None: it runs on the event loop, without the hop to a worker thread (about 100 us of CPU).

    A conversation with an assistant turn is left to `plan`: looking for the call it extends compares
    every earlier call's messages, and it renders the new turns. A first prompt not kept yet is hashed
    twice (here and in `plan`): microseconds, before a render of milliseconds."""
    messages = list(request.get("messages") or [])
    if _has_assistant_turn(messages):
        return None
    tools, kwargs = _settings(request)
    kept = renderer.kept_json(messages, tools, dict(kwargs or {}))
    return None if kept is None else Plan(*kept, f"fresh: {_new_conversation(earlier)}")


def _new_conversation(earlier: list[RecordedCall]) -> str:
    """Why a conversation with no call to extend is rendered fresh."""
    return "first call of the attempt" if not earlier else "a new conversation (no earlier assistant turn)"


def _has_assistant_turn(messages: list[Any]) -> bool:
    return any(isinstance(m, dict) and m.get("role") == "assistant" for m in messages)


class Continuity:
    """Builds continuous-mode prompts for a gateway: renderers per model, earlier calls per attempt."""

    def __init__(self) -> None:
        self._renderers: dict[tuple[str, str | None, int], ChatRenderer] = {}
        self._lock = asyncio.Lock()

    async def renderer(self, model: ModelEntry) -> ChatRenderer:
        """The model's renderer, from its registered tokenizer directory (loaded once)."""
        key = (model.base_url, model.tokenizer, model.seq)
        found = self._renderers.get(key)
        if found is not None:
            return found
        async with self._lock:
            found = self._renderers.get(key)
            if found is None:
                found = self._renderers[key] = await self._load(model)
            return found

    async def _load(self, model: ModelEntry) -> ChatRenderer:
        try:
            if not model.tokenizer:
                raise RenderError("it was registered without `tokenizer`")
            return await asyncio.to_thread(ChatRenderer.from_dir, model.tokenizer)
        except Exception as exc:  # no directory, a missing file, bad JSON, a template Jinja cannot compile
            raise ProxyRefusal(
                502,
                f"continuous prompt mode needs model {model.name}'s tokenizer and chat template: {exc}; "
                "register the model with `tokenizer` (its directory, holding tokenizer.json and the chat template)",
                kind="upstream_error",
            ) from None

    async def earlier(self, gw: Gateway, key: AttemptKey, *, reread: bool = False) -> tuple[list[RecordedCall], bool]:
        """The attempt's earlier `ok` calls, and whether they were just read from the stream.

        From the cache when it holds the attempt (unless `reread`), else read from the stream,
        which then refills the cache with the attempt's latest calls."""
        chains: CallChains = gw.chains
        cached = chains.recent(key)
        if cached is not None and not reread:
            return cached, False
        run_id, rollout_id, attempt_id = key
        if rollout_id is None:
            return [], True
        found: list[tuple[ModelRequestRecorded, int]] = []
        for stored in await gw.store.read_rollout(run_id, rollout_id):
            event = stored.event
            if type(event) is ModelRequestRecorded and event.attempt_id == attempt_id and event.status == "ok":
                found.append((event, stored.seq))
        chains.forget(run_id, rollout_id, attempt_id)
        for event, seq in found[-PER_ATTEMPT:]:
            tokens = np.asarray([*event.prompt_ids, *event.response_ids], dtype=np.int32)
            chains.add(key, event, seq, tokens, len(event.prompt_ids))
        return chains.recent(key) or [], True

    async def prepare(self, gw: Gateway, call: Call) -> None:
        """Turn a chat call into a token-in completion call with its planned prompt."""
        renderer = await self.renderer(call.model)
        key = (call.view.run_id, call.view.rollout_id, call.attempt_id)
        earlier, fresh_read = await self.earlier(gw, key)
        try:
            planned = await _planned(renderer, call.recorded_request, earlier)
            if planned.partial and not fresh_read:  # the cache may lack a later call: look on the stream
                earlier, _ = await self.earlier(gw, key, reread=True)
                planned = await _planned(renderer, call.recorded_request, earlier)
        except RenderError as exc:
            raise ProxyRefusal(400, str(exc), kind="invalid_request_error", param="messages") from None
        prompt = msgspec.Raw(planned.prompt)
        call.payload = _encode(completion_body(call.recorded_request, prompt, call.model.upstream_model))
        call.endpoint = "/completions"
        call.prompt_size = planned.size
        call.continuity = planned.continuity
        call.parse_tools = (
            bool(call.recorded_request.get("tools")) and call.recorded_request.get("tool_choice") != "none"
        )
        call.parse_reasoning = call.model.reasoning_parser is not None


async def _planned(renderer: ChatRenderer, request: dict[str, Any], earlier: list[RecordedCall]) -> Plan:
    """`plan`, on the event loop when it needs no rendering, else in a worker thread (a render takes
    milliseconds)."""
    planned = kept_plan(renderer, request, earlier)
    return planned if planned is not None else await asyncio.to_thread(plan, renderer, request, earlier)
