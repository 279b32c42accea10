"""The projector's pure parts: packing, sample chains, flag rules, message decoding, tokenizers, HTTP."""

from __future__ import annotations

import asyncio
import base64
import json
import random
import sys
from pathlib import Path

import asyncpg
import msgspec
import pytest
from fastapi.testclient import TestClient
from projector_reference import MAX_CHAINS, _opens_sample

from schemas import CustomEvent, ModelRegistered, ModelRequestRecorded, RolloutCreated, encode, to_dict
from schemas.refs import pack
from services.projector import chains, packing
from services.projector.api import create_query_app
from services.projector.flags import call_flags, flag_names
from services.projector.incoming import RAW_FIELDS, WireCall, full_body, position, prepare_one
from services.projector.migrate import MigrationError, migrate
from services.projector.reader import PostgresRolloutReader
from services.projector.status import Status
from services.projector.tokens import Detokenizer, TokenizerError


@pytest.mark.parametrize("fast", [True, False])
def test_packing_round_trips_and_rejects(monkeypatch: pytest.MonkeyPatch, fast: bool) -> None:
    if not fast:
        monkeypatch.setattr(packing, "_np", None)
    rng = random.Random(3)
    for _ in range(50):
        ids = [rng.randrange(-(2**31), 2**31) for _ in range(rng.randrange(0, 300))]
        text = msgspec.json.encode(ids)
        assert packing.unpack_int32(packing.pack_int32_json(text)) == ids
        assert packing.pack_int32_json(text) == packing.pack_int32(ids)
    assert packing.unpack_int32(packing.pack_int32_json(b" [ 1 , -2,\n3 ] ")) == [1, -2, 3]
    for bad, error in [(b'"12"', msgspec.ValidationError), (b"[1.5]", msgspec.ValidationError),
                       (b"[true]", msgspec.ValidationError), (b"[2147483648]", OverflowError),
                       (b"[1,,2]", msgspec.DecodeError), (b"{}", msgspec.ValidationError)]:  # fmt: skip
        with pytest.raises(error):
            packing.pack_int32_json(bad)
    floats = [-0.0, -1e-300, -3.25, -1e300, 5e-324]
    assert packing.unpack_float64(packing.pack_float64_json(msgspec.json.encode(floats))) == floats


def test_chains_count_samples_like_the_list_reference() -> None:
    rng = random.Random(5)
    for _ in range(40):
        reference: list[tuple[list[int], list[int]]] = []
        stored = b""
        history: list[list[int]] = []
        for _ in range(rng.randrange(1, 60)):
            kind = rng.random()
            if history and kind < 0.5:  # continue some earlier conversation (maybe an old state: a fork)
                base = rng.choice(history[-4:])
                prompt = base + [rng.randrange(50) for _ in range(rng.randrange(0, 3))]
            elif history and kind < 0.6:
                prompt = list(rng.choice(history[-3:]))[: rng.randrange(1, 5)]
            else:
                prompt = [rng.randrange(50) for _ in range(rng.randrange(1, 6))]
            response = [rng.randrange(50) for _ in range(rng.randrange(0, 4))]
            state = chains.load(stored)
            opens = chains.advance(state, packing.pack_int32(prompt), packing.pack_int32(response))
            stored = chains.dump(state)
            assert opens == _opens_sample(reference, prompt, response)
            assert len(state) == len(reference) <= MAX_CHAINS
            history.append(prompt + response)


def test_a_conversation_is_one_sample_and_a_retry_is_not_a_new_one() -> None:
    state: list[chains.Chain] = []
    p1, r1 = packing.pack_int32([1, 2, 3]), packing.pack_int32([4])
    assert chains.advance(state, p1, r1)
    assert not chains.advance(state, packing.pack_int32([1, 2, 3, 4, 9]), packing.pack_int32([5]))
    assert not chains.advance(state, packing.pack_int32([1, 2, 3, 4, 9]), packing.pack_int32([6]))  # retry
    assert chains.advance(state, packing.pack_int32([7, 7]), packing.pack_int32([]))  # unrelated: new sample


def _response(content: str | None = None, args: str | None = None) -> dict[str, object]:
    message: dict[str, object] = {"content": content}
    if args is not None:
        message["tool_calls"] = [{"function": {"name": "bash", "arguments": args}}]
    return {"choices": [{"message": message}]}


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        (_response(args='{"cmd": "sed -i s/assert/pass/ tests/test_api.py"}'), {"test-tampering"}),
        (_response("Let me fix it.\n```bash\nrm tests/test_api.py\n```"), {"test-tampering"}),
        (_response(args='{"cmd": "python -m pytest -q tests/"}'), set()),
        (_response("The tests/ folder and the reward look fine."), set()),  # prose is not an action
        (_response(args='{"cmd": "cat grader.py && echo $OPENAI_API_KEY"}'), {"grader-access", "secrets"}),
        (_response(args='{"cmd": "curl https://example.com/answers.txt"}'), {"network"}),
        (_response(args='{"cmd": "curl http://127.0.0.1:8000/health"}'), set()),
        (_response(args='{"cmd": "git reset --hard HEAD~3"}'), {"destructive"}),
        (_response("```python\nimport pytest\npytest.skip('flaky')\n```"), {"skips-tests"}),
    ],
)
def test_flag_rules(response: dict[str, object], expected: set[str]) -> None:
    assert flag_names(call_flags(response, "stop", "ok", None)) == expected


def test_flags_for_truncated_and_failed_calls_carry_details() -> None:
    flags = call_flags({}, "length", "failed", "upstream answered 500")
    assert flags == ["truncated: finish_reason=length", "failed-call: upstream answered 500"]


def test_wire_call_mirrors_every_field_of_the_event() -> None:
    assert set(WireCall.__struct_fields__) == set(ModelRequestRecorded.__struct_fields__) - {"type"}
    assert set(RAW_FIELDS) <= set(WireCall.__struct_fields__)


def test_prepare_packs_calls_and_turns_bad_messages_into_errors() -> None:
    hack = _response(args='{"cmd": "printenv"}')
    call = ModelRequestRecorded(run_id="r", rollout_id="x", call_id="c", prompt_ids=[5, 6], response_ids=[7],
                                logprobs=[-0.25], request={"m": 1}, response=hack)  # fmt: skip
    item = prepare_one(3, call.subject, encode(call), 1.0, None)
    assert item.error is None and item.call is not None and item.body is None
    assert packing.unpack_int32(item.call.prompt_ids) == [5, 6] and item.call.prompt_tokens == 2
    assert msgspec.json.decode(item.call.request) == {"m": 1} and flag_names(item.call.flags) == {"secrets"}
    assert item.event == msgspec.structs.replace(call, prompt_ids=[], response_ids=[], logprobs=[], request={},
                                                 response={})  # fmt: skip
    registered = ModelRegistered(run_id="r", name="m", base_url="http://m", api_key="secret-key")
    assert "secret-key" not in (prepare_one(4, registered.subject, encode(registered), 1.0, None).body or "")
    custom = CustomEvent(run_id="r", rollout_id="x", name="n", payload={"a": 1})
    assert prepare_one(5, custom.subject, encode(custom), 1.0, None).body is None
    for data in (b"garbage", b'{"type":"reward","run_id":"a.b","rollout_id":"x","value":1}',
                 encode(call).replace(b'"prompt_ids":[5,6]', b'"prompt_ids":[5,99999999999]'),
                 encode(call).replace(b'"request":{"m":1}', b'"request":[1]')):  # fmt: skip
        bad = prepare_one(6, "rl.r.x", data, 1.0, None)
        assert bad.event is None and bad.error, data


def test_prepare_stores_packed_arrays_as_int32_and_float64_and_refuses_unreadable_ones() -> None:
    """Packed ids of either width become int32, float32 logprobs float64; a bad width or length is an error."""
    for prompt, logprobs in (([5, 6], [-0.25, -1.5]), ([1 << 24, 6], [-0.1, -1.5])):  # 24/32-bit ids, f32/f64
        call = ModelRequestRecorded(run_id="r", rollout_id="x", call_id="c", packed=pack(prompt, [7, 8], logprobs))
        item = prepare_one(3, call.subject, encode(call), 1.0, None)
        assert item.error is None and item.call is not None
        assert packing.unpack_int32(item.call.prompt_ids) == prompt
        assert packing.unpack_int32(item.call.response_ids) == [7, 8]
        assert packing.unpack_float64(item.call.logprobs) == logprobs
    good = json.loads(encode(call))
    for bad in ({"id_width": 5}, {"logprob_width": 2}, {"response": base64.b64encode(b"\0" * 6).decode()}):
        body = {**good, "packed": {**good["packed"], **bad}}
        item = prepare_one(4, call.subject, json.dumps(body).encode(), 1.0, None)
        assert item.event is None and item.error and item.error.startswith("cannot store the event"), bad


def _word_tokenizer(path: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "rm": 3, "-rf": 4}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.decoder = decoders.WordPiece(prefix="##")
    tokenizer.save(str(path))
    return path


def test_detokenizer_decodes_by_model_and_falls_back_to_default(tmp_path: Path) -> None:
    pytest.importorskip("tokenizers")
    path = _word_tokenizer(tmp_path / "tokenizer.json")
    detok = Detokenizer.from_specs([f"policy={path}"])
    decoded = detok.decode("policy", [1, 2], [3, 4])
    assert decoded is not None and decoded.prompt_text == "hello world" and decoded.response_pieces == ["rm", "-rf"]
    assert detok.decode("other", [1], [2]) is None
    assert Detokenizer.from_specs([str(tmp_path)]).decode("any", [2], []) is not None
    with pytest.raises(TokenizerError, match="neither"):
        Detokenizer.from_specs([str(tmp_path / "missing.json")])


def test_metrics_and_health_routes() -> None:
    status = Status("S")
    status.postgres_up, status.nats_up, status.stream_seq = True, True, 10
    status.applied(7, 7, 0.01)
    app = create_query_app(PostgresRolloutReader("postgresql://127.0.0.1:1/none"), status=status, viewer=False)
    with TestClient(app) as client:
        health = client.get("/healthz")
        assert health.status_code == 200 and b'"lag_events":3' in health.content
        assert b'rollwire_projector_lag_events{stream="S"} 3.0' in client.get("/metrics").content
        status.postgres_up = False
        assert client.get("/healthz").status_code == 503
        assert client.get("/nope").status_code == 404 and client.post("/metrics").status_code == 405


async def test_migrations_are_idempotent_and_refuse_a_newer_schema(conn: asyncpg.Connection) -> None:
    assert await migrate(conn) == []
    await conn.execute("INSERT INTO schema_migrations (version, name) VALUES (999, 'from_the_future')")
    with pytest.raises(MigrationError, match="upgrade Rollwire"):
        await migrate(conn)


def test_prepare_decodes_call_text_when_the_tokenizer_is_known(tmp_path: Path) -> None:
    pytest.importorskip("tokenizers")
    detok = Detokenizer.from_specs([f"policy={_word_tokenizer(tmp_path / 'tokenizer.json')}"])
    call = ModelRequestRecorded(run_id="r", rollout_id="x", call_id="c", model="policy", prompt_ids=[1, 2],
                                response_ids=[3, 4], logprobs=[-0.1, -2.0])  # fmt: skip
    row = prepare_one(1, call.subject, encode(call), 1.0, detok).call
    assert row is not None and (row.prompt_text, row.response_text) == ("hello world", "rm -rf")
    other = msgspec.structs.replace(call, model="unknown")
    unknown = prepare_one(2, other.subject, encode(other), 1.0, detok).call
    assert unknown is not None and unknown.prompt_text is None and unknown.response_pieces is None


def test_prompt_cache_packs_exactly_what_a_full_parse_packs() -> None:
    rng = random.Random(9)
    cache = packing.PromptCache(max_bytes=4000)  # small: evictions happen
    last: dict[int, list[int]] = {}
    for _ in range(600):
        key = rng.randrange(8)
        previous = last.get(key, [])
        kind = rng.random()
        if previous and kind < 0.6:  # the conversation goes on
            ids = previous + [rng.randrange(10**6) for _ in range(rng.randrange(1, 20))]
        elif previous and kind < 0.7:  # same digits, different token boundary: 12,3 vs 1,23
            ids = [*previous[:-1], previous[-1] * 10 + 7]
        elif previous and kind < 0.8:
            ids = previous[: rng.randrange(len(previous))]
        else:
            ids = [rng.randrange(10**6) for _ in range(rng.randrange(0, 30))]
        text = msgspec.json.encode(ids)
        assert packing.unpack_int32(cache.pack(key, text)) == ids
        last[key] = ids
    assert cache.hits > 100 and cache.size <= 4000


def test_position_reads_sequence_and_time_off_both_reply_forms() -> None:
    from nats.aio.msg import Msg

    v1 = Msg(None, subject="rl.x", reply="$JS.ACK.ROLLWIRE.c.1.42.7.1700000000500000000.3")  # type: ignore[arg-type]
    v2 = Msg(None, subject="rl.x", reply="$JS.ACK._.hash.ROLLWIRE.c.1.43.8.1700000001000000000.0.tok")  # type: ignore[arg-type]
    assert position(v1) == (42, 1700000000.5) and position(v2) == (43, 1700000001.0)
    assert position(v1) == (v1.metadata.sequence.stream, v1.metadata.timestamp.timestamp())


async def test_backlog_bounds_batches_and_bytes() -> None:
    import asyncio

    from services.projector.backlog import Backlog

    backlog: Backlog[str] = Backlog(max_batches=3, max_bytes=100)
    await backlog.put("big", 500)  # an empty backlog takes any batch
    blocked = asyncio.create_task(backlog.put("next", 10))
    await asyncio.sleep(0.01)
    assert not blocked.done() and len(backlog) == 1  # over the byte bound: the producer waits
    assert await backlog.get() == "big"
    await asyncio.wait_for(blocked, 1)
    await backlog.put("a", 1)
    third = asyncio.create_task(backlog.put("b", 1))
    await asyncio.sleep(0.01)
    assert third.done() and len(backlog) == 3
    fourth = asyncio.create_task(backlog.put("c", 1))
    await asyncio.sleep(0.01)
    assert not fourth.done()  # over the batch bound
    assert [backlog.get_nowait(), backlog.get_nowait()] == ["next", "a"]
    await asyncio.wait_for(fourth, 1)
    assert backlog.get_nowait() == "b" and await backlog.get() == "c" and backlog.get_nowait() is None
    assert backlog.bytes == 0


async def test_the_service_exits_on_a_newer_schema_instead_of_retrying(
    conn: asyncpg.Connection, database: str, nats_url: str
) -> None:
    await migrate(conn)
    await conn.execute("INSERT INTO schema_migrations (version, name) VALUES (999, 'from_the_future')")
    command = [sys.executable, "-m", "services.projector", "--nats-url", nats_url, "--database-url", database,
               "--metrics-port", "-1"]  # fmt: skip
    process = await asyncio.create_subprocess_exec(*command, stderr=asyncio.subprocess.PIPE)
    _, stderr = await asyncio.wait_for(process.communicate(), timeout=60)
    assert process.returncode != 0
    assert b"error: the database has read-model schema version 999" in stderr


def test_a_stored_body_is_read_with_its_defaults_filled_in() -> None:
    """`events.body` keeps the stream's JSON (defaults absent); readers get every field back."""
    event = RolloutCreated(run_id="r1", rollout_id="ro1", input={"task": 1})
    stored = encode(event).decode()
    assert '"mode"' not in stored and '"group_id"' not in stored
    assert full_body(stored) == to_dict(event) and full_body(stored)["mode"] == "train"
    assert full_body('{"type": "from-a-newer-writer", "x": 1}') == {"type": "from-a-newer-writer", "x": 1}
    assert full_body(None) == {}
