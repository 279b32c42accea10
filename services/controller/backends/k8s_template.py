"""From a user's Job template and a `LaunchSpec` to the Job manifest of one attempt.

The template is a YAML batch/v1 Job with placeholders written `{{ name }}`:

    job_name  namespace  instance  image  run_id  rollout_id  attempt_id
    timeout_s (int)  ttl_seconds_after_finished (int)  plus any name given in `values`

A scalar that is exactly one placeholder takes the value with its type (`{{ timeout_s }}` stays
a number); inside a longer string the value is inserted as text. Placeholders are replaced after
the YAML is parsed, never spliced into its text, so quoting them is optional and an id full of
`:`, `#` or `{` cannot change the manifest's structure. `{{` in any other form is an error.

Whatever the template says, the backend sets (see `JobTemplate.render`): the Job's name and
namespace; the labels `app.kubernetes.io/managed-by=rollwire`, `rollwire.dev/instance`,
`rollwire.dev/run`, `rollwire.dev/rollout`, `rollwire.dev/attempt` on the Job and its pods
(pods also get `app.kubernetes.io/component=agent`, which the NetworkPolicy selects); the exact
ids as annotations (label values cannot hold every id); `backoffLimit: 0` (Rollwire retries
attempts itself); `activeDeadlineSeconds` from the timeout; `restartPolicy: Never`; the
`LaunchSpec.env` variables in every container, credentials (`k8s_secret.SECRET_ENV`) as
`secretKeyRef`s to the attempt's Secret, never as values; and the input, as ROLLWIRE_INPUT when small and
always as the file ROLLWIRE_INPUT_FILE, projected from a pod annotation by the downward API (no
ConfigMap to create or clean up; the limit is Kubernetes' 256 KiB of annotations per object).
`ttlSecondsAfterFinished` and `automountServiceAccountToken: false` are set unless the template
sets them: agents are untrusted and get no Kubernetes credentials by default.

With an evaluator, the agent container becomes the last init container and the evaluator (a
copy of the agent container with the evaluator's command and environment) the main container,
so the evaluator runs only after the agent exited 0, with the same volumes. Other containers of
the template then start with the evaluator; a sidecar the agent needs while it runs must be a
native sidecar (an init container with `restartPolicy: Always`).
"""

from __future__ import annotations

import copy
import logging
import math
import re
from collections.abc import Iterator, Mapping
from typing import Any

import yaml

from schemas import InvalidId, check_id
from services.controller.backends.base import (
    INPUT_ENV,
    INPUT_ENV_LIMIT,
    INPUT_FILE_ENV,
    ExecutionKey,
    LaunchSpec,
    PermanentBackendError,
)
from services.controller.backends.k8s_names import (  # re-exported: the backend's and tests' names
    ATTEMPT_ANNOTATION,
    COMPONENT,
    INPUT_ANNOTATION,
    INSTANCE_LABEL,
    MANAGED_BY,
    MANAGER,
    ROLLOUT_ANNOTATION,
    RUN_ANNOTATION,
    TemplateError,
    ids_annotations,
    job_name,
    key_labels,
    key_of,
    label_problem,
    label_value,
    owner_labels,
    selector,
    validate_manifest,
)
from services.controller.backends.k8s_secret import AGENT, EVALUATOR, SECRET_ENV, secret_key

__all__ = [
    "ATTEMPT_ANNOTATION",
    "COMPONENT",
    "INPUT_ANNOTATION",
    "INSTANCE_LABEL",
    "MANAGED_BY",
    "MANAGER",
    "ROLLOUT_ANNOTATION",
    "RUN_ANNOTATION",
    "JobTemplate",
    "TemplateError",
    "deadline_seconds",
    "job_name",
    "key_of",
    "label_problem",
    "label_value",
    "owner_labels",
    "selector",
    "validate_manifest",
]

log = logging.getLogger(__name__)

Manifest = dict[str, Any]

INPUT_VOLUME = "rollwire-input"
INPUT_DIR = "/var/run/rollwire"
INPUT_FILE = f"{INPUT_DIR}/input.json"
INPUT_ANNOTATION_LIMIT = 200 * 1024
"""Largest input (bytes) passed through the pod annotation; Kubernetes allows 256 KiB of annotations."""

EVALUATOR_CONTAINER = "evaluator"

BUILTIN_PLACEHOLDERS = (
    "job_name",
    "namespace",
    "instance",
    "image",
    "run_id",
    "rollout_id",
    "attempt_id",
    "timeout_s",
    "ttl_seconds_after_finished",
)
_PLACEHOLDER = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")
_SENTINEL = re.compile(r"__rollwire_placeholder_([A-Za-z_][A-Za-z0-9_]*)__")
# Fields Kubernetes rejects on init containers (the agent becomes one when an evaluator runs).
_INIT_FORBIDDEN = ("lifecycle", "livenessProbe", "readinessProbe", "startupProbe")


class JobTemplate:
    """A parsed, checked Job template; `render(spec)` gives one attempt's Job manifest."""

    def __init__(
        self,
        text: str,
        *,
        source: str = "job template",
        namespace: str = "default",
        instance: str = "default",
        image: str | None = None,
        ttl_seconds_after_finished: int = 3600,
        values: Mapping[str, str] | None = None,
        agent_container: str | None = None,
        kubernetes_version: str = "1.33",
    ) -> None:
        self.source = source
        self.namespace = namespace
        self.instance = instance
        self.image = image
        self.ttl_seconds_after_finished = ttl_seconds_after_finished
        self.values = dict(values or {})
        self.kubernetes_version = kubernetes_version
        self._tree = self._parse(text)
        self.agent_container = self._agent_container_name(agent_container)
        self._check_structure()
        self._check_schema()

    # --- parsing and checks (at start, once) ---

    def _error(self, message: str) -> TemplateError:
        return TemplateError(f"{self.source}: {message}")

    def _parse(self, text: str) -> Manifest:
        for name in self.values:
            if name in BUILTIN_PLACEHOLDERS or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
                raise self._error(f"template value {name!r} is reserved or not a valid placeholder name")
        marked = _PLACEHOLDER.sub(lambda m: f"__rollwire_placeholder_{m.group(1)}__", text)
        try:
            documents = [d for d in yaml.safe_load_all(marked) if d is not None]
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f"line {mark.line + 1}: " if mark is not None else ""
            hint = ""
            if mark is not None and "{" in marked.splitlines()[min(mark.line, len(marked.splitlines()) - 1)]:
                hint = "; placeholders are written {{ name }} with a plain name"
            raise self._error(f"{where}not valid YAML: {getattr(e, 'problem', None) or e}{hint}") from None
        if len(documents) != 1 or not isinstance(documents[0], dict):
            raise self._error(f"must hold exactly one YAML mapping (a Job), found {len(documents)} document(s)")
        tree: Manifest = documents[0]
        strings = list(_strings(tree))
        for string in strings:
            if "{{" in string or "}}" in string:
                raise self._error(f"unsupported placeholder syntax in {string!r}; write {{{{ name }}}}")
        allowed = set(BUILTIN_PLACEHOLDERS) | set(self.values)
        self.placeholders = {m.group(1) for string in strings for m in _SENTINEL.finditer(string)}
        unknown = sorted(self.placeholders - allowed)
        if unknown:
            raise self._error(
                f"unknown placeholder(s) {', '.join(unknown)}; allowed: {', '.join(sorted(allowed))} "
                "(add more with the backend's template values)"
            )
        if tree.get("apiVersion") != "batch/v1" or tree.get("kind") != "Job":
            raise self._error(
                f"must be a batch/v1 Job, got apiVersion {tree.get('apiVersion')!r} kind {tree.get('kind')!r}"
            )
        return tree

    def _containers(self, tree: Manifest) -> list[dict[str, Any]]:
        pod = (((tree.get("spec") or {}).get("template") or {}).get("spec")) or {}
        containers = pod.get("containers")
        if not isinstance(containers, list) or not containers or not all(isinstance(c, dict) for c in containers):
            raise self._error("spec.template.spec.containers must list at least one container")
        return containers

    def _agent_container_name(self, configured: str | None) -> str:
        names = [c.get("name") for c in self._containers(self._tree)]
        if configured is not None:
            if configured not in names:
                raise self._error(f"the agent container {configured!r} is not in the template; containers: {names}")
            return configured
        return "agent" if "agent" in names else str(names[0])

    def _check_structure(self) -> None:
        tree = self._tree
        meta = tree.get("metadata") or {}
        spec = tree.get("spec") or {}
        pod = spec["template"].get("spec") or {}
        if meta.get("name") not in (None, "__rollwire_placeholder_job_name__"):
            raise self._error(
                f"metadata.name is {meta['name']!r}; every attempt needs a Job of its own: "
                "remove it or write {{ job_name }}"
            )
        if meta.get("namespace") not in (None, self.namespace, "__rollwire_placeholder_namespace__"):
            raise self._error(
                f"metadata.namespace is {meta['namespace']!r} but the backend runs in {self.namespace!r}; remove it"
            )
        if spec.get("backoffLimit") not in (None, 0):
            raise self._error(
                f"spec.backoffLimit is {spec['backoffLimit']}; Rollwire retries attempts itself, "
                "so it must be 0 or absent"
            )
        for field in ("completions", "parallelism"):
            if spec.get(field) not in (None, 1):
                raise self._error(
                    f"spec.{field} is {spec[field]}; an attempt runs exactly one pod, so use 1 or leave it out"
                )
        if pod.get("restartPolicy") not in (None, "Never"):
            raise self._error(
                f"spec.template.spec.restartPolicy is {pod['restartPolicy']!r}; it must be Never (a failed agent is "
                "a failed attempt, retried by Rollwire) or absent"
            )
        for container in self._containers(tree):
            if not isinstance(container.get("name"), str):
                raise self._error("every container needs a name")

    def _check_schema(self) -> None:
        sample = ExecutionKey("run-sample", "rollout-sample", "attempt-sample")
        base = LaunchSpec(
            key=sample,
            env={"OPENAI_BASE_URL": "http://gateway"},
            input_json="{}",
            timeout_s=60,
            image=self.image or "image:sample",
        )
        with_evaluator = LaunchSpec(
            key=sample,
            env={},
            input_json="{}",
            timeout_s=60,
            evaluator_command=["true"],
            evaluator_env={},
            image=self.image or "image:sample",
        )
        for spec in (base, with_evaluator):
            try:
                validate_manifest(self.render(spec), self.kubernetes_version)
            except TemplateError as e:
                raise self._error(
                    f"the rendered Job is not valid for Kubernetes {self.kubernetes_version}: {e}"
                ) from None

    # --- rendering (per launch) ---

    def placeholder_values(self, spec: LaunchSpec, name: str) -> dict[str, Any]:
        """The value of every placeholder for one launch."""
        image = spec.image or self.image
        return {
            **self.values,
            "job_name": name,
            "namespace": self.namespace,
            "instance": self.instance,
            "image": image,
            "run_id": spec.key.run_id,
            "rollout_id": spec.key.rollout_id,
            "attempt_id": spec.key.attempt_id,
            "timeout_s": deadline_seconds(spec.timeout_s),
            "ttl_seconds_after_finished": self.ttl_seconds_after_finished,
        }

    def render(self, spec: LaunchSpec) -> Manifest:
        """The Job manifest of one attempt. Raises `PermanentBackendError` for a spec that cannot run."""
        key = spec.key
        try:
            for kind, value in (("run_id", key.run_id), ("rollout_id", key.rollout_id), ("attempt_id", key.attempt_id)):
                check_id(kind, value)
        except InvalidId as e:
            raise PermanentBackendError(str(e)) from None
        name = job_name(key)
        values = self.placeholder_values(spec, name)
        if values["image"] is None and "image" in self.placeholders:
            raise PermanentBackendError(
                f"{self.source} uses {{{{ image }}}} but neither the launch nor the backend settings name an image"
            )
        job: Manifest = _fill(self._tree, values)  # builds a new tree: the parsed template is never changed
        for problem in (label_problem(k, v) for k, v in spec.labels.items()):
            if problem:
                raise PermanentBackendError(f"launch labels: {problem}")
        ids = ids_annotations(key)
        labels = {**spec.labels, **owner_labels(self.instance), **key_labels(key)}
        meta = job.setdefault("metadata", {})
        meta.update(name=name, namespace=self.namespace)
        meta["labels"] = {**(meta.get("labels") or {}), **labels}
        meta["annotations"] = {**(meta.get("annotations") or {}), **ids}

        job_spec = job["spec"]
        job_spec["backoffLimit"] = 0
        job_spec["activeDeadlineSeconds"] = deadline_seconds(spec.timeout_s)
        job_spec.setdefault("ttlSecondsAfterFinished", self.ttl_seconds_after_finished)
        template = job_spec["template"]
        pod_meta = template.setdefault("metadata", {}) or {}
        template["metadata"] = pod_meta
        pod_meta["labels"] = {**(pod_meta.get("labels") or {}), **labels, COMPONENT: "agent"}
        pod_meta["annotations"] = {**(pod_meta.get("annotations") or {}), **ids, **self._input_annotation(spec)}
        pod = template["spec"]
        pod["restartPolicy"] = "Never"
        pod.setdefault("automountServiceAccountToken", False)
        pod["volumes"] = [v for v in pod.get("volumes") or [] if v.get("name") != INPUT_VOLUME] + [_input_volume()]
        self._place_containers(pod, spec)
        return job

    def _input_annotation(self, spec: LaunchSpec) -> dict[str, str]:
        size = len(spec.input_json.encode())
        if size > INPUT_ANNOTATION_LIMIT:
            raise PermanentBackendError(
                f"the input of rollout {spec.key.rollout_id!r} is {size} bytes; Kubernetes Jobs carry at most "
                f"{INPUT_ANNOTATION_LIMIT} bytes: keep large data elsewhere (an object store) "
                "and put its address in the input"
            )
        return {INPUT_ANNOTATION: spec.input_json}

    def _place_containers(self, pod: dict[str, Any], spec: LaunchSpec) -> None:
        containers: list[dict[str, Any]] = pod["containers"]
        agent = next(c for c in containers if c["name"] == self.agent_container)
        if spec.command is not None:
            agent["command"] = list(spec.command)
            agent.pop("args", None)
        input_env = _input_env(spec.input_json)
        agent_env = {**spec.env, **input_env}
        secret = job_name(spec.key)  # the Secret of the attempt has the Job's name (see k8s_secret)
        if spec.evaluator_command is not None:
            if any(c["name"] == EVALUATOR_CONTAINER for c in containers):
                raise PermanentBackendError(
                    f"{self.source} has a container named {EVALUATOR_CONTAINER!r}; rename it so the evaluator can run"
                )
            if pod.get("shareProcessNamespace"):
                raise PermanentBackendError(
                    f"{self.source} sets shareProcessNamespace, which would let the agent read the evaluator's "
                    "token; remove it to run an evaluator"
                )
            evaluator = copy.deepcopy(agent)
            evaluator.update(name=EVALUATOR_CONTAINER, command=list(spec.evaluator_command))
            evaluator.pop("args", None)
            for field in _INIT_FORBIDDEN:
                agent.pop(field, None)
                evaluator.pop(field, None)
            _set_env(evaluator, {**(spec.evaluator_env or {}), **input_env}, secret, EVALUATOR)
            pod["initContainers"] = [*(pod.get("initContainers") or []), agent]
            pod["containers"] = [evaluator if c is agent else c for c in containers]
        for container in [*(pod.get("initContainers") or []), *pod["containers"]]:
            if container.get("name") != EVALUATOR_CONTAINER or spec.evaluator_command is None:
                _set_env(container, agent_env, secret, AGENT)
            mounts = [m for m in container.get("volumeMounts") or [] if m.get("name") != INPUT_VOLUME]
            container["volumeMounts"] = [*mounts, {"name": INPUT_VOLUME, "mountPath": INPUT_DIR, "readOnly": True}]


def deadline_seconds(timeout_s: float) -> int:
    """`activeDeadlineSeconds` for a timeout: whole seconds, rounded up, at least 1."""
    return max(1, math.ceil(timeout_s))


def _input_env(input_json: str) -> dict[str, str]:
    env = {INPUT_FILE_ENV: INPUT_FILE}
    if len(input_json.encode()) <= INPUT_ENV_LIMIT:
        env[INPUT_ENV] = input_json
    return env


def _input_volume() -> dict[str, Any]:
    return {
        "name": INPUT_VOLUME,
        "downwardAPI": {
            "items": [{"path": "input.json", "fieldRef": {"fieldPath": f"metadata.annotations['{INPUT_ANNOTATION}']"}}]
        },
    }


def _set_env(container: dict[str, Any], env: Mapping[str, str], secret: str, role: str) -> None:
    """Put `env` into a container, replacing same-named variables of the template.

    Credentials (`SECRET_ENV`) are references to the attempt's Secret, never values: the Job
    spec is readable by whoever may read Jobs.
    """
    kept = [e for e in container.get("env") or [] if e.get("name") not in env]
    container["env"] = [*kept, *(_env_var(k, v, secret, role) for k, v in env.items())]


def _env_var(name: str, value: str, secret: str, role: str) -> dict[str, Any]:
    if name not in SECRET_ENV:
        return {"name": name, "value": value}
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": secret, "key": secret_key(role, name)}}}


def _strings(node: Any) -> Iterator[str]:
    """Every string (key or value) in a parsed YAML tree."""
    if isinstance(node, str):
        yield node
    elif isinstance(node, dict):
        for k, v in node.items():
            yield from _strings(k)
            yield from _strings(v)
    elif isinstance(node, list):
        for item in node:
            yield from _strings(item)


def _fill(node: Any, values: Mapping[str, Any]) -> Any:
    """Replace placeholder sentinels in a parsed YAML tree (keys and values)."""
    if isinstance(node, str):
        whole = _SENTINEL.fullmatch(node)
        if whole:
            return values[whole.group(1)]
        return _SENTINEL.sub(lambda m: str(values[m.group(1)]), node)
    if isinstance(node, dict):
        return {_fill(k, values): _fill(v, values) for k, v in node.items()}
    if isinstance(node, list):
        return [_fill(item, values) for item in node]
    return node
