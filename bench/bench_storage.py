"""Storage per token of long rollouts: bytes per distinct token in JetStream and Postgres, full vs compact.

    python bench/bench_storage.py                    # 60- and 120-turn rollouts (about a minute)
    python bench/bench_storage.py --turns 30 60 120

Everything runs here: an embedded nats-server and Postgres, an upstream engine that speaks vLLM's
format with a consistent chat template (each prompt ends with the assistant header, each response
with the end token, so the next prompt starts with the previous prompt + response, as with a real
model), and two real gateways in this process: one recording `full` (schema version 1: every
call's full prompt ids and request, as the code before version 2 did) and one `compact` (version
2: references and packed arrays). A plain `openai` tool loop drives each rollout: every turn adds a
~1,800-character tool result and a 100-token answer (about 565 tokens a turn). The projector then
projects the stream into Postgres, where a compact call's row, like its event, stores a reference
to the earlier call's row and only the new ids, text and request parts (`full` calls' rows hold
their full prompts). Printed per turns and format: the rollout's distinct tokens (its final
context), the bytes of its messages in JetStream, the bytes of its model-call rows in Postgres
(`pg_column_size` of the rows, as stored), and each per distinct token.

Measured (schema version 4, bytes per distinct token, JetStream / Postgres, at 30, 60 and 120 turns):

    --chars-per-token 1   full     72.4 / 74.4   137.6 / 143.5   268.0 / 281.6
                          compact   7.8 / 7.7      7.7 / 7.8       7.7 / 7.8
    --chars-per-token 4   full    161.2 / 99.8   315.1 / 194.2   623.6 / 384.0
                          compact  11.3 / 11.3    11.3 / 11.3     11.3 / 11.3

(Version 3, which wrote every field at its default too, took 8.1 on the stream at 1 byte per token.)
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import msgspec
import numpy as np
import openai

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "services" / "gateway"))
sys.path.insert(0, str(ROOT / "tests"))

from gw_harness import ADMIN, Served, gateway_settings  # noqa: E402

from services.common.eventstore import EventStore  # noqa: E402
from services.devstack.embedded import NatsServer, PostgresServer  # noqa: E402
from services.gateway import create_app  # noqa: E402
from services.projector.service import Projector, ProjectorSettings  # noqa: E402

_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder(dict[str, Any]).decode
ROLES = {"system": 1, "user": 2, "assistant": 3, "tool": 4}
END = 5
ANSWER_TOKENS = 100
WORDS = [f"w{i:03d}" for i in range(1000)]  # 4 bytes each: one token per word


CHARS = 4
"""Bytes of text per token (`--chars-per-token`): 4 is like a BPE vocabulary on English and code."""


def tokenize(text: str) -> list[int]:
    """One token per CHARS bytes of UTF-8 (padded), offset past the special ids."""
    data = text.encode()
    data += b" " * (-len(data) % CHARS)
    return [6 + int.from_bytes(data[i : i + CHARS], "little") % 150_000 for i in range(0, len(data), CHARS)]


def render(messages: list[dict[str, Any]]) -> list[int]:
    """The chat template: each message as role id, content, end; then the assistant header."""
    ids: list[int] = []
    for message in messages:
        ids.append(ROLES.get(message.get("role", ""), 2))
        ids.extend(tokenize(message.get("content") or ""))
        ids.append(END)
    ids.append(ROLES["assistant"])
    return ids


class TemplateEngine:
    """vLLM's non-streamed chat-completions format: prompt_token_ids, token_ids and logprobs."""

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        request = _decode(body)
        prompt = render(request["messages"])
        seed = int.from_bytes(hashlib.blake2b(_encode(prompt[-8:]), digest_size=4).digest(), "little")
        rng = np.random.default_rng(seed)
        words = [WORDS[i] for i in rng.integers(0, len(WORDS), (ANSWER_TOKENS - 1) * CHARS // 4)]
        text = "".join(words)
        tokens = [*tokenize(text), END]
        logprobs = [float(x) for x in (-rng.random(len(tokens))).astype(np.float32)]
        payload = {
            "id": "cmpl",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": "template",
            "prompt_token_ids": prompt,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": "stop",
                    "token_ids": tokens,
                    "logprobs": {"content": [{"token": "x", "logprob": lp, "top_logprobs": []} for lp in logprobs]},
                }
            ],
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(tokens), "total_tokens": 0},
        }
        headers = [(b"content-type", b"application/json"), (b"x-rollwire-weights-version", b"1")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": _encode(payload)})


def rollout(gateway: str, run_id: str, engine: str, turns: int) -> tuple[str, int]:
    """One rollout of `turns` calls through the gateway; returns its id and distinct tokens."""
    admin = httpx.Client(base_url=gateway, headers={"authorization": f"Bearer {ADMIN}"}, timeout=60)
    admin.post("/api/models", json={"name": "policy", "base_url": f"{engine}/v1", "run_id": run_id}).raise_for_status()
    created = admin.post("/api/rollouts", json={"rollouts": [{"run_id": run_id, "input": {}}]})
    rollout_id = created.json()["rollouts"][0]["rollout_id"]
    attempt = admin.post(f"/api/rollouts/{rollout_id}/attempts", json={}).json()
    client: Any = openai.OpenAI(base_url=attempt["proxy_base_url"], api_key=attempt["token"], max_retries=0)
    rng = np.random.default_rng(turns)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a coding agent. Use the shell tool. " * 8},
        {"role": "user", "content": "Fix the failing test in the repository."},
    ]
    last: list[int] = []
    for _ in range(turns):
        answer = client.chat.completions.create(model="policy", messages=messages, max_tokens=ANSWER_TOKENS)
        text = answer.choices[0].message.content
        output = "".join(WORDS[i] for i in rng.integers(0, len(WORDS), 450 * CHARS // 4))
        last = render(messages)
        last += [*tokenize(text), END]
        messages = [*messages, {"role": "assistant", "content": text}, {"role": "tool", "content": output}]
    admin.close()
    return rollout_id, len(last)


async def _measure(nats_url: str, pg_url: str, run_id: str, rollout_id: str) -> tuple[int, int]:
    store = await EventStore.connect(nats_url, ensure=False)
    try:
        subject = f"rl.{run_id}.rollout.{rollout_id}.>"
        stream_bytes = 0
        async for batch in store.read_raw(subject):
            stream_bytes += sum(len(m.data) for m in batch)
        last = await store.last_sequence()
    finally:
        await store.close()
    projector = Projector(ProjectorSettings(nats_url=nats_url, database_url=pg_url))
    task = asyncio.create_task(projector.run())
    conn = await asyncpg.connect(pg_url)
    try:
        while (await _position(conn)) < last:
            await asyncio.sleep(0.1)
        rows = await conn.fetchval(
            "SELECT coalesce(sum(pg_column_size(m.*)), 0) FROM model_calls m WHERE run_id = $1", run_id
        )
    finally:
        await conn.close()
        projector.stop.set()
        await asyncio.wait_for(task, 60)
    return stream_bytes, int(rows)


async def _position(conn: asyncpg.Connection) -> int:
    try:
        return int(await conn.fetchval("SELECT coalesce(max(last_seq), 0) FROM projector_position") or 0)
    except asyncpg.UndefinedTableError:
        return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, nargs="+", default=[60, 120])
    parser.add_argument("--chars-per-token", type=int, choices=[1, 2, 3, 4], default=4)
    args = parser.parse_args()
    global CHARS
    CHARS = args.chars_per_token
    print(f"{CHARS} bytes of text per token")
    with tempfile.TemporaryDirectory() as tmp:
        nats = NatsServer(Path(tmp) / "nats").start()
        pg = PostgresServer(Path(tmp) / "pg", durable=False).start()
        try:
            engine_app = TemplateEngine()
            with Served(engine_app) as engine:
                gateways = {
                    fmt: Served(create_app(settings), settings.port)
                    for fmt in ("full", "compact")
                    for settings in [gateway_settings(nats.url, record_format=fmt, max_body_bytes=64 << 20)]
                }
                for served in gateways.values():
                    served.__enter__()
                try:
                    print(f"{'turns':>5} {'format':>8} {'tokens':>8} {'JetStream':>11} {'B/token':>8} "
                          f"{'Postgres':>11} {'B/token':>8} {'s':>6}")  # fmt: skip
                    for turns in args.turns:
                        for fmt, served in gateways.items():
                            run_id = f"s{turns}{fmt}c{CHARS}"
                            started = time.perf_counter()
                            rollout_id, tokens = rollout(served.url, run_id, engine.url, turns)
                            elapsed = time.perf_counter() - started
                            js, rows = asyncio.run(_measure(nats.url, pg.url, run_id, rollout_id))
                            print(
                                f"{turns:>5} {fmt:>8} {tokens:>8} {js:>11,} {js / tokens:>8.1f} "
                                f"{rows:>11,} {rows / tokens:>8.1f} {elapsed:>6.1f}",
                                flush=True,
                            )
                finally:
                    for served in gateways.values():
                        served.__exit__(None, None, None)
        finally:
            pg.stop()
            nats.stop()


if __name__ == "__main__":
    main()
