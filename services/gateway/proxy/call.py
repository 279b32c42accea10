"""One model call while it is proxied: who made it, what is sent and recorded, and what it produced.

The front end builds a `Call` at admission; continuous prompt mode (`continuity.py`) rewrites its
payload; the pipeline (`pipeline.py`) forwards it, folds the answer into an `Outcome` and records it.
"""

from __future__ import annotations

from typing import Any

import msgspec

from schemas.rollout import RolloutView
from services.gateway.proxy.frontends.base import Translator
from services.gateway.proxy.ledger import Charge
from services.gateway.proxy.openai_format import ChoiceRecord
from services.gateway.proxy.promptids import PromptIds
from services.gateway.state import ModelEntry


class Upstream(msgspec.Struct):
    """An upstream answer read in full: status, the weights version header, body bytes."""

    status: int
    weights: str | None
    content: bytes


class Call(msgspec.Struct, kw_only=True):
    """One admitted call: who, where to, what to send and record, and how to answer."""

    view: RolloutView
    attempt_id: str
    mode: str
    model: ModelEntry
    call_id: str
    api: str
    payload: bytes
    recorded_request: dict[str, Any]
    stream: bool
    translator: Translator
    started: float = 0.0
    started_at: float = 0.0
    agent: str | None = None
    endpoint: str = "/chat/completions"
    continuity: str | None = None
    parse_tools: bool = False
    parse_reasoning: bool = False
    prompt_size: int | None = None
    """Tokens of a prompt known before the call (a token-in prompt's ids), for its reservation."""
    used: int | None = None
    """Tokens the engine spent on the call (None: unknown, the call is charged its reservation)."""
    seqs: list[int] = msgspec.field(default_factory=list)
    """Stream sequences of the call's records."""
    record_bytes: int = 0
    """Bytes of its records that count against the byte budget (those of a failed or aborted call)."""

    def note(self, outcome: Outcome) -> None:
        """Note the tokens an outcome shows the engine spent (its prompt and responses), when it shows any."""
        if len(outcome.prompt_ids) or outcome.records:
            self.used = len(outcome.prompt_ids) + sum(len(r.token_ids) for r in outcome.records)

    def spent(self, reserved: Charge) -> Charge:
        """What the call spent, to settle its reservation with."""
        tokens = reserved.tokens if self.used is None else self.used
        return Charge(calls=1 if self.seqs else 0, tokens=tokens, bytes=self.record_bytes)

    @property
    def token_in(self) -> bool:
        """Sent as a token-in completion (continuous prompt mode), answered back as chat."""
        return self.endpoint == "/completions"


class Outcome(msgspec.Struct, kw_only=True):
    """What a call produced, to record."""

    status: str
    prompt_ids: PromptIds = msgspec.field(default_factory=list)
    """The prompt's ids (an int32 array when parsed straight from the engine's answer)."""
    records: list[ChoiceRecord] = msgspec.field(default_factory=list)
    usage: Any = None
    weights: str | None = None
    error: str | None = None
    model: str | None = None
