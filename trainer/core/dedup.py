"""Retried calls: within one attempt, a call whose prompt ids repeat an earlier call's supersedes it.

A harness retries a request (timeout, rate limit, a malformed tool call it rejected) by sending the
same prompt again; only the last answer is what the conversation continued from. So of the calls
with identical prompt ids, the last is kept, at the last one's position in the call order (that is
where the conversation actually resumed). Sibling choices of one request (`n > 1`, told apart by
`choice_index`) share a prompt without being retries, so the key is (prompt ids, choice index).
"""

from __future__ import annotations

from collections.abc import Sequence

from trainer.core.calls import Call


def _bucket_key(call: Call) -> tuple[int, int, int, int, int]:
    # A cheap pre-key (length and three sampled tokens): only calls sharing it are compared in full,
    # so a 4k-token prompt is never hashed or copied just to find that it is unique.
    ids = call.prompt_ids
    n = len(ids)
    return (call.choice_index, n, ids[0] if n else -1, ids[n // 2] if n else -1, ids[-1] if n else -1)


def dedup_calls(calls: Sequence[Call]) -> list[Call]:
    """The calls with every retried one removed: of equal prompts, the last, at its own position."""
    buckets: dict[tuple[int, int, int, int, int], list[int]] = {}
    superseded: set[int] = set()
    for i in range(len(calls) - 1, -1, -1):
        later = buckets.setdefault(_bucket_key(calls[i]), [])
        prompt = calls[i].prompt_ids
        if any(calls[j].prompt_ids == prompt for j in later):
            superseded.add(i)
        else:
            later.append(i)
    if not superseded:
        return list(calls)
    return [call for i, call in enumerate(calls) if i not in superseded]
