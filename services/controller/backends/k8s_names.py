"""Names, labels and schema checks shared by the Kubernetes backend's Job and Secret manifests.

Every object of an attempt carries a deterministic name (`job_name`), the labels
`app.kubernetes.io/managed-by=rollwire` and `rollwire.dev/instance` (the watch selector) plus
the run, rollout and attempt as labels (made valid) and as exact annotations (`key_of`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import re
from collections.abc import Mapping
from typing import Any

from services.controller.backends.base import ExecutionKey, PermanentBackendError

log = logging.getLogger(__name__)

Manifest = dict[str, Any]

MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGER = "rollwire"
COMPONENT = "app.kubernetes.io/component"
INSTANCE_LABEL = "rollwire.dev/instance"
RUN_LABEL = "rollwire.dev/run"
ROLLOUT_LABEL = "rollwire.dev/rollout"
ATTEMPT_LABEL = "rollwire.dev/attempt"
RUN_ANNOTATION = "rollwire.dev/run-id"
ROLLOUT_ANNOTATION = "rollwire.dev/rollout-id"
ATTEMPT_ANNOTATION = "rollwire.dev/attempt-id"
INPUT_ANNOTATION = "rollwire.dev/input"

JOB_NAME_PREFIX = "rw"
MAX_NAME = 63
HASH_CHARS = 10

_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_LABEL_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_NOT_DNS = re.compile(r"[^a-z0-9-]+")


class TemplateError(PermanentBackendError):
    """The Job template cannot be used; the message names the template, the place and the fix."""


def _digest(*parts: str) -> str:
    return hashlib.sha256("\x00".join(parts).encode()).hexdigest()[:HASH_CHARS]


def job_name(key: ExecutionKey) -> str:
    """The Job name of an attempt: deterministic, a DNS-1123 label of at most 63 characters.

    `rw-<run>-<rollout>-<attempt>` lowercased and cut to fit, then a hash of the exact ids. The
    hash is always there because the readable part is lossy (case, `_`, cutting) and ambiguous
    (`a-b`+`c` vs `a`+`b-c`): two attempts never share a name, and the same attempt always gets
    the same one, so creating it twice hits 409 AlreadyExists instead of running it twice.
    """
    digest = _digest(key.run_id, key.rollout_id, key.attempt_id)
    readable = _NOT_DNS.sub("-", f"{key.run_id}-{key.rollout_id}-{key.attempt_id}".lower()).strip("-")
    room = MAX_NAME - len(JOB_NAME_PREFIX) - len(digest) - 2
    readable = re.sub(r"-+", "-", readable)[:room].strip("-")
    return f"{JOB_NAME_PREFIX}-{readable}-{digest}" if readable else f"{JOB_NAME_PREFIX}-{digest}"


def label_value(raw: str) -> str:
    """`raw` if it is a valid label value, else a readable valid form ending in a hash of `raw`."""
    if len(raw) <= MAX_NAME and _LABEL_VALUE.match(raw):
        return raw
    digest = _digest(raw)
    clean = re.sub(r"[^A-Za-z0-9_.-]+", "_", raw)[: MAX_NAME - HASH_CHARS - 1].strip("-_.")
    return f"{clean}-{digest}" if clean else digest


def label_problem(key: str, value: str) -> str | None:
    """Why `key: value` is not a valid Kubernetes label, or None if it is."""
    prefix, _, name = key.rpartition("/")
    if prefix and (len(prefix) > 253 or not _DNS_SUBDOMAIN.match(prefix)):
        return f"label key {key!r}: the prefix must be a DNS subdomain (lowercase, digits, '-', '.')"
    if not name or len(name) > MAX_NAME or not _LABEL_NAME.match(name):
        return f"label key {key!r}: the name must be 1-63 characters of [A-Za-z0-9_.-], alphanumeric at both ends"
    if len(value) > MAX_NAME or not _LABEL_VALUE.match(value):
        return (
            f"label {key!r}: value {value!r} must be at most 63 characters of [A-Za-z0-9_.-], alphanumeric at both ends"
        )
    return None


def owner_labels(instance: str) -> dict[str, str]:
    """The labels every Job and pod of one backend instance carries (its watch selector)."""
    return {MANAGED_BY: MANAGER, INSTANCE_LABEL: label_value(instance)}


def selector(instance: str) -> str:
    """The label selector matching exactly the Jobs and pods of one backend instance."""
    return ",".join(f"{k}={v}" for k, v in owner_labels(instance).items())


def key_of(obj: Mapping[str, Any]) -> ExecutionKey | None:
    """The execution key of a Job or pod, from its annotations; None for objects not made by Rollwire."""
    annotations = (obj.get("metadata") or {}).get("annotations") or {}
    try:
        return ExecutionKey(
            annotations[RUN_ANNOTATION], annotations[ROLLOUT_ANNOTATION], annotations[ATTEMPT_ANNOTATION]
        )
    except KeyError:
        return None


def validate_manifest(manifest: Manifest, kubernetes_version: str, *, strict: bool = True) -> None:
    """Check a manifest against the Kubernetes OpenAPI schema (offline, `kubernetes-validate`).

    Raises `TemplateError` naming the field. Without `kubernetes-validate` installed, logs that
    only the structure was checked. Results are remembered: the same manifest is checked once.
    """
    problem = _schema_problem(json.dumps(manifest, sort_keys=True), kubernetes_version, strict)
    if problem is not None:
        raise TemplateError(problem)


@functools.lru_cache(maxsize=256)
def _schema_problem(manifest_json: str, kubernetes_version: str, strict: bool) -> str | None:
    try:
        import kubernetes_validate
    except ImportError:
        log.warning("kubernetes-validate is not installed: manifests are checked for structure only")
        return None
    try:
        kubernetes_validate.validate(json.loads(manifest_json), kubernetes_version, strict=strict)
    except kubernetes_validate.ValidationError as e:
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in e.path).lstrip(".") or "(top level)"
        return f"{where}: {e.message}"
    except kubernetes_validate.SchemaNotFoundError as e:
        return str(e.message)
    return None


def key_labels(key: ExecutionKey) -> dict[str, str]:
    """The run, rollout and attempt labels of an attempt's objects (valid label values)."""
    return {
        RUN_LABEL: label_value(key.run_id),
        ROLLOUT_LABEL: label_value(key.rollout_id),
        ATTEMPT_LABEL: label_value(key.attempt_id),
    }


def ids_annotations(key: ExecutionKey) -> dict[str, str]:
    """The exact ids of an attempt, as annotations (`key_of` reads them back)."""
    return {RUN_ANNOTATION: key.run_id, ROLLOUT_ANNOTATION: key.rollout_id, ATTEMPT_ANNOTATION: key.attempt_id}
