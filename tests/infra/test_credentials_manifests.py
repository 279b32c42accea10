"""Compose and Kubernetes give NATS and Postgres credentials to the service that needs each, and nobody else."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import yaml
from test_compose import compose_services

from services.devstack.credentials import NATS_PERMISSIONS, nats_config_from_env, password_variable
from services.devstack.embedded import nats_server_binary

ROOT = Path(__file__).resolve().parents[2]


def test_the_nats_config_of_compose_and_kubernetes_is_the_one_rollwire_up_uses() -> None:
    assert (ROOT / "infra/nats/nats.conf").read_text() == nats_config_from_env()
    env = {**os.environ, **{password_variable(user): f"pw-{user}" for user in NATS_PERMISSIONS}}
    checked = subprocess.run(
        [str(nats_server_binary()), "-c", str(ROOT / "infra/nats/nats.conf"), "-t"], env=env, capture_output=True
    )
    assert checked.returncode == 0, checked.stderr


def test_compose_gives_each_service_its_own_nats_user_and_postgres_to_the_projector_only() -> None:
    services = compose_services()
    assert "/etc/nats/nats.conf" in services["nats"]["command"]
    assert "change-me" in services["postgres"]["environment"]["POSTGRES_PASSWORD"]
    for name in ("gateway", "projector", "controller"):
        env = services[name]["environment"]
        assert env["NATS_URL"].startswith(f"nats://{name}:change-me-nats-{name}@nats:4222"), name
        assert ("DATABASE_URL" in env) == (name == "projector"), name
    assert "NATS_URL" not in services["engine"]["environment"]
    assert services["controller"]["environment"]["ROLLWIRE_AGENT_ISOLATION"] == "auto"


def test_kubernetes_keeps_credentials_in_secrets_each_mounted_by_its_service() -> None:
    kustomization = yaml.safe_load((ROOT / "infra/k8s/kustomization.yaml").read_text())
    config = [item for generated in kustomization["configMapGenerator"] for item in generated.get("literals", [])]
    assert not [item for item in config if item.startswith(("NATS_URL", "DATABASE_URL"))]
    secrets = {s["name"]: s["literals"] for s in kustomization["secretGenerator"]}
    mounted = {}
    for name in ("gateway", "projector", "controller"):
        documents = yaml.safe_load_all((ROOT / f"infra/k8s/{name}.yaml").read_text())
        deployment = next(d for d in documents if d and d["kind"] == "Deployment")
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        refs = [ref["secretRef"]["name"] for ref in container["envFrom"] if "secretRef" in ref]
        mounted[name] = [item for ref in refs for item in secrets[ref]]
    for name, items in mounted.items():
        nats = [item for item in items if item.startswith("NATS_URL=")]
        assert nats == [next(i for i in nats if i.startswith(f"NATS_URL=nats://{name}:"))], name
        assert any(i.startswith("DATABASE_URL=") for i in items) == (name == "projector"), name


def test_prometheus_in_kubernetes_scrapes_vllm_with_the_key_the_engine_requires() -> None:
    """vLLM answers /metrics only with its key: the engine's scrape job sends the secret's key, the
    pod-annotation job never reaches the engine (it would be refused), and the port is vLLM's."""
    manifest = yaml.safe_load((ROOT / "infra/k8s/prometheus-scrape.yaml").read_text())
    jobs = {job["job_name"]: job for job in yaml.safe_load(manifest["data"]["rollwire-scrape.yml"])["scrape_configs"]}
    engine_job = jobs["rollwire-engine"]
    keep = engine_job["relabel_configs"][0]
    assert keep["source_labels"] == ["__meta_kubernetes_pod_label_app_kubernetes_io_component"]
    assert (keep["action"], keep["regex"]) == ("keep", "engine")
    key_path = engine_job["authorization"]["credentials_file"]
    secret, key = key_path.split("/")[-2:]
    engine = next(
        d for d in yaml.safe_load_all((ROOT / "infra/k8s/engine.yaml").read_text()) if d and d["kind"] == "Deployment"
    )
    pod = engine["spec"]["template"]
    vllm = pod["spec"]["containers"][0]
    refs = [env["valueFrom"]["secretKeyRef"] for env in vllm.get("env", []) if "valueFrom" in env]
    assert {"name": secret, "key": key} in refs
    port = vllm["args"][vllm["args"].index("--port") + 1]
    assert engine_job["relabel_configs"][1]["replacement"] == f"$1:{port}"
    assert "prometheus.io/scrape" not in pod["metadata"].get("annotations", {})  # the keyless job skips it
