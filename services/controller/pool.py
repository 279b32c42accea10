"""The controller's execution backends: which it serves, creating them on demand, and following their
watches and listings into `executions`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time

import msgspec

from schemas.runs import RunSpec
from services.controller.backends.base import (
    ExecutionBackend,
    ExecutionState,
    PermanentBackendError,
)
from services.controller.state import ControllerState, backend_id
from services.controller.view import RunSpecError

log = logging.getLogger("rollwire.controller")


class BackendPool(ControllerState):
    """Part of `Controller` (`reconciler.py`); see the module docstring."""

    def _serves(self, spec: RunSpec | RunSpecError | None) -> bool:
        if spec is None:
            return False
        if isinstance(spec, RunSpecError):
            return True
        return spec.backend in self.settings.backends

    def _needed_backends(self) -> set[str]:
        needed = {"local"} & set(self.settings.backends)
        for spec in self.specs.values():
            if isinstance(spec, RunSpec) and spec.backend in self.settings.backends:
                needed.add(backend_id(spec))
        return needed

    def _make_backend(self, name: str) -> ExecutionBackend:
        """Build the backend instance `name` (see `backend_id`)."""
        if name == "local":
            from services.controller.backends.local import LocalBackend

            return LocalBackend(
                self.settings.executions_dir,
                capacity=self.settings.local_capacity,
                kill_grace_s=self.settings.local_kill_grace_s,
                isolation=self.settings.agent_isolation,
                hidden=(self.settings.data_dir, self.settings.executions_dir),
            )
        if name == "kubernetes":
            from services.controller.backends.kubernetes import KubernetesBackend, KubernetesSettings

            return KubernetesBackend(KubernetesSettings.from_env())
        if name.startswith("kubernetes:") and name in self._templates:
            from services.controller.backends.kubernetes import KubernetesBackend, KubernetesSettings

            template, run_id = self._templates[name]
            # Everything but the template comes from the ROLLWIRE_K8S_* variables, as for the default.
            base = KubernetesSettings.from_env({**os.environ, "ROLLWIRE_K8S_JOB_TEMPLATE": os.devnull})
            settings = msgspec.structs.replace(
                base,
                job_template=template,
                template_source=f"the job_template of run {run_id}",
                instance=f"{base.instance}-{name.split(':', 1)[1]}",
            )
            return KubernetesBackend(settings)
        raise PermanentBackendError(f"unknown backend {name!r}")

    async def _ensure_backend(self, name: str) -> ExecutionBackend | None:
        """The backend `name`, made, listed and watched on first use; None (logged once) if it cannot be made."""
        backend = self.backends.get(name)
        if backend is None:
            if self._backend_retry_at.get(name, 0.0) > time.monotonic():
                return None
            try:
                backend = self._make_backend(name)
            except Exception as exc:
                message = f"the {name} backend is not available: {exc}"
                if self.backend_errors.get(name) != message:
                    log.error("%s; its runs' rollouts stay queued (retrying)", message)
                self.backend_errors[name] = message
                self._backend_retry_at[name] = time.monotonic() + self.settings.resync_s
                return None
            self.backends[name] = backend
            self.backend_errors.pop(name, None)
        if name not in self._watching:
            self._watching.add(name)
            try:
                await self._relist(name, backend)
            except Exception as exc:
                log.warning("cannot list the %s backend yet: %s", name, exc)
            self._spawn(self._watch(name, backend))
        return backend

    async def _watch(self, name: str, backend: ExecutionBackend) -> None:
        while not self._stopping.is_set():
            try:
                async for state in backend.watch():
                    self._on_state(name, state)
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("watching the %s backend failed (%s); watching again in 1s", name, exc)
                await asyncio.sleep(1.0)

    def _on_state(self, name: str, state: ExecutionState) -> None:
        key = state.key
        rollout_key = key.rollout
        known = self.executions.setdefault(rollout_key, {})
        self.owner[key] = name
        self.seen_at[key] = time.monotonic()
        if state.deleted:
            view = self.rollouts.get(rollout_key)
            # Keep the last word on the active attempt so its reason is reported, not "vanished".
            if view is not None and view.active_attempt_id == key.attempt_id and state.terminal:
                known[key.attempt_id] = msgspec.structs.replace(state, deleted=False)
            else:
                known.pop(key.attempt_id, None)
        else:
            known[key.attempt_id] = state
        self._dirty.add(rollout_key)
        self._changed.set()

    async def _relist(self, name: str, backend: ExecutionBackend) -> None:
        """Merge a fresh listing: update what it shows, drop what it no longer has (unless newer)."""
        began = time.monotonic()
        states = await backend.list()
        listed = {state.key for state in states}
        for state in states:
            if self.seen_at.get(state.key, 0.0) <= began:
                self._on_state(name, state)
        for key, owner in list(self.owner.items()):
            if owner == name and key not in listed and self.seen_at.get(key, 0.0) <= began:
                known = self.executions.get(key.rollout, {})
                current = known.get(key.attempt_id)
                if current is not None and not current.terminal:
                    known.pop(key.attempt_id, None)
                    self._dirty.add(key.rollout)
                self.owner.pop(key, None)
                self.seen_at.pop(key, None)
