"""Counting training samples as calls arrive, without keeping their tokens.

The trainer merges an attempt's calls into samples exactly (see `trainer/core/merge.py`): a call
extends an open chain when the chain's whole token sequence is a prefix of the call's prompt,
and opens a new chain (a new sample) otherwise; a retried call with an identical prompt replaces
the earlier one. The projector sees one call at a time, so it keeps, per attempt, only a hash of
each open chain's last prompt and of its full sequence (prompt + response) with its length: the
prefix test then hashes the first `full_len` tokens of the new prompt. The count is the number
of chains opened, the trainer's sample count before its length limit drops anything. At most
`MAX_CHAINS` most recently extended chains are kept, which bounds the work per call.
"""

from __future__ import annotations

import hashlib
import struct
from typing import NamedTuple

MAX_CHAINS = 32
_ENTRY = struct.Struct("<16sI16s")


class Chain(NamedTuple):
    """One open chain: its last call's prompt hash, full length (tokens) and full-sequence hash."""

    prompt_hash: bytes
    full_len: int
    full_hash: bytes


def digest(data: bytes) -> bytes:
    """A 16-byte hash of packed token ids."""
    return hashlib.blake2b(data, digest_size=16).digest()


def load(data: bytes | None) -> list[Chain]:
    """Chains from their stored form (oldest first)."""
    if not data:
        return []
    return [Chain(*fields) for fields in _ENTRY.iter_unpack(data)]


def dump(chains: list[Chain]) -> bytes:
    """The stored form of `chains`."""
    return b"".join(_ENTRY.pack(*chain) for chain in chains)


def advance(chains: list[Chain], prompt: bytes, response: bytes) -> bool:
    """Fold one ok call (packed int32 prompt and response ids) into `chains`; True if it opens a sample.

    One pass over the prompt: the hasher is snapshotted at each open chain's length on the way
    (the prefix test), then at the prompt's end (the retry test), then fed the response.
    """
    hasher = hashlib.blake2b(digest_size=16)
    prefix_hashes: dict[int, bytes] = {}
    done = 0
    for size in sorted({c.full_len * 4 for c in chains if c.full_len * 4 <= len(prompt)}):
        hasher.update(prompt[done:size])
        done = size
        prefix_hashes[size] = hasher.copy().digest()
    hasher.update(prompt[done:])
    prompt_hash = hasher.copy().digest()
    hasher.update(response)
    after = Chain(prompt_hash, (len(prompt) + len(response)) // 4, hasher.digest())
    chosen: int | None = None
    for index, chain in enumerate(chains):
        if chain.prompt_hash == prompt_hash:
            chosen = index  # a retry of that chain's last call: it replaces the call
            break
    if chosen is None:
        best = -1
        for index, chain in enumerate(chains):
            if chain.full_len > best and prefix_hashes.get(chain.full_len * 4) == chain.full_hash:
                chosen, best = index, chain.full_len
    opens = chosen is None
    if chosen is not None:
        del chains[chosen]
    chains.append(after)
    if len(chains) > MAX_CHAINS:
        del chains[0]
    return opens
