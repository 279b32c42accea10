"""A small but real Kubernetes API server for tests: batch/v1 Jobs, core/v1 Pods and Secrets over HTTP.

No Kubernetes runs here, so tests talk to this instead, through the official `kubernetes` client
and the real wire protocol (kopf's rule: fake Kubernetes at the HTTP layer, never at call sites):

    POST   /apis/batch/v1/namespaces/{ns}/jobs               201, or 409 AlreadyExists (a Status)
    GET    /apis/batch/v1/namespaces/{ns}/jobs[/{name}]      list (labelSelector) or get
    GET    .../jobs?watch=true&resourceVersion=N             newline-delimited watch events
    DELETE /apis/batch/v1/namespaces/{ns}/jobs/{name}        propagationPolicy: Orphan (the
                                                             default for Jobs), Background, Foreground
    GET    /api/v1/namespaces/{ns}/pods[/{name}]             list, watch, get; DELETE a pod
    GET    /api/v1/namespaces/{ns}/pods/{name}/log           container, tailLines, limitBytes
    POST   /api/v1/namespaces/{ns}/secrets                   201, or 409 AlreadyExists; `stringData`
                                                             is merged into `data` (base64), as stored
    GET    /api/v1/namespaces/{ns}/secrets[/{name}]          list, watch, get; DELETE a Secret

Secrets follow the API reference (kubernetes.io/docs/reference/kubernetes-api/config-and-storage-
resources/secret-v1/): a DNS-1123 subdomain name, data keys of [-._a-zA-Z0-9]+, base64 values.
Owner references follow the garbage collector (kubernetes.io/docs/concepts/architecture/garbage-
collection/, pkg/controller/garbagecollector): deleting a Job with propagationPolicy Background or
Foreground deletes every object whose ownerReferences name the Job's uid (its pods, its Secret);
Orphan removes that reference instead; an object created with owners none of which exists is
deleted at once (the collector does so shortly after).

resourceVersion is one counter for the whole server. Every change is kept in a bounded history;
a watch from a version older than the history answers with an ERROR event carrying a 410 Gone
Status, as the real server does. Created objects are checked like the real server checks them
(names, label syntax, and the OpenAPI schema via `kubernetes-validate`) and answered with 422.

The test-control methods play the job controller and the kubelet: a created Job gets a Pending
pod (as the job controller would); `set_pod_running`, `set_pod_succeeded`, `set_pod_failed`,
`set_pod_waiting`, `evict_pod`, `exceed_deadline`... move that pod and update the Job's status
and conditions the way Kubernetes does. `drop_watches`, `lose_watch_events`, `hold_watch_events`
and `compact` break watches on purpose; `fail_next` makes the next matching requests fail.

    with FakeApiServer() as server:
        api = kubernetes.client.BatchV1Api(server.api_client())
"""

from __future__ import annotations

import base64
import bisect
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

import kubernetes.client
import msgspec

Obj = dict[str, Any]

_KINDS = {"jobs": ("batch/v1", "Job"), "pods": ("v1", "Pod"), "secrets": ("v1", "Secret")}
_PREFIX = {"jobs": "/apis/batch/v1", "pods": "/api/v1", "secrets": "/api/v1"}
_SECRET_KEY = re.compile(r"^[-._a-zA-Z0-9]+$")
_PATH = re.compile(
    r"^(?P<prefix>/api/v1|/apis/batch/v1)(?:/namespaces/(?P<ns>[^/]+))?/(?P<resource>jobs|pods|secrets)"
    r"(?:/(?P<name>[^/]+)(?:/(?P<sub>log))?)?/?$"
)
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_LABEL_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")

_encode = msgspec.json.encode
_decode = msgspec.json.decode


def _copy(obj: Obj) -> Obj:
    result: Obj = _decode(_encode(obj))
    return result


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def status_object(code: int, reason: str, message: str, details: Obj | None = None) -> Obj:
    """A Kubernetes `Status` object, as the API server sends with every error."""
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Success" if code < 400 else "Failure",
        "message": message,
        "reason": reason,
        "details": details or {},
        "code": code,
    }


class ApiError(Exception):
    """An error answer: HTTP code plus the Status object sent with it."""

    def __init__(self, code: int, reason: str, message: str, details: Obj | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.status = status_object(code, reason, message, details)


# --- label selectors -------------------------------------------------------------------------


def _split_requirements(text: str) -> list[str]:
    parts, depth, current = [], 0, ""
    for ch in text:
        if ch == "," and depth == 0:
            parts.append(current.strip())
            current = ""
            continue
        depth += ch == "("
        depth -= ch == ")"
        current += ch
    if current.strip():
        parts.append(current.strip())
    return parts


def label_matcher(selector: str | None) -> Callable[[dict[str, str]], bool]:
    """Compile a label selector (`k=v`, `k==v`, `k!=v`, `k`, `!k`, `k in (a,b)`, `k notin (a,b)`)."""
    requirements: list[tuple[str, str, frozenset[str]]] = []
    for req in _split_requirements(selector or ""):
        set_match = re.fullmatch(r"(\S+)\s+(in|notin)\s+\((.*)\)", req)
        if set_match:
            values = frozenset(v.strip() for v in set_match.group(3).split(","))
            requirements.append((set_match.group(2), set_match.group(1), values))
        elif "!=" in req:
            key, value = (s.strip() for s in req.split("!=", 1))
            requirements.append(("notin", key, frozenset({value})))
        elif "=" in req:
            key, value = (s.strip() for s in req.replace("==", "=").split("=", 1))
            requirements.append(("in", key, frozenset({value})))
        elif req.startswith("!"):
            requirements.append(("absent", req[1:].strip(), frozenset()))
        else:
            requirements.append(("present", req, frozenset()))

    def matches(labels: dict[str, str]) -> bool:
        for op, key, values in requirements:
            value = labels.get(key)
            if (
                (op == "in" and value not in values)
                or (op == "notin" and value in values)
                or (op == "absent" and key in labels)
                or (op == "present" and key not in labels)
            ):
                return False
        return True

    return matches


# --- server state ----------------------------------------------------------------------------


@dataclass
class Request:
    """One request the server answered, with the RBAC verb it needs (for permission tests)."""

    method: str
    path: str
    resource: str
    subresource: str | None
    namespace: str | None
    name: str | None
    verb: str
    query: dict[str, str]


@dataclass
class _Event:
    rv: int
    resource: str
    namespace: str
    type: str
    obj: Obj


@dataclass
class _Watcher:
    resource: str
    namespace: str | None
    matches: Callable[[dict[str, str]], bool]
    connection: socket.socket
    dropped: bool = False


@dataclass
class _Failure:
    method: str
    resource: str
    code: int
    times: int
    message: str
    reason: str
    retry_after: float | None


@dataclass
class _Store:
    objects: dict[tuple[str, str, str], Obj] = field(default_factory=dict)
    history: list[_Event] = field(default_factory=list)
    history_rvs: list[int] = field(default_factory=list)
    rv: int = 1
    compacted_rv: int = 0


class FakeApiServer:
    """An in-process Kubernetes API server on 127.0.0.1 (see the module docstring)."""

    def __init__(
        self,
        *,
        history_limit: int = 1000,
        validate: bool = True,
        kubernetes_version: str = "1.33",
        auto_pods: bool = True,
    ) -> None:
        self.history_limit = history_limit
        self.validate = validate
        self.kubernetes_version = kubernetes_version
        self.auto_pods = auto_pods
        self.requests: list[Request] = []
        self._store = _Store()
        self._cond = threading.Condition()
        self._watchers: list[_Watcher] = []
        self._failures: list[_Failure] = []
        self._logs: dict[tuple[str, str, str], str] = {}
        self._held: set[str] = set()
        self._lossy = False
        self._stopping = False
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # --- lifecycle ---

    def start(self) -> FakeApiServer:
        """Listen on a free port and serve in a background thread."""
        server = self

        class Handler(_Handler):
            api = server

        httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        httpd.daemon_threads = True
        httpd.block_on_close = False
        self._httpd = httpd
        self._thread = threading.Thread(
            target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, name="fake-apiserver", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and cut every open watch."""
        with self._cond:
            self._stopping = True
        self.drop_watches()
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()

    def __enter__(self) -> FakeApiServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        """Base URL (http://127.0.0.1:PORT)."""
        assert self._httpd is not None, "start() the server first"
        return f"http://127.0.0.1:{self._httpd.server_address[1]}"

    def configuration(self) -> kubernetes.client.Configuration:
        """A client configuration pointing at this server."""
        config = kubernetes.client.Configuration(host=self.url)
        config.connection_pool_maxsize = 32
        return config

    def api_client(self) -> kubernetes.client.ApiClient:
        """An official-client `ApiClient` talking to this server."""
        return kubernetes.client.ApiClient(self.configuration())

    # --- test-control: inspection ---

    @property
    def resource_version(self) -> int:
        """The server's current resourceVersion."""
        with self._cond:
            return self._store.rv

    def objects(self, resource: str, namespace: str | None = None) -> list[Obj]:
        """Copies of all stored `jobs` or `pods`, optionally in one namespace."""
        with self._cond:
            return [
                _copy(o)
                for (r, ns, _), o in sorted(self._store.objects.items())
                if r == resource and namespace in (None, ns)
            ]

    def jobs(self, namespace: str | None = None) -> list[Obj]:
        """Copies of all stored Jobs."""
        return self.objects("jobs", namespace)

    def pods(self, namespace: str | None = None) -> list[Obj]:
        """Copies of all stored Pods."""
        return self.objects("pods", namespace)

    def secrets(self, namespace: str | None = None) -> list[Obj]:
        """Copies of all stored Secrets."""
        return self.objects("secrets", namespace)

    def job(self, name: str) -> Obj:
        """A copy of the Job called `name` (in whichever namespace holds it)."""
        with self._cond:
            return _copy(self._find("jobs", name))

    def pod_of(self, job_name: str) -> Obj:
        """A copy of the newest pod of a Job."""
        with self._cond:
            return _copy(self._pod_of(job_name))

    def count(self, method: str, resource: str, verb: str | None = None) -> int:
        """How many requests of `method` on `resource` (and RBAC `verb`) were answered."""
        return sum(
            1
            for r in list(self.requests)
            if r.method == method and r.resource == resource and (verb is None or r.verb == verb)
        )

    # --- test-control: breaking things ---

    def fail_next(
        self,
        method: str,
        resource: str,
        code: int,
        *,
        times: int = 1,
        message: str = "injected failure",
        reason: str = "InternalError",
        retry_after: float | None = None,
    ) -> None:
        """Answer the next `times` requests of `method` on `resource` (`jobs`, `pods`, `pods/log`) with `code`."""
        with self._cond:
            self._failures.append(_Failure(method, resource, code, times, message, reason, retry_after))

    def drop_watches(self) -> None:
        """Cut every open watch connection abruptly (no final chunk), as a dying proxy would."""
        with self._cond:
            watchers, self._watchers = self._watchers, []
            for w in watchers:
                w.dropped = True
            self._cond.notify_all()
        for w in watchers:
            try:
                w.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def lose_watch_events(self, lost: bool = True) -> None:
        """Silently drop every watch event, on open and new watches alike, until called with False.

        Connections stay open and lists keep working, so only a re-list shows what changed.
        """
        with self._cond:
            self._lossy = lost

    def hold_watch_events(self, resource: str, held: bool = True) -> None:
        """Delay (`held`) or release the events of `resource` (`jobs`, `pods`) to every watch: a lagging watch."""
        with self._cond:
            if held:
                self._held.add(resource)
            else:
                self._held.discard(resource)
            self._cond.notify_all()

    def compact(self) -> None:
        """Forget the event history: a watch from any earlier resourceVersion gets 410 Gone."""
        with self._cond:
            store = self._store
            store.compacted_rv = store.rv
            store.history.clear()
            store.history_rvs.clear()
            self._cond.notify_all()

    @property
    def open_watches(self) -> int:
        """How many watch connections are open now."""
        with self._cond:
            return len(self._watchers)

    # --- test-control: the job controller and the kubelet ---

    def create_pod(self, job_name: str) -> str:
        """Create a Pending pod for a Job from its pod template (what the job controller does)."""
        with self._cond:
            return self._create_pod_for(self._find("jobs", job_name))

    def set_pod_running(self, job_name: str, container: str | None = None) -> None:
        """Run the Job's pod: its main containers, or, if `container` is an init container, that one."""
        with self._cond:
            pod = self._pod_of(job_name)
            inits, mains = _container_names(pod)
            now = _now()
            pod["status"].setdefault("startTime", now)
            if container in inits:
                position = inits.index(container)
                for name in inits[:position]:
                    _set_container(pod, name, _terminated(0, "Completed", now), init=True)
                _set_container(pod, container, {"running": {"startedAt": now}}, init=True)
                for name in mains:
                    _set_container(pod, name, {"waiting": {"reason": "PodInitializing"}})
                pod["status"]["phase"] = "Pending"
            else:
                for name in inits:
                    _set_container(pod, name, _terminated(0, "Completed", now), init=True)
                for name in mains:
                    _set_container(pod, name, {"running": {"startedAt": now}}, ready=True)
                pod["status"]["phase"] = "Running"
                self._update_job_of(pod, lambda job: job["status"].update(ready=1))
            self._put("pods", pod, "MODIFIED")

    def set_pod_succeeded(self, job_name: str) -> None:
        """Every container of the Job's pod exits 0; the job controller marks the Job Complete."""
        with self._cond:
            pod = self._pod_of(job_name)
            inits, mains = _container_names(pod)
            now = _now()
            for name in inits:
                _set_container(pod, name, _terminated(0, "Completed", now), init=True)
            for name in mains:
                _set_container(pod, name, _terminated(0, "Completed", now))
            pod["status"]["phase"] = "Succeeded"
            self._put("pods", pod, "MODIFIED")
            self._pod_ended(pod, succeeded=True)

    def set_pod_failed(
        self,
        job_name: str,
        exit_code: int = 1,
        reason: str = "Error",
        *,
        container: str | None = None,
        message: str | None = None,
    ) -> None:
        """One container (default: the first main one) exits with `exit_code`; the pod fails."""
        with self._cond:
            pod = self._pod_of(job_name)
            inits, mains = _container_names(pod)
            container = container or mains[0]
            now = _now()
            failed = _terminated(exit_code, reason, now, message)
            if container in inits:
                position = inits.index(container)
                for name in inits[:position]:
                    _set_container(pod, name, _terminated(0, "Completed", now), init=True)
                _set_container(pod, container, failed, init=True)
                for name in mains:
                    _set_container(pod, name, {"waiting": {"reason": "PodInitializing"}})
            else:
                for name in inits:
                    _set_container(pod, name, _terminated(0, "Completed", now), init=True)
                for name in mains:
                    _set_container(pod, name, failed if name == container else _terminated(0, "Completed", now))
            pod["status"]["phase"] = "Failed"
            self._put("pods", pod, "MODIFIED")
            self._pod_ended(pod, succeeded=False)

    def set_pod_oom_killed(self, job_name: str, container: str | None = None) -> None:
        """The kernel kills a container for exceeding its memory limit (exit 137, reason OOMKilled)."""
        self.set_pod_failed(job_name, 137, "OOMKilled", container=container)

    def set_pod_waiting(
        self, job_name: str, reason: str, message: str | None = None, *, container: str | None = None
    ) -> None:
        """A container of the Job's pod cannot start (ImagePullBackOff, ErrImagePull, CreateContainerConfigError)."""
        with self._cond:
            pod = self._pod_of(job_name)
            _, mains = _container_names(pod)
            waiting: Obj = {"reason": reason}
            if message is not None:
                waiting["message"] = message
            _set_container(pod, container or mains[0], {"waiting": waiting})
            pod["status"]["phase"] = "Pending"
            self._put("pods", pod, "MODIFIED")

    def set_unschedulable(self, job_name: str, message: str) -> None:
        """The scheduler finds no node for the Job's pod."""
        with self._cond:
            pod = self._pod_of(job_name)
            pod["status"]["conditions"] = [
                {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": message}
            ]
            self._put("pods", pod, "MODIFIED")

    def set_pod_phase_unknown(self, job_name: str) -> None:
        """The node of the Job's pod stopped reporting (pod phase Unknown)."""
        with self._cond:
            pod = self._pod_of(job_name)
            pod["status"]["phase"] = "Unknown"
            self._put("pods", pod, "MODIFIED")

    def evict_pod(self, job_name: str, message: str = "The node was low on resource: memory.") -> None:
        """The kubelet evicts the Job's pod (node pressure); the Job fails."""
        with self._cond:
            pod = self._pod_of(job_name)
            _, mains = _container_names(pod)
            now = _now()
            for name in mains:
                _set_container(pod, name, _terminated(137, "Error", now))
            pod["status"].update(phase="Failed", reason="Evicted", message=message)
            pod["status"]["conditions"] = [
                {"type": "DisruptionTarget", "status": "True", "reason": "TerminationByKubelet", "message": message}
            ]
            self._put("pods", pod, "MODIFIED")
            self._pod_ended(pod, succeeded=False)

    def exceed_deadline(self, job_name: str) -> None:
        """The Job outlives activeDeadlineSeconds: it fails with DeadlineExceeded and its pods are deleted."""
        with self._cond:
            job = _copy(self._find("jobs", job_name))
            now = _now()
            message = "Job was active longer than specified deadline"
            job["status"].update(active=0, ready=0, failed=job["status"].get("failed", 0) + 1)
            job["status"]["conditions"] = [
                _condition("FailureTarget", "DeadlineExceeded", message, now),
                _condition("Failed", "DeadlineExceeded", message, now),
            ]
            self._put("jobs", job, "MODIFIED")
            for pod in self._pods_of(job):
                self._remove("pods", pod["metadata"]["namespace"], pod["metadata"]["name"])

    def set_logs(self, job_name: str, text: str, container: str | None = None) -> None:
        """Set what `pods/log` returns for a container (default: the first main one) of the Job's pod."""
        with self._cond:
            pod = self._pod_of(job_name)
            _, mains = _container_names(pod)
            key = (pod["metadata"]["namespace"], pod["metadata"]["name"], container or mains[0])
            self._logs[key] = text

    # --- store internals (call with self._cond held) ---

    def _find(self, resource: str, name: str) -> Obj:
        found = [o for (r, _, n), o in self._store.objects.items() if r == resource and n == name]
        if len(found) != 1:
            raise KeyError(f"{len(found)} {resource} named {name!r}")
        return found[0]

    def _pods_of(self, job: Obj) -> list[Obj]:
        uid = job["metadata"]["uid"]
        pods = [
            o
            for (r, _, _), o in self._store.objects.items()
            if r == "pods" and any(ref.get("uid") == uid for ref in o["metadata"].get("ownerReferences", []))
        ]
        return sorted(pods, key=lambda p: int(p["metadata"]["resourceVersion"]))

    def _pod_of(self, job_name: str) -> Obj:
        pods = self._pods_of(self._find("jobs", job_name))
        if not pods:
            raise KeyError(f"job {job_name!r} has no pod")
        newest = max(pods, key=lambda p: p["metadata"]["creationTimestamp"] + p["metadata"]["name"])
        return _copy(newest)

    def _put(self, resource: str, obj: Obj, event_type: str) -> Obj:
        store = self._store
        store.rv += 1
        meta = obj["metadata"]
        meta["resourceVersion"] = str(store.rv)
        stored = _copy(obj)
        store.objects[(resource, meta["namespace"], meta["name"])] = stored
        self._record(resource, meta["namespace"], event_type, stored)
        return stored

    def _remove(self, resource: str, namespace: str, name: str) -> Obj:
        store = self._store
        obj = _copy(store.objects.pop((resource, namespace, name)))
        store.rv += 1
        obj["metadata"]["resourceVersion"] = str(store.rv)
        self._record(resource, namespace, "DELETED", obj)
        return obj

    def _record(self, resource: str, namespace: str, event_type: str, obj: Obj) -> None:
        store = self._store
        apiversion, kind = _KINDS[resource]
        # Stored objects are never changed in place (every change stores a new copy), so the
        # history can share them.
        snapshot = {"apiVersion": apiversion, "kind": kind, **obj}
        store.history.append(_Event(store.rv, resource, namespace, event_type, snapshot))
        store.history_rvs.append(store.rv)
        if len(store.history) > self.history_limit:
            drop = len(store.history) - self.history_limit
            store.compacted_rv = store.history_rvs[drop - 1]
            del store.history[:drop]
            del store.history_rvs[:drop]
        self._cond.notify_all()

    def _update_job_of(self, pod: Obj, change: Callable[[Obj], None]) -> None:
        for ref in pod["metadata"].get("ownerReferences", []):
            if ref.get("kind") == "Job":
                job = _copy(self._store.objects[("jobs", pod["metadata"]["namespace"], ref["name"])])
                change(job)
                self._put("jobs", job, "MODIFIED")

    def _pod_ended(self, pod: Obj, *, succeeded: bool) -> None:
        """The job controller's reaction to a finished pod (one completion; backoffLimit retries)."""
        ref = next(r for r in pod["metadata"]["ownerReferences"] if r.get("kind") == "Job")
        job = _copy(self._store.objects[("jobs", pod["metadata"]["namespace"], ref["name"])])
        status, now = job["status"], _now()
        status.update(active=0, ready=0)
        if succeeded:
            status["succeeded"] = status.get("succeeded", 0) + 1
            status["completionTime"] = now
            status["conditions"] = [
                _condition(
                    "SuccessCriteriaMet", "CompletionsReached", "Reached expected number of succeeded pods", now
                ),
                _condition("Complete", "CompletionsReached", "Reached expected number of succeeded pods", now),
            ]
            self._put("jobs", job, "MODIFIED")
            return
        status["failed"] = status.get("failed", 0) + 1
        if status["failed"] <= job["spec"].get("backoffLimit", 6):
            self._put("jobs", job, "MODIFIED")
            self._create_pod_for(job)
            return
        message = "Job has reached the specified backoff limit"
        status["conditions"] = [
            _condition("FailureTarget", "BackoffLimitExceeded", message, now),
            _condition("Failed", "BackoffLimitExceeded", message, now),
        ]
        self._put("jobs", job, "MODIFIED")

    def _create_pod_for(self, job: Obj) -> str:
        template = _copy(job["spec"]["template"])
        meta = template.get("metadata") or {}
        name = f"{job['metadata']['name']}-{uuid.uuid4().hex[:5]}"
        namespace = job["metadata"]["namespace"]
        labels = dict(meta.get("labels") or {})
        pod: Obj = {
            "metadata": {
                "name": name,
                "namespace": namespace,
                "uid": str(uuid.uuid4()),
                "creationTimestamp": _now(),
                "labels": labels,
                "annotations": dict(meta.get("annotations") or {}),
                "ownerReferences": [
                    {
                        "apiVersion": "batch/v1",
                        "kind": "Job",
                        "name": job["metadata"]["name"],
                        "uid": job["metadata"]["uid"],
                        "controller": True,
                        "blockOwnerDeletion": True,
                    }
                ],
            },
            "spec": template["spec"],
            "status": {"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "True"}]},
        }
        self._put("pods", pod, "ADDED")
        fresh = _copy(job)
        fresh["status"].update(active=1, ready=0)
        fresh["status"].setdefault("startTime", _now())
        self._put("jobs", fresh, "MODIFIED")
        return name

    # --- request handling (called from handler threads) ---

    def take_failure(self, method: str, resource: str) -> _Failure | None:
        """The injected failure the next request of this kind must get, if any."""
        with self._cond:
            for failure in self._failures:
                if failure.method == method and failure.resource == resource and failure.times > 0:
                    failure.times -= 1
                    return failure
        return None

    def create(self, resource: str, namespace: str, body: Obj) -> Obj:
        """POST: check the object like the API server does, then store it."""
        if resource == "secrets":
            return self._create_secret(namespace, body)
        if resource != "jobs":
            raise ApiError(405, "MethodNotAllowed", f"creating {resource} is not supported by this fake")
        apiversion, kind = _KINDS[resource]
        if body.get("apiVersion") != apiversion or body.get("kind") != kind:
            raise ApiError(
                400, "BadRequest", f"expected {apiversion} {kind}, got {body.get('apiVersion')} {body.get('kind')}"
            )
        meta = body.setdefault("metadata", {})
        if meta.get("namespace", namespace) != namespace:
            raise ApiError(
                400,
                "BadRequest",
                "the namespace of the provided object does not match the namespace sent on the request",
            )
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        self._check_job(body)
        with self._cond:
            name = meta["name"]
            if (resource, namespace, name) in self._store.objects:
                raise ApiError(
                    409,
                    "AlreadyExists",
                    f'jobs.batch "{name}" already exists',
                    {"name": name, "group": "batch", "kind": "jobs"},
                )
            uid = str(uuid.uuid4())
            meta.update(namespace=namespace, uid=uid, creationTimestamp=_now(), generation=1)
            spec = body["spec"]
            spec.setdefault("backoffLimit", 6)
            spec.setdefault("completions", 1)
            spec.setdefault("parallelism", 1)
            template_meta = spec["template"].setdefault("metadata", {})
            template_meta.setdefault("labels", {}).update(
                {
                    "batch.kubernetes.io/controller-uid": uid,
                    "batch.kubernetes.io/job-name": name,
                    "controller-uid": uid,
                    "job-name": name,
                }
            )
            spec["selector"] = {"matchLabels": {"batch.kubernetes.io/controller-uid": uid}}
            body["status"] = {}
            stored = self._put("jobs", body, "ADDED")
            if self.auto_pods:
                self._create_pod_for(stored)
            return self._store.objects[("jobs", namespace, name)]

    def _create_secret(self, namespace: str, body: Obj) -> Obj:
        if body.get("apiVersion") != "v1" or body.get("kind") != "Secret":
            raise ApiError(400, "BadRequest", f"expected v1 Secret, got {body.get('apiVersion')} {body.get('kind')}")
        meta = body.setdefault("metadata", {})
        if meta.get("namespace", namespace) != namespace:
            raise ApiError(
                400,
                "BadRequest",
                "the namespace of the provided object does not match the namespace sent on the request",
            )
        data = dict(body.get("data") or {})
        data.update(
            {k: base64.b64encode(str(v).encode()).decode() for k, v in (body.pop("stringData", None) or {}).items()}
        )
        body["data"] = data
        body.setdefault("type", "Opaque")
        self._check_secret(body)
        with self._cond:
            name = meta["name"]
            if ("secrets", namespace, name) in self._store.objects:
                raise ApiError(
                    409, "AlreadyExists", f'secrets "{name}" already exists', {"name": name, "kind": "secrets"}
                )
            meta.update(namespace=namespace, uid=str(uuid.uuid4()), creationTimestamp=_now())
            stored = self._put("secrets", body, "ADDED")
            owners = meta.get("ownerReferences") or []
            live = {o["metadata"]["uid"] for (_, ns, _), o in self._store.objects.items() if ns == namespace}
            if owners and not any(ref.get("uid") in live for ref in owners):
                self._remove("secrets", namespace, name)  # the garbage collector: every owner is gone
            return stored

    def _check_secret(self, body: Obj) -> None:
        meta = body["metadata"]
        name = meta.get("name") or ""
        causes: list[str] = []
        if not _DNS_SUBDOMAIN.match(name) or len(name) > 253:
            causes.append(f"metadata.name: Invalid value: {name!r}: must be a DNS-1123 subdomain")
        for key, value in (meta.get("labels") or {}).items():
            causes.extend(f"metadata.labels: {problem}" for problem in _label_problems(key, value))
        for key, value in body["data"].items():
            if not _SECRET_KEY.match(key):
                causes.append(f"data[{key}]: Invalid value: {key!r}: a valid config key must consist of [-._a-zA-Z0-9]")
            try:
                base64.b64decode(str(value), validate=True)
            except ValueError:
                causes.append(f"data[{key}]: Invalid value: not base64")
        for ref in meta.get("ownerReferences") or []:
            if not all(ref.get(f) for f in ("apiVersion", "kind", "name", "uid")):
                causes.append("metadata.ownerReferences: apiVersion, kind, name and uid are required")
        if self.validate:
            import kubernetes_validate

            try:
                kubernetes_validate.validate(body, self.kubernetes_version, strict=False)
            except kubernetes_validate.ValidationError as e:
                causes.append(f"{'.'.join(str(p) for p in e.path)}: {e.message}")
        if causes:
            raise ApiError(422, "Invalid", f'Secret "{name}" is invalid: ' + "; ".join(causes), {"name": name})

    def _check_job(self, body: Obj) -> None:
        meta = body["metadata"]
        name = meta.get("name") or ""
        causes: list[str] = []
        if not _DNS_LABEL.match(name) or len(name) > 63:
            causes.append(f"metadata.name: Invalid value: {name!r}: must be a DNS-1123 label of at most 63 characters")
        spec = body.get("spec") or {}
        template_meta = (spec.get("template") or {}).get("metadata") or {}
        for where, labels in (
            ("metadata.labels", meta.get("labels")),
            ("spec.template.metadata.labels", template_meta.get("labels")),
        ):
            for key, value in (labels or {}).items():
                causes.extend(f"{where}: {problem}" for problem in _label_problems(key, value))
        if self.validate:
            import kubernetes_validate

            try:
                kubernetes_validate.validate(body, self.kubernetes_version, strict=False)
            except kubernetes_validate.ValidationError as e:
                causes.append(f"{'.'.join(str(p) for p in e.path)}: {e.message}")
        if causes:
            raise ApiError(
                422, "Invalid", f'Job.batch "{name}" is invalid: ' + "; ".join(causes), {"name": name, "kind": "Job"}
            )

    def get(self, resource: str, namespace: str, name: str) -> Obj:
        """GET one object."""
        with self._cond:
            obj = self._store.objects.get((resource, namespace, name))
            if obj is None:
                raise ApiError(404, "NotFound", f'{resource} "{name}" not found', {"name": name, "kind": resource})
            apiversion, kind = _KINDS[resource]
            return {"apiVersion": apiversion, "kind": kind, **_copy(obj)}

    def list(self, resource: str, namespace: str | None, selector: str | None) -> Obj:
        """GET a collection (a consistent snapshot and its resourceVersion)."""
        matches = label_matcher(selector)
        apiversion, kind = _KINDS[resource]
        with self._cond:
            items = [
                _copy(o)
                for (r, ns, _), o in sorted(self._store.objects.items())
                if r == resource and namespace in (None, ns) and matches(o["metadata"].get("labels") or {})
            ]
            rv = self._store.rv
        return {
            "apiVersion": apiversion,
            "kind": f"{kind}List",
            "metadata": {"resourceVersion": str(rv)},
            "items": items,
        }

    def delete(self, resource: str, namespace: str, name: str, policy: str | None) -> Obj:
        """DELETE one object; a Job's pods go too unless the policy is Orphan (the default for Jobs)."""
        with self._cond:
            if (resource, namespace, name) not in self._store.objects:
                raise ApiError(404, "NotFound", f'{resource} "{name}" not found', {"name": name, "kind": resource})
            obj = self._store.objects[(resource, namespace, name)]
            uid = obj["metadata"]["uid"]
            dependents = [
                (r, o)
                for (r, ns, _), o in sorted(self._store.objects.items())
                if ns == namespace and any(ref.get("uid") == uid for ref in o["metadata"].get("ownerReferences") or [])
            ]
            effective = policy or ("Orphan" if resource == "jobs" else "Background")
            if effective not in ("Orphan", "Background", "Foreground"):
                raise ApiError(400, "BadRequest", f"propagationPolicy {policy!r} is not supported")
            removed = self._remove(resource, namespace, name)
            for kind, dependent in dependents:
                if effective == "Orphan":
                    orphan = _copy(dependent)
                    refs = orphan["metadata"]["ownerReferences"]
                    orphan["metadata"]["ownerReferences"] = [ref for ref in refs if ref.get("uid") != uid]
                    self._put(kind, orphan, "MODIFIED")
                else:
                    self._remove(kind, namespace, dependent["metadata"]["name"])
            group = "batch" if resource == "jobs" else ""
            return status_object(
                200, "", "", {"name": name, "group": group, "kind": resource, "uid": removed["metadata"]["uid"]}
            )

    def log(self, namespace: str, name: str, query: dict[str, str]) -> str:
        """GET pods/{name}/log."""
        with self._cond:
            pod = self._store.objects.get(("pods", namespace, name))
            if pod is None:
                raise ApiError(404, "NotFound", f'pods "{name}" not found', {"name": name, "kind": "pods"})
            inits, mains = _container_names(pod)
            container = query.get("container")
            if container is None:
                if len(mains) != 1 or inits:
                    raise ApiError(
                        400,
                        "BadRequest",
                        f"a container name must be specified for pod {name}, choose one of: [{' '.join(mains)}]"
                        + (f" or one of the init containers: [{' '.join(inits)}]" if inits else ""),
                    )
                container = mains[0]
            if container not in inits + mains:
                raise ApiError(400, "BadRequest", f"container {container} is not valid for pod {name}")
            text = self._logs.get((namespace, name, container), "")
        if "tailLines" in query:
            lines = text.splitlines(keepends=True)
            text = "".join(lines[-int(query["tailLines"]) :]) if int(query["tailLines"]) > 0 else ""
        if "limitBytes" in query:
            text = text.encode()[: int(query["limitBytes"])].decode(errors="ignore")
        return text

    def watch_events(self, watcher: _Watcher, resource_version: str | None, timeout_s: float) -> Iterator[Obj | None]:
        """The events a watch sends: replayed history, then live changes until the timeout.

        Yields event dicts; yields None once when the watch should end with a BOOKMARK at the
        current resourceVersion (timeout reached). Raises ApiError(410) if the history needed is gone,
        and `ConnectionAbortedError` when the watch was dropped.
        """
        deadline = time.monotonic() + timeout_s
        with self._cond:
            store = self._store
            if resource_version in (None, "", "0"):
                cursor = store.rv
                initial = [
                    {
                        "type": "ADDED",
                        "object": {
                            "apiVersion": _KINDS[watcher.resource][0],
                            "kind": _KINDS[watcher.resource][1],
                            **_copy(o),
                        },
                    }
                    for (r, ns, _), o in sorted(store.objects.items())
                    if r == watcher.resource
                    and watcher.namespace in (None, ns)
                    and watcher.matches(o["metadata"].get("labels") or {})
                ]
            else:
                cursor = int(resource_version)
                initial = []
            self._watchers.append(watcher)
        try:
            yield from initial
            while True:
                with self._cond:
                    pending: list[_Event] | None = None
                    while True:
                        if watcher.dropped or self._stopping:
                            raise ConnectionAbortedError("watch dropped")
                        if cursor < store.compacted_rv:
                            raise ApiError(
                                410,
                                "Expired",
                                f"too old resource version: {cursor} ({store.compacted_rv})",
                            )
                        index = bisect.bisect_right(store.history_rvs, cursor)
                        if index < len(store.history) and watcher.resource not in self._held:
                            pending = store.history[index:]
                            break
                        remaining = deadline - time.monotonic()
                        if remaining <= 0:
                            break
                        self._cond.wait(remaining)
                if pending is None:
                    yield None
                    return
                for event in pending:
                    cursor = event.rv
                    if (
                        self._lossy
                        or event.resource != watcher.resource
                        or watcher.namespace not in (None, event.namespace)
                        or not watcher.matches(event.obj["metadata"].get("labels") or {})
                    ):
                        continue
                    yield {"type": event.type, "object": event.obj}
        finally:
            with self._cond:
                if watcher in self._watchers:
                    self._watchers.remove(watcher)


# --- object helpers ----------------------------------------------------------------------------


def _label_problems(key: str, value: str) -> list[str]:
    problems = []
    prefix, _, name = key.rpartition("/")
    if prefix and (len(prefix) > 253 or not _DNS_SUBDOMAIN.match(prefix)):
        problems.append(f"Invalid value: {key!r}: prefix part must be a DNS-1123 subdomain")
    if not name or len(name) > 63 or not _LABEL_NAME.match(name):
        problems.append(
            f"Invalid value: {key!r}: name part must be at most 63 characters of [A-Za-z0-9_.-], "
            "alphanumeric at both ends"
        )
    if not isinstance(value, str) or len(value) > 63 or not _LABEL_VALUE.match(value):
        problems.append(
            f"Invalid value: {value!r}: a label value must be at most 63 characters of [A-Za-z0-9_.-], "
            "alphanumeric at both ends"
        )
    return problems


def _container_names(pod: Obj) -> tuple[list[str], list[str]]:
    spec = pod.get("spec") or {}
    return [c["name"] for c in spec.get("initContainers") or []], [c["name"] for c in spec.get("containers") or []]


def _terminated(exit_code: int, reason: str, when: str, message: str | None = None) -> Obj:
    state: Obj = {"exitCode": exit_code, "reason": reason, "startedAt": when, "finishedAt": when}
    if message is not None:
        state["message"] = message
    return {"terminated": state}


def _set_container(pod: Obj, name: str, state: Obj, *, init: bool = False, ready: bool = False) -> None:
    key = "initContainerStatuses" if init else "containerStatuses"
    spec_key = "initContainers" if init else "containers"
    image = next((c.get("image", "") for c in pod["spec"].get(spec_key) or [] if c["name"] == name), "")
    statuses = [s for s in pod["status"].get(key) or [] if s["name"] != name]
    statuses.append(
        {
            "name": name,
            "image": image,
            "imageID": "",
            "ready": ready,
            "restartCount": 0,
            "started": "running" in state,
            "state": state,
            "lastState": {},
        }
    )
    order = [c["name"] for c in pod["spec"].get(spec_key) or []]
    pod["status"][key] = sorted(statuses, key=lambda s: order.index(s["name"]) if s["name"] in order else len(order))


def _condition(kind: str, reason: str, message: str, when: str) -> Obj:
    return {
        "type": kind,
        "status": "True",
        "reason": reason,
        "message": message,
        "lastProbeTime": when,
        "lastTransitionTime": when,
    }


# --- HTTP --------------------------------------------------------------------------------------


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    api: FakeApiServer

    def setup(self) -> None:
        super().setup()
        # Small JSON answers: without this, Nagle plus delayed ACKs add 40 ms to each request.
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    def do_PATCH(self) -> None:
        self._dispatch("PATCH")

    def _dispatch(self, method: str) -> None:
        split = urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(split.query).items()}
        body_bytes = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        match = _PATH.match(split.path)
        if not match or _PREFIX[match["resource"]] != match["prefix"]:
            self._send_json(
                404, status_object(404, "NotFound", f"the server could not find the requested resource ({split.path})")
            )
            return
        resource, namespace, name, sub = match["resource"], match["ns"], match["name"], match["sub"]
        watching = query.get("watch") in ("true", "1")
        verb = {
            "POST": "create",
            "PUT": "update",
            "PATCH": "patch",
            "DELETE": "delete" if name else "deletecollection",
        }.get(method) or ("get" if name else "watch" if watching else "list")
        api = self.api
        api.requests.append(Request(method, split.path, resource, sub, namespace, name, verb, query))
        failure = api.take_failure(method, f"{resource}/{sub}" if sub else resource)
        if failure is not None:
            headers = {"Retry-After": str(int(failure.retry_after))} if failure.retry_after is not None else {}
            self._send_json(failure.code, status_object(failure.code, failure.reason, failure.message), headers)
            return
        try:
            if sub == "log":
                assert namespace is not None and name is not None
                self._send(200, api.log(namespace, name, query).encode(), "text/plain")
            elif method == "GET" and watching:
                self._serve_watch(resource, namespace, query)
            elif method == "GET" and name:
                assert namespace is not None
                self._send_json(200, api.get(resource, namespace, name))
            elif method == "GET":
                self._send_json(200, api.list(resource, namespace, query.get("labelSelector")))
            elif method == "POST" and namespace and not name:
                try:
                    body = _decode(body_bytes) if body_bytes else {}
                except msgspec.DecodeError as e:
                    raise ApiError(400, "BadRequest", f"the request body is not JSON: {e}") from e
                self._send_json(201, api.create(resource, namespace, body))
            elif method == "DELETE" and namespace and name:
                options = _decode(body_bytes) if body_bytes else {}
                policy = query.get("propagationPolicy") or options.get("propagationPolicy")
                self._send_json(200, api.delete(resource, namespace, name, policy))
            else:
                raise ApiError(405, "MethodNotAllowed", f"{method} {split.path} is not supported by this fake")
        except ApiError as e:
            self._send_json(e.code, e.status)

    def _serve_watch(self, resource: str, namespace: str | None, query: dict[str, str]) -> None:
        watcher = _Watcher(resource, namespace, label_matcher(query.get("labelSelector")), self.connection)
        timeout = float(query.get("timeoutSeconds") or 1800)
        bookmarks = query.get("allowWatchBookmarks") in ("true", "1")
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        try:
            try:
                for event in self.api.watch_events(watcher, query.get("resourceVersion"), timeout):
                    if event is None:
                        if bookmarks:
                            apiversion, kind = _KINDS[resource]
                            rv = str(self.api.resource_version)
                            self._chunk(
                                _encode(
                                    {
                                        "type": "BOOKMARK",
                                        "object": {
                                            "apiVersion": apiversion,
                                            "kind": kind,
                                            "metadata": {"resourceVersion": rv},
                                        },
                                    }
                                )
                                + b"\n"
                            )
                        break
                    self._chunk(_encode(event) + b"\n")
            except ApiError as e:
                self._chunk(_encode({"type": "ERROR", "object": e.status}) + b"\n")
            self.wfile.write(b"0\r\n\r\n")
        except (ConnectionAbortedError, OSError):
            self.close_connection = True

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))

    def _send_json(self, code: int, obj: Obj, headers: dict[str, str] | None = None) -> None:
        self._send(code, _encode(obj), "application/json", headers)

    def _send(self, code: int, body: bytes, content_type: str, headers: dict[str, str] | None = None) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(body)
