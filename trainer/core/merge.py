"""Merging a rollout's model calls into training samples, exactly.

Why merge at all. An agent's rollout is a sequence of calls, each prompt usually the previous
prompt plus the previous response plus a new observation (a tool result, a user turn). Training
on each call separately re-encodes the whole shared prefix once per call (quadratic in the number
of turns) and splits one trajectory into many samples. When the next prompt starts with everything
the model has seen and said so far, the calls are one sequence: prompt, response 1, observation 1,
response 2, ... — trained in one forward pass, with the loss mask on the sampled tokens only.

Why exact. A sample is only correct if every token the loss is computed on was sampled by the
model from exactly the context that precedes it in the sample. So a call may extend a sample only
if the sample's entire token sequence is, token for token, a prefix of the call's prompt ids; the
rest of the prompt (the observation) is appended with loss mask 0 and the response with mask 1
and its recorded behaviour logprobs. Nothing is ever rewritten: when a harness re-renders the
conversation and the tokenizer encodes the previous response differently (retokenization drift),
the prefix does not match and the call starts a new sample. Replacing the re-encoded ids by the
originally sampled ones would make the later response look sampled from a context the model never
consumed (off-policy without the importance weight to show for it), so the adapter does not.

Why several open chains. Harnesses run sub-agents in parallel and interleave their calls; a
single "current sample" would be closed by every switch. The merger keeps every chain open and
gives each call to the longest chain that is a prefix of its prompt (chains that are prefixes of
one prompt are nested, so the longest is the most recent state of that conversation). A call that
extends no chain opens one. A chain that was extended is no longer its old state: a later call
forking from the old state (two branches from one turn) opens a new chain whose prompt carries the
shared turn with mask 0, so no sampled token is ever trained twice.

Sampling settings and agent. The loss recomputes a sample's logprobs under the distribution its
tokens were drawn from (temperature, then the top-k / top-p nucleus), and a per-role adapter trains
on one agent's samples, so a call whose temperature, top_p, top_k or agent differs from a chain's
does not extend it (it opens a chain of its own). The sample carries all four.

Length. A merged sample is exactly as long as its last call's prompt plus response (the chain is
a prefix of that prompt), so a chain can only outgrow `max_length` through a call that is itself
too long. Such a call closes the chain it would have extended (later calls open new chains) and is
dropped and counted: keeping it would need truncation, and truncating the front of a prompt
trains on a context the model did not see.

References. A call recorded as continuing an earlier one (`CallTokens.prompt_ref`, `CallTokens.ref_tokens`,
set from the recorded `prompt_ref`) whose shared length is the whole of that call's prompt +
response extends the chain that call ended, if that chain is still open and ends there: the
chain's tokens are exactly that call's prompt + response, so they are a prefix of the new prompt
by construction, and the arrays need not be compared. The other open chains are still looked at
(one of them may be longer, or the referenced call's chain may have moved on), so the choice is
the one the comparison alone makes; a call without a usable reference is compared as always.

`per-call` mode skips the merging (one sample per call) for comparison and for harnesses whose
prompts never share prefixes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import msgspec
import numpy as np

from trainer.core.recorded import CallTokens
from trainer.core.tokens import IdArray, Logprobs, TokenIds, as_floats, as_ids, joined, same_ids

MergeMode = Literal["exact", "per-call"]


class Sample(msgspec.Struct, frozen=True, kw_only=True):
    """One training sequence: the tokens, which of them were sampled, and their behaviour logprobs.

    `tokens`, `loss_mask` and `logprobs` have one entry per token; `loss_mask[t]` is 1 exactly
    where `tokens[t]` was sampled by the model, and `logprobs[t]` is its behaviour log-probability
    (0.0 where the mask is 0). `advantage` and `token_weight` are set by the step builder; the
    token loss of this sample counts with weight `token_weight` on each sampled token. A merged
    sample holds numpy arrays (int32 tokens and mask, float64 logprobs; `trainer.core.tokens`).
    """

    rollout_id: str
    group_id: str | None
    index: int
    tokens: TokenIds
    loss_mask: TokenIds
    logprobs: Logprobs
    call_ids: list[str]
    response_tokens: int
    min_weights_version: int | None = None
    max_weights_version: int | None = None
    advantage: float = 0.0
    token_weight: float = 0.0
    temperature: float | None = None
    """The sampling temperature of its calls (None: not recorded); the loss recomputes logprobs under it."""
    token_advantages: Logprobs | None = None
    """A per-token advantage the loss takes instead of `advantage` (one entry per token; None: `advantage`
    on every token). Off-policy re-training sets it to the advantage times each token's importance weight."""
    top_p: float | None = None
    """The nucleus its calls were sampled from (None: off); the loss re-applies it, so on policy the ratio is 1."""
    top_k: int | None = None
    """Top-k of its calls (None, 0 or -1: off); re-applied in the loss like `top_p`."""
    agent: str | None = None
    """The agent (role) that made its calls: which LoRA adapter trains it (`lora_adapters`)."""

    @property
    def num_calls(self) -> int:
        """How many calls were merged into this sample."""
        return len(self.call_ids)


class MergeResult(msgspec.Struct, frozen=True, kw_only=True):
    """The samples of one rollout, in the order their first call was made, and dropped calls."""

    samples: list[Sample]
    calls_too_long: int


class _Chain:
    """An open sample under construction (mutable; only `merge_calls` sees it).

    Its tokens are always its last call's prompt + response (a call extends a chain only when the
    chain is a prefix of its prompt), so they are kept as those two arrays, and the sampled spans
    as (offset, call) pairs: the sample's arrays are built once, when it is closed.
    """

    __slots__ = (
        "call_ids",
        "end",
        "first",
        "key",
        "last",
        "length",
        "prompt",
        "response",
        "spans",
        "touched",
        "versions",
    )

    def __init__(self, call: CallTokens, touched: int) -> None:
        self.call_ids: list[str] = []
        self.spans: list[tuple[int, CallTokens]] = []
        self.versions: list[int] = []
        self.key = chain_key(call)
        self.extend(call, touched)
        self.first = int(self.prompt[0]) if len(self.prompt) else int(self.response[0]) if self.length else -1

    def extend(self, call: CallTokens, touched: int) -> None:
        """Take the call as the chain's new end: its unseen prompt suffix is an observation (mask 0),
        its response is sampled (mask 1); the arrays are built in `to_sample`."""
        self.prompt, self.response = as_ids(call.prompt_ids), as_ids(call.response_ids)
        self.length = len(self.prompt) + len(self.response)
        self.last = int(self.response[-1]) if len(self.response) else int(self.prompt[-1]) if self.length else -1
        self.spans.append((len(self.prompt), call))
        self.call_ids.append(call.call_id)
        if call.weights_version is not None:
            self.versions.append(call.weights_version)
        self.touched = touched
        self.end = call.event_id
        """The event id of its last call: its tokens are that call's prompt + response."""

    def is_prefix_of(self, prompt: IdArray) -> bool:
        """True when the chain's whole token sequence is a prefix of `prompt`."""
        cut = len(self.prompt)
        return same_ids(prompt[:cut], self.prompt) and same_ids(prompt[cut : self.length], self.response)

    def to_sample(self, rollout_id: str, group_id: str | None, index: int) -> Sample:
        mask = np.zeros(self.length, dtype=np.int32)
        logprobs = np.zeros(self.length, dtype=np.float64)
        sampled = 0
        for offset, call in self.spans:
            n = len(call.response_ids)
            mask[offset : offset + n] = 1
            logprobs[offset : offset + n] = as_floats(call.logprobs)
            sampled += n
        return Sample(
            rollout_id=rollout_id,
            group_id=group_id,
            index=index,
            tokens=joined(self.prompt, self.response),
            loss_mask=mask,
            logprobs=logprobs,
            call_ids=self.call_ids,
            response_tokens=sampled,
            min_weights_version=min(self.versions) if self.versions else None,
            max_weights_version=max(self.versions) if self.versions else None,
            temperature=self.key[0],
            top_p=self.key[1],
            top_k=self.key[2],
            agent=self.key[3],
        )


def chain_key(call: CallTokens) -> tuple[float | None, float | None, int | None, str | None]:
    """What calls of one sample share: temperature, top_p, top_k (off spelled None) and agent."""
    top_p = call.top_p if call.top_p is not None and call.top_p < 1.0 else None
    top_k = call.top_k if call.top_k is not None and call.top_k > 0 else None
    return (call.temperature, top_p, top_k, call.agent)


def _longest_prefix_chain(chains: Sequence[_Chain], call: CallTokens, known: _Chain | None = None) -> _Chain | None:
    """The longest open chain (same `chain_key`) whose whole token sequence is a prefix of the call's prompt.

    Ties go to the most recent chain. `known` is an open chain already known to be such a prefix
    (the one the call's reference names): it is not compared again, only the others that could beat it.
    """
    prompt = as_ids(call.prompt_ids)
    key = chain_key(call)
    best = known
    best_len = -1 if known is None else known.length
    for chain in chains:
        if chain.key != key or chain is known:
            continue
        n = chain.length
        # Cheap rejections first; only a surviving candidate pays for the full comparison.
        if n == 0 or n > len(prompt) or n < best_len:
            continue
        if n == best_len and best is not None and chain.touched < best.touched:
            continue
        if prompt[n - 1] != chain.last or prompt[0] != chain.first:
            continue
        if chain.is_prefix_of(prompt):
            best, best_len = chain, n
    return best


class _Ends:
    """The open chains by the event id of their last call, for calls that reference that call."""

    __slots__ = ("chains", "repeated", "seen")

    def __init__(self) -> None:
        self.chains: dict[str, _Chain] = {}
        self.seen: set[str] = set()
        self.repeated: set[str] = set()

    def referenced(self, call: CallTokens) -> _Chain | None:
        """The open chain the call's reference extends whole, else None (then only comparing decides)."""
        ref = call.prompt_ref
        if ref is None or ref in self.repeated:
            return None
        chain = self.chains.get(ref)
        if chain is None or chain.key != chain_key(call):
            return None
        prompt, n = call.prompt_ids, chain.length
        if call.ref_tokens != n or not 0 < n <= len(prompt) or prompt[n - 1] != chain.last or prompt[0] != chain.first:
            return None
        return chain

    def forget(self, chain: _Chain) -> None:
        """The chain no longer ends where it did (extended, or closed)."""
        if chain.end is not None and self.chains.get(chain.end) is chain:
            del self.chains[chain.end]

    def ended(self, chain: _Chain) -> None:
        """The chain now ends at its last call."""
        end = chain.end
        if end is None:
            return
        if end in self.seen:  # an id seen twice names no single call
            self.repeated.add(end)
            self.chains.pop(end, None)
            return
        self.seen.add(end)
        self.chains[end] = chain


def merge_calls(
    calls: Sequence[CallTokens],
    *,
    rollout_id: str,
    group_id: str | None,
    mode: MergeMode = "exact",
    max_length: int | None = None,
) -> MergeResult:
    """Turn one attempt's (deduplicated, ordered) calls into samples; see the module docstring.

    `exact` gives each call to the longest open chain that is a prefix of its prompt, else opens
    a chain; `per-call` makes one sample per call. A call longer than `max_length` (prompt plus
    response) closes the chain it would have extended and is dropped (counted in the result).
    """
    if mode not in ("exact", "per-call"):
        raise ValueError(f"merge mode {mode!r} is not one of 'exact', 'per-call'")
    opened: list[_Chain] = []
    live: list[_Chain] = []
    ends = _Ends()
    too_long = 0
    for position, call in enumerate(calls):
        parent = _longest_prefix_chain(live, call, ends.referenced(call)) if mode == "exact" else None
        if max_length is not None and len(call.prompt_ids) + len(call.response_ids) > max_length:
            too_long += 1
            if parent is not None:
                live.remove(parent)
                ends.forget(parent)
            continue
        if parent is not None:
            ends.forget(parent)
            parent.extend(call, position)
            ends.ended(parent)
        else:
            chain = _Chain(call, position)
            opened.append(chain)
            if mode == "exact":
                live.append(chain)
                ends.ended(chain)
    samples = [chain.to_sample(rollout_id, group_id, i) for i, chain in enumerate(opened)]
    return MergeResult(samples=samples, calls_too_long=too_long)
