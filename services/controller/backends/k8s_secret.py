"""The per-attempt Secret that holds an attempt's credentials, so the Job spec carries none.

The Job's containers read the credentials with `valueFrom.secretKeyRef` (see
`k8s_template._set_env`); anyone allowed to read Jobs or pods sees only the Secret's name. The
Secret has the Job's name (deterministic per attempt, so a retried launch finds it) and one key
per variable and role: `agent.ROLLWIRE_TOKEN`, `evaluator.ROLLWIRE_TOKEN`, ...

It is owned by the Job (`metadata.ownerReferences` to the Job's uid): Kubernetes' garbage
collector deletes it when the Job is deleted (cancel, cleanup, `ttlSecondsAfterFinished`).
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from typing import Any

from services.controller.backends.base import ExecutionKey, LaunchSpec
from services.controller.backends.k8s_names import ids_annotations, key_labels, owner_labels

Manifest = dict[str, Any]

SECRET_ENV = ("ROLLWIRE_TOKEN", "OPENAI_API_KEY", "ANTHROPIC_API_KEY")
"""Variables that hold a credential: they reach containers from the Secret, never as a value."""
AGENT = "agent"
EVALUATOR = "evaluator"


def secret_key(role: str, variable: str) -> str:
    """The Secret's data key for one variable of one role (`agent` or `evaluator`)."""
    return f"{role}.{variable}"


def credentials(spec: LaunchSpec) -> dict[str, str]:
    """The Secret's data (plain text, by data key): the credential variables of the agent and evaluator."""
    data = {secret_key(AGENT, k): v for k, v in spec.env.items() if k in SECRET_ENV}
    if spec.evaluator_command is not None:
        evaluator = spec.evaluator_env or {}
        data.update({secret_key(EVALUATOR, k): v for k, v in evaluator.items() if k in SECRET_ENV})
    return data


def encode(data: Mapping[str, str]) -> dict[str, str]:
    """Secret `data` as Kubernetes stores it: base64 of each value."""
    return {k: base64.b64encode(v.encode()).decode() for k, v in data.items()}


def secret_manifest(
    spec: LaunchSpec, name: str, namespace: str, instance: str, owner: Mapping[str, str] | None = None
) -> Manifest:
    """The attempt's Secret; `owner` (the Job's `name` and `uid`) makes it the Job's dependent."""
    key: ExecutionKey = spec.key
    meta: Manifest = {
        "name": name,
        "namespace": namespace,
        "labels": {**owner_labels(instance), **key_labels(key)},
        "annotations": ids_annotations(key),
    }
    if owner is not None:
        # No blockOwnerDeletion: setting it needs `update` on jobs/finalizers, and nothing has
        # to wait for the Secret before the Job goes.
        meta["ownerReferences"] = [
            {"apiVersion": "batch/v1", "kind": "Job", "name": owner["name"], "uid": owner["uid"]}
        ]
    return {"apiVersion": "v1", "kind": "Secret", "metadata": meta, "type": "Opaque", "data": encode(credentials(spec))}


def owner_uid(secret: Mapping[str, Any]) -> str | None:
    """The uid of the Job that owns a Secret, if any."""
    refs = (secret.get("metadata") or {}).get("ownerReferences") or []
    return next((r.get("uid") for r in refs if r.get("kind") == "Job"), None)
