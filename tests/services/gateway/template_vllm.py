"""A fake vLLM that renders prompts with a real tokenizer and chat template and answers from a script.

It speaks the two vLLM endpoints continuous prompt mode is about, in the shapes of vLLM's
`vllm/entrypoints/openai/protocol.py` (v0.10.2 and later, where `return_token_ids` exists):

- `POST /v1/chat/completions`: the messages are rendered with the model directory's chat template
  and tokenized (`apply_chat_template`, as vLLM's chat serving does); the answer has top-level
  `prompt_token_ids`, per-choice `token_ids`, `logprobs.content[]`, and the message parsed with the
  Hermes tool parser and a Qwen3-style reasoning parser (`reasoning_content`);
- `POST /v1/completions` with a token-id `prompt`: the ids are used as they are; each choice has
  `text`, `token_ids`, `prompt_token_ids` and `logprobs.token_logprobs` (`stream: true` too: one
  chunk per token, prompt ids in the first).

What it answers comes from `script(turn) -> list[int]`: the sampled ids of the answer at `turn`,
the number of assistant turns already in the prompt (counted in the prompt's text), ending with
the end-of-turn id. Every served prompt is kept in `prompts`, so a test can check token continuity.

`QWEN3_STYLE` is a chat template with the two habits that split exact merging: it drops earlier
assistant turns' reasoning, and it writes tool-call arguments with `tojson` (re-serialising the
JSON the model sampled), as Qwen3's template does.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from services.common.tinymodel.tokenizer import load_tokenizer
from services.common.toolcalls import parse_tool_calls, split_reasoning

_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder(dict[str, Any]).decode

QWEN3_STYLE = (
    "{%- if tools %}<|im_start|>system\n"
    "{%- if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{%- endif %}"
    "# Tools\n<tools>{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools><|im_end|>\n"
    "{%- elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role == 'assistant' %}"
    "{%- set content = message.content or '' %}"
    "{%- if '</think>' in content %}{%- set content = content.split('</think>')[-1].lstrip('\n') %}{%- endif %}"
    "<|im_start|>assistant\n{{ content }}"
    "{%- for call in message.tool_calls or [] %}"
    "{%- if content or not loop.first %}\n{%- endif %}"
    '<tool_call>\n{"name": "{{ call.function.name }}", '
    '"arguments": {{ call.function.arguments | tojson }}}\n</tool_call>'
    "{%- endfor %}<|im_end|>\n"
    "{%- elif message.role == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)


def _usage(prompt: list[int], ids: list[int]) -> dict[str, int]:
    return {"prompt_tokens": len(prompt), "completion_tokens": len(ids), "total_tokens": len(prompt) + len(ids)}


def qwen3_style_dir(tiny_model_dir: Path, out: Path) -> Path:
    """A copy of the tiny model's tokenizer files with the Qwen3-style template."""
    out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "config.json"):
        if (tiny_model_dir / name).is_file():
            (out / name).write_bytes((tiny_model_dir / name).read_bytes())
    (out / "chat_template.jinja").write_text(QWEN3_STYLE, encoding="utf-8")
    return out


class TemplateVLLM:
    """The ASGI app (see the module docstring)."""

    def __init__(self, model_dir: Path, script: Callable[[int], list[int]], name: str = "qwen3-style") -> None:
        self.tokenizer = load_tokenizer(model_dir)
        self.script = script
        self.name = name
        self.prompts: list[list[int]] = []
        self.marker = "<|im_start|>assistant"

    def turn(self, prompt: list[int]) -> int:
        """How many assistant turns the prompt already holds."""
        return str(self.tokenizer.decode(prompt, skip_special_tokens=False)).count(self.marker) - 1

    def _sample(self, prompt: list[int]) -> tuple[list[int], str, list[float]]:
        self.prompts.append(list(prompt))
        ids = self.script(self.turn(prompt))
        text = str(self.tokenizer.decode(ids, skip_special_tokens=True))
        return ids, text, [-0.25 - 0.01 * i for i in range(len(ids))]

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        request = _decode(body) if body else {}
        if scope["path"] == "/v1/chat/completions":
            await self._json(send, self._chat(request))
        elif scope["path"] == "/v1/completions" and request.get("stream"):
            await self._stream(send, request)
        elif scope["path"] == "/v1/completions":
            await self._json(send, self._completion(request))
        else:
            await self._json(send, {"error": {"message": "not found"}}, 404)

    async def _json(self, send: Any, payload: Any, status: int = 200) -> None:
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json")]})  # fmt: skip
        await send({"type": "http.response.body", "body": _encode(payload)})

    def _chat(self, request: dict[str, Any]) -> dict[str, Any]:
        text = self.tokenizer.apply_chat_template(
            request["messages"], tools=request.get("tools"), add_generation_prompt=True, tokenize=False
        )
        prompt = list(self.tokenizer.encode(str(text), add_special_tokens=False))
        ids, sampled, logprobs = self._sample(prompt)
        reasoning, answer = split_reasoning(sampled)
        parsed = parse_tool_calls(answer)
        message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
        if reasoning:
            message["reasoning_content"] = reasoning
        if parsed.tool_calls:
            message["tool_calls"] = [msgspec.to_builtins(c) for c in parsed.tool_calls]
        content = [{"token": f"t{t}", "logprob": lp, "top_logprobs": []} for t, lp in zip(ids, logprobs, strict=True)]
        return {
            "id": "chatcmpl-fake", "object": "chat.completion", "created": 0, "model": self.name,
            "prompt_token_ids": prompt,
            "choices": [{"index": 0, "message": message, "logprobs": {"content": content}, "token_ids": ids,
                         "finish_reason": "tool_calls" if parsed.tool_calls else "stop"}],
            "usage": _usage(prompt, ids),
        }  # fmt: skip

    def _completion(self, request: dict[str, Any]) -> dict[str, Any]:
        prompt = list(request["prompt"])
        ids, text, logprobs = self._sample(prompt)
        return {
            "id": "cmpl-fake", "object": "text_completion", "created": 0, "model": self.name,
            "choices": [{"index": 0, "text": text, "finish_reason": "stop", "stop_reason": None,
                         "prompt_token_ids": prompt, "token_ids": ids,
                         "logprobs": {"tokens": [f"t{t}" for t in ids], "token_logprobs": logprobs,
                                      "top_logprobs": None, "text_offset": [0] * len(ids)}}],
            "usage": _usage(prompt, ids),
        }  # fmt: skip

    async def _stream(self, send: Any, request: dict[str, Any]) -> None:
        prompt = list(request["prompt"])
        ids, _text, logprobs = self._sample(prompt)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})  # fmt: skip
        for i, (token, logprob) in enumerate(zip(ids, logprobs, strict=True)):
            piece = str(self.tokenizer.decode(ids[: i + 1], skip_special_tokens=True))
            piece = piece[len(str(self.tokenizer.decode(ids[:i], skip_special_tokens=True))) :]
            choice: dict[str, Any] = {
                "index": 0, "text": piece, "token_ids": [token],
                "logprobs": {"tokens": [f"t{token}"], "token_logprobs": [logprob], "top_logprobs": None,
                             "text_offset": [0]},
                "finish_reason": "stop" if i == len(ids) - 1 else None,
            }  # fmt: skip
            if i == 0:
                choice["prompt_token_ids"] = prompt
            chunk = {
                "id": "cmpl-fake",
                "object": "text_completion",
                "created": 0,
                "model": self.name,
                "choices": [choice],
            }
            await send({"type": "http.response.body", "body": b"data: " + _encode(chunk) + b"\n\n", "more_body": True})
        usage = {"prompt_tokens": len(prompt), "completion_tokens": len(ids), "total_tokens": len(prompt) + len(ids)}
        tail = {
            "id": "cmpl-fake",
            "object": "text_completion",
            "created": 0,
            "model": self.name,
            "choices": [],
            "usage": usage,
        }
        await send({"type": "http.response.body", "body": b"data: " + _encode(tail) + b"\n\ndata: [DONE]\n\n"})
