"""Access lines: the text and JSON formats, ids read from paths, paths a client cannot use to forge lines."""

from __future__ import annotations

import asyncio
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


class _Writes:
    """A stream that keeps each `write` apart, to count the writes."""

    def __init__(self) -> None:
        self.writes: list[str] = []

    def write(self, text: str) -> int:
        self.writes.append(text)
        return len(text)


def test_one_loop_turn_is_one_write_and_nothing_waits_outside_a_loop() -> None:
    stream = _Writes()
    log = AccessLog("gateway", "text", stream)  # type: ignore[arg-type]

    async def turns() -> None:
        for status in (200, 201, 202):
            log.write("GET", "/healthz", status, 0.0)
        assert stream.writes == []  # written at the end of the turn
        await asyncio.sleep(0)
        log.write("GET", "/healthz", 203, 0.0)
        await asyncio.sleep(0)

    asyncio.run(turns())
    assert len(stream.writes) == 2 and stream.writes[0].count("\n") == 3
    statuses = [line.split("status=")[1].split()[0] for line in "".join(stream.writes).splitlines()]
    assert statuses == ["200", "201", "202", "203"]

    stream.writes.clear()
    log.write("GET", "/healthz", 404, 0.0)  # no loop: written at once
    assert len(stream.writes) == 1 and "status=404" in stream.writes[0]


def test_a_turn_cut_short_by_its_loop_closing_is_written_by_the_next_line() -> None:
    stream = _Writes()
    log = AccessLog("gateway", "text", stream)  # type: ignore[arg-type]
    loop = asyncio.new_event_loop()

    def one() -> None:
        log.write("GET", "/a", 200, 0.0)
        loop.stop()  # the loop stops before the turn's write runs

    loop.call_soon(one)
    loop.run_forever()
    loop.close()
    assert stream.writes == []
    log.write("GET", "/b", 200, 0.0)
    text = "".join(stream.writes)
    assert text.index("path=/a") < text.index("path=/b") and text.count("\n") == 2
