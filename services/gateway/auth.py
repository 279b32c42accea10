"""Who is calling: the admin token, or a signed token scoped to one attempt.

Agents are untrusted (RL agents learn to hack rewards), so an agent only ever holds a token that
names its run, rollout and attempt, signed with the gateway's secret:

    rw1.<base64url(JSON [role, run_id, rollout_id, attempt_id])>.<base64url(HMAC-SHA256)>

`role` is `agent` (proxy calls and events of that attempt) or `evaluator` (events of that
attempt, including rewards when the run wants them from an evaluator). A token is deterministic
for its scope, so re-issuing it is idempotent; it stops working when the attempt ends because
every use checks the attempt's state, not a clock.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from typing import Literal

import msgspec

from schemas import InvalidId, check_id

TOKEN_PREFIX = "rw1"
Role = Literal["agent", "evaluator"]


class Admin(msgspec.Struct, frozen=True):
    """The trainer, the controller or an operator: may do everything."""


class AttemptScope(msgspec.Struct, frozen=True):
    """The holder of a token for one attempt (an agent or its evaluator)."""

    role: Role
    run_id: str
    rollout_id: str
    attempt_id: str


Principal = Admin | AttemptScope
ADMIN = Admin()

_payload_decoder = msgspec.json.Decoder(tuple[str, str, str, str])


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


VERIFIED_CACHE = 16_384
"""Valid tokens a signer remembers (a few MB at most)."""


class TokenSigner:
    """Issues and checks attempt tokens with one secret."""

    def __init__(self, secret: str) -> None:
        if not secret:
            raise ValueError("the token signing secret must not be empty: set ROLLWIRE_SECRET")
        self._key = hashlib.sha256(secret.encode()).digest()
        self._verified: dict[str, AttemptScope] = {}
        """Tokens this signer verified (a valid token's scope never changes): every model call presents one."""

    def _sign(self, body: str) -> str:
        return _b64(hmac.new(self._key, f"{TOKEN_PREFIX}.{body}".encode(), hashlib.sha256).digest())

    def issue(self, role: Role, run_id: str, rollout_id: str, attempt_id: str) -> str:
        """A token that lets its holder act for one attempt in the given role."""
        body = _b64(msgspec.json.encode([role, run_id, rollout_id, attempt_id]))
        return f"{TOKEN_PREFIX}.{body}.{self._sign(body)}"

    def verify(self, token: str) -> AttemptScope | None:
        """The scope of a valid token, or None when it is malformed or not signed by us.

        Valid tokens are remembered (up to `VERIFIED_CACHE` of them, then the memory starts over), so a
        token's HMAC is computed once and not on each of its calls; an invalid one is checked every time."""
        known = self._verified.get(token)
        if known is not None:
            return known
        scope = self._verify(token)
        if scope is not None:
            if len(self._verified) >= VERIFIED_CACHE:
                self._verified.clear()
            self._verified[token] = scope
        return scope

    def _verify(self, token: str) -> AttemptScope | None:
        parts = token.split(".")
        if len(parts) != 3 or parts[0] != TOKEN_PREFIX:
            return None
        body, signature = parts[1], parts[2]
        if not hmac.compare_digest(signature, self._sign(body)):
            return None
        try:
            role, run_id, rollout_id, attempt_id = _payload_decoder.decode(_unb64(body))
            for kind, value in (("run_id", run_id), ("rollout_id", rollout_id), ("attempt_id", attempt_id)):
                check_id(kind, value)
        except (msgspec.DecodeError, msgspec.ValidationError, InvalidId, ValueError):
            return None
        if role not in ("agent", "evaluator"):
            return None
        return AttemptScope(role=role, run_id=run_id, rollout_id=rollout_id, attempt_id=attempt_id)  # type: ignore[arg-type]


class Authenticator:
    """Turns request headers into a principal (or None when no valid token is presented)."""

    def __init__(self, admin_token: str, signer: TokenSigner) -> None:
        if not admin_token:
            raise ValueError("the admin token must not be empty: set ROLLWIRE_ADMIN_TOKEN")
        self._admin = admin_token.encode()
        self.signer = signer

    def principal(self, authorization: str | None, api_key: str | None = None) -> Principal | None:
        """Resolve `Authorization: Bearer <token>` (or Agent Lightning's `x-api-key`)."""
        token = ""
        if authorization and authorization[:7].lower() == "bearer ":
            token = authorization[7:].strip()
        elif api_key:
            token = api_key.strip()
        if not token:
            return None
        if token.startswith(TOKEN_PREFIX + "."):
            return self.signer.verify(token)
        if hmac.compare_digest(token.encode(), self._admin):
            return ADMIN
        return None
