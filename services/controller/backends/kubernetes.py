"""The Kubernetes backend: one batch/v1 Job per attempt, watched with the standard controller loop.

    launch   render the Job from the user's template (`k8s_template`), wait for the creation
             rate limit (token bucket), POST it; 409 AlreadyExists is success (the Job name is
             a function of the attempt, so a repeated launch finds its own Job); then POST the
             attempt's Secret (`k8s_secret`: its tokens, owned by the Job), 409 with the same
             data and owner is success
    watch    two list-then-watch loops (`k8s_watch`): Jobs and pods labelled
             managed-by=rollwire for this instance, cached by execution (`k8s_cache`); every
             change to a Job or its pods re-derives that execution's state (`k8s_state`);
             failures with an exit code get the last lines of the container's log (pods/log)
             before they are reported
    list     a fresh LIST of Jobs and pods, derived the same way
    cancel   DELETE the Job with propagationPolicy=Background (its pods and Secret go too)
    cleanup  DELETE every Job whose rollout is not kept

The official `kubernetes` client is synchronous: calls run on a small thread pool of the
backend, and each watch loop in a thread of its own. Responses are read raw
(`_preload_content=False`) and decoded with msgspec; the client's typed models are not needed.
Errors are sorted at this boundary (`k8s_api`) into `TemporaryBackendError` and
`PermanentBackendError`, whose messages say what to fix. Settings: `k8s_settings`.

RBAC needed, in the backend's namespace (see infra/k8s/rbac.yaml): jobs create, get, list,
watch, delete; secrets create, get, delete; pods list, watch; pods/log get.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable, Collection
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec
import urllib3.exceptions
from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from services.controller.backends.base import (
    ExecutionKey,
    ExecutionState,
    LaunchSpec,
    PermanentBackendError,
    RolloutKey,
    TemporaryBackendError,
)
from services.controller.backends.k8s_api import read, translate
from services.controller.backends.k8s_cache import ObjectCache
from services.controller.backends.k8s_secret import owner_uid, secret_manifest
from services.controller.backends.k8s_settings import KubernetesSettings, load_api_client
from services.controller.backends.k8s_state import Derived, derive
from services.controller.backends.k8s_template import JobTemplate, job_name, key_of, selector
from services.controller.backends.k8s_watch import ListWatch, WatchStats, list_all
from services.controller.backends.ratelimit import TokenBucket

__all__ = ["KubernetesBackend", "KubernetesSettings", "load_api_client"]

log = logging.getLogger(__name__)

Obj = dict[str, Any]
Objs = list[Obj]  # `list` is also a method name in the class body below
LOG_LIMIT_BYTES = 64 * 1024
PARALLEL_DELETES = 16


class KubernetesBackend:
    """Runs each attempt as a Kubernetes Job (see the module docstring). Implements `ExecutionBackend`.

    The backend owns `api_client` (it is closed by `close()`); without one it loads the in-cluster
    configuration or the kubeconfig. `limiter` overrides the token bucket built from the settings.
    The Job template is checked at construction: a bad one raises `TemplateError` here, not at the
    first launch.
    """

    name = "kubernetes"

    def __init__(
        self,
        settings: KubernetesSettings,
        *,
        api_client: k8s.ApiClient | None = None,
        limiter: TokenBucket | None = None,
    ) -> None:
        self.settings = settings
        self.capacity = settings.capacity
        self.namespace = settings.namespace
        self.template = JobTemplate(
            settings.job_template,
            source=settings.template_source,
            namespace=settings.namespace,
            instance=settings.instance,
            image=settings.image,
            ttl_seconds_after_finished=settings.ttl_seconds_after_finished,
            values=settings.template_values,
            agent_container=settings.agent_container,
            kubernetes_version=settings.kubernetes_version,
        )
        if limiter is None and settings.create_rate:
            limiter = TokenBucket(settings.create_rate, settings.create_burst)
        self.limiter = limiter
        self._api = api_client or load_api_client(settings.api_threads + 4)
        self._batch = k8s.BatchV1Api(self._api)
        self._core = k8s.CoreV1Api(self._api)
        self._executor = ThreadPoolExecutor(settings.api_threads, thread_name_prefix="rollwire-k8s")
        self._selector = selector(settings.instance)
        self._cache = ObjectCache()
        self._emitted: dict[ExecutionKey, ExecutionState] = {}
        self._logs: dict[ExecutionKey, str | None] = {}
        self._subscribers: set[asyncio.Queue[ExecutionState | None]] = set()
        self._refreshing: dict[ExecutionKey, asyncio.Task[None]] = {}
        self._dirty: set[ExecutionKey] = set()
        self._timers: dict[ExecutionKey, asyncio.TimerHandle] = {}
        self._lagging: dict[ExecutionKey, float] = {}
        self._loops: dict[str, ListWatch] = {}
        self._synced: set[str] = set()
        self._ready = asyncio.Event()
        self._secured: set[ExecutionKey] = set()  # launched with their Secret in place
        self._closed = False

    # --- the interface ---

    async def launch(self, spec: LaunchSpec) -> None:
        """Create the attempt's Job, then its Secret owned by the Job (AlreadyExists means done: success).

        The Job comes first so that no Secret is ever without an owner (the garbage collector
        would not remove it). Its pod waits in CreateContainerConfigError until the Secret exists,
        which the kubelet retries; a launch cut between the two calls is repeated by the
        controller and creates the Secret then.
        """
        self._check_open()
        key = spec.key
        if key in self._cache.jobs and key in self._secured:
            return
        manifest = self.template.render(spec)
        name = manifest["metadata"]["name"]
        uid = ((self._cache.jobs.get(key) or {}).get("metadata") or {}).get("uid")
        if uid is None:
            if self.limiter is not None:
                await self.limiter.acquire()
            uid = await self._create_job(name, manifest)
        await self._ensure_secret(spec, name, uid)
        self._secured.add(key)

    async def list(self) -> list[ExecutionState]:
        """Every execution of this instance, from a fresh LIST of its Jobs and pods."""
        self._check_open()
        jobs, _ = await self._call("list Jobs", list_all, self._batch_list, self.settings.request_timeout_s)
        pods, _ = await self._call("list pods", list_all, self._pod_list, self.settings.request_timeout_s)
        by_key: dict[ExecutionKey, Objs] = {}
        for pod in pods:
            key = key_of(pod)
            if key is not None:
                by_key.setdefault(key, []).append(pod)
        keyed = [(key, job) for job in jobs if (key := key_of(job)) is not None]
        limit = asyncio.Semaphore(self.settings.api_threads)

        async def state(key: ExecutionKey, job: Obj) -> ExecutionState:
            async with limit:
                return (await self._derive(key, job, by_key.get(key, []))).state

        return list(await asyncio.gather(*(state(k, j) for k, j in keyed)))

    async def cancel(self, key: ExecutionKey) -> None:
        """Delete the attempt's Job and its pods; a missing Job is fine."""
        self._check_open()
        await self._delete(job_name(key))

    async def cleanup(self, keep: Collection[RolloutKey]) -> int:
        """Delete every Job (finished or not) whose rollout is not in `keep`; return how many were deleted."""
        self._check_open()
        kept = {RolloutKey(k.run_id, k.rollout_id) for k in keep}
        jobs, _ = await self._call("list Jobs", list_all, self._batch_list, self.settings.request_timeout_s)
        doomed = [
            job["metadata"]["name"] for job in jobs if (key := key_of(job)) is not None and key.rollout not in kept
        ]
        limit = asyncio.Semaphore(PARALLEL_DELETES)

        async def delete(name: str) -> bool:
            async with limit:
                return await self._delete(name)

        return sum(await asyncio.gather(*(delete(name) for name in doomed)))

    async def watch(self) -> AsyncIterator[ExecutionState]:
        """Every execution's state once the first lists are in, then each change (see `ExecutionBackend`)."""
        if self._closed:
            return
        queue: asyncio.Queue[ExecutionState | None] = asyncio.Queue()
        self._subscribers.add(queue)
        try:
            self._start()
            await self._ready.wait()
            for known in list(self._emitted.values()):
                yield known
            while (state := await queue.get()) is not None:
                yield state
        finally:
            self._subscribers.discard(queue)

    async def close(self) -> None:
        """Stop watching, end every `watch()` iterator, release threads and connections."""
        if self._closed:
            return
        self._closed = True
        loop = asyncio.get_running_loop()
        await asyncio.gather(*(loop.run_in_executor(None, w.stop) for w in self._loops.values()))
        for timer in self._timers.values():
            timer.cancel()
        for task in list(self._refreshing.values()):
            task.cancel()
        await asyncio.gather(*self._refreshing.values(), return_exceptions=True)
        for queue in self._subscribers:
            queue.put_nowait(None)
        self._ready.set()  # a watcher still waiting for the first lists ends too
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._api.close()

    @property
    def stats(self) -> dict[str, WatchStats]:
        """The watch loops' counters, by resource (`jobs`, `pods`)."""
        return {name: loop.stats for name, loop in self._loops.items()}

    # --- calling the API ---

    def _check_open(self) -> None:
        if self._closed:
            raise PermanentBackendError("the Kubernetes backend is closed")

    def _batch_list(self, **kwargs: Any) -> Any:
        return self._batch.list_namespaced_job(self.namespace, label_selector=self._selector, **kwargs)

    def _pod_list(self, **kwargs: Any) -> Any:
        return self._core.list_namespaced_pod(self.namespace, label_selector=self._selector, **kwargs)

    async def _call(
        self, what: str, fn: Callable[..., Any], *args: Any, ok_statuses: tuple[int, ...] = (), **kwargs: Any
    ) -> Any:
        """Run a blocking client call on the backend's threads; sort its errors into temporary and permanent."""
        if fn is not list_all:
            kwargs.setdefault("_preload_content", False)
            kwargs.setdefault("_request_timeout", self.settings.request_timeout_s)
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._executor, functools.partial(read, fn, *args, **kwargs))
        except ApiException as e:
            if e.status in ok_statuses:
                return None
            raise translate(what, e, self.namespace) from None
        except (urllib3.exceptions.HTTPError, OSError) as e:
            raise TemporaryBackendError(
                f"{what}: cannot reach the Kubernetes API server: {e}", retry_after=2.0
            ) from None
        except ValueError as e:  # the client's request validation (pydantic) or a malformed answer
            raise PermanentBackendError(f"{what}: the request or its answer is malformed: {e}") from None

    async def _create_job(self, name: str, manifest: Obj) -> str:
        """POST the Job (409 AlreadyExists: read the one there); return its uid."""
        created = await self._call(
            f"create Job {name}", self._batch.create_namespaced_job, self.namespace, manifest, ok_statuses=(409,)
        )
        if created is None:
            created = await self._call(f"read Job {name}", self._batch.read_namespaced_job, name, self.namespace)
        return str(msgspec.json.decode(created)["metadata"]["uid"])

    async def _ensure_secret(self, spec: LaunchSpec, name: str, uid: str) -> None:
        """Create the attempt's Secret owned by Job `uid`; one already there with the same data and owner is fine.

        Another one (left by an earlier Job of the same name whose garbage collection is pending,
        or holding other credentials) is deleted and created again.
        """
        body = secret_manifest(spec, name, self.namespace, self.settings.instance, {"name": name, "uid": uid})
        for _ in range(3):
            created = await self._call(
                f"create Secret {name}", self._core.create_namespaced_secret, self.namespace, body, ok_statuses=(409,)
            )
            if created is not None:
                return
            raw = await self._call(
                f"read Secret {name}", self._core.read_namespaced_secret, name, self.namespace, ok_statuses=(404,)
            )
            if raw is None:
                continue  # deleted meanwhile: create it again
            existing = msgspec.json.decode(raw)
            if (existing.get("data") or {}) == body["data"] and owner_uid(existing) == uid:
                return
            await self._call(
                f"delete Secret {name}", self._core.delete_namespaced_secret, name, self.namespace, ok_statuses=(404,)
            )
        raise TemporaryBackendError(f"create Secret {name}: it was replaced while being created; retrying", 1.0)

    async def _delete(self, name: str) -> bool:
        """Delete a Job and its pods; False if it was already gone."""
        response = await self._call(
            f"delete Job {name}",
            self._batch.delete_namespaced_job,
            name,
            self.namespace,
            propagation_policy="Background",
            ok_statuses=(404,),
        )
        return response is not None

    async def _read_log(self, pod: str, container: str) -> str | None:
        try:
            data = await self._call(
                f"read the log of {pod}/{container}",
                self._core.read_namespaced_pod_log,
                pod,
                self.namespace,
                container=container,
                tail_lines=self.settings.log_tail_lines,
                limit_bytes=LOG_LIMIT_BYTES,
            )
        except (TemporaryBackendError, PermanentBackendError) as e:
            log.info("no log tail for %s/%s: %s", pod, container, e)
            return None
        return data.decode(errors="replace") if data is not None else None

    # --- the watch side ---

    def _start(self) -> None:
        if self._loops:
            return
        loop = asyncio.get_running_loop()
        for resource, list_call in (("jobs", self._batch_list), ("pods", self._pod_list)):

            def on_list(items: Objs, resource: str = resource) -> None:
                _call_soon(loop, self._on_list, resource, items)

            def on_event(kind: str, obj: Obj, resource: str = resource) -> None:
                _call_soon(loop, self._on_event, resource, kind, obj)

            self._loops[resource] = ListWatch(
                resource=resource,
                list_call=list_call,
                on_list=on_list,
                on_event=on_event,
                resync_s=self.settings.resync_s,
                request_timeout_s=self.settings.request_timeout_s,
            )
        for watch_loop in self._loops.values():
            watch_loop.start()

    def _on_list(self, resource: str, items: Objs) -> None:
        """A fresh LIST replaces the cache; every execution that differs is re-derived."""
        touched = self._cache.replace(resource, items)
        self._synced.add(resource)
        for key in touched:
            self._touch(key)
        if not self._ready.is_set() and self._synced == {"jobs", "pods"}:
            self._ready.set()
            for key in list(self._dirty):
                self._touch(key)

    def _on_event(self, resource: str, kind: str, obj: Obj) -> None:
        key = self._cache.apply(resource, kind, obj)
        if key is not None:
            self._touch(key)

    def _touch(self, key: ExecutionKey) -> None:
        """Re-derive one execution's state; changes of one execution are handled in order, one at a time."""
        if self._closed:
            return
        if not self._ready.is_set() or key in self._refreshing:
            self._dirty.add(key)
            return
        self._dirty.discard(key)
        self._refreshing[key] = asyncio.get_running_loop().create_task(self._refresh_until_clean(key))

    async def _refresh_until_clean(self, key: ExecutionKey) -> None:
        try:
            while True:
                self._dirty.discard(key)
                await self._refresh(key)
                if key not in self._dirty:
                    return
        except Exception:
            log.exception("re-deriving the state of %s failed", key)
        finally:
            self._refreshing.pop(key, None)

    async def _refresh(self, key: ExecutionKey) -> None:
        job = self._cache.jobs.get(key)
        if job is None:
            self._forget(key)
            return
        derived = await self._derive(key, job, list(self._cache.pods.get(key, {}).values()))
        if self._cache.jobs.get(key) is None:
            return  # deleted while the log was read; the next refresh reports it
        if derived.recheck_at is not None:
            self._schedule(key, derived.recheck_at)
        if derived.pods_lag:
            since = self._lagging.setdefault(key, time.time())
            if time.time() - since < self.settings.pod_lag_s:
                self._schedule(key, since + self.settings.pod_lag_s)
                return
        else:
            self._lagging.pop(key, None)
        state = derived.state
        if self._emitted.get(key) != state:
            self._emitted[key] = state
            self._publish(state)

    async def _derive(self, key: ExecutionKey, job: Obj, pods: Objs) -> Derived:
        """Derive the state; fetch the failed container's log tail first if it is not known yet."""
        derived = self._derive_now(key, job, pods)
        if derived.log_source is not None and key not in self._logs:
            self._logs[key] = await self._read_log(*derived.log_source)
            derived = self._derive_now(key, job, pods)
        return derived

    def _derive_now(self, key: ExecutionKey, job: Obj, pods: Objs) -> Derived:
        return derive(
            key,
            job,
            pods,
            namespace=self.namespace,
            agent_container=self.template.agent_container,
            now=time.time(),
            stuck_grace_s=self.settings.stuck_grace_s,
            log_tail=self._logs.get(key),
        )

    def _schedule(self, key: ExecutionKey, at: float) -> None:
        """Look at an execution again at `at` (a stuck pod turns failed without any event)."""
        previous = self._timers.pop(key, None)
        if previous is not None:
            previous.cancel()
        delay = max(0.0, at - time.time()) + 0.01
        self._timers[key] = asyncio.get_running_loop().call_later(delay, self._touch, key)

    def _forget(self, key: ExecutionKey) -> None:
        """The Job is gone: report its last state as deleted (failed, if it had not ended)."""
        timer = self._timers.pop(key, None)
        if timer is not None:
            timer.cancel()
        self._logs.pop(key, None)
        self._lagging.pop(key, None)
        self._secured.discard(key)
        last = self._emitted.pop(key, None)
        if last is None or last.deleted:
            return
        if last.terminal:
            final = msgspec.structs.replace(last, deleted=True)
        else:
            final = msgspec.structs.replace(
                last,
                phase="failed",
                deleted=True,
                finished_at=time.time(),
                reason=f"the Job {last.execution} was deleted before it finished",
            )
        self._publish(final)

    def _publish(self, state: ExecutionState) -> None:
        for queue in self._subscribers:
            queue.put_nowait(state)


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable[..., None], *args: Any) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the event loop is closed: nobody is listening any more
        pass
