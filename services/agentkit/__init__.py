"""A tiny helper for agents run by the Rollwire controller: read the input, report a reward, emit events.

Any harness in any language can do without it: the controller hands every execution its whole
contract in environment variables, and this module only reads them. It depends on nothing but
`httpx` and the standard library, so it can also be copied next to an agent on its own.

    OPENAI_BASE_URL       the proxy base URL of this attempt (point the OpenAI client here)
    OPENAI_API_KEY        the attempt's token (the OpenAI client sends it as a Bearer token)
    ROLLWIRE_TOKEN        the token for the events endpoint (the agent's token, or the evaluator's)
    ROLLWIRE_EVENTS_URL   where rewards and custom events of this attempt are posted
    ROLLWIRE_RUN_ID, ROLLWIRE_ROLLOUT_ID, ROLLWIRE_ATTEMPT_ID
    ROLLWIRE_INPUT        the rollout's input as JSON (left out when it is large)
    ROLLWIRE_INPUT_FILE   a file holding the same JSON (always set)

Example agent:

    from openai import OpenAI
    from services import agentkit

    task = agentkit.read_input()
    reply = OpenAI().chat.completions.create(model="any", messages=[{"role": "user", "content": task["q"]}])
    agentkit.report_reward(1.0 if reply.choices[0].message.content == task["a"] else 0.0)
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import httpx

BACKOFF_S = (0.2, 5.0)
"""First delay between tries and the cap (doubling between them), in seconds."""
RETRY_STATUSES = frozenset({502, 503, 504})


class AgentkitError(RuntimeError):
    """The attempt's environment is incomplete or the gateway refused a call; the message says which."""


@dataclass(frozen=True)
class Attempt:
    """What the controller told this execution about itself (see the module docstring)."""

    run_id: str
    rollout_id: str
    attempt_id: str
    events_url: str
    token: str
    base_url: str | None
    input_json: str | None
    input_file: str | None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Attempt:
        """Read the attempt from the environment; raises AgentkitError naming a missing variable."""
        env = os.environ if env is None else env

        def need(name: str) -> str:
            value = env.get(name)
            if not value:
                raise AgentkitError(f"{name} is not set: run this agent through the Rollwire controller")
            return value

        token = env.get("ROLLWIRE_TOKEN") or env.get("OPENAI_API_KEY")
        if not token:
            raise AgentkitError("neither ROLLWIRE_TOKEN nor OPENAI_API_KEY is set: no token for the events endpoint")
        return cls(
            run_id=env.get("ROLLWIRE_RUN_ID", ""),
            rollout_id=need("ROLLWIRE_ROLLOUT_ID"),
            attempt_id=need("ROLLWIRE_ATTEMPT_ID"),
            events_url=need("ROLLWIRE_EVENTS_URL"),
            token=token,
            base_url=env.get("OPENAI_BASE_URL"),
            input_json=env.get("ROLLWIRE_INPUT"),
            input_file=env.get("ROLLWIRE_INPUT_FILE"),
        )

    def read_input(self) -> Any:
        """The rollout's input: from ROLLWIRE_INPUT, or from ROLLWIRE_INPUT_FILE when it was too large."""
        if self.input_json is not None:
            return json.loads(self.input_json)
        if self.input_file:
            with open(self.input_file, encoding="utf-8") as handle:
                return json.load(handle)
        raise AgentkitError("neither ROLLWIRE_INPUT nor ROLLWIRE_INPUT_FILE is set: the rollout's input is unknown")

    def post(self, body: dict[str, Any], *, retries: int = 5, timeout: float = 10.0) -> dict[str, Any]:
        """POST one event body to the attempt's events URL, retrying transient failures.

        One idempotency key covers every retry, so an event the gateway stored before the
        connection dropped is not stored twice.
        """
        headers = {"Authorization": f"Bearer {self.token}", "Idempotency-Key": uuid.uuid4().hex}

        delay, cap = BACKOFF_S
        for attempt in range(retries + 1):
            try:
                response = httpx.post(self.events_url, json=body, headers=headers, timeout=timeout)
            except httpx.TransportError as exc:
                if attempt == retries:
                    raise AgentkitError(f"could not reach the gateway at {self.events_url}: {exc}") from None
            else:
                if response.status_code not in RETRY_STATUSES or attempt == retries:
                    break
            time.sleep(min(cap, delay * 2.0**attempt))
        if response.status_code >= 400:
            raise AgentkitError(
                f"the gateway refused {body.get('type')} with {response.status_code}: {_error_text(response)}"
            )
        return dict(response.json()) if response.content else {}

    def report_reward(self, value: float, *, name: str | None = None, step: int | None = None) -> dict[str, Any]:
        """Report a scalar reward for this attempt (the last reward of the succeeded attempt counts)."""
        body: dict[str, Any] = {"type": "reward", "value": float(value)}
        if name is not None:
            body["name"] = name
        if step is not None:
            body["step"] = step
        return self.post(body)

    def emit(self, name: str, payload: dict[str, Any] | None = None) -> dict[str, Any]:
        """Emit a custom event `name` (subject `rl.<run>.rollout.<rollout>.event.<name>`)."""
        return self.post({"type": "custom", "name": name, "payload": payload or {}})


def _error_text(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text[:500]
    if isinstance(body, dict) and "error" in body:
        return str(body["error"])
    return json.dumps(body)[:500]


_current: Attempt | None = None


def current() -> Attempt:
    """The attempt this process runs (read from the environment once)."""
    global _current
    if _current is None:
        _current = Attempt.from_env()
    return _current


def read_input() -> Any:
    """The rollout's input (see `Attempt.read_input`)."""
    return current().read_input()


def report_reward(value: float, *, name: str | None = None, step: int | None = None) -> dict[str, Any]:
    """Report a reward for the current attempt (see `Attempt.report_reward`)."""
    return current().report_reward(value, name=name, step=step)


def emit(name: str, payload: dict[str, Any] | None = None) -> dict[str, Any]:
    """Emit a custom event for the current attempt (see `Attempt.emit`)."""
    return current().emit(name, payload)


def agent_base_url(name: str, base_url: str | None = None) -> str:
    """The OpenAI base URL of agent `name` of this attempt: `OPENAI_BASE_URL` with `/agent/{name}` before `/openai/v1`.

    Calls through it are recorded with `agent = name`, and routed to the model the run gives that
    agent. A harness that cannot vary its base URL sends the `X-Rollwire-Agent: name` header instead.
    """
    base = (base_url or os.environ.get("OPENAI_BASE_URL") or "").rstrip("/")
    if not base.endswith("/openai/v1"):
        raise AgentkitError(f"OPENAI_BASE_URL {base!r} is not a Rollwire proxy base URL (ending in /openai/v1)")
    if not name or any(c in name for c in "./*> \t\n"):
        raise AgentkitError(f"agent name {name!r} must be an id (no '.', '*', '>', '/' or whitespace)")
    return f"{base.removesuffix('/openai/v1')}/agent/{name}/openai/v1"
