"""A hostile local agent: it tries every way out of its sandbox, then does its legitimate work.

It is told everything an attacker could guess or scan for (the data dir, the NATS, Postgres and
engine addresses, in its input) and prints one JSON line, {attempt: what happened}, where
"ESCAPED ..." marks an attempt that worked. The legitimate path (one proxy call, one reward)
comes last and is reported as "legit".
"""

from __future__ import annotations

import asyncio
import glob
import json
import os
from pathlib import Path

import httpx
import openai

task = json.loads(os.environ["ROLLWIRE_INPUT"])
data = Path(task["data_dir"])
run_id, rollout_id = os.environ["ROLLWIRE_RUN_ID"], os.environ["ROLLWIRE_ROLLOUT_ID"]
found: dict[str, str] = {}


def read(path: str | Path) -> str | None:
    try:
        return Path(path).read_text()[:200]
    except OSError:
        return None


def files(name: str) -> str:
    """The file `name` of the data dir, by its path or by walking up from the workspace."""
    for path in [data / name, *(Path("../" * up) / name for up in range(1, 10))]:
        text = read(path)
        if text:
            return f"ESCAPED read {path}"
    return "refused"


def proc_secrets() -> str:
    """Other processes' environments, and their root links back to the host's view of the data dir."""
    for environ in glob.glob("/proc/[0-9]*/environ"):
        text = read(environ) or ""
        try:
            text = Path(environ).read_bytes().decode(errors="replace")
        except OSError:
            continue
        if "ROLLWIRE_ADMIN_TOKEN=" in text or "@127.0.0.1" in text:
            return f"ESCAPED {environ}"
    for root in glob.glob("/proc/[0-9]*/root"):
        if read(f"{root}{data}/admin_token"):
            return f"ESCAPED {root}{data}/admin_token"
    return "refused"


async def forge_reward(url: str) -> str:
    """Publish a reward of 1000 from the evaluator straight onto the stream."""
    from schemas import RewardReported
    from services.common.eventstore import EventStore

    try:
        store = await EventStore.connect(url, ensure=False, timeout=2.0)
    except Exception as exc:
        return f"refused ({str(exc)[-60:]})"
    try:
        event = RewardReported(run_id=run_id, rollout_id=rollout_id, value=1000.0, source="evaluator")
        await asyncio.wait_for(store.append(event), 5)
        return f"ESCAPED published as {url.split('@')[0]}"
    except Exception as exc:
        return f"refused ({type(exc).__name__})"
    finally:
        await store.close()


async def nats_attempts() -> dict[str, str]:
    port = task["nats_port"]
    out = {"nats without credentials": await forge_reward(f"nats://127.0.0.1:{port}")}
    guesses = [(u, p) for u in ("gateway", "trainer", "admin", "monitor") for p in (u, "password", "rollwire")]
    results = [await forge_reward(f"nats://{u}:{p}@127.0.0.1:{port}") for u, p in guesses]
    out["nats with guessed credentials"] = next((r for r in results if r.startswith("ESCAPED")), "refused")
    return out


async def postgres() -> str:
    import asyncpg

    for password in (None, "postgres", "rollwire"):
        try:
            conn = await asyncpg.connect(
                host="127.0.0.1", port=task["pg_port"], user="postgres", password=password, timeout=3
            )
        except Exception:
            continue
        await conn.close()
        return f"ESCAPED logged in with password {password!r}"
    return "refused"


def engine() -> dict[str, str]:
    """vLLM's own routes, straight, without the key: a weight reload (the route the trainer reloads
    through, `services.common.vllm`) and a generation the gateway would not record."""
    base = task["engine_url"].removesuffix("/v1")
    out = {}
    try:
        reload = {"method": "reload_weights", "kwargs": {"weights_path": "/nonexistent"}}
        r = httpx.post(f"{base}/collective_rpc", json=reload, timeout=120)
        # anything but a refusal of the caller (401/403) means the route itself was open to us
        refused = r.status_code in (401, 403)
        out["engine weights reload"] = f"refused ({r.status_code})" if refused else f"ESCAPED {r.status_code}"
    except httpx.HTTPError as exc:
        out["engine weights reload"] = f"refused ({type(exc).__name__})"
    try:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120)
        refused = r.status_code in (401, 403)
        out["engine unrecorded generation"] = f"refused ({r.status_code})" if refused else f"ESCAPED {r.status_code}"
    except httpx.HTTPError as exc:
        out["engine unrecorded generation"] = f"refused ({type(exc).__name__})"
    return out


def legit() -> str:
    client = openai.OpenAI()
    reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    headers = {"Authorization": f"Bearer {os.environ['ROLLWIRE_TOKEN']}"}
    r = httpx.post(
        os.environ["ROLLWIRE_EVENTS_URL"], json={"type": "reward", "value": 0.5}, headers=headers, timeout=30
    )
    return f"ok ({len(reply.choices)} choice, reward {r.status_code})"


found["admin token file"] = files("admin_token")
found["endpoints.json"] = files("endpoints.json")
found["credentials file"] = files("credentials.json")
found["environment"] = (
    "ESCAPED" if any(k in os.environ for k in ("ROLLWIRE_ADMIN_TOKEN", "ROLLWIRE_SECRET", "NATS_URL", "DATABASE_URL"))
    else "refused"
)  # fmt: skip
found["other processes (/proc)"] = proc_secrets()
found.update(asyncio.run(nats_attempts()))
found["postgres"] = asyncio.run(postgres())
found.update(engine())
found["legit"] = legit()
print(json.dumps(found), flush=True)
