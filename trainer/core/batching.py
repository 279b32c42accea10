"""Cutting a batch into optimizer steps and micro-batches without splitting a rollout.

A rollout's samples share one advantage and, under `rollout-mean`, one normalizer; they stay in
one optimizer step so the step's weights see the whole rollout. Within a step, samples are spread
over data-parallel workers balanced by tokens (LPT: largest first, each to the least loaded
worker), then packed into micro-batches of at most a token budget. Sizes are token counts of
packed (unpadded) sequences.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence


def plan_steps(
    sizes: Sequence[int], *, max_tokens: int | None = None, max_rollouts: int | None = None
) -> list[list[int]]:
    """Consecutive groups of rollout indices, one per optimizer step, never splitting a rollout.

    `sizes[i]` is rollout i's token count. A step closes before a rollout that would push it over
    `max_tokens`, or once it holds `max_rollouts`; a rollout bigger than `max_tokens` alone makes a
    step. With neither limit, everything is one step. An empty input gives no steps.
    """
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens must be a positive token count, got {max_tokens}")
    if max_rollouts is not None and max_rollouts < 1:
        raise ValueError(f"max_rollouts must be at least 1, got {max_rollouts}")
    steps: list[list[int]] = []
    current: list[int] = []
    load = 0
    for i, size in enumerate(sizes):
        full = max_rollouts is not None and len(current) >= max_rollouts
        over = max_tokens is not None and load + size > max_tokens
        if current and (full or over):
            steps.append(current)
            current, load = [], 0
        current.append(i)
        load += size
    if current:
        steps.append(current)
    return steps


def partition_balanced(sizes: Sequence[int], parts: int) -> list[list[int]]:
    """Indices split into `parts` lists with near-equal size sums (LPT greedy), each list ascending.

    Guarantees (tested): the largest sum exceeds the smallest by at most the largest size, and is
    at most (4/3 - 1/(3·parts)) times the best possible largest sum.
    """
    if parts < 1:
        raise ValueError(f"parts must be at least 1, got {parts}")
    order = sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))
    heap = [(0, p) for p in range(parts)]
    bins: list[list[int]] = [[] for _ in range(parts)]
    for i in order:
        load, p = heapq.heappop(heap)
        bins[p].append(i)
        heapq.heappush(heap, (load + sizes[i], p))
    return [sorted(b) for b in bins]


def pack_bins(sizes: Sequence[int], capacity: int) -> list[list[int]]:
    """Indices packed first-fit-decreasing into bins of at most `capacity` (an oversized item alone)."""
    if capacity < 1:
        raise ValueError(f"capacity must be a positive token count, got {capacity}")
    loads: list[int] = []
    bins: list[list[int]] = []
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        for b, load in enumerate(loads):
            if load + sizes[i] <= capacity:
                bins[b].append(i)
                loads[b] += sizes[i]
                break
        else:
            bins.append([i])
            loads.append(sizes[i])
    return [sorted(b) for b in bins]


def plan_micro_batches(sizes: Sequence[int], *, workers: int, max_tokens: int) -> list[list[list[int]]]:
    """Sample indices as `[worker][micro_batch][...]`: balanced across workers, packed per worker.

    Every worker gets the same number of micro-batches (trailing ones may be empty) because
    data-parallel workers run their forward/backward passes in lockstep.
    """
    per_worker = partition_balanced(sizes, workers)
    packed = [[[idx[j] for j in b] for b in pack_bins([sizes[i] for i in idx], max_tokens)] for idx in per_worker]
    count = max((len(p) for p in packed), default=0)
    return [p + [[] for _ in range(count - len(p))] for p in packed]
