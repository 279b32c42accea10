"""Config sections for what a run trains and how its agents run: `[[policies]]`, `[[frozen]]`, `[validation]`.

Kept beside `trainer.config` (which holds `TrainConfig`) so that module stays one screen per part.
`[model]` is the first trained policy; each `[[policies]]` entry is one more (its own weights,
engine, optimizer); each `[[frozen]]` entry is a model served for context only. `agents` routes
agent names to a model (an agent no entry names goes to `[model]`).
"""

from __future__ import annotations

import msgspec


class PolicySection(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """`[[policies]]`: one more trained model: its registered `name`, starting weights and agents."""

    name: str
    path: str
    agents: list[str] = []


class FrozenSection(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """`[[frozen]]`: a model served for context only: weights at `path` (an embedded engine) or a
    running OpenAI-compatible endpoint at `base_url` (`served_model` names its model there)."""

    name: str
    path: str | None = None
    base_url: str | None = None
    served_model: str | None = None
    agents: list[str] = []


class ValidationSection(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """`[validation]`: every `every` steps, each task of `path` runs `rollouts_per_task` times in `val`
    mode through the same harness; never trained on, its mean reward is `val/reward`. With `at_start`,
    the pass also runs on the starting weights before step 1 (row `step = 0`): the before of before/after."""

    path: str
    every: int = 5
    rollouts_per_task: int = 1
    max_tasks: int | None = None
    at_start: bool = False
