"""The manifests in infra/: valid offline (kubernetes-validate), and consistent with the backend."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from fake_apiserver import FakeApiServer
from k8s_support import REPO, TEMPLATE_PATH, StateLog, launch_spec

from services.controller.backends.base import ExecutionKey, RolloutKey
from services.controller.backends.k8s_secret import secret_manifest
from services.controller.backends.k8s_template import JobTemplate, job_name, validate_manifest
from services.controller.backends.kubernetes import KubernetesBackend, KubernetesSettings

KUBERNETES_VERSION = "1.33"
K8S_DIR = REPO / "infra" / "k8s"
COMPOSE_ONLY = (REPO / "infra" / "prometheus", REPO / "infra" / "grafana")  # monitoring configs, not Kubernetes objects
MANIFESTS = sorted(
    p
    for p in (REPO / "infra").rglob("*.y*ml")
    if p.name != TEMPLATE_PATH.name and not any(p.is_relative_to(d) for d in COMPOSE_ONLY)
)


def documents(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def find(kind: str, name: str | None = None) -> dict[str, Any]:
    """The one document of `kind` (and `name`) among the manifests."""
    found = [
        d for p in MANIFESTS for d in documents(p) if d["kind"] == kind and name in (None, d["metadata"].get("name"))
    ]
    assert len(found) == 1, f"{len(found)} {kind} {name or ''} in infra/"
    return found[0]


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_manifest_validates_offline(path: Path) -> None:
    docs = documents(path)
    assert docs, f"{path} holds no document"
    for doc in docs:
        if doc["kind"] == "Kustomization":
            continue  # not a cluster object; checked below
        validate_manifest(doc, KUBERNETES_VERSION)


def test_the_example_job_template_renders_valid_jobs() -> None:
    template = JobTemplate(TEMPLATE_PATH.read_text(), source=str(TEMPLATE_PATH), image="registry.example/agent:1")
    key = ExecutionKey("run-1", "rollout-1", "attempt-1")
    for spec in (
        launch_spec(key),
        launch_spec(key, command=["python", "-m", "agent"], labels={"team": "rl"}),
        launch_spec(key, evaluator_command=["python", "-m", "grade"], evaluator_env={"ROLLWIRE_TOKEN": "e"}),
    ):
        validate_manifest(template.render(spec), KUBERNETES_VERSION)
        owner = {"name": job_name(key), "uid": "0f5c1b9e-6a43-4bd0-9a3e-2f1f3f0b8c11"}
        validate_manifest(secret_manifest(spec, job_name(key), "rollwire", "default", owner), KUBERNETES_VERSION)


def test_the_kustomization_lists_every_manifest() -> None:
    (kustomization,) = documents(K8S_DIR / "kustomization.yaml")
    listed = set(kustomization["resources"])
    on_disk = {p.name for p in K8S_DIR.glob("*.yaml")} - {"kustomization.yaml", TEMPLATE_PATH.name}
    assert listed == on_disk
    files = [f for generator in kustomization["configMapGenerator"] for f in generator.get("files", [])]
    assert TEMPLATE_PATH.name in files
    assert all((K8S_DIR / f).exists() for f in files)


def test_the_network_policy_confines_exactly_the_agent_pods() -> None:
    policy = find("NetworkPolicy")["spec"]
    template = JobTemplate(TEMPLATE_PATH.read_text(), image="registry.example/agent:1")
    pod_labels = template.render(launch_spec(ExecutionKey("r", "ro", "a")))["spec"]["template"]["metadata"]["labels"]
    assert policy["podSelector"]["matchLabels"].items() <= pod_labels.items()
    for kind in ("controller", "gateway"):
        labels = find("Deployment", f"rollwire-{kind}")["spec"]["template"]["metadata"]["labels"]
        assert not policy["podSelector"]["matchLabels"].items() <= labels.items()
    assert sorted(policy["policyTypes"]) == ["Egress", "Ingress"] and policy["ingress"] == []
    gateway_rule, dns_rule = policy["egress"]
    gateway = find("Deployment", "rollwire-gateway")["spec"]["template"]
    assert gateway_rule["to"][0]["podSelector"]["matchLabels"].items() <= gateway["metadata"]["labels"].items()
    assert [p["port"] for p in gateway_rule["ports"]] == [gateway["spec"]["containers"][0]["ports"][0]["containerPort"]]
    assert {p["port"] for p in dns_rule["ports"]} == {53}


def test_the_controller_deployment_configures_the_backend(tmp_path: Path) -> None:
    deployment = find("Deployment", "rollwire-controller")["spec"]["template"]["spec"]
    assert deployment["serviceAccountName"] == find("ServiceAccount")["metadata"]["name"]
    binding = find("RoleBinding")
    assert binding["roleRef"]["name"] == find("Role")["metadata"]["name"]
    assert binding["subjects"][0]["name"] == deployment["serviceAccountName"]
    env = {e["name"]: e.get("value", "") for e in deployment["containers"][0]["env"]}
    mount = next(m for m in deployment["containers"][0]["volumeMounts"] if m["name"] == "job-template")
    assert env["ROLLWIRE_K8S_JOB_TEMPLATE"] == f"{mount['mountPath']}/{TEMPLATE_PATH.name}"
    env.update(ROLLWIRE_K8S_JOB_TEMPLATE=str(TEMPLATE_PATH), ROLLWIRE_K8S_NAMESPACE="rollwire")
    settings = KubernetesSettings.from_env(env)
    assert (settings.create_rate, settings.capacity, settings.resync_s) == (10.0, 256, 60.0)
    JobTemplate(settings.job_template, image=settings.image)


async def test_the_role_grants_exactly_what_the_backend_uses(
    make_backend: Callable[..., KubernetesBackend], apiserver: FakeApiServer
) -> None:
    granted = {
        (group, resource, verb)
        for rule in find("Role")["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    backend = make_backend(resync_s=0.5)
    log = StateLog(backend)
    key = ExecutionKey("run-1", "rollout-1", "attempt-1")
    await backend.launch(launch_spec(key))
    await log.until(lambda s: s.key == key)
    apiserver.set_logs(job_name(key), "boom\n")
    apiserver.set_pod_failed(job_name(key), 1)
    await log.until(lambda s: s.key == key and s.phase == "failed")
    await backend.list()
    await backend.cancel(key)
    await backend.launch(launch_spec(ExecutionKey("run-1", "rollout-2", "attempt-1")))
    await backend.cleanup({RolloutKey("run-1", "rollout-1")})
    # A launch repeated by a fresh backend reads the Job and the Secret there (409 AlreadyExists) ...
    other = ExecutionKey("run-1", "rollout-4", "attempt-1")
    await backend.launch(launch_spec(other))
    await make_backend().launch(launch_spec(other))
    # ... and a Secret left by an earlier Job of the same name is replaced.
    stale = ExecutionKey("run-1", "rollout-3", "attempt-1")
    owner = apiserver.job(job_name(other))["metadata"]
    apiserver.create(
        "secrets",
        "agents",
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {
                "name": job_name(stale),
                "ownerReferences": [
                    {"apiVersion": "batch/v1", "kind": "Job", "name": owner["name"], "uid": owner["uid"]}
                ],
            },
            "stringData": {"agent.OPENAI_API_KEY": "old"},
        },
    )
    await backend.launch(launch_spec(stale))
    await log.stop()
    used = {
        ("batch" if r.resource == "jobs" else "", r.resource + (f"/{r.subresource}" if r.subresource else ""), r.verb)
        for r in apiserver.requests
    }
    assert used == granted
    assert all(r.namespace == "agents" for r in apiserver.requests)  # nothing cluster-wide
