"""The task dataset: a JSON Lines file, one rollout input per line, visited in seeded epochs.

Task number k of a run (counting from 0 over the whole run) is line `order(epoch)[k % n]` with
`epoch = k // n`, where `order` is a permutation drawn from the run's seed and the epoch (or the
file order when shuffling is off). So the tasks a run trains on follow from the seed and the
count of tasks consumed, which is all a checkpoint needs to keep.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any


class DatasetError(ValueError):
    """The dataset cannot be used; the message names the file and line."""


def load_jsonl(path: Path) -> list[Any]:
    """Every line's JSON value (blank lines skipped); `DatasetError` names a bad line."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DatasetError(f"dataset {path} does not exist (data.path)") from None
    items: list[Any] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            items.append(json.loads(line))
        except ValueError as exc:
            raise DatasetError(f"{path}:{number} is not valid JSON: {exc}") from None
    if not items:
        raise DatasetError(f"dataset {path} has no tasks; write one JSON value (a rollout input) per line")
    return items


class TaskOrder:
    """Which dataset line is the run's k-th task (see the module docstring)."""

    def __init__(self, size: int, seed: int, shuffle: bool) -> None:
        self.size = size
        self.seed = seed
        self.shuffle = shuffle
        self._epoch = -1
        self._order: list[int] = []

    def index(self, k: int) -> int:
        """The dataset line of task number `k`."""
        epoch, position = divmod(k, self.size)
        if not self.shuffle:
            return position
        if epoch != self._epoch:
            self._order = list(range(self.size))
            random.Random(f"{self.seed}/{epoch}").shuffle(self._order)
            self._epoch = epoch
        return self._order[position]
