"""One verl update under torchrun, as `rollwire train` runs it: rank 0 leads, the other ranks follow.

    torchrun --nproc_per_node 2 tests/trainer/backends/verl_ranks.py MODEL_DIR OUT_DIR LORA_RANK

Rank 0 takes one update on `multi_turn_samples(0)` and saves the weights to OUT_DIR; the test
compares them with the same update on one rank.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_forward_backend import multi_turn_samples

from trainer.backends.verl import VerlBackend
from trainer.run.sections import AlgorithmSection, BackendSection, LossSection


def main() -> None:
    """Update once and save (rank 0), or follow (the others)."""
    model, out, lora_rank = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
    algorithm = AlgorithmSection(lr=1e-2, micro_batch_tokens=64, loss=LossSection(kl_coef=0.05))
    settings = BackendSection(threads=1, lora_rank=lora_rank, lora_alpha=8)
    backend = VerlBackend(model, algorithm, seed=0, settings=settings)
    if not backend.is_main:
        backend.follow()
        return
    metrics = backend.update(multi_turn_samples(0))
    backend.save_weights(out)
    backend.close()
    (out / "metrics.json").write_text(
        json.dumps(
            {
                "loss": metrics.loss,
                "micro_batches": metrics.micro_batches,
                "world": backend.world,
                "grad_norm": metrics.grad_norm,
            }
        )
    )


if __name__ == "__main__":
    main()
