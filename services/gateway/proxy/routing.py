"""Which engine replica serves a rollout: the same one whichever gateway process serves the call.

Rendezvous (highest random weight) hashing over the registered endpoints: every endpoint gets a
score from a hash of (rollout id, endpoint name, base URL) and the highest wins. The choice depends
only on the rollout and the registry, which every gateway folds from the same stream, so all
replicas agree; when an endpoint is added or removed, only the rollouts it wins or held move (a
modulo over the pool would move most of them and cool every prefix cache).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Protocol, TypeVar


class _Endpoint(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def base_url(self) -> str: ...


E = TypeVar("E", bound=_Endpoint)


def sticky(rollout_id: str, pool: Sequence[E]) -> E:
    """The endpoint of `pool` that serves `rollout_id` (rendezvous hashing; `pool` must not be empty)."""

    def score(endpoint: E) -> bytes:
        key = "\x1f".join((rollout_id, endpoint.name, endpoint.base_url)).encode()
        return hashlib.blake2b(key, digest_size=8).digest()

    return max(pool, key=score)
