"""The Kubernetes backend's settings (ROLLWIRE_K8S_* variables) and its API client."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

import msgspec
from kubernetes import client as k8s
from kubernetes import config as k8s_config

from services.controller.backends.base import PermanentBackendError

IN_CLUSTER_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


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
