"""Integer bounds of the contract: what every store an event reaches can hold.

An event's integers end up in Postgres columns (`integer` for counts, steps, versions and token
ids, `bigint` for sequences) and in JSON read by any language (exact only up to 2^53). A number
outside that range must be refused where it enters, with a 422 naming the field, not found later
by the projector. The types below carry the bounds as msgspec constraints, so decoding refuses
them (and the exported JSON Schemas state them); `check_int` does the same for Structs built in
Python, whose fields msgspec does not validate on construction.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

INT32_MIN = -(2**31)
INT32_MAX = 2**31 - 1
JSON_INT_MAX = 2**53 - 1
"""The largest integer every JSON reader (JavaScript included) holds exactly."""
PAGE_MAX = 10_000_000
"""The largest page size or offset a read query takes (`limit`, `cursor`, `after`, `offset`)."""

Int32 = Annotated[int, msgspec.Meta(ge=INT32_MIN, le=INT32_MAX)]
Count = Annotated[int, msgspec.Meta(ge=0, le=INT32_MAX)]
"""A non-negative count, step, version, index or token id (a Postgres `integer`)."""
Positive = Annotated[int, msgspec.Meta(ge=1, le=INT32_MAX)]


def check_int(field: str, value: object, low: int = INT32_MIN, high: int = INT32_MAX, *, optional: bool = True) -> None:
    """Raise msgspec.ValidationError naming `field` when `value` is not an integer in [low, high].

    The message ends with msgspec's `- at `$.field`` so API errors name the field the same way a
    decode error does.
    """
    if type(value) is int and low <= value <= high:  # the common case first: every decoded event checks
        return
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise msgspec.ValidationError(f"Expected `int`, got `{type(value).__name__}` - at `$.{field}`")
    if value < low:
        raise msgspec.ValidationError(f"Expected `int` >= {low} - at `$.{field}`")
    if value > high:
        raise msgspec.ValidationError(f"Expected `int` <= {high} - at `$.{field}`")
