"""Dedup and exact merge: merging never changes a token the model consumed or sampled."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from trainer.core import CallTokens, Sample, dedup_calls, merge_calls, plain

PROPERTY = settings(max_examples=150, derandomize=True, deadline=None)

_ids = iter(range(10**9))


def call(prompt: list[int], response: list[int], version: int | None = None, choice: int = 0) -> CallTokens:
    """A call whose logprobs are distinct per call and position, so misplacement is visible."""
    cid = next(_ids)
    return CallTokens(
        call_id=f"c{cid}",
        prompt_ids=list(prompt),
        response_ids=list(response),
        logprobs=[-(cid + 1) - i / 1000 for i in range(len(response))],
        weights_version=version,
        choice_index=choice,
    )


def merge(calls: list[CallTokens], **kw: object) -> list[Sample]:
    return merge_calls(dedup_calls(calls), rollout_id="ro", group_id="g", **kw).samples  # type: ignore[arg-type]


def assert_exact(calls: list[CallTokens], samples: list[Sample]) -> None:
    """Every kept call sits verbatim at the start of exactly one sample; masks cover exactly responses."""
    by_id = {c.call_id: c for c in calls}
    placed = [cid for s in samples for cid in s.call_ids]
    assert len(placed) == len(set(placed)), "a call was placed twice"
    for s in samples:
        assert len(s.tokens) == len(s.loss_mask) == len(s.logprobs)
        sampled = [0] * len(s.tokens)
        for cid in s.call_ids:
            c = by_id[cid]
            p, r = len(c.prompt_ids), len(c.response_ids)
            assert plain(s.tokens[: p + r]) == plain(c.prompt_ids) + plain(c.response_ids)
            assert plain(s.loss_mask[p : p + r]) == [1] * r
            assert plain(s.logprobs[p : p + r]) == plain(c.logprobs)
            sampled[p : p + r] = [1] * r
        assert plain(s.loss_mask) == sampled, "mask is 1 exactly on the tokens the sample's calls sampled"
        assert all(lp == 0.0 for lp, m in zip(s.logprobs, s.loss_mask, strict=True) if not m)
        assert s.response_tokens == sum(s.loss_mask)
        last = by_id[s.call_ids[-1]]
        assert plain(s.tokens) == plain(last.prompt_ids) + plain(last.response_ids)
        order = [calls.index(by_id[cid]) for cid in s.call_ids]
        assert order == sorted(order), "calls keep their order within a sample"


def random_rollout(rng: random.Random, vocab: int = 6) -> list[CallTokens]:
    """Calls from a few conversations: continuations, drifted re-encodings, forks, retries, new ones.

    The vocabulary is tiny on purpose, so accidental prefix matches between conversations happen.
    """
    calls: list[CallTokens] = []
    states: list[list[int]] = []

    def tokens(lo: int, hi: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(rng.randint(lo, hi))]

    for _ in range(rng.randint(1, 14)):
        op = rng.random()
        if not states or op < 0.15:
            prompt = tokens(1, 5)
        elif op < 0.6:
            prompt = rng.choice(states) + tokens(0, 3)
        elif op < 0.7:  # retokenization drift: the response comes back re-encoded
            c = rng.choice(calls)
            prompt = [*c.prompt_ids, *(t + 1 for t in c.response_ids), *tokens(0, 3)]
        elif op < 0.8:  # a fork from an older turn
            c = rng.choice(calls)
            prompt = [*c.prompt_ids, *c.response_ids, *tokens(1, 3)]
        else:  # a retry of an earlier prompt
            prompt = list(rng.choice(calls).prompt_ids)
        response = tokens(0, 4)
        calls.append(call(prompt, response))
        states.append(prompt + response)
    return calls


@PROPERTY
@given(st.randoms(use_true_random=False))
def test_merging_never_changes_a_consumed_token(rng: random.Random) -> None:
    calls = random_rollout(rng)
    kept = dedup_calls(calls)
    samples = merge(calls)
    assert_exact(calls, samples)
    assert sorted(cid for s in samples for cid in s.call_ids) == sorted(c.call_id for c in kept)


@PROPERTY
@given(st.randoms(use_true_random=False), st.integers(4, 20))
def test_max_length_is_never_exceeded_nor_truncated(rng: random.Random, max_length: int) -> None:
    calls = random_rollout(rng)
    result = merge_calls(dedup_calls(calls), rollout_id="ro", group_id="g", max_length=max_length)
    assert_exact(calls, result.samples)
    too_long = [c for c in dedup_calls(calls) if len(c.prompt_ids) + len(c.response_ids) > max_length]
    assert result.calls_too_long == len(too_long)
    assert all(len(s.tokens) <= max_length for s in result.samples)


@PROPERTY
@given(
    st.lists(
        st.tuples(st.lists(st.integers(0, 99), max_size=6), st.lists(st.integers(0, 99), min_size=1, max_size=6)),
        max_size=8,
    )
)
def test_linear_conversation_is_one_sample(turns: list[tuple[list[int], list[int]]]) -> None:
    prompt = [1, 2, 3]
    calls = []
    for observation, response in [([], [4]), *turns]:
        prompt = prompt + observation
        calls.append(call(prompt, response))
        prompt = prompt + response
    (sample,) = merge(calls)
    assert_exact(calls, [sample])
    assert sample.num_calls == len(calls)


@PROPERTY
@given(st.integers(2, 5), st.randoms(use_true_random=False))
def test_interleaved_sub_agents_merge_into_one_sample_each(agents: int, rng: random.Random) -> None:
    system = [0, 0, 1]  # a shared system prompt; each sub-agent's task starts with its own token
    conversations: list[list[CallTokens]] = []
    for a in range(agents):
        prompt = [*system, 100 + a, *[rng.randrange(5) for _ in range(3)]]
        convo = []
        for _ in range(rng.randint(1, 4)):
            response = [rng.randrange(5) for _ in range(rng.randint(1, 3))]
            convo.append(call(prompt, response))
            prompt = prompt + response + [rng.randrange(5) for _ in range(rng.randint(0, 3))]
        conversations.append(convo)
    cursors = [0] * agents
    calls = []
    while any(cursors[a] < len(conversations[a]) for a in range(agents)):
        a = rng.choice([a for a in range(agents) if cursors[a] < len(conversations[a])])
        calls.append(conversations[a][cursors[a]])
        cursors[a] += 1
    samples = merge(calls)
    assert_exact(calls, samples)
    assert sorted(s.call_ids for s in samples) == sorted([c.call_id for c in convo] for convo in conversations)


def test_retokenization_drift_splits_the_chain_and_never_corrupts_it() -> None:
    first = call([1, 2, 3], [10, 11])  # sampled "10 11"
    drifted = call([1, 2, 3, 12, 4], [20])  # the harness re-encoded "10 11" as the single token 12
    third = call([1, 2, 3, 12, 4, 20, 5], [30])
    samples = merge([first, drifted, third])
    assert_exact([first, drifted, third], samples)
    assert [s.call_ids for s in samples] == [[first.call_id], [drifted.call_id, third.call_id]]
    assert plain(samples[0].tokens) == [1, 2, 3, 10, 11] and plain(samples[0].loss_mask) == [0, 0, 0, 1, 1]
    assert plain(samples[1].loss_mask) == [0, 0, 0, 0, 0, 1, 0, 1]  # the drifted ids are context, never trained


def test_a_call_extends_the_longest_matching_chain() -> None:
    deep = call([1, 2, 3, 4], [5])  # chain [1, 2, 3, 4, 5]
    shallow = call([1, 2], [3])  # too short to extend `deep`: opens chain [1, 2, 3]
    nxt = call([1, 2, 3, 4, 5, 6], [7])  # both chains are prefixes of this prompt
    samples = merge([deep, shallow, nxt])
    assert [s.call_ids for s in samples] == [[deep.call_id, nxt.call_id], [shallow.call_id]]


def test_equal_chains_go_to_the_most_recent() -> None:
    a, b = call([1, 2], [3], choice=0), call([1, 2], [3], choice=1)  # two choices that sampled the same
    nxt = call([1, 2, 3, 4], [5])
    samples = merge([a, b, nxt])
    assert [s.call_ids for s in samples] == [[a.call_id], [b.call_id, nxt.call_id]]


def test_a_fork_from_an_extended_turn_opens_a_chain_without_training_the_turn_twice() -> None:
    root = call([1, 2], [3])
    branch_a = call([1, 2, 3, 4], [5])
    branch_b = call([1, 2, 3, 6], [7])  # forks from root's state, which branch_a already extended
    samples = merge([root, branch_a, branch_b])
    assert_exact([root, branch_a, branch_b], samples)
    assert samples[1].call_ids == [branch_b.call_id] and plain(samples[1].loss_mask) == [0, 0, 0, 0, 1]


def test_dedup_keeps_the_last_retry_at_its_own_position() -> None:
    first = call([1, 2], [3])
    other = call([9, 9], [8])
    retry = call([1, 2], [4])
    assert dedup_calls([first, other, retry]) == [other, retry]
    follow = call([1, 2, 4, 5], [6])  # the conversation continued from the retry's answer
    samples = merge([first, other, retry, follow])
    assert [s.call_ids for s in samples] == [[other.call_id], [retry.call_id, follow.call_id]]


def test_dedup_keeps_sibling_choices() -> None:
    a, b = call([1, 2], [3], choice=0), call([1, 2], [4], choice=1)
    assert dedup_calls([a, b]) == [a, b]
    assert dedup_calls([a, b, call([1, 2], [5], choice=0)])[0] == b


def test_dedup_compares_whole_prompts_not_just_the_bucket_key() -> None:
    a, b = call([1, 5, 2, 7], [3]), call([1, 6, 2, 7], [3])  # same length, first, middle and last token
    assert dedup_calls([a, b]) == [a, b]


def test_max_length_closes_the_chain() -> None:
    c1 = call([1] * 8, [2] * 2)  # 10 tokens
    c2 = call([1] * 8 + [2] * 2 + [3] * 8, [4] * 2)  # 20 tokens, extends c1
    c3 = call([*c2.prompt_ids, 4, 4, 5, 5, 5], [6] * 5)  # 30 > 25: dropped, closes the chain
    c4 = call([*c2.prompt_ids, 4, 4, 7], [8])  # 22 tokens: would have extended [c1, c2]
    result = merge_calls([c1, c2, c3, c4], rollout_id="ro", group_id="g", max_length=25)
    assert result.calls_too_long == 1
    assert [s.call_ids for s in result.samples] == [[c1.call_id, c2.call_id], [c4.call_id]]
    assert plain(result.samples[1].loss_mask) == [0] * 21 + [1]  # c1's and c2's answers are context here
    assert_exact([c1, c2, c3, c4], result.samples)


def test_per_call_mode_makes_one_sample_per_call() -> None:
    calls = [call([1, 2], [3]), call([1, 2, 3, 4], [5])]
    samples = merge_calls(calls, rollout_id="ro", group_id="g", mode="per-call").samples
    assert [s.call_ids for s in samples] == [[c.call_id] for c in calls]
    assert plain(samples[1].loss_mask) == [0, 0, 0, 0, 1]
    assert_exact(calls, samples)


def test_sample_records_weights_versions_and_order() -> None:
    samples = merge([call([1], [2], version=3), call([1, 2, 5], [6], version=5), call([7], [8])])
    assert [(s.index, s.min_weights_version, s.max_weights_version) for s in samples] == [(0, 3, 5), (1, None, None)]
