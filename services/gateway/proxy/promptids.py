"""A call's prompt ids from the engine's JSON, parsed straight into int32, and reused from the attempt's last call.

A long prompt's ids are most of an engine's answer: 5,000 ids are about 30 KB of JSON. Decoded
into Python ints, validated and then turned into the array the recording packs, they took about a
third of the proxy's CPU per call at 32 in flight (py-spy: the decode 22%, the conversion 9%);
numpy's C parser reads the raw digits into int32 at once (the JSON was validated when the answer
was decoded, so an array of only digits, commas and whitespace holds integers, and the count of
commas checks that every one was read). Anything else (a sign,
a fraction, an id past 2^31-1) is decoded and validated as a list, as before, so the recording's
bounds checks see exactly what the engine sent.

An agent's next call repeats its last prompt and extends it (the answer, a tool's result, the new
message), and the engine's ids JSON does the same. `PromptIdParser` keeps each attempt's last
parse: when that JSON, less its closing bracket, starts the new one and a comma follows, only the
new ids are parsed; the same JSON again is not parsed at all. The ids before that comma are the
same numbers, since each ended at a separator in both.

The JSON decoder need not read the ids either: it checks every digit of a value it only skips
(74 us of the 30 KB answer's 85 us decode on a 2-core machine). `cut_prompt_ids` finds the last
`"prompt_token_ids":[...]` of a compact answer (vLLM's, which writes no whitespace) and returns the
answer with a marker string in its place, for the decoder, and the ids' JSON, checked here as a
list of plain non-negative integers. The caller takes the cut only when the marker lands where the
ids belong: at the top level of a chat completion (`openai_format.decode_completion`), in one
choice of a token-in completion (`tokenin.decode_completion`, continuous mode: 150 against 30 us
for a 91 KB answer of 15,746 ids). The same bytes inside a string or a nested object leave the
marker there instead, and the caller decodes the whole answer as before.
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

from schemas.refs import IdArray
from services.common.bytecache import ByteLRU

PromptIds = list[int] | IdArray
"""A call's prompt ids: an int32 array when parsed straight from the engine's JSON, else a list."""

AttemptKey = tuple[str, str | None, str | None]
_decode_any = msgspec.json.Decoder().decode
_INT32_MAX = 2**31 - 1
_COMMA = 0x2C
_ZERO = 0x30
_DIGITS_COMMAS = b"0123456789,"
_IDS_KEY = b'"prompt_token_ids":['
IDS_MARKER = "\u0000rollwire:prompt_token_ids"
"""What `cut_prompt_ids` puts where the ids were: a string no engine sends (it starts with NUL)."""
IDS_MARKER_JSON = b'"\\u0000rollwire:prompt_token_ids"'
"""`IDS_MARKER` as it stands in the cut answer's JSON (what a `msgspec.Raw` left there holds)."""
_MARKER_JSON = b'"prompt_token_ids":' + IDS_MARKER_JSON
_NOT_IN_CUT = (b'"', b"[", b" ", b"\n", b"\t", b"\r")
_WHITESPACE = b" \t\r\n"


def cut_prompt_ids(content: bytes) -> tuple[bytes, bytes] | None:
    """(the answer with `IDS_MARKER` for its last `"prompt_token_ids":[...]`, the array's JSON), when
    that array holds no string, array or whitespace; None otherwise (then decode it all).

    Its first `]` then closes it. Its JSON is checked where it is parsed (`_int32_array`, else the
    exact decoder, which refuses what is not JSON), or equals a parse already checked."""
    start = content.rfind(_IDS_KEY)
    if start < 0:
        return None
    opening = start + len(_IDS_KEY) - 1
    closing = content.find(b"]", opening)
    if closing < 0:
        return None
    ids = content[opening : closing + 1]
    for absent in _NOT_IN_CUT:  # memchr each: they are absent from vLLM's ids
        if ids.find(absent, 1) >= 0:
            return None
    return b"".join((content[:start], _MARKER_JSON, content[closing + 1 :])), ids


def int_list(value: Any) -> list[int]:
    """Token ids, validated in C (a Python loop over a long prompt costs ten times more); [] if not ids."""
    if not isinstance(value, list):
        return []
    try:
        return msgspec.convert(value, list[int])
    except msgspec.ValidationError:
        return []


def prompt_token_ids(value: Any) -> PromptIds:
    """Prompt ids as recorded: raw JSON (`msgspec.Raw`) of ids in 0..2^31-1 as an int32 array,
    anything else decoded and validated as a list."""
    return _from_json(bytes(value)) if isinstance(value, msgspec.Raw) else int_list(value)


def _from_json(data: bytes) -> PromptIds:
    ids = _int32_array(data[1:-1]) if _is_array(data) else None
    return ids if ids is not None else int_list(_decode_any(data))


def _is_array(data: bytes) -> bool:
    return len(data) >= 2 and data[0] == 0x5B and data[-1] == 0x5D  # "[...]"


def _int32_array(inner: bytes) -> IdArray | None:
    """The ids between a JSON array's brackets as int32; None unless they are all JSON integers in range.

    Only digits and commas are read (whitespace around them dropped: it reaches here only from JSON
    the decoder checked); an empty element, a leading zero or an unread rest makes it None."""
    other = inner.translate(None, _DIGITS_COMMAS)  # empty for vLLM's ids: one pass over them
    if other:
        if other.translate(None, _WHITESPACE):  # a sign, a fraction, an exponent
            return None
        inner = inner.translate(None, _WHITESPACE)
    text = np.frombuffer(inner, np.uint8)
    if not len(text) or text[0] == _COMMA or text[-1] == _COMMA or _leading_zero(text):
        return None
    try:
        ids = np.fromstring(inner, dtype=np.int64, sep=",")
    except ValueError:  # numpy stops at an empty element ("1,,2")
        return None
    if len(ids) != np.count_nonzero(text == _COMMA) + 1 or int(ids.max()) > _INT32_MAX:
        return None
    return ids.astype(np.int32)


def _leading_zero(text: np.ndarray[Any, np.dtype[np.uint8]]) -> bool:
    """Whether a number of digits and commas starts with 0 and goes on (`007`: not JSON)."""
    zeros = np.flatnonzero(text[:-1] == _ZERO)
    firsts = zeros[(zeros == 0) | (text[zeros - 1] == _COMMA)]
    return bool((text[firsts + 1] != _COMMA).any())


class PromptIdParser:
    """`prompt_token_ids`, reusing each attempt's last parse for the prompt that repeats or extends it
    (see the module docstring); bounded by bytes, so a forgotten attempt only costs a whole parse."""

    def __init__(self, max_bytes: int = 64 << 20) -> None:
        self._last: ByteLRU[AttemptKey, tuple[bytes, IdArray]] = ByteLRU(max_bytes, _entry_size)

    def parse(self, key: AttemptKey, value: Any) -> PromptIds:
        """The prompt ids of one call of the attempt `key` (its answer's `prompt_token_ids`)."""
        if not isinstance(value, msgspec.Raw):
            return prompt_token_ids(value)
        data = bytes(value)
        last = self._last.get(key)
        ids = _extended(last, data) if last is not None else None
        if ids is None:
            parsed = _from_json(data)
            if not isinstance(parsed, np.ndarray):
                return parsed
            ids = parsed
        ids.flags.writeable = False  # shared with the next call's parse
        self._last.put(key, (data, ids))
        return ids


def _extended(last: tuple[bytes, IdArray], data: bytes) -> IdArray | None:
    """The ids of `data` from the last parse and only what it adds; None when it does not extend it."""
    old, ids = last
    if data == old:
        return ids
    head = len(old) - 1  # the last parse's JSON without its closing bracket
    if len(data) <= head + 1 or data[head] != _COMMA or not _is_array(data) or not data.startswith(old[:head]):
        return None
    more = _int32_array(data[head + 1 : -1])
    return None if more is None else np.concatenate((ids, more))


def _entry_size(entry: tuple[bytes, IdArray]) -> int:
    return len(entry[0]) + entry[1].nbytes
