"""Turning one choice's generated tokens into text, stop decisions and stream deltas, token by token.

A `ChoiceBuilder` is fed each sampled token (with its raw logprob) and answers a `TokenDelta`: the
text that may be shown now, and whether the choice has finished. The same builder serves streaming
and non-streaming responses, so the concatenated stream deltas always equal the final content.

- Text is decoded incrementally from each token's exact bytes (UTF-8 sequences split across tokens
  are completed before they are shown); special tokens add no text.
- An EOS token (unless `ignore_eos`) or a `stop_token_ids` token ends the choice with "stop"; the
  token stays in `token_ids` (the model sampled it and a trainer must learn it) but adds no text.
- A stop string ends the choice with "stop"; the text is cut before it, the tokens are kept.
- Text that could still become a stop string, or the start of a `<tool_call>` block when tools are
  parsed, is held back until it is decided.
- `max_tokens` reached ends the choice with "length".
- When tools are parsed, the finished text is split into content and tool calls
  (`services.common.toolcalls`); if there are calls, finish_reason becomes "tool_calls".
"""

from __future__ import annotations

import codecs

import msgspec

from services.common.tinymodel.tokenizer import TokenTable
from services.common.toolcalls import TOOL_CALL_START, ParsedOutput, ToolCall, held_back, parse_tool_calls
from services.engine.sampling import SamplingParams


class TopLogprob(msgspec.Struct, frozen=True):
    """One alternative token and its raw logprob (OpenAI's `top_logprobs` item)."""

    token: str
    logprob: float
    bytes: list[int]


class LogprobEntry(msgspec.Struct, frozen=True):
    """The sampled token's raw logprob and the most likely alternatives (OpenAI's `logprobs.content` item)."""

    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class TokenDelta(msgspec.Struct, frozen=True):
    """What one sampled token adds to choice `index`: visible text, the token, and the finish if any."""

    index: int
    token_id: int
    content: str
    logprob: LogprobEntry | None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    tool_calls: tuple[ToolCall, ...] = ()


class ChoiceBuilder:
    """The growing output of one choice (see the module docstring)."""

    def __init__(
        self,
        index: int,
        table: TokenTable,
        params: SamplingParams,
        eos_token_ids: frozenset[int],
        parse_tools: bool,
        want_logprobs: bool,
    ) -> None:
        self.index = index
        self._table = table
        self._params = params
        self._eos = frozenset() if params.ignore_eos else eos_token_ids
        self._parse_tools = parse_tools
        self._want_logprobs = want_logprobs
        self._markers = params.stop + ((TOOL_CALL_START,) if parse_tools else ())
        self._longest_stop = max((len(s) for s in params.stop), default=0)
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.token_ids: list[int] = []
        self.logprobs: list[LogprobEntry] = []
        self.text = ""
        self._shown = 0
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.parsed: ParsedOutput | None = None

    @property
    def finished(self) -> bool:
        """True once the choice has its finish reason."""
        return self.finish_reason is not None

    def _entry(self, token_id: int, logprob: float, top: list[tuple[int, float]]) -> LogprobEntry:
        table = self._table
        alternatives = [TopLogprob(table.display(t), lp, list(table.pieces[t])) for t, lp in top]
        return LogprobEntry(table.display(token_id), logprob, list(table.pieces[token_id]), alternatives)

    def _cut_at_stop_string(self, searched_from: int) -> None:
        start = max(0, searched_from - self._longest_stop + 1)
        found = [(pos, stop) for stop in self._params.stop if (pos := self.text.find(stop, start)) >= 0]
        if found:
            pos, stop = min(found)
            self.text = self.text[:pos]
            self.finish_reason, self.stop_reason = "stop", stop

    def add(self, token_id: int, logprob: float, top: list[tuple[int, float]]) -> TokenDelta:
        """Record one sampled token and say what it makes visible (must not be called once finished)."""
        if self.finished:
            raise RuntimeError(f"choice {self.index} already finished ({self.finish_reason})")
        self.token_ids.append(token_id)
        entry = self._entry(token_id, logprob, top) if self._want_logprobs else None
        if entry is not None:
            self.logprobs.append(entry)
        if token_id in self._params.stop_token_ids:
            self.finish_reason, self.stop_reason = "stop", token_id
        elif token_id in self._eos:
            self.finish_reason = "stop"
        else:
            before = len(self.text)
            if token_id not in self._table.hidden:
                self.text += self._decoder.decode(self._table.pieces[token_id])
            if self._params.stop:
                self._cut_at_stop_string(before)
            if not self.finished and len(self.token_ids) >= self._params.max_tokens:
                self.finish_reason = "length"
        if self.finished and not isinstance(self.stop_reason, str):
            self.text += self._decoder.decode(b"", final=True)
        return self._delta(token_id, entry)

    def _delta(self, token_id: int, entry: LogprobEntry | None) -> TokenDelta:
        if not self.finished:
            limit = len(self.text) - held_back(self.text, self._markers)
            if self._parse_tools and (tool_start := self.text.find(TOOL_CALL_START)) >= 0:
                limit = min(limit, tool_start)
            return TokenDelta(self.index, token_id, self._show(limit), entry)
        calls: tuple[ToolCall, ...] = ()
        limit = len(self.text)
        if self._parse_tools:
            self.parsed = parse_tool_calls(self.text)
            calls = self.parsed.tool_calls
            if calls:
                limit = len(self.parsed.content or "")
                self.finish_reason = "tool_calls"
        content = self._show(limit)
        return TokenDelta(self.index, token_id, content, entry, self.finish_reason, self.stop_reason, calls)

    def _show(self, limit: int) -> str:
        if limit <= self._shown:
            return ""
        shown, self._shown = self.text[self._shown : limit], limit
        return shown

    @property
    def content(self) -> str | None:
        """The final message content: text before the tool calls (None if empty) or the whole text."""
        if self.parsed is not None and self.parsed.tool_calls:
            return self.parsed.content
        return self.text

    @property
    def tool_calls(self) -> tuple[ToolCall, ...]:
        """The parsed tool calls of a finished choice (empty when none or not parsed)."""
        return self.parsed.tool_calls if self.parsed is not None else ()
