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
from trainer.run.sections import EngineSection


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
def embedded_stack(
    data_dir: Path,
    model_dir: Path,
    say: Callable[[str], None],
    engine: EngineSection | None = None,
    *,
    lora_rank: int = 0,
    max_loras: int = 1,
) -> Iterator[ServiceUrls]:
    """The embedded stack (free ports, vLLM serving `model_dir`) for the duration.

    The stack starts `engine.replicas` vLLM servers (installing vLLM when missing); the trainer
    attaches to them through `ServiceUrls.engine_urls` and their key. A LoRA run's `lora_rank`
    starts them with LoRA enabled, so the trainer can load its adapters there.
    """
    from services.common.vllm import VllmServeSettings
    from services.devstack.stack import Stack, StackConfig

    engine = engine or EngineSection()
    vllm = VllmServeSettings(
        executable=engine.executable,
        port=0,
        dtype=engine.dtype,
        gpu_memory_utilization=engine.gpu_memory_utilization,
        extra_args=list(engine.extra_args),
        max_lora_rank=lora_rank,
        max_loras=max_loras,
    )
    config = StackConfig(
        data_dir=data_dir,
        nats_port=0,
        pg_port=0,
        gateway_port=0,
        engine_model=model_dir,
        vllm=vllm,
        vllm_replicas=engine.replicas,
    )
    with _engine_single_thread():
        # Isolation none: the trainer's agents start through a fork server of this process's user
        # (trainer/quickstart/forkserver.py), whose socket an agent of another uid could not reach.
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
            engine_urls=tuple(endpoints.engine_urls),
            engine_api_key=endpoints.engine_api_key,
        )
    finally:
        local.stop()
