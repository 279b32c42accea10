"""Running verl's training engine where there is no GPU: a CPU platform, and torch.distributed set up.

verl resolves its hardware through `verl.plugin.platform.PlatformRegistry` once per process
(`VERL_PLATFORM` names it). `PlatformCPU` registers a `cpu` platform (gloo collectives, no device
module calls), so `FSDPEngineWithLMHead` runs the same FSDP2 code on CPU, which is how the backend
is tested exactly against the CPU backend. On a GPU machine nothing here is used: verl's own
`cuda` platform and NCCL are.

`init_distributed` starts the process group once: from torchrun's environment (RANK,
WORLD_SIZE, MASTER_ADDR...) when present, else as a world of one on a free local port.
"""

from __future__ import annotations

import os
import socket
from contextlib import contextmanager
from types import ModuleType
from typing import Any

import torch
from verl.plugin.platform.platform_base import PlatformBase

PLATFORM_ENV = "VERL_PLATFORM"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class _NoDevice:
    """Stands in for `torch.cuda` where verl calls the device module directly (memory logging)."""

    @staticmethod
    def is_available() -> bool:
        return False

    @staticmethod
    def memory_allocated(*_: Any, **__: Any) -> int:
        return 0

    @staticmethod
    def memory_reserved(*_: Any, **__: Any) -> int:
        return 0

    @staticmethod
    def max_memory_allocated(*_: Any, **__: Any) -> int:
        return 0

    @staticmethod
    def mem_get_info(*_: Any, **__: Any) -> tuple[int, int]:
        return (0, 0)

    @staticmethod
    def empty_cache() -> None:
        return None

    @staticmethod
    def synchronize(*_: Any, **__: Any) -> None:
        return None

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def set_device(*_: Any) -> None:
        return None

    @staticmethod
    def manual_seed(seed: int) -> None:
        return None

    @staticmethod
    def manual_seed_all(seed: int) -> None:
        return None


class PlatformCPU(PlatformBase):
    """verl on the CPU: gloo collectives, no device memory, no profiler ranges."""

    device_name = "cpu"
    vendor_name = "cpu"
    device_module: ModuleType = _NoDevice  # type: ignore[assignment]

    def is_available(self) -> bool:
        return True

    def current_device(self) -> Any:
        return "cpu"  # verl moves tensors `.to(current_device())`: the CPU, not accelerator 0

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        return None

    def synchronize(self, device_index: int | None = None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    @contextmanager
    def nvtx_range(self, msg: str) -> Any:
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def ray_resource_name(self) -> str:
        return "CPU"

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> Any:
        return None


def register_cpu_platform() -> bool:
    """Register verl's `cpu` platform and select it when no GPU is present; returns whether CPU is used."""
    if torch.cuda.is_available() and os.environ.get(PLATFORM_ENV, "") != "cpu":
        return False
    from verl.plugin.platform.platform_manager import PlatformRegistry

    PlatformRegistry.register(platform="cpu")(PlatformCPU)
    os.environ[PLATFORM_ENV] = "cpu"
    return True


def init_distributed(on_cpu: bool) -> tuple[int, int]:
    """Start torch.distributed (torchrun's rendezvous, or a world of one); returns (rank, world size)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        if "RANK" not in os.environ:
            os.environ.update(
                RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port())
            )
        if not on_cpu:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend="gloo" if on_cpu else "nccl")
    return dist.get_rank(), dist.get_world_size()
