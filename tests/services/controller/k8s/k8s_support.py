"""Shared helpers of the Kubernetes backend tests: the example template, launch specs, a watch recorder."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from services.controller.backends.base import ExecutionKey, ExecutionState, LaunchSpec
from services.controller.backends.kubernetes import KubernetesBackend

REPO = Path(__file__).resolve().parents[4]
TEMPLATE_PATH = REPO / "infra" / "k8s" / "job-template.yaml"
TEMPLATE = TEMPLATE_PATH.read_text()
NAMESPACE = "agents"


def launch_spec(key: ExecutionKey, **overrides: Any) -> LaunchSpec:
    """A launch spec with the environment the controller gives an agent."""
    fields: dict[str, Any] = {
        "key": key,
        "env": {
            "OPENAI_BASE_URL": f"http://gateway:8080/v1/{key.run_id}/{key.rollout_id}/{key.attempt_id}",
            "OPENAI_API_KEY": "agent-token",
            "ROLLWIRE_EVENTS_URL": "http://gateway:8080/events",
            "ROLLWIRE_ROLLOUT_ID": key.rollout_id,
            "ROLLWIRE_ATTEMPT_ID": key.attempt_id,
        },
        "input_json": '{"question": "2+2"}',
        "timeout_s": 600,
    }
    fields.update(overrides)
    return LaunchSpec(**fields)


class StateLog:
    """Records what `backend.watch()` yields, so a test can wait for a state without sleeping blindly."""

    def __init__(self, backend: KubernetesBackend) -> None:
        self.states: list[ExecutionState] = []
        self._changed = asyncio.Event()
        self._task = asyncio.create_task(self._consume(backend))

    async def _consume(self, backend: KubernetesBackend) -> None:
        async for state in backend.watch():
            self.states.append(state)
            self._changed.set()
        self._changed.set()

    async def until(self, predicate: Callable[[ExecutionState], bool], timeout: float = 5.0) -> ExecutionState:
        """The first recorded state matching `predicate`, waiting up to `timeout` seconds for it."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            for state in self.states:
                if predicate(state):
                    return state
            remaining = deadline - loop.time()
            if remaining <= 0 or self._task.done():
                seen = [(s.key.attempt_id, s.phase, s.reason) for s in self.states]
                raise AssertionError(f"no matching state within {timeout}s; seen: {seen}")
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), remaining)

    def phases(self, key: ExecutionKey) -> list[str]:
        """The phases recorded for one execution, repeats collapsed."""
        phases: list[str] = []
        for state in self.states:
            if state.key == key and (not phases or phases[-1] != state.phase):
                phases.append(state.phase)
        return phases

    async def stop(self) -> None:
        """Stop recording."""
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
