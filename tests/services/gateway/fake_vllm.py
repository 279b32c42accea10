"""A fake vLLM-format chat-completions server: deterministic tokens, fast, and it remembers what it sampled.

It speaks the format the gateway's proxy relies on: with `return_token_ids` the response has a
top-level `prompt_token_ids` and per-choice `token_ids`; with `logprobs`, `logprobs.content[]`;
streamed, the prompt ids come in the first chunk and `token_ids` as per-chunk deltas, and
`stream_options.include_usage` adds a final usage chunk. `n > 1` and tool calls are supported.

Every served choice is appended to `served` (prompt ids, token ids, logprobs, finish reason), so a
test can check what the gateway recorded against what was actually sampled. Knobs: `delay_s`,
`token_delay_s` (between streamed chunks), `fail_status`, `hang_s`, `weights_version`, `reasoning`
(text sent as vLLM's `reasoning_content` before the answer, as a reasoning parser does),
`tool_script` (tool name -> JSON arguments: call that tool when the request offers it),
`answer_tokens` (answers end, `finish_reason: stop`, after this many tokens when max_tokens allows more),
and injected faults an engine could answer but the contract cannot hold: `forge_token` (the first
sampled token id is this, e.g. 2^32 or -1), `forge_prompt_token` (the last prompt id is this),
`forge_usage` (the answer's `completion_tokens`, e.g. 2^63).

With tools, the first call of a turn calls the first tool (arguments `{"x": N}`) and the call after
its result (last message role `tool`) answers in text and stops (`finish_reason: stop`; otherwise
answers run to `max_tokens`), so an agent loop completes one tool round trip and ends its turn.

It also implements the control routes a trainer reloads weights through, with the shapes of
vLLM v0.34.0's source, and records each call in `control` (path with query, body, time):

- `vllm/entrypoints/rl/online/api_router.py`: `POST /pause?mode=abort|wait|keep` -> `{"status":
  "paused"}` (while paused in `abort`/`wait` mode new generation requests get 503),
  `POST /resume` -> `{"status": "resumed"}`, `GET /is_paused`, `POST /update_weight_version`
  `{"new_version": str}` -> `{"success": true, "new_version": ...}`;
- `vllm/entrypoints/serve/dev/rpc/api_router.py`: `POST /collective_rpc {"method", "args",
  "kwargs", "timeout"}` -> `{"results": [...]}` (400 without `method`); `reload_weights` takes
  `weights_path` (`vllm/v1/worker/gpu_worker.py`); `fail_reload` makes it answer 500;
- `vllm/entrypoints/serve/dev/cache/api_router.py`: `POST /reset_prefix_cache` -> `{"success": bool}`;
- `vllm/entrypoints/serve/lora/api_router.py` and `protocol.py`: `POST /v1/load_lora_adapter
  {"lora_name", "lora_path", "load_inplace"}` (400 if loaded and not in place), `POST
  /v1/unload_lora_adapter {"lora_name"}` (404 if not loaded); `loras` holds the loaded adapters;
- `GET /health` -> 200.

    python tests/services/gateway/fake_vllm.py --port 9000        # serve until interrupted (the benchmark does this)
    fake_vllm.py serve MODEL --port 9000 --served-model-name NAME ...   # as `vllm serve` (rollwire up's test)

Run as `serve`, it appends its argv and the VLLM_* environment as one JSON line to the file named
by FAKE_VLLM_LOG, so a test can check the command line `rollwire up --engine vllm` built.
`fake_vllm_python(dir)` writes a stand-in for vLLM's Python that runs it so (`python -m
vllm.entrypoints.openai.api_server --model M ...` becomes `fake_vllm.py serve M ...`), for a stack or
trainer that starts "vLLM" itself. FAKE_VLLM_VOCAB (default 32000) bounds its token ids, so a trainer
can train a small model on what it "sampled".
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import stat
import sys
import threading
import time
from array import array
from pathlib import Path
from typing import Any

import msgspec

_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder(dict[str, Any]).decode
VOCAB = int(os.environ.get("FAKE_VLLM_VOCAB", "32000"))
CONTROL_ROUTES = frozenset(
    {"/pause", "/resume", "/collective_rpc", "/reset_prefix_cache", "/update_weight_version",
     "/v1/load_lora_adapter", "/v1/unload_lora_adapter"}
)  # fmt: skip


def tokenize(text: str) -> list[int]:
    """A deterministic toy tokenizer: one token per 4 bytes of UTF-8, folded into the vocabulary."""
    data = text.encode()
    data += b"\0" * (-len(data) % 4)
    return [word % VOCAB for word in array("I", data)]


def prompt_ids(messages: list[Any]) -> list[int]:
    """Token ids of a chat prompt (role and content of each message)."""
    ids: list[int] = []
    for message in messages:
        if isinstance(message, dict):
            content = message.get("content")
            text = content if isinstance(content, str) else _encode(content).decode()
            ids.append(1)
            ids.extend(tokenize(f"{message.get('role', '')}:{text}"))
    return ids


def sample(prompt: list[int], index: int, count: int, draw: int = 0) -> tuple[list[int], list[float]]:
    """Deterministic 'sampled' token ids and their logprobs for choice `index` (and `draw`, see `vary`)."""
    seed = hashlib.blake2b(_encode([prompt[-16:], len(prompt), index, draw]), digest_size=8).digest()
    state = int.from_bytes(seed, "big")
    tokens, logprobs = [], []
    for _ in range(count):
        state = (state * 6364136223846793005 + 1442695040888963407) % (1 << 64)
        tokens.append(100 + state % (VOCAB - 100))
        logprobs.append(-((state >> 20) % 1000) / 500.0)
    return tokens, logprobs


def detokenize(tokens: list[int]) -> list[str]:
    """One text piece per token."""
    return [f"t{t} " for t in tokens]


class FakeVLLM:
    """The ASGI app (serve it with uvicorn) and its record of served choices."""

    def __init__(self, *, weights_version: int | None = 7, model: str = "fake-model") -> None:
        self.weights_version = weights_version
        self.model = model
        self.url = ""  # set by whoever serves it
        self.delay_s = 0.0
        self.token_delay_s = 0.0
        self.fail_status: int | None = None
        self.hang_s = 0.0
        self.reasoning: str | None = None
        self.tool_script: dict[str, str] = {}
        self.answer_tokens: int | None = None
        self.forge_token: int | None = None
        self.forge_prompt_token: int | None = None
        self.forge_usage: int | None = None
        self.vary = False  # True: every request draws anew, so identical requests get different answers
        self.draws = 0
        self.record = True
        self.epoch = 0  # bumped by reset(): a call still in flight from before records nothing after it
        self.served: list[dict[str, Any]] = []
        self.requests: list[dict[str, Any]] = []
        self.aborted = 0
        self.started = 0
        self.lock = threading.Lock()
        self.control: list[dict[str, Any]] = []
        self.paused = False
        self.loaded_weights: str | None = None
        self.weight_version: str | None = None
        self.loras: dict[str, str] = {}
        self.fail_reload = False
        self.request_times: list[float] = []

    def reset(self) -> None:
        """Forget served calls and restore the default knobs."""
        self.epoch += 1
        self.delay_s = self.token_delay_s = self.hang_s = 0.0
        self.fail_status = None
        self.reasoning = None
        self.tool_script = {}
        self.answer_tokens = None
        self.forge_token = self.forge_prompt_token = self.forge_usage = None
        self.served.clear()
        self.requests.clear()
        self.aborted = self.started = 0
        self.control.clear()
        self.paused = self.fail_reload = False
        self.loaded_weights = self.weight_version = None
        self.loras.clear()
        self.request_times.clear()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        path = scope["path"]
        if scope["method"] == "GET" and path.endswith("/models"):
            await self._json(
                send, 200, {"object": "list", "data": [{"id": self.model, "object": "model", "owned_by": "fake"}]}
            )
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        if path in CONTROL_ROUTES or (scope["method"] == "GET" and path in ("/health", "/is_paused")):
            query = scope.get("query_string", b"").decode()
            status, answer = self._control(path, query, _decode(body) if body else {})
            if isinstance(answer, str):  # vLLM answers the LoRA routes with a plain-text Response
                await send({"type": "http.response.start", "status": status, "headers": self._headers(b"text/plain")})
                await send({"type": "http.response.body", "body": answer.encode()})
                return
            await self._json(send, status, answer)
            return
        if path.endswith("/v1/completions") and scope["method"] == "POST":
            await self._json(send, 200, self._token_in(_decode(body)))
            return
        if not path.endswith("/chat/completions"):
            await self._json(send, 404, {"error": {"message": f"no route {path}"}})
            return
        if self.paused:
            await self._json(send, 503, {"error": {"message": "generation is paused", "code": 503}})
            return
        request = _decode(body)
        epoch = self.epoch
        self.started += 1
        self.request_times.append(time.monotonic())
        if self.record:
            self.requests.append(request)
        if self.hang_s:
            await asyncio.sleep(self.hang_s)
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if self.fail_status is not None:
            await self._json(
                send,
                self.fail_status,
                {"error": {"message": "fake upstream failure", "type": "internal_error", "code": self.fail_status}},
            )
            return
        if request.get("stream"):
            await self._stream(request, receive, send, epoch)
        else:
            await self._complete(request, send, epoch)

    def _control(self, path: str, query: str, body: dict[str, Any]) -> tuple[int, Any]:
        """One control route (see the module docstring); returns (status, JSON body)."""
        self.control.append({"path": f"{path}?{query}" if query else path, "body": body, "time": time.monotonic()})
        match path:
            case "/health":
                return 200, {}
            case "/is_paused":
                return 200, {"is_paused": self.paused}
            case "/pause":
                self.paused = "mode=keep" not in query
                return 200, {"status": "paused"}
            case "/resume":
                self.paused = False
                return 200, {"status": "resumed"}
            case "/collective_rpc":
                if "method" not in body:
                    return 400, {"detail": "Missing 'method' in request body"}
                if body["method"] == "reload_weights":
                    if self.fail_reload:
                        return 500, {"error": {"message": "weights could not be loaded", "code": 500}}
                    self.loaded_weights = body.get("kwargs", {}).get("weights_path")
                return 200, {"results": [None]}
            case "/reset_prefix_cache":
                return 200, {"success": True}
            case "/update_weight_version":
                self.weight_version = str(body["new_version"])
                return 200, {"success": True, "new_version": self.weight_version}
            case "/v1/load_lora_adapter":
                name = body["lora_name"]
                if name in self.loras and not body.get("load_inplace"):
                    return 400, {"error": {"message": f"The lora adapter '{name}' has already been loaded.",
                                           "code": 400}}  # fmt: skip
                self.loras[name] = body["lora_path"]
                return 200, f"Success: LoRA adapter '{name}' added successfully."
            case "/v1/unload_lora_adapter":
                name = body["lora_name"]
                if self.loras.pop(name, None) is None:
                    return 404, {"error": {"message": f"The lora adapter '{name}' cannot be found.", "code": 404}}
                return 200, f"Success: LoRA adapter '{name}' removed successfully."
        return 404, {"error": {"message": f"no route {path}"}}

    def _headers(self, content_type: bytes) -> list[tuple[bytes, bytes]]:
        headers = [(b"content-type", content_type)]
        if self.weights_version is not None:
            headers.append((b"x-rollwire-weights-version", str(self.weights_version).encode()))
        return headers

    async def _json(self, send: Any, status: int, payload: Any) -> None:
        await send({"type": "http.response.start", "status": status, "headers": self._headers(b"application/json")})
        await send({"type": "http.response.body", "body": _encode(payload)})

    def _draw(self) -> int:
        """0, or with `vary` a new number per request (mixed into what is sampled)."""
        if not self.vary:
            return 0
        with self.lock:
            self.draws += 1
            return self.draws

    def _choices(self, request: dict[str, Any], epoch: int) -> tuple[list[int], list[dict[str, Any]]]:
        prompt = prompt_ids(request.get("messages") or [])
        if self.forge_prompt_token is not None and prompt:
            prompt[-1] = self.forge_prompt_token
        limit = int(request.get("max_tokens") or request.get("max_completion_tokens") or 8)
        count = min(limit, self.answer_tokens or limit)
        tools = request.get("tools") or []
        messages = request.get("messages") or [{}]
        # A scripted agent turn: call the first tool, then answer in text once its result is in.
        answered = isinstance(messages[-1], dict) and messages[-1].get("role") == "tool"
        use_tool = bool(tools) and request.get("tool_choice") != "none" and not answered
        choices = []
        draw = self._draw()
        for index in range(int(request.get("n") or 1)):
            tokens, logprobs = sample(prompt, index, count, draw)
            if self.forge_token is not None and tokens:
                tokens[0] = self.forge_token
            choice: dict[str, Any] = {
                "index": index,
                "tokens": tokens,
                "logprobs": logprobs,
                "pieces": detokenize(tokens),
                "finish_reason": "stop" if answered or count < limit else "length",
            }
            if use_tool:
                name, arguments = self._tool_call(tools, tokens[0])
                choice["tool_call"] = {
                    "id": f"call_{index}_{tokens[0]}",
                    "type": "function",
                    "function": {"name": name, "arguments": arguments},
                }
                choice["finish_reason"] = "tool_calls"
            choices.append(choice)
            if self.record and epoch == self.epoch:
                with self.lock:
                    self.served.append(
                        {
                            "prompt_ids": prompt,
                            "token_ids": tokens,
                            "logprobs": logprobs,
                            "finish_reason": choice["finish_reason"],
                            "index": index,
                        }
                    )
        return prompt, choices

    def _token_in(self, request: dict[str, Any]) -> dict[str, Any]:
        """A non-streamed token-in completion (continuous prompt mode): the `prompt` ids as they are, and per
        choice `text`, `token_ids`, `prompt_token_ids` and `logprobs.token_logprobs`, as vLLM's
        `CompletionResponse` (`vllm/entrypoints/openai/protocol.py`, v0.10.2 and later) has them."""
        prompt = [int(t) for t in request.get("prompt") or []]
        count = int(request.get("max_tokens") or 8)
        choices: list[dict[str, Any]] = []
        completion = 0
        draw = self._draw()
        for index in range(int(request.get("n") or 1)):
            tokens, logprobs = sample(prompt, index, count, draw)
            completion += len(tokens)
            pieces = detokenize(tokens)
            choices.append(
                {
                    "index": index,
                    "text": "".join(pieces),
                    "finish_reason": "length",
                    "stop_reason": None,
                    "prompt_token_ids": prompt,
                    "token_ids": tokens,
                    "logprobs": {"tokens": pieces, "token_logprobs": logprobs, "top_logprobs": None,
                                 "text_offset": [0] * len(tokens)},
                }
            )  # fmt: skip
        usage = {
            "prompt_tokens": len(prompt),
            "completion_tokens": completion,
            "total_tokens": len(prompt) + completion,
        }
        return {"id": "cmpl-fake", "object": "text_completion", "created": int(time.time()), "model": self.model,
                "choices": choices, "usage": usage}  # fmt: skip

    def _tool_call(self, tools: list[Any], token: int) -> tuple[str, str]:
        """The scripted call (the first tool named in `tool_script`), else the first tool with `{"x": N}`."""
        names = [t.get("function", {}).get("name") for t in tools if isinstance(t, dict)]
        for name, arguments in self.tool_script.items():
            if name in names:
                return name, arguments
        return names[0] or "tool", f'{{"x": {token % 100}}}'

    async def _complete(self, request: dict[str, Any], send: Any, epoch: int) -> None:
        prompt, choices = self._choices(request, epoch)
        out_choices = []
        for c in choices:
            text = None if "tool_call" in c else "".join(c["pieces"])
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if self.reasoning:
                message["reasoning_content"] = self.reasoning
            if "tool_call" in c:
                message["tool_calls"] = [c["tool_call"]]
            choice: dict[str, Any] = {
                "index": c["index"],
                "message": message,
                "finish_reason": c["finish_reason"],
                "logprobs": None,
            }
            if request.get("logprobs"):
                choice["logprobs"] = {
                    "content": [
                        {"token": p, "logprob": lp, "bytes": None, "top_logprobs": []}
                        for p, lp in zip(c["pieces"], c["logprobs"], strict=True)
                    ]
                }
            if request.get("return_token_ids"):
                choice["token_ids"] = c["tokens"]
            out_choices.append(choice)
        completion = sum(len(c["tokens"]) for c in choices)
        payload: dict[str, Any] = {
            "id": f"chatcmpl-{prompt[-1] if prompt else 0}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model,
            "choices": out_choices,
            "usage": {
                "prompt_tokens": len(prompt),
                "completion_tokens": completion if self.forge_usage is None else self.forge_usage,
                "total_tokens": len(prompt) + completion,
            },
        }
        if request.get("return_token_ids"):
            payload["prompt_token_ids"] = prompt
        await self._json(send, 200, payload)

    async def _stream(self, request: dict[str, Any], receive: Any, send: Any, epoch: int) -> None:
        prompt, choices = self._choices(request, epoch)
        await send({"type": "http.response.start", "status": 200, "headers": self._headers(b"text/event-stream")})
        disconnected = asyncio.Event()

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            disconnected.set()

        watcher = asyncio.ensure_future(watch())
        base = {
            "id": "chatcmpl-stream",
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": self.model,
        }
        usage_wanted = bool((request.get("stream_options") or {}).get("include_usage"))

        def chunk(choices_: list[dict[str, Any]], first: bool = False) -> bytes:
            payload = {**base, "choices": choices_}
            if first and request.get("return_token_ids"):
                payload["prompt_token_ids"] = prompt
            if usage_wanted:
                payload["usage"] = None
            return b"data: " + _encode(payload) + b"\n\n"

        try:
            await send(
                {
                    "type": "http.response.body",
                    "more_body": True,
                    "body": chunk(
                        [
                            {
                                "index": c["index"],
                                "delta": {"role": "assistant", "content": ""},
                                "finish_reason": None,
                                "logprobs": None,
                            }
                            for c in choices
                        ],
                        first=True,
                    ),
                }
            )
            if self.reasoning:
                thought = [{"index": c["index"], "delta": {"reasoning_content": self.reasoning}, "finish_reason": None}
                           for c in choices]  # fmt: skip
                await send({"type": "http.response.body", "more_body": True, "body": chunk(thought)})
            steps = max(len(c["tokens"]) for c in choices)
            for step in range(steps):
                if self.token_delay_s:
                    await asyncio.sleep(self.token_delay_s)
                if disconnected.is_set():
                    self.aborted += 1
                    return
                parts = []
                for c in choices:
                    if step >= len(c["tokens"]):
                        continue
                    last = step == len(c["tokens"]) - 1
                    delta: dict[str, Any]
                    if "tool_call" in c:
                        call = c["tool_call"]
                        delta = (
                            {
                                "tool_calls": [
                                    {
                                        "index": 0,
                                        "id": call["id"],
                                        "type": "function",
                                        "function": {"name": call["function"]["name"], "arguments": ""},
                                    }
                                ]
                            }
                            if step == 0
                            else {
                                "tool_calls": [
                                    {
                                        "index": 0,
                                        "function": {"arguments": call["function"]["arguments"] if last else ""},
                                    }
                                ]
                            }
                        )
                    else:
                        delta = {"content": c["pieces"][step]}
                    part: dict[str, Any] = {
                        "index": c["index"],
                        "delta": delta,
                        "finish_reason": c["finish_reason"] if last else None,
                        "logprobs": None,
                    }
                    if request.get("logprobs"):
                        part["logprobs"] = {
                            "content": [
                                {
                                    "token": c["pieces"][step],
                                    "logprob": c["logprobs"][step],
                                    "bytes": None,
                                    "top_logprobs": [],
                                }
                            ]
                        }
                    if request.get("return_token_ids"):
                        part["token_ids"] = [c["tokens"][step]]
                    parts.append(part)
                await send({"type": "http.response.body", "more_body": True, "body": chunk(parts)})
            tail = b""
            if usage_wanted:
                completion = sum(len(c["tokens"]) for c in choices)
                tail += (
                    b"data: "
                    + _encode(
                        {
                            **base,
                            "choices": [],
                            "usage": {
                                "prompt_tokens": len(prompt),
                                "completion_tokens": completion,
                                "total_tokens": len(prompt) + completion,
                            },
                        }
                    )
                    + b"\n\n"
                )
            await send({"type": "http.response.body", "body": tail + b"data: [DONE]\n\n"})
        finally:
            watcher.cancel()


def fake_vllm_python(directory: Path) -> Path:
    """An executable `directory/python` standing in for vLLM's: `-m vllm.entrypoints.openai.api_server --model M
    ...` runs this module as `serve M ...` (see the module docstring)."""
    executable = directory / "python"
    executable.write_text(
        f"#!{sys.executable}\nimport runpy, sys\nsys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "args = sys.argv[1:]\nassert args[:2] == ['-m', 'vllm.entrypoints.openai.api_server'], args\n"
        "sys.argv = [sys.argv[0], 'serve', args[3], *args[4:]]\n"
        "runpy.run_path(sys.path[0] + '/fake_vllm.py', run_name='__main__')\n"
    )
    executable.chmod(executable.stat().st_mode | stat.S_IEXEC)
    return executable


def main() -> None:
    """Serve a FakeVLLM on a port (for the benchmark, or as `serve MODEL ...`: see `fake_vllm_python`)."""
    import uvicorn

    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--served-model-name", default="fake-model")
    argv = sys.argv[1:]
    serving = bool(argv) and argv[0] == "serve"
    args, _ = parser.parse_known_args(argv[2:] if serving else argv)
    if serving and os.environ.get("FAKE_VLLM_LOG"):
        with open(os.environ["FAKE_VLLM_LOG"], "a") as log:
            env = {k: v for k, v in os.environ.items() if k.startswith("VLLM_") or k == "CUDA_VISIBLE_DEVICES"}
            log.write(_encode({"argv": argv, "env": env}).decode() + "\n")
    app = FakeVLLM(weights_version=None if serving else 7, model=args.served_model_name)
    app.record = False
    app.vary = os.environ.get("FAKE_VLLM_VARY") == "1"
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level="warning",
        access_log=False,
        http="httptools",
        loop="uvloop",
        lifespan="off",
    )


if __name__ == "__main__":
    main()
