"""Rendering conversations to token ids as the served model's chat template does (continuous prompt mode).

A `ChatRenderer` holds one model's tokenizer (`tokenizers`, from its `tokenizer.json`) and chat
template, compiled the way transformers' `apply_chat_template` compiles it: a sandboxed Jinja
environment with `trim_blocks`/`lstrip_blocks`, loop controls, a `tojson` that does not escape HTML,
`raise_exception`, `strftime_now`, and the `{% generation %}` tag (rendered as its body). Messages
are flattened as vLLM flattens them (content as one string, text parts joined with "\n", or as a
list of text parts, as vLLM detects from the template: `content_format`; tool-call arguments as
mappings), so a fresh render gives the ids vLLM's chat endpoint would.

`suffix_ids` renders only what follows an earlier assistant turn: the template is applied to a
fixed conversation ending in an assistant turn with a unique marker as its content, followed by
the new messages, and the text after the marker is the part to append (the turn's closing tokens,
the new turns, the generation prompt). When the earlier turn's sampled ids already end with the
end-of-turn token, that token's text is not appended twice. Templates that cannot be split this
way (the marker is not rendered once, verbatim) give None, and the caller renders afresh.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import msgspec
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from services.common.bytecache import ByteLRU
from services.gateway.proxy.content_format import ContentFormat, detect_content_format, template_content, text_parts

MARKER = "\u2063rollwire-earlier-turn\u2063"
RENDERED_BYTES = 64 << 20
"""Bytes of whole-conversation renders a renderer keeps (the rollouts of a group open with one prompt)."""
_LEAD = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]


_encode_key = msgspec.json.Encoder().encode
_decode_ids = msgspec.json.Decoder(list[int]).decode
PromptJson = tuple[bytes, int]
"""A prompt's ids as the JSON array the engine is sent, and how many ids it holds."""


class RenderError(ValueError):
    """The conversation cannot be rendered with this template; the message says why."""


class _Generation(jinja2.ext.Extension):
    """`{% generation %}…{% endgeneration %}` (transformers' assistant-mask tag): renders its body."""

    tags = {"generation"}  # noqa: RUF012 (jinja2.ext.Extension declares it an instance attribute)

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())


def _raise(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def _token_text(value: Any) -> str | None:
    return value.get("content") if isinstance(value, dict) else value if isinstance(value, str) else None


def text_content(content: Any) -> str:
    """A message's content as text: a string, or its text parts joined with "\n" as vLLM joins them
    (RenderError for anything else)."""
    texts = text_parts(content)
    if texts is None:
        raise RenderError("message content must be text or a list of text parts")
    return "\n".join(texts)


def template_arguments(arguments: Any) -> Any:
    """Tool-call arguments as a mapping when they are a JSON object (as vLLM hands them to templates)."""
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except ValueError:
            return arguments
        return parsed if isinstance(parsed, dict) else arguments
    return arguments


def template_messages(messages: Sequence[Any], content_format: ContentFormat = "string") -> list[dict[str, Any]]:
    """Chat-completions messages as the template sees them (vLLM's flattening for `content_format`)."""
    out: list[dict[str, Any]] = []
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise RenderError("each message must be an object with a role")
        texts = text_parts(message.get("content"))
        if texts is None:
            raise RenderError("message content must be text or a list of text parts")
        item: dict[str, Any] = {
            "role": message["role"],
            "content": template_content(message["role"], texts, content_format),
        }
        calls = message.get("tool_calls")
        if calls:
            item["tool_calls"] = [
                {
                    "id": c.get("id") or "",
                    "type": c.get("type") or "function",
                    "function": {
                        "name": c["function"]["name"],
                        "arguments": template_arguments(c["function"].get("arguments")),
                    },
                }
                for c in calls
                if isinstance(c, dict) and isinstance(c.get("function"), dict)
            ]
        for key in ("name", "tool_call_id"):
            if key in message:
                item[key] = message[key]
        out.append(item)
    return out


class ChatRenderer:
    """One model's tokenizer and chat template (see the module docstring)."""

    def __init__(self, tokenizer_json: str, config: dict[str, Any], template: str, eos_ids: Sequence[int]) -> None:
        self.tokenizer = Tokenizer.from_str(tokenizer_json)
        self.template = _compile(template)
        self.content_format = detect_content_format(template)
        self.special = {
            name: text
            for name in ("bos_token", "eos_token", "unk_token", "pad_token")
            if (text := _token_text(config.get(name))) is not None
        }
        eos = set(eos_ids)
        eos_text = self.special.get("eos_token")
        if eos_text is not None and (eos_id := self.tokenizer.token_to_id(eos_text)) is not None:
            eos.add(eos_id)
        self.eos_ids = frozenset(eos)
        # A template that reads the clock (`strftime_now`) renders another prompt tomorrow: not kept.
        self._rendered: ByteLRU[bytes, PromptJson] | None = (
            None if "strftime_now" in template else ByteLRU(RENDERED_BYTES, lambda kept: 64 + len(kept[0]))
        )
        self._rendered_lock = threading.Lock()  # renders run in worker threads

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ChatRenderer:
        """A model directory's tokenizer.json, tokenizer_config.json and chat template."""
        root = Path(model_dir)
        config_file, template_file = root / "tokenizer_config.json", root / "chat_template.jinja"
        config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
        template = template_file.read_text(encoding="utf-8") if template_file.is_file() else config.get("chat_template")
        if not isinstance(template, str) or not template:
            raise RenderError(f"{root.name} has no chat template (chat_template.jinja or tokenizer_config.json)")
        generation = root / "generation_config.json"
        eos: Any = (
            json.loads(generation.read_text(encoding="utf-8")).get("eos_token_id") if generation.is_file() else None
        )
        eos_ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
        return cls((root / "tokenizer.json").read_text(encoding="utf-8"), config, template, eos_ids)

    def text(self, messages: list[dict[str, Any]], tools: Any, generation_prompt: bool, kwargs: dict[str, Any]) -> str:
        """The template's text for template-ready messages (RenderError when the template refuses them)."""
        try:
            return self.template.render(
                messages=messages,
                tools=tools or None,
                add_generation_prompt=generation_prompt,
                **{**self.special, **kwargs},
            )
        except (jinja2.TemplateError, TypeError, ValueError, KeyError) as exc:
            raise RenderError(f"the chat template could not render these messages: {exc}") from None

    def encode(self, text: str) -> list[int]:
        """Token ids of text, special tokens recognised, none added."""
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def prompt_ids(self, messages: Sequence[Any], tools: Any, kwargs: dict[str, Any]) -> list[int]:
        """A whole conversation's prompt, with the generation prompt (what the engine would render)."""
        return _decode_ids(self.prompt_json(messages, tools, kwargs)[0])

    def prompt_json(self, messages: Sequence[Any], tools: Any, kwargs: dict[str, Any]) -> PromptJson:
        """`prompt_ids` as the JSON array the engine is sent, and how many ids it holds.

        Kept by the conversation's digest: every rollout of a group sends the same first prompt, and a
        long one costs milliseconds to render and tokenize (6 ms for 20,000 characters here). Kept as
        JSON, a kept prompt is not encoded again (125 us for 15,746 ids)."""
        key = self._key(messages, tools, kwargs)
        if key is not None:
            kept = self._kept(key)
            if kept is not None:
                return kept
        ids = self._render(messages, tools, kwargs)
        made = _encode_key(ids), len(ids)
        if key is not None and self._rendered is not None:
            with self._rendered_lock:
                self._rendered.put(key, made)
        return made

    def kept_json(self, messages: Sequence[Any], tools: Any, kwargs: dict[str, Any]) -> PromptJson | None:
        """`prompt_json` when the conversation's prompt is kept, else None: it never renders, so it may run
        on the event loop."""
        key = self._key(messages, tools, kwargs)
        return None if key is None else self._kept(key)

    def _key(self, messages: Sequence[Any], tools: Any, kwargs: dict[str, Any]) -> bytes | None:
        if self._rendered is None:
            return None
        try:
            return hashlib.blake2b(_encode_key([messages, tools, kwargs]), digest_size=16).digest()
        except (TypeError, ValueError, OverflowError):  # not plain JSON: rendered, not kept
            return None

    def _kept(self, key: bytes) -> PromptJson | None:
        if self._rendered is None:
            return None
        with self._rendered_lock:
            return self._rendered.get(key)

    def _render(self, messages: Sequence[Any], tools: Any, kwargs: dict[str, Any]) -> list[int]:
        return self.encode(self.text(template_messages(messages, self.content_format), tools, True, kwargs))

    def suffix_ids(
        self, new: Sequence[Any], tools: Any, kwargs: dict[str, Any], last_sampled: int | None
    ) -> list[int] | None:
        """What follows an earlier assistant turn's sampled ids: its closing, the `new` turns, the generation prompt."""
        lead = [*_LEAD, {"role": "assistant", "content": MARKER}]
        text = self.text(template_messages([*lead, *new], self.content_format), tools, True, kwargs)
        if text.count(MARKER) != 1:
            return None
        tail = text[text.index(MARKER) + len(MARKER) :]
        if last_sampled is not None and last_sampled in self.eos_ids:
            closing = self.tokenizer.id_to_token(last_sampled) or ""
            if closing and not tail.startswith(closing):
                return None  # the template closes a turn with another token than the one the model sampled
            tail = tail[len(closing) :]
        return self.encode(tail)
