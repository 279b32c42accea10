"""The proxy's own rendering (continuous prompt mode) against transformers' `apply_chat_template`,
and the sampled-text parser's stream/whole agreement. Pure: no servers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
from template_vllm import qwen3_style_dir

pytest.importorskip("transformers", reason="the comparison needs transformers (pip install -e .[train])")

from services.common.tinymodel.build import build_tiny_model
from services.common.tinymodel.tokenizer import load_tokenizer
from services.gateway.proxy.continuity import kept_plan, plan
from services.gateway.proxy.recording import RecordedCall
from services.gateway.proxy.render import ChatRenderer, RenderError, template_messages
from services.gateway.proxy.tokenin import OutputParser, completion_body

TOOLS: Any = [{"type": "function", "function": {"name": "add", "description": "a + b",
               "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}}]  # fmt: skip
CONVERSATION: Any = [
    {"role": "system", "content": "You add."},
    {"role": "user", "content": [{"type": "text", "text": "Add "}, {"type": "text", "text": "1 and 2."}]},
    {"role": "assistant", "content": None,
     "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a":  1}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "3"},
    {"role": "assistant", "content": "It is 3."},
    {"role": "user", "content": "Thanks. And 2 + 2?"},
]  # fmt: skip


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """The tiny model (Hermes-style ChatML template) and a Qwen3-style copy of its tokenizer."""
    tiny = build_tiny_model(tmp_path_factory.mktemp("render-tiny"), seed=0)
    return [tiny, qwen3_style_dir(tiny, tmp_path_factory.mktemp("render-qwen3"))]


def _transformers_ids(model_dir: Path, messages: Any, tools: Any) -> list[int]:
    tokenizer = load_tokenizer(model_dir)
    content_format = ChatRenderer.from_dir(model_dir).content_format  # as vLLM detects it (tests/system/vllm checks)
    text = tokenizer.apply_chat_template(template_messages(messages, content_format), tools=tools,
                                         add_generation_prompt=True, tokenize=False)  # fmt: skip
    return list(tokenizer.encode(str(text), add_special_tokens=False))


@pytest.mark.parametrize("with_tools", [False, True])
def test_a_fresh_render_is_what_transformers_renders(dirs: list[Path], with_tools: bool) -> None:
    """Same template, same tokenizer: the proxy's prompt ids equal the engine's for every prefix."""
    tools = TOOLS if with_tools else None
    for model_dir in dirs:
        renderer = ChatRenderer.from_dir(model_dir)
        for end in range(2, len(CONVERSATION) + 1):
            assert renderer.prompt_ids(CONVERSATION[:end], tools, {}) == _transformers_ids(
                model_dir, CONVERSATION[:end], tools
            ), (model_dir.name, end)


def test_extending_sampled_ids_equals_a_fresh_render_when_the_template_keeps_history(dirs: list[Path]) -> None:
    """On a template that renders history as sampled, prompt + sampled ids + suffix is the fresh render."""
    renderer = ChatRenderer.from_dir(dirs[0])
    eos = renderer.tokenizer.token_to_id("<|im_end|>")
    answer = "It is 3."
    earlier = CONVERSATION[:4]
    sampled = [*renderer.encode(answer), eos]
    new = [{"role": "user", "content": "Thanks. And 2 + 2?"}]
    suffix = renderer.suffix_ids(new, TOOLS, {}, eos)
    assert suffix is not None
    extended = renderer.prompt_ids(earlier, TOOLS, {}) + sampled + suffix
    assert extended == renderer.prompt_ids([*earlier, {"role": "assistant", "content": answer}, *new], TOOLS, {})
    # An answer cut short (no end-of-turn sampled) gets the template's closing from the suffix.
    cut = renderer.suffix_ids(new, TOOLS, {}, sampled[-2])
    assert cut is not None and cut[0] == eos and cut[1:] == suffix


def test_a_template_that_refuses_the_messages_is_a_render_error(tmp_path: Path, dirs: list[Path]) -> None:
    """`raise_exception` in a template becomes RenderError (the proxy answers 400)."""
    model_dir = qwen3_style_dir(dirs[0], tmp_path / "strict")
    (model_dir / "chat_template.jinja").write_text("{{ raise_exception('system messages only') }}", encoding="utf-8")
    with pytest.raises(RenderError, match="system messages only"):
        ChatRenderer.from_dir(model_dir).prompt_ids(CONVERSATION, None, {})


@pytest.mark.parametrize(
    "text",
    [
        '<think>\nadd\n</think>\n\nSure.<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>',
        "<thi",
        "<think>stopped while thinking",
        "plain <tool_call>{not json",
        "x</think>y",
    ],
)
def test_parsed_stream_deltas_add_up_to_the_whole_message(text: str) -> None:
    """Fed in any pieces, the shown reasoning and content equal the final message's."""
    for step in (1, 3, 7, len(text)):
        parser = OutputParser(reasoning=True)
        shown_reasoning = shown_content = ""
        for i in range(0, len(text), step):
            reasoning, content = parser.feed(text[i : i + step])
            shown_reasoning, shown_content = shown_reasoning + reasoning, shown_content + content
        reasoning, content, _calls, message = parser.finish(tools=True)
        assert shown_reasoning + reasoning == (message.get("reasoning_content") or "")
        assert shown_content + content == (message["content"] or "")


def test_the_token_in_body_keeps_the_chat_sampling_fields() -> None:
    """Sampling fields carry over; no max_tokens means the context's limit (null), never a completion's 16."""
    chat = {"model": "m", "messages": [], "temperature": 0.5, "top_p": 0.9, "seed": 3, "stop": ["x"], "n": 2,
            "top_logprobs": 2, "stream": True, "tools": TOOLS}  # fmt: skip
    body = completion_body(chat, [1, 2, 3], "m")
    assert body == {"model": "m", "prompt": [1, 2, 3], "return_token_ids": True, "temperature": 0.5, "top_p": 0.9,
                    "seed": 3, "stop": ["x"], "n": 2, "max_tokens": None, "logprobs": 2, "stream": True,
                    "stream_options": {"include_usage": True}}  # fmt: skip
    assert completion_body({"max_completion_tokens": 9, "max_tokens": 5}, [1], "m")["max_tokens"] == 9


def test_a_repeated_conversation_is_rendered_once_and_a_clock_template_every_time(
    dirs: list[Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rollouts of a group open with one prompt: rendered once, handed out as copies. A template that
    reads the clock is rendered every time (tomorrow's prompt differs)."""
    renderer = ChatRenderer.from_dir(dirs[0])
    renders: list[int] = []
    render = renderer._render
    monkeypatch.setattr(renderer, "_render", lambda *a: renders.append(1) or render(*a))
    first = renderer.prompt_ids(CONVERSATION[:2], TOOLS, {})
    first.append(-1)  # the caller's list is its own
    again = renderer.prompt_ids(CONVERSATION[:2], TOOLS, {})
    assert again == first[:-1] == _transformers_ids(dirs[0], CONVERSATION[:2], TOOLS)
    assert len(renders) == 1
    assert renderer.prompt_ids(CONVERSATION[:2], None, {}) != again and len(renders) == 2  # tools are in the key

    clock = tmp_path / "clock"
    clock.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (clock / name).write_bytes((dirs[0] / name).read_bytes())
    template = "{{ strftime_now('%Y') }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (clock / "chat_template.jinja").write_text(template)
    timed = ChatRenderer.from_dir(clock)
    timed_renders: list[int] = []
    timed_render = timed._render
    monkeypatch.setattr(timed, "_render", lambda *a: timed_renders.append(1) or timed_render(*a))
    assert timed.prompt_ids([{"role": "user", "content": "hi"}], None, {}) == timed.prompt_ids(
        [{"role": "user", "content": "hi"}], None, {}
    )
    assert len(timed_renders) == 2
    assert timed.kept_json([{"role": "user", "content": "hi"}], None, {}) is None  # never kept


def test_a_kept_prompt_is_planned_without_rendering(dirs: list[Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """A group's repeated first prompt is planned from the kept JSON (on the event loop: no render, no
    thread); a first sight of a conversation, or one that extends an earlier call, is not."""
    renderer = ChatRenderer.from_dir(dirs[0])
    request = {"messages": CONVERSATION[:2], "tools": TOOLS}
    assert kept_plan(renderer, request, []) is None
    fresh = plan(renderer, request, [])
    monkeypatch.setattr(renderer, "_render", lambda *a: pytest.fail("rendered again"))
    kept = kept_plan(renderer, request, [])
    assert kept == fresh and kept.continuity == "fresh: first call of the attempt"
    assert msgspec.json.decode(kept.prompt) == _transformers_ids(dirs[0], CONVERSATION[:2], TOOLS)
    assert kept.size == len(msgspec.json.decode(kept.prompt))
    answer = {"role": "assistant", "content": "It is 2."}
    ids = np.asarray([*msgspec.json.decode(kept.prompt), 5, 6], dtype=np.int32)
    earlier = RecordedCall("e", 1, ids, request, ids.nbytes, kept.size, answer)
    extending = {**request, "messages": [*CONVERSATION[:2], answer, {"role": "user", "content": "And 3+3?"}]}
    assert kept_plan(renderer, extending, [earlier]) is None  # its suffix must be rendered
    assert plan(renderer, extending, [earlier]).continuity == "extended"
