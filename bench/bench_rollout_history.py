"""The trainer's read of long rollouts: `rollout_history` against `EventStore.read_rollout`.

    python bench/bench_rollout_history.py                    # 8 rollouts x 120 calls, 67k tokens
    python bench/bench_rollout_history.py --calls 60 --context 34000

Long-horizon rollouts recorded compactly (each call a reference to the previous one and its new
ids, packed), read back for the adapter and merged, two ways:

- `read_rollout`: every event typed, every call's full prompt and request resolved as lists;
- `rollout_history` (what the trainer's `replay_group` reads): calls as `CallRecord`s, bodies
  skipped, packed arrays and references left for the adapter, which reads them into arrays.

Both give the same samples (tests/services/tools/test_compact_calls.py). Measured on 2 shared cores, 8
rollouts of 120 calls ending at 67k tokens (68,483 in the last sample), best of 3: read_rollout
2.03 s, rollout_history 0.54 s (3.8x).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_replay import write_run  # noqa: E402

from services.common.eventstore import EventStore  # noqa: E402
from services.devstack.embedded import NatsServer  # noqa: E402
from trainer.core import AdapterConfig, merge_rollout, rollout_calls  # noqa: E402
from trainer.rollouts import rollout_history  # noqa: E402


async def run(rollouts: int, calls: int, context: int, repeats: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        server = NatsServer(Path(tmp)).start()
        try:
            await write_run(server.url, "long", rollouts, calls, context, "compact")
            store = await EventStore.connect(server.url)
            best = {"read_rollout": float("inf"), "rollout_history": float("inf")}
            for _ in range(repeats):
                for way in best:
                    started = time.perf_counter()
                    for i in range(rollouts):
                        if way == "read_rollout":
                            events = [s.event for s in await store.read_rollout("long", f"ro{i}")]
                            merged = merge_rollout(rollout_calls(events), AdapterConfig(), 1.0)
                        else:
                            history = await rollout_history(store, "long", f"ro{i}")
                            merged = merge_rollout(rollout_calls(history), AdapterConfig(), 1.0)
                    best[way] = min(best[way], time.perf_counter() - started)
            tokens = len(merged.samples[0].tokens)
            print(f"{rollouts} rollouts x {calls} calls, last sample {tokens} tokens (best of {repeats}):")
            for way, seconds in best.items():
                print(f"  {way:16s} {seconds:6.2f} s  {best['read_rollout'] / seconds:4.1f}x")
            await store.close()
        finally:
            server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--rollouts", type=int, default=8)
    parser.add_argument("--calls", type=int, default=120)
    parser.add_argument("--context", type=int, default=67_000, help="tokens of a rollout's last call")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    asyncio.run(run(args.rollouts, args.calls, args.context, args.repeats))


if __name__ == "__main__":
    main()
