"""Executors of the controller: each turns an attempt into a running agent behind one interface.

`base` holds the contract (`ExecutionBackend`) and its data; `kubernetes` runs attempts as
Kubernetes Jobs. Import a backend module only when it is used: it pulls its client library in.
"""

from services.controller.backends.base import (
    INPUT_ENV,
    INPUT_ENV_LIMIT,
    INPUT_FILE_ENV,
    TERMINAL_PHASES,
    BackendError,
    ExecutionBackend,
    ExecutionKey,
    ExecutionPhase,
    ExecutionState,
    LaunchSpec,
    PermanentBackendError,
    RolloutKey,
    TemporaryBackendError,
)

__all__ = [
    "INPUT_ENV",
    "INPUT_ENV_LIMIT",
    "INPUT_FILE_ENV",
    "TERMINAL_PHASES",
    "BackendError",
    "ExecutionBackend",
    "ExecutionKey",
    "ExecutionPhase",
    "ExecutionState",
    "LaunchSpec",
    "PermanentBackendError",
    "RolloutKey",
    "TemporaryBackendError",
]
