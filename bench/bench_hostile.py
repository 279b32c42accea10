"""Gateway memory under a hostile agent: large custom events, each under a fresh Idempotency-Key.

    python bench/bench_hostile.py [--events 200] [--size 1000000] [--tree PATH]

Starts nats-server and a gateway process (`python -m services.gateway`) from the tree at `--tree`
(default: this one; pass an older checkout to measure a baseline side by side), creates one
rollout and attempt, then posts `--events` custom events of `--size` bytes with the attempt's own
token, each with a fresh key (the issue's attack: responses to keyed requests were cached whole,
capped by count, so 200 events of 1 MB took the gateway from 93 to 514 MB). Past the attempt's
byte budget (32 MiB by default) the events are refused, and say so. Prints how many were stored
and the gateway's resident memory before and after.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx
import psutil

from services.devstack.embedded import NatsServer, free_port

ADMIN = "bench-admin"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--events", type=int, default=200)
    parser.add_argument("--size", type=int, default=1_000_000)
    parser.add_argument("--tree", type=Path, default=Path(__file__).resolve().parent.parent)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        nats = NatsServer(Path(tmp) / "nats").start()
        port = free_port()
        env = {**os.environ, "PYTHONPATH": str(args.tree), "NATS_URL": nats.url, "ROLLWIRE_ADMIN_TOKEN": ADMIN,
               "ROLLWIRE_SECRET": "s" * 32, "ROLLWIRE_GATEWAY_PORT": str(port)}  # fmt: skip
        gateway = subprocess.Popen([sys.executable, "-m", "services.gateway"], env=env, cwd=args.tree,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        try:
            url = f"http://127.0.0.1:{port}"
            admin = httpx.Client(base_url=url, headers={"authorization": f"Bearer {ADMIN}"}, timeout=60)
            deadline = time.monotonic() + 60
            while True:
                try:
                    if admin.get("/healthz").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise SystemExit("the gateway did not start")
                time.sleep(0.2)
            rollout = admin.post("/api/rollouts", json={"rollouts": [{"input": 1}]}).json()["rollouts"][0]
            attempt = admin.post(f"/api/rollouts/{rollout['rollout_id']}/attempts", json={}).json()
            agent = httpx.Client(headers={"authorization": f"Bearer {attempt['token']}"}, timeout=60)
            rss = psutil.Process(gateway.pid)
            before = rss.memory_info().rss
            blob = "x" * args.size
            stored = 0
            for _ in range(args.events):
                r = agent.post(attempt["events_url"], json={"type": "custom", "name": "blob", "payload": {"b": blob}},
                               headers={"idempotency-key": uuid.uuid4().hex})  # fmt: skip
                assert r.status_code in (201, 403), r.text  # 403: past the attempt's byte budget
                stored += r.status_code == 201
            after = rss.memory_info().rss
            print(f"tree {args.tree}: {args.events} custom events of {args.size / 1e6:g} MB with fresh keys "
                  f"({stored} stored, the rest refused by the attempt's byte budget): "
                  f"gateway RSS {before / 2**20:.0f} MB -> {after / 2**20:.0f} MB")  # fmt: skip
        finally:
            gateway.terminate()
            gateway.wait(20)
            nats.stop()


if __name__ == "__main__":
    main()
