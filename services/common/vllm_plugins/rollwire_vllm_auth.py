"""An ASGI middleware vLLM loads (`--middleware rollwire_vllm_auth.RequireApiKey`): the API key on every route.

vLLM's own `--api-key` guards only paths under `/v1`; its development routes (`/pause`,
`/collective_rpc`, `/reset_prefix_cache`, `/update_weight_version`, `/resume`, `/sleep`, ...) and
the rest stay open to anyone who can reach the port. This middleware answers 401 to any request
without `Authorization: Bearer $VLLM_API_KEY`, except `GET /health` (a liveness probe: it answers
200 or 503 and nothing else). It runs inside vLLM's own environment, so it imports nothing beyond
the standard library; `services.common.vllm.serve_command` puts this directory on vLLM's
PYTHONPATH. The ASGI interface as Starlette implements it
(`__call__(scope, receive, send)`), the pattern of vLLM's `AuthenticationMiddleware`
(`vllm/entrypoints/serve/middleware/authenticate.py`).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

KEY_ENV = "VLLM_API_KEY"
OPEN = frozenset({("GET", "/health")})


class RequireApiKey:
    """Refuse (401) every HTTP or WebSocket request without the bearer key in $VLLM_API_KEY."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        key = os.environ.get(KEY_ENV, "")
        if not key:
            raise RuntimeError(f"rollwire_vllm_auth: ${KEY_ENV} is empty; vLLM would serve without a key")
        self.digest = hashlib.sha256(key.encode()).digest()

    def _allowed(self, scope: Scope) -> bool:
        if (scope.get("method", "GET"), scope.get("path", "")) in OPEN:
            return True
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                given = hashlib.sha256(token.strip().encode()).digest()
                return scheme.lower() == "bearer" and hmac.compare_digest(given, self.digest)
        return False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Pass an authorised request on; answer anything else with 401 in OpenAI's error shape."""
        if scope["type"] not in ("http", "websocket") or self._allowed(scope):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        body = json.dumps(
            {"error": {"message": "missing or invalid API key", "type": "authentication_error", "code": 401}}
        ).encode()
        headers = [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")]
        await send({"type": "http.response.start", "status": 401, "headers": headers})
        await send({"type": "http.response.body", "body": body})
