"""A stand-in for `ray` where Ray is not installed (the GPU machine of `bench/gpu_check.sh`).

verl imports `ray` at its top level (`verl/__init__.py`, `verl.protocol`'s `isinstance(x, ray.ObjectRef)`,
`@ray.remote` on worker classes); its FSDP training engine, the only part the verl backend drives, never
calls Ray. This module gives those names: `remote` returns the class or function unchanged, `ObjectRef`
is a class nothing is an instance of, and anything else raises, naming the stub.
"""

from typing import Any

__version__ = "0.0.0-stub"


class ObjectRef:
    """Nothing is an instance of it here (verl's `isinstance` checks then take their other branch)."""


def remote(*args: Any, **kwargs: Any) -> Any:
    """`@ray.remote` and `@ray.remote(...)`: the decorated object, unchanged."""
    if args and callable(args[0]) and not kwargs:
        return args[0]
    return lambda target: target


def _missing(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("ray is a stand-in here (bench/gpu_stubs): this code path needs the real Ray")


init = get = put = wait = kill = get_actor = _missing


def is_initialized() -> bool:
    """Ray never runs here."""
    return False


def __getattr__(name: str) -> Any:
    return _missing
