"""The Grafana dashboard (infra/grafana/rollwire-dashboard.json) checked against what the services
actually export: every metric a panel queries is a sample name some running service (the engine:
vLLM's own `vllm:*` families, or the trainer's endpoint) serves, with the labels the query selects,
groups and prints."""

from __future__ import annotations

import json
import re
from pathlib import Path

from ops_stack import Stack
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from trainer.loggers import PrometheusSink

DASHBOARD = Path(__file__).resolve().parents[3] / "infra" / "grafana" / "rollwire-dashboard.json"
QUESTIONS = ("Are agents running?", "Is the proxy healthy?", "Is the projector lagging?", "Is the reward moving?")
TARGET_LABELS = {"job", "instance"}  # added by Prometheus to every scraped sample
NAME = re.compile(r"\b(rollwire_[a-z0-9_]+|vllm:[a-z0-9_:]+|up|process_[a-z0-9_]+)\b(\{[^}]*\})?")
BY = re.compile(r"\bby \(([^)]*)\)")


def exported(stack: Stack) -> dict[str, set[str]]:
    """Sample name -> label names, over every service of the stack and a trainer endpoint."""
    names: dict[str, set[str]] = {"up": set()}
    texts = [
        scrape_text(url, stack.engine_key if name == "engine" else "") for name, url in stack.metrics_urls().items()
    ]
    trainer = PrometheusSink("r", port=-1)  # the trainer's families, without serving them
    trainer.log({"step": 1, "reward_mean": 0.5, "reward_std": 0.1, "loss": 0.2, "entropy": 1.0, "approx_kl": 0.0,
                 "weights_version": 1, "time_step_s": 3.0, "rollouts": 4, "rollouts_failed": 1})  # fmt: skip
    texts.append(generate_latest(trainer.registry).decode())
    for text in texts:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                names.setdefault(sample.name, set()).update(sample.labels)
    return names


def scrape_text(url: str, key: str = "") -> str:
    """A /metrics page's text (`key`: vLLM's, which it requires)."""
    import httpx

    response = httpx.get(url, headers={"Authorization": f"Bearer {key}"} if key else {}, timeout=60)
    assert response.status_code == 200, (url, response.status_code)
    return response.text


def test_every_query_uses_exported_metrics_and_labels(stack: Stack) -> None:
    stack.scrape("gateway")  # a scrape of each has happened, so the HTTP families carry samples
    names = exported(stack)
    dashboard = json.loads(DASHBOARD.read_text())
    queried: set[str] = set()
    for panel in (p for p in dashboard["panels"] if p["type"] != "row"):
        for target in panel["targets"]:
            expr = target["expr"]
            found = NAME.findall(expr)
            assert found, (panel["title"], expr)
            available: set[str] = set(TARGET_LABELS)
            for name, selector in found:
                assert name in names, f"panel {panel['title']!r} queries {name}, which no service exports"
                queried.add(name)
                labels = names[name] | TARGET_LABELS
                available |= labels
                for key in re.findall(r"(\w+)\s*[=!]~?", selector):
                    assert key in labels, f"panel {panel['title']!r}: {name} has no label {key!r}"
            for group in BY.findall(expr):
                for key in (k.strip() for k in group.split(",")):
                    assert key in available, f"panel {panel['title']!r} groups by {key!r}, which {found} lack"
            for key in re.findall(r"\{\{(\w+)\}\}", target["legendFormat"]):
                assert key in available, f"panel {panel['title']!r} prints {key!r}, which {found} lack"
    # The dashboard reads every service's families.
    for prefix in ("rollwire_gateway_", "vllm:", "rollwire_controller_", "rollwire_projector_",
                   "rollwire_trainer_", "rollwire_http_"):  # fmt: skip
        assert any(q.startswith(prefix) for q in queried), prefix


def test_the_dashboard_answers_the_four_questions() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    rows = [p["title"] for p in dashboard["panels"] if p["type"] == "row"]
    assert rows == list(QUESTIONS)
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)) and dashboard["uid"] == "rollwire"
    assert {v["name"] for v in dashboard["templating"]["list"]} == {"datasource"}
    for panel in dashboard["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}" and panel["targets"], panel["title"]
