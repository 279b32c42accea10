"""Small HTTP helpers shared by the routes: bounded body reading, msgspec decoding, JSON responses."""

from __future__ import annotations

import hashlib
import math
import sys
from typing import Any, TypeGuard, TypeVar

import msgspec
from fastapi import Request, Response

from schemas import InvalidId
from services.gateway import asgi
from services.gateway.errors import from_validation, invalid, too_deep

T = TypeVar("T")
_encoder = msgspec.json.Encoder()


def json_response(payload: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    """A JSON response encoded with msgspec."""
    return Response(_encoder.encode(payload), status_code=status, media_type="application/json", headers=headers)


def encode(payload: Any) -> bytes:
    """JSON bytes of a payload."""
    return _encoder.encode(payload)


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refusing (413) anything larger than `limit` bytes before reading it all.

    The one body reader of the gateway (`asgi.read_body`, which the proxy uses on raw ASGI).
    """
    return await asgi.read_body(request.scope, request.receive, limit)  # type: ignore[arg-type]  # Mapping vs dict


def decode(body: bytes, type_: type[T], *, empty: T | None = None) -> T:
    """Decode JSON into `type_`; 422 naming the field on malformed JSON or a wrong type."""
    if not body.strip():
        if empty is not None:
            return empty
        raise invalid("the request body is empty; send a JSON object", "body")
    try:
        decoded = _decode(body, type_)
    except RecursionError:
        raise too_deep() from None
    refuse_huge_numbers(body)
    return decoded


_DIGIT_RUN = b"1" * 309
"""A run of 309 digits: the shortest integer no 64-bit float holds (above 1.8e308) has that many."""
_DIGITS_AS_ONES = bytes(0x31 if 0x30 <= i <= 0x39 else 0x30 for i in range(256))
"""A `bytes.translate` table: each ASCII digit to `1`, every other byte to `0`."""


def huge_number(value: Any) -> str | None:
    """Where in a decoded JSON value an integer sits that no 64-bit float holds (10^400), or None.

    JSON readers that hold numbers as floats (JavaScript, most others) cannot read one, and every
    other part of the contract keeps numbers within a float: a field, payload or input holding one
    is refused where it enters. Iterative, so the decoder's full nesting depth is walked."""
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        path, item = stack.pop()
        if type(item) is int and not -_FLOAT_MAX <= item <= _FLOAT_MAX:
            return path or "body"
        if isinstance(item, dict):
            stack.extend((f"{path}.{key}" if path else str(key), inner) for key, inner in item.items())
        elif isinstance(item, list):
            stack.extend((f"{path}[{i}]", inner) for i, inner in enumerate(item))
    return None


_FLOAT_MAX = int(sys.float_info.max)


def finite_number(value: Any) -> TypeGuard[int | float]:
    """True for an int or float (not a bool) that a 64-bit float holds finitely (10^400 is not one)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def refuse_huge_numbers(body: bytes) -> None:
    """422 naming the field when the JSON body holds an integer no float holds (see `huge_number`).

    A search of the raw bytes for a long run of digits decides first, so an ordinary body is never
    walked: digits are translated to `1` and the rest to `0`, and the run is a substring search (both
    in C at memory speed; a regular expression tried every position and cost 10x more on a long prompt)."""
    if _DIGIT_RUN not in body.translate(_DIGITS_AS_ONES):
        return
    try:
        where = huge_number(msgspec.json.decode(body))
    except (msgspec.DecodeError, RecursionError):
        return
    if where is not None:
        raise invalid(f"{where}: a number no 64-bit float holds (such as 10^400); send a finite number", where)


def _decode(body: bytes, type_: type[T]) -> T:
    try:
        return msgspec.json.decode(body, type=type_)
    except msgspec.ValidationError as exc:
        # JSON has one number type: `3.0` is an integer to JSON Schema (and to every client that
        # writes numbers as floats). Retry with integral floats where the body wants an int.
        try:
            raw = msgspec.json.decode(body)
        except msgspec.DecodeError:
            raise from_validation(exc) from None
        try:
            return msgspec.convert(_integral(raw, msgspec.inspect.type_info(type_)), type_)
        except (msgspec.ValidationError, InvalidId) as again:
            raise from_validation(again) from None
    except msgspec.DecodeError as exc:
        raise invalid(f"malformed JSON: {exc}", "body") from None
    except InvalidId as exc:
        raise from_validation(exc) from None


def fingerprint(body: bytes) -> str:
    """A digest of the request body (an idempotency key must not be reused for another body)."""
    return hashlib.sha256(body).hexdigest()


def _integral(value: Any, info: msgspec.inspect.Type) -> Any:
    """`value` with integral floats turned into ints wherever `info` (a msgspec type) expects an int."""
    match info:
        case msgspec.inspect.IntType():
            return int(value) if isinstance(value, float) and value.is_integer() else value
        case msgspec.inspect.UnionType():
            for member in info.types:
                value = _integral(value, member)
            return value
        case msgspec.inspect.StructType() if isinstance(value, dict):
            for field in info.fields:
                if field.encode_name in value:
                    value[field.encode_name] = _integral(value[field.encode_name], field.type)
            return value
        case msgspec.inspect.ListType() if isinstance(value, list):
            return [_integral(item, info.item_type) for item in value]
        case msgspec.inspect.DictType() if isinstance(value, dict):
            return {key: _integral(item, info.value_type) for key, item in value.items()}
        case msgspec.inspect.Metadata():
            return _integral(value, info.type)
    return value
