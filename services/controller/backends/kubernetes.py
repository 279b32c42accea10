"""The Kubernetes backend: one batch/v1 Job per attempt, watched with the standard controller loop.

    launch   render the Job from the user's template (`k8s_template`), wait for the creation
             rate limit (token bucket), POST it; 409 AlreadyExists is success (the Job name is
             a function of the attempt, so a repeated launch finds its own Job)
    watch    two list-then-watch loops (`k8s_watch`): Jobs and pods labelled
             managed-by=rollwire for this instance; every change to a Job or its pods
             re-derives that execution's state (`k8s_state`); failures with an exit code get
             the last lines of the container's log (pods/log) before they are reported
    list     a fresh LIST of Jobs and pods, derived the same way
    cancel   DELETE the Job with propagationPolicy=Background (its pods go too)
    cleanup  DELETE every Job whose rollout is not kept

The official `kubernetes` client is synchronous: calls run on a small thread pool of the
backend, and each watch loop in a thread of its own. Responses are read raw
(`_preload_content=False`) and decoded with msgspec; the client's typed models are not needed.
Errors are sorted at this boundary into `TemporaryBackendError` (unreachable API server, 429,
5xx, an exhausted ResourceQuota) and `PermanentBackendError` (forbidden, invalid, unauthorized),
whose messages say what to fix.

RBAC needed, in the backend's namespace (see infra/k8s/rbac.yaml): jobs create, list, watch,
delete; pods list, watch; pods/log get.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import time
from collections.abc import AsyncIterator, Callable, Collection, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgspec
import urllib3.exceptions
from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException

from services.controller.backends.base import (
    ExecutionKey,
    ExecutionState,
    LaunchSpec,
    PermanentBackendError,
    RolloutKey,
    TemporaryBackendError,
)
from services.controller.backends.k8s_state import Derived, derive
from services.controller.backends.k8s_template import INPUT_ANNOTATION, JobTemplate, job_name, key_of, selector
from services.controller.backends.k8s_watch import ListWatch, WatchStats, list_all
from services.controller.backends.ratelimit import TokenBucket

log = logging.getLogger(__name__)

Obj = dict[str, Any]
Objs = list[Obj]  # `list` is also a method name in the class body below
IN_CLUSTER_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
LOG_LIMIT_BYTES = 64 * 1024
PARALLEL_DELETES = 16


class KubernetesSettings(msgspec.Struct, frozen=True, kw_only=True):
    """How the Kubernetes backend runs attempts. `from_env` reads them from ROLLWIRE_K8S_* variables.

    `create_rate` is Jobs created per second (None: no limit), with bursts of `create_burst`.
    `pod_lag_s` is how long the state of a failed Job waits for its pod's news (the reason)
    before it is reported with only the Job's own reason.
    `stuck_grace_s` is how long a pod may fail to start (image pull errors, missing Secret)
    before the execution is reported failed. `resync_s` is the period of the full re-list that
    repairs lost watch events. `kubernetes_version` is the schema the template is checked against.
    """

    job_template: str
    template_source: str = "job template"
    namespace: str = "default"
    instance: str = "default"
    image: str | None = None
    template_values: dict[str, str] = {}
    agent_container: str | None = None
    ttl_seconds_after_finished: int = 3600
    create_rate: float | None = 10.0
    create_burst: int = 10
    capacity: int | None = None
    resync_s: float = 60.0
    request_timeout_s: float = 30.0
    log_tail_lines: int = 50
    stuck_grace_s: float = 120.0
    pod_lag_s: float = 2.0
    api_threads: int = 8
    kubernetes_version: str = "1.33"

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> KubernetesSettings:
        """Settings from the environment (the variables are listed in infra/k8s/controller.yaml)."""
        env = os.environ if environ is None else environ
        path = env.get("ROLLWIRE_K8S_JOB_TEMPLATE")
        if not path:
            raise PermanentBackendError("ROLLWIRE_K8S_JOB_TEMPLATE is not set: give the path of the Job template YAML")
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise PermanentBackendError(
                f"ROLLWIRE_K8S_JOB_TEMPLATE={path}: cannot read the Job template: {e}"
            ) from None
        namespace = env.get("ROLLWIRE_K8S_NAMESPACE") or (
            IN_CLUSTER_NAMESPACE.read_text().strip() if IN_CLUSTER_NAMESPACE.exists() else "default"
        )
        rate = _env_number(env, "ROLLWIRE_K8S_CREATE_RATE", 10.0)
        capacity = _env_number(env, "ROLLWIRE_K8S_CAPACITY", 0)
        try:
            values = json.loads(env.get("ROLLWIRE_K8S_TEMPLATE_VALUES") or "{}")
            assert isinstance(values, dict) and all(isinstance(v, str) for v in values.values())
        except (ValueError, AssertionError):
            raise PermanentBackendError(
                'ROLLWIRE_K8S_TEMPLATE_VALUES must be a JSON object of strings, e.g. {"service_account": "agents"}'
            ) from None
        return cls(
            job_template=text,
            template_source=path,
            namespace=namespace,
            instance=env.get("ROLLWIRE_K8S_INSTANCE") or "default",
            image=env.get("ROLLWIRE_K8S_IMAGE") or None,
            template_values=values,
            agent_container=env.get("ROLLWIRE_K8S_AGENT_CONTAINER") or None,
            ttl_seconds_after_finished=int(_env_number(env, "ROLLWIRE_K8S_TTL_S", 3600)),
            create_rate=rate or None,
            create_burst=int(_env_number(env, "ROLLWIRE_K8S_CREATE_BURST", 10)),
            capacity=int(capacity) or None,
            resync_s=_env_number(env, "ROLLWIRE_K8S_RESYNC_S", 60.0),
            stuck_grace_s=_env_number(env, "ROLLWIRE_K8S_STUCK_GRACE_S", 120.0),
        )


def _env_number(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name)
    if raw in (None, ""):
        return default
    try:
        value = float(raw)
    except ValueError:
        raise PermanentBackendError(f"{name}={raw!r} is not a number") from None
    if value < 0:
        raise PermanentBackendError(f"{name}={raw!r} must not be negative")
    return value


def load_api_client(pool_size: int = 16) -> k8s.ApiClient:
    """A client for the cluster this process runs in, or else the one the kubeconfig names."""
    try:
        k8s_config.load_incluster_config()
    except k8s_config.ConfigException:
        try:
            k8s_config.load_kube_config()
        except (k8s_config.ConfigException, OSError) as e:
            raise PermanentBackendError(
                f"no Kubernetes credentials: not running in a cluster and no usable kubeconfig "
                f"(~/.kube/config or $KUBECONFIG): {e}"
            ) from None
    configuration = k8s.Configuration.get_default_copy()
    configuration.connection_pool_maxsize = pool_size
    return k8s.ApiClient(configuration)


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
        self._jobs: dict[ExecutionKey, Obj] = {}
        self._pods: dict[ExecutionKey, dict[str, Obj]] = {}
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
        self._closed = False

    # --- the interface ---

    async def launch(self, spec: LaunchSpec) -> None:
        """Create the attempt's Job (a 409 AlreadyExists means it exists already: success)."""
        self._check_open()
        if spec.key in self._jobs:
            return
        manifest = self.template.render(spec)
        if self.limiter is not None:
            await self.limiter.acquire()
        await self._call(
            f"create Job {manifest['metadata']['name']}",
            self._batch.create_namespaced_job,
            self.namespace,
            manifest,
            ok_statuses=(409,),
        )

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
            return await loop.run_in_executor(self._executor, functools.partial(_read, fn, *args, **kwargs))
        except ApiException as e:
            if e.status in ok_statuses:
                return None
            raise self._translate(what, e) from None
        except (urllib3.exceptions.HTTPError, OSError) as e:
            raise TemporaryBackendError(
                f"{what}: cannot reach the Kubernetes API server: {e}", retry_after=2.0
            ) from None
        except ValueError as e:  # the client's request validation (pydantic) or a malformed answer
            raise PermanentBackendError(f"{what}: the request or its answer is malformed: {e}") from None

    def _translate(self, what: str, error: ApiException) -> Exception:
        code, message = error.status or 0, _status_message(error)
        if code == 0:
            return TemporaryBackendError(f"{what}: cannot reach the Kubernetes API server: {message}", retry_after=2.0)
        if code == 429:
            retry = _retry_after(error, 1.0)
            return TemporaryBackendError(f"{what}: the API server is throttling requests: {message}", retry_after=retry)
        if code >= 500:
            return TemporaryBackendError(f"{what}: the API server failed ({code}): {message}", retry_after=2.0)
        if code == 403 and "exceeded quota" in message:
            return TemporaryBackendError(
                f"{what}: the ResourceQuota of namespace {self.namespace} is used up ({message}); "
                "retrying as running Jobs finish",
                retry_after=10.0,
            )
        if code == 403:
            return PermanentBackendError(
                f"{what}: forbidden: {message}. The controller's service account needs the Role in "
                f"infra/k8s/rbac.yaml in namespace {self.namespace}"
            )
        if code == 401:
            return PermanentBackendError(
                f"{what}: unauthorized: {message}; check the kubeconfig or service account token"
            )
        if code == 404:
            return PermanentBackendError(f"{what}: not found: {message}; does namespace {self.namespace} exist?")
        if code in (400, 422):
            return PermanentBackendError(f"{what}: Kubernetes rejected it: {message}; fix the Job template")
        if code == 409:
            return TemporaryBackendError(f"{what}: conflict: {message}", retry_after=1.0)
        return PermanentBackendError(f"{what}: HTTP {code}: {message}")

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
        touched: set[ExecutionKey] = set()
        if resource == "jobs":
            fresh = {key: _slim(o) for o in items if (key := key_of(o)) is not None}
            touched = {k for k in self._jobs.keys() | fresh.keys() if _rv(self._jobs.get(k)) != _rv(fresh.get(k))}
            self._jobs = fresh
        else:
            pods: dict[ExecutionKey, dict[str, Obj]] = {}
            for o in items:
                if (key := key_of(o)) is not None:
                    pods.setdefault(key, {})[o["metadata"]["name"]] = _slim(o)
            touched = {
                k
                for k in self._pods.keys() | pods.keys()
                if {n: _rv(p) for n, p in self._pods.get(k, {}).items()}
                != {n: _rv(p) for n, p in pods.get(k, {}).items()}
            }
            self._pods = pods
        self._synced.add(resource)
        for key in touched:
            self._touch(key)
        if not self._ready.is_set() and self._synced == {"jobs", "pods"}:
            self._ready.set()
            for key in list(self._dirty):
                self._touch(key)

    def _on_event(self, resource: str, kind: str, obj: Obj) -> None:
        key = key_of(obj)
        if key is None:
            return
        if resource == "jobs":
            if kind == "DELETED":
                self._jobs.pop(key, None)
            else:
                self._jobs[key] = _slim(obj)
        else:
            pods = self._pods.setdefault(key, {})
            if kind == "DELETED":
                pods.pop(obj["metadata"]["name"], None)
                if not pods:
                    del self._pods[key]
            else:
                pods[obj["metadata"]["name"]] = _slim(obj)
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
        job = self._jobs.get(key)
        if job is None:
            self._forget(key)
            return
        derived = await self._derive(key, job, list(self._pods.get(key, {}).values()))
        if self._jobs.get(key) is None:
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


def _read(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call the client; for a raw HTTP response, read its body in the same thread and return the bytes."""
    result = fn(*args, **kwargs)
    data = getattr(result, "data", None)
    return result if data is None else data


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable[..., None], *args: Any) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the event loop is closed: nobody is listening any more
        pass


def _rv(obj: Obj | None) -> str | None:
    return None if obj is None else (obj.get("metadata") or {}).get("resourceVersion")


def _slim(obj: Obj) -> Obj:
    """What the state derivation needs of a Job or pod: not the input annotation, not the pod spec."""
    meta = obj.get("metadata") or {}
    annotations = {k: v for k, v in (meta.get("annotations") or {}).items() if k != INPUT_ANNOTATION}
    spec = obj.get("spec") or {}
    slim_spec: Obj = {k: spec[k] for k in ("activeDeadlineSeconds", "suspend", "nodeName") if k in spec}
    for field in ("containers", "initContainers"):
        if field in spec and "template" not in spec:
            slim_spec[field] = [{"name": c.get("name"), "image": c.get("image")} for c in spec[field]]
    return {
        "metadata": {
            "name": meta.get("name"),
            "namespace": meta.get("namespace"),
            "resourceVersion": meta.get("resourceVersion"),
            "creationTimestamp": meta.get("creationTimestamp"),
            "annotations": annotations,
        },
        "spec": slim_spec,
        "status": obj.get("status") or {},
    }


def _status_message(error: ApiException) -> str:
    try:
        body = json.loads(error.body or "")
        return str(body.get("message") or error.reason)
    except (ValueError, AttributeError):
        return str(error.reason or error.body or "no message")


def _retry_after(error: ApiException, default: float) -> float:
    try:
        return float((error.headers or {}).get("Retry-After", default))
    except (TypeError, ValueError):
        return default
