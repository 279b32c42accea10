"""The Kubernetes backend's cache of its Jobs and pods, by execution, as its watch loops see them.

A LIST replaces one resource's part of the cache and says which executions changed (by their
objects' resourceVersions); a watch event updates one object. What is kept of each object is what
the state derivation (`k8s_state`) reads: never the input annotation or a pod's full spec.
"""

from __future__ import annotations

from typing import Any

from services.controller.backends.base import ExecutionKey
from services.controller.backends.k8s_template import INPUT_ANNOTATION, key_of

Obj = dict[str, Any]


class ObjectCache:
    """Jobs (one per execution) and pods (by name, per execution) of this backend's instance."""

    def __init__(self) -> None:
        self.jobs: dict[ExecutionKey, Obj] = {}
        self.pods: dict[ExecutionKey, dict[str, Obj]] = {}

    def replace(self, resource: str, items: list[Obj]) -> set[ExecutionKey]:
        """Replace the `jobs` or `pods` with a fresh LIST; the executions whose objects differ."""
        if resource == "jobs":
            fresh = {key: slim(o) for o in items if (key := key_of(o)) is not None}
            touched = {k for k in self.jobs.keys() | fresh.keys() if _rv(self.jobs.get(k)) != _rv(fresh.get(k))}
            self.jobs = fresh
            return touched
        pods: dict[ExecutionKey, dict[str, Obj]] = {}
        for o in items:
            if (key := key_of(o)) is not None:
                pods.setdefault(key, {})[o["metadata"]["name"]] = slim(o)
        touched = {
            k
            for k in self.pods.keys() | pods.keys()
            if {n: _rv(p) for n, p in self.pods.get(k, {}).items()} != {n: _rv(p) for n, p in pods.get(k, {}).items()}
        }
        self.pods = pods
        return touched

    def apply(self, resource: str, kind: str, obj: Obj) -> ExecutionKey | None:
        """Apply one watch event (ADDED, MODIFIED, DELETED); the execution it is of (None: not ours)."""
        key = key_of(obj)
        if key is None:
            return None
        if resource == "jobs":
            if kind == "DELETED":
                self.jobs.pop(key, None)
            else:
                self.jobs[key] = slim(obj)
            return key
        pods = self.pods.setdefault(key, {})
        if kind == "DELETED":
            pods.pop(obj["metadata"]["name"], None)
            if not pods:
                del self.pods[key]
        else:
            pods[obj["metadata"]["name"]] = slim(obj)
        return key


def _rv(obj: Obj | None) -> str | None:
    return None if obj is None else (obj.get("metadata") or {}).get("resourceVersion")


def slim(obj: Obj) -> Obj:
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
            "uid": meta.get("uid"),
            "resourceVersion": meta.get("resourceVersion"),
            "creationTimestamp": meta.get("creationTimestamp"),
            "annotations": annotations,
        },
        "spec": slim_spec,
        "status": obj.get("status") or {},
    }
