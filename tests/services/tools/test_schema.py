"""The committed JSON Schema of the replay report is current, and a real report validates against it."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
from agentrun import agent_run
from replay_support import CliResult, publish

from services.tools.schema import SCHEMA_PATH, schema_text


def test_committed_schema_is_current() -> None:
    assert SCHEMA_PATH.read_text() == schema_text(), "run `python -m services.tools.schema` and commit the file"


def test_a_report_validates_against_the_schema(rollwire: Callable[..., CliResult], nats_url: str, run_id: str) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    publish(nats_url, agent_run(run_id, groups=3, per_group=3, steps=2, seed=1))
    result = rollwire("replay", run_id, "--format", "json", "--compare", "token-mean", "per-call+rloo")
    report = json.loads(result.stdout)
    schema = json.loads(SCHEMA_PATH.read_text())
    jsonschema.validate(report, schema)
    sample = schema["$defs"]["SampleRow"]["properties"]
    for field in ("rollout_id", "group_id", "index", "prompt_tokens", "response_tokens", "reward", "advantage",
                  "token_weight"):  # fmt: skip
        assert field in sample and field in report["schemes"][0]["samples"][0]
    broken = {**report, "schemes": [{**report["schemes"][0], "samples": [{"index": "first"}]}]}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, schema)
