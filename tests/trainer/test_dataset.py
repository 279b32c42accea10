"""The task dataset: JSON Lines with named errors, visited in seeded epochs."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainer.dataset import DatasetError, TaskOrder, load_jsonl


def test_load_jsonl_skips_blank_lines_and_names_bad_ones(tmp_path: Path) -> None:
    good = tmp_path / "good.jsonl"
    good.write_text('{"a": 1}\n\n[2]\n"three"\n')
    assert load_jsonl(good) == [{"a": 1}, [2], "three"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"a": 1}\n{oops\n')
    with pytest.raises(DatasetError, match=r"bad.jsonl:2 is not valid JSON"):
        load_jsonl(bad)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(DatasetError, match="has no tasks"):
        load_jsonl(empty)
    with pytest.raises(DatasetError, match="does not exist"):
        load_jsonl(tmp_path / "missing.jsonl")


def test_each_epoch_is_a_seeded_permutation() -> None:
    order = TaskOrder(10, seed=3, shuffle=True)
    first = [order.index(k) for k in range(10)]
    second = [order.index(k) for k in range(10, 20)]
    assert sorted(first) == list(range(10)) and sorted(second) == list(range(10))
    assert first != second  # epochs differ
    again = TaskOrder(10, seed=3, shuffle=True)
    assert [again.index(k) for k in (15, 2, 19, 0)] == [second[5], first[2], second[9], first[0]]  # any order
    assert [TaskOrder(10, seed=4, shuffle=True).index(k) for k in range(10)] != first
    assert [TaskOrder(4, seed=3, shuffle=False).index(k) for k in range(6)] == [0, 1, 2, 3, 0, 1]
