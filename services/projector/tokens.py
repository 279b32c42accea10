"""Decoding token ids to text for the viewer, when the projector knows the model's tokenizer.

Tokenizers are given as `--tokenizer [MODEL=]SOURCE` (repeatable): SOURCE is a `tokenizer.json`
file, a directory holding one, or a Hugging Face repo id already in the local cache (nothing is
downloaded). A spec without `MODEL=` is the default for every model not named otherwise.
Per-token pieces of the response are decoded one id at a time, so the viewer can shade each token
by its logprob.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, NamedTuple


class TokenizerError(ValueError):
    """A `--tokenizer` spec that cannot be loaded; the message says which and why."""


class Decoded(NamedTuple):
    """The text of a call's prompt and response, and the response's per-token pieces."""

    prompt_text: str
    response_text: str
    response_pieces: list[str]


def _load_one(source: str) -> Any:
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise TokenizerError("decoding needs the `tokenizers` package: pip install tokenizers") from None
    path = Path(source).expanduser()
    if path.is_dir():
        path = path / "tokenizer.json"
    if path.is_file():
        try:
            return Tokenizer.from_file(str(path))
        except Exception as exc:
            raise TokenizerError(f"cannot load tokenizer {path}: {exc}") from None
    cached: object = None
    with contextlib.suppress(Exception):  # not installed, or not a valid repo id
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(source, "tokenizer.json")
    if isinstance(cached, str):
        return Tokenizer.from_file(cached)
    raise TokenizerError(
        f"tokenizer {source!r} is neither a tokenizer.json, a directory holding one, nor a cached Hugging Face repo"
    )


class Detokenizer:
    """Maps model names to tokenizers and decodes a call's ids."""

    def __init__(self, by_model: dict[str, Any] | None = None, default: Any = None) -> None:
        self.by_model = by_model or {}
        self.default = default

    @classmethod
    def from_specs(cls, specs: list[str]) -> Detokenizer:
        """Load every `[MODEL=]SOURCE` spec (see the module docstring)."""
        by_model: dict[str, Any] = {}
        default = None
        for spec in specs:
            model, sep, source = spec.partition("=")
            if sep and model and not Path(spec).exists():
                by_model[model] = _load_one(source)
            else:
                default = _load_one(spec)
        return cls(by_model, default)

    def __bool__(self) -> bool:
        return bool(self.by_model) or self.default is not None

    def decode(self, model: str, prompt_ids: list[int], response_ids: list[int]) -> Decoded | None:
        """The decoded texts for a call of `model`, or None when its tokenizer is unknown."""
        tokenizer = self.by_model.get(model, self.default)
        if tokenizer is None:
            return None
        try:
            prompt = tokenizer.decode(prompt_ids, skip_special_tokens=False)
            response = tokenizer.decode(response_ids, skip_special_tokens=False)
            pieces = tokenizer.decode_batch([[i] for i in response_ids], skip_special_tokens=False)
        except Exception:  # ids outside the vocabulary: the text is unknown, the ids still stored
            return None
        return Decoded(prompt, response, list(pieces))
