"""The embedded stack for a training run: nats-server, Postgres and every service, on free ports.

`rollwire train` (with `stack.embedded`), `rollwire quickstart` and the training benchmark all
start it through `embedded_stack`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path

from trainer.clients import ServiceUrls


@contextlib.contextmanager
def _engine_single_thread() -> Iterator[None]:
    """Children started inside get one torch thread: the engine decodes one token at a time, where
    threads only add synchronisation, and the other core stays free for agents and the trainer."""
    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = saved


@contextlib.contextmanager
def embedded_stack(data_dir: Path, model_dir: Path, say: Callable[[str], None]) -> Iterator[ServiceUrls]:
    """The embedded stack (free ports, the engine serving `model_dir`) for the duration; yields its URLs."""
    from services.devstack.stack import Stack, StackConfig

    with _engine_single_thread():
        # Isolation none: the trainer's agents start through a fork server of this process's user
        # (trainer/quickstart/forkserver.py), whose socket an agent of another uid could not reach.
        config = StackConfig(data_dir=data_dir, nats_port=0, pg_port=0, gateway_port=0, engine_model=model_dir)
        config.agent_isolation = "none"
        local = Stack(config, say=say)
        endpoints = local.start()
    try:
        for line in endpoints.lines:
            say(line)
        assert endpoints.gateway_url and endpoints.engine_url
        yield ServiceUrls(
            gateway_url=endpoints.gateway_url,
            nats_url=endpoints.nats_url,
            engine_url=endpoints.engine_url,
            admin_token=endpoints.admin_token,
        )
    finally:
        local.stop()
