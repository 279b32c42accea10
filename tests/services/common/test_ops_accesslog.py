"""Access lines: the text and JSON formats, ids read from paths, paths a client cannot use to forge lines."""

from __future__ import annotations

import json

import pytest

from services.common.accesslog import AccessLog, AccessLogError, access_format, ids_in


def test_text_and_json_lines_name_the_rollout_and_attempt() -> None:
    path = "/proxy/rollout/ro-1/attempt/a-2/mode/train/openai/v1/chat/completions"
    text = AccessLog("gateway", "text").line("POST", path, 200, 0.01234)
    assert text == (
        f"access method=POST path={path} status=200 rollout=ro-1 attempt=a-2 latency_ms=12.34 service=gateway"
    )
    record = json.loads(AccessLog("gateway", "json").line("GET", "/api/rollouts/ro-9", 404, 0.001))
    assert record["rollout"] == "ro-9" and record["attempt"] is None and record["status"] == 404
    assert set(record) == {"ts", "service", "method", "path", "status", "rollout", "attempt", "latency_ms"}
    assert ids_in("/api/rollouts/ro-1/attempt/a1/events") == ("ro-1", "a1")
    assert ids_in("/api/rollouts/terminal") == (None, None) and ids_in("/healthz") == (None, None)


def test_a_client_cannot_break_a_line() -> None:
    line = AccessLog("gateway", "text").line("GET", "/api/x\naccess method=FAKE path=/ status=200", 404, 0.0)
    assert "\n" not in line and " method=FAKE" not in line and "%0A" in line
    assert len(AccessLog("gateway", "text").line("GET", "/" + "a" * 10_000, 404, 0.0)) < 700


def test_the_switch_names_its_values() -> None:
    assert access_format({}) == "text" and access_format({"ROLLWIRE_ACCESS_LOG": "JSON"}) == "json"
    assert not AccessLog("x", "off").enabled
    with pytest.raises(AccessLogError, match="use one of text, json, off"):
        access_format({"ROLLWIRE_ACCESS_LOG": "yaml"})
