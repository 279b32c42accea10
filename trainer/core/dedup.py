"""Retried calls: within one attempt, a call superseded by an identical later one is dropped.

A harness retries a request (timeout, rate limit, a malformed tool call it rejected) by sending the
same prompt again once the first try is over; only the last answer is what the conversation
continued from. But identical prompts are not always retries: a harness that fans one prompt out
to several sub-agents (best-of-n, parallel workers started from the same system prompt and task)
sends them concurrently, and uses every answer. So an earlier call counts as a retried one only
when all of this holds (DESIGN §3):

- a later call of the attempt has the same prompt ids (and the same `choice_index`: sibling
  choices of one `n > 1` request share a prompt without being retries);
- the earlier call had ended before that later call started (concurrent twins are a fan-out);
- no other call of the attempt extends the earlier call's prompt + response (its answer was used),
  or the later call answered the same response ids: then both answers are "used" by the next call,
  but they are one sample, and only the later one is kept (a sequential retry whose answer equals
  the first is trained once).

Times come from the events (`CallTokens.started_at`, `CallTokens.ended_at`); a call without them is taken to
have ended before the next one started (stream order). The "extends" check also looks at
`context` calls: a trained call whose answer only a frozen helper consumed was still used. The
retry is dropped; the kept call stays at its own position in the call order.
"""

from __future__ import annotations

from collections.abc import Sequence

from trainer.core.recorded import CallTokens
from trainer.core.tokens import as_ids, same_ids


def _bucket_key(call: CallTokens) -> tuple[int, int, int, int, int]:
    # A cheap pre-key (length and three sampled tokens): only calls sharing it are compared in full,
    # so a 4k-token prompt is never hashed or copied just to find that it is unique.
    ids = call.prompt_ids
    n = len(ids)
    if not n:
        return (call.choice_index, 0, -1, -1, -1)
    return (call.choice_index, n, int(ids[0]), int(ids[n // 2]), int(ids[-1]))


def _ended_before(earlier: CallTokens, later: CallTokens) -> bool:
    """True when `earlier` had ended before `later` started (unknown times: stream order says yes)."""
    if earlier.ended_at is None or later.started_at is None:
        return True
    return earlier.ended_at <= later.started_at


def _extended(call: CallTokens, others: Sequence[CallTokens]) -> bool:
    """True when some other call's prompt starts with this call's prompt + response."""
    prompt, response = as_ids(call.prompt_ids), as_ids(call.response_ids)
    n = len(prompt) + len(response)
    for other in others:
        ids = as_ids(other.prompt_ids)
        if other is call or len(ids) < n or not len(response):
            continue
        if same_ids(ids[len(prompt) : n], response) and same_ids(ids[: len(prompt)], prompt):
            return True
    return False


def dedup_calls(calls: Sequence[CallTokens], context: Sequence[CallTokens] = ()) -> list[CallTokens]:
    """The calls with every retried one removed (see the module docstring), in their own order."""
    buckets: dict[tuple[int, int, int, int, int], list[int]] = {}
    superseded: set[int] = set()
    everything: list[CallTokens] | None = None
    for i in range(len(calls) - 1, -1, -1):
        later = buckets.setdefault(_bucket_key(calls[i]), [])
        call = calls[i]
        twins = [j for j in later if same_ids(calls[j].prompt_ids, call.prompt_ids)]
        retried_by = [j for j in twins if _ended_before(call, calls[j])]
        if retried_by:
            if any(same_ids(calls[j].response_ids, call.response_ids) for j in retried_by):
                superseded.add(i)  # the same (prompt, answer) again: one sample
                continue
            if everything is None:
                everything = [*calls, *context]
            if not _extended(call, everything):
                superseded.add(i)
                continue
        later.append(i)
    if not superseded:
        return list(calls)
    return [call for i, call in enumerate(calls) if i not in superseded]
