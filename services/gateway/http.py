"""Small HTTP helpers shared by the routes: bounded body reading, msgspec decoding, JSON responses."""

from __future__ import annotations

import hashlib
from typing import Any, TypeVar

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
        return _decode(body, type_)
    except RecursionError:
        raise too_deep() from None


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
