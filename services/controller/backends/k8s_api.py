"""Sorting the Kubernetes API's answers: raw bodies read in the calling thread, errors into
`TemporaryBackendError` (unreachable, 429, 5xx, an exhausted ResourceQuota) and
`PermanentBackendError` (forbidden, invalid, unauthorized), with messages that say what to fix.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from kubernetes.client.exceptions import ApiException

from services.controller.backends.base import PermanentBackendError, TemporaryBackendError


def translate(what: str, error: ApiException, namespace: str) -> Exception:
    """The backend error for an API error: temporary (retry after a delay) or permanent (say what to fix)."""
    code, message = error.status or 0, status_message(error)
    if code == 0:
        return TemporaryBackendError(f"{what}: cannot reach the Kubernetes API server: {message}", retry_after=2.0)
    if code == 429:
        retry = retry_after(error, 1.0)
        return TemporaryBackendError(f"{what}: the API server is throttling requests: {message}", retry_after=retry)
    if code >= 500:
        return TemporaryBackendError(f"{what}: the API server failed ({code}): {message}", retry_after=2.0)
    if code == 403 and "exceeded quota" in message:
        return TemporaryBackendError(
            f"{what}: the ResourceQuota of namespace {namespace} is used up ({message}); "
            "retrying as running Jobs finish",
            retry_after=10.0,
        )
    if code == 403:
        return PermanentBackendError(
            f"{what}: forbidden: {message}. The controller's service account needs the Role in "
            f"infra/k8s/rbac.yaml in namespace {namespace}"
        )
    if code == 401:
        return PermanentBackendError(f"{what}: unauthorized: {message}; check the kubeconfig or service account token")
    if code == 404:
        return PermanentBackendError(f"{what}: not found: {message}; does namespace {namespace} exist?")
    if code in (400, 422):
        return PermanentBackendError(f"{what}: Kubernetes rejected it: {message}; fix the Job template")
    if code == 409:
        return TemporaryBackendError(f"{what}: conflict: {message}", retry_after=1.0)
    return PermanentBackendError(f"{what}: HTTP {code}: {message}")


def read(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call the client; for a raw HTTP response, read its body in the same thread and return the bytes."""
    result = fn(*args, **kwargs)
    data = getattr(result, "data", None)
    return result if data is None else data


def status_message(error: ApiException) -> str:
    try:
        body = json.loads(error.body or "")
        return str(body.get("message") or error.reason)
    except (ValueError, AttributeError):
        return str(error.reason or error.body or "no message")


def retry_after(error: ApiException, default: float) -> float:
    try:
        return float((error.headers or {}).get("Retry-After", default))
    except (TypeError, ValueError):
        return default
