"""The replay decodes calls as the adapter's slim `CallRecord`; it must give the same `CallTokens` as the event."""

from __future__ import annotations

import msgspec

from schemas import ModelRequestRecorded, encode
from schemas.calls import BODIES, CallRecord, decode_call
from trainer.core import call_from_event, plain


def test_call_record_fields_match_the_event() -> None:
    event_fields = {f.name: f for f in msgspec.structs.fields(ModelRequestRecorded)}
    for field in msgspec.structs.fields(CallRecord):
        twin = event_fields[field.name]
        assert (field.type, field.default) == (twin.type, twin.default), field.name


def test_decoded_record_gives_the_same_call() -> None:
    event = ModelRequestRecorded(
        run_id="r1", rollout_id="ro1", attempt_id="a1", call_id="c1", choice_index=1, weights_version=3,
        prompt_ids=[1, 2, 3], response_ids=[4, 5], logprobs=[-0.5, -0.25],
        request={"messages": [{"role": "user", "content": "hi"}]}, response={"message": {"content": "ok"}},
    )  # fmt: skip
    record = decode_call(encode(event))
    assert (record.rollout_id, record.attempt_id, record.status, record.mode) == ("ro1", "a1", "ok", "train")
    assert plain(call_from_event(record)) == plain(call_from_event(event))


def test_every_contract_field_but_the_bodies_reaches_the_record() -> None:
    """A field added to `ModelRequestRecorded` reaches `CallRecord` with no other edit."""
    event_fields = {f.name for f in msgspec.structs.fields(ModelRequestRecorded)}
    assert {f.name for f in msgspec.structs.fields(CallRecord)} == event_fields - set(BODIES)
