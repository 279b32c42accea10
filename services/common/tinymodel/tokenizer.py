"""Loading a model directory's tokenizer faithfully, and the bytes each token id stands for.

`load_tokenizer` builds `PreTrainedTokenizerFast` straight from `tokenizer.json`, never through
`AutoTokenizer`: for some model types the auto class rebuilds the pre-tokenizer from the vocabulary
and can split text differently from the file that was trained and saved. Special tokens and the
chat template come from `tokenizer_config.json` / `chat_template.jinja` next to it.

`TokenTable` maps every id to its exact bytes (byte-level BPE: through the byte-to-unicode alphabet),
so text can be decoded incrementally and logprob entries carry OpenAI's `bytes` field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerFast


class ModelLoadError(RuntimeError):
    """A model directory is missing files or holds something we cannot load; the message says which."""


def _token_content(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def load_tokenizer(model_dir: Path) -> PreTrainedTokenizerFast:
    """The tokenizer saved in `model_dir` (tokenizer.json + its config and chat template)."""
    model_dir = Path(model_dir)
    tokenizer_file = model_dir / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise ModelLoadError(f"{model_dir} has no tokenizer.json; save the tokenizer with save_pretrained there")
    config_file = model_dir / "tokenizer_config.json"
    config: dict[str, Any] = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
    kwargs: dict[str, Any] = {}
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        content = _token_content(config.get(name))
        if content:
            kwargs[name] = content
    template_file = model_dir / "chat_template.jinja"
    template = template_file.read_text(encoding="utf-8") if template_file.is_file() else config.get("chat_template")
    return PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_file), chat_template=template, **kwargs)


def bytes_to_unicode() -> dict[int, str]:
    """The byte-level BPE alphabet: each byte 0..255 as a printable character.

    Printable Latin-1 bytes stand for themselves; the others are shifted to code points from 256 up,
    in byte order. This is the alphabet byte-level tokenizers write their vocabularies in.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    shift = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + shift)
            shift += 1
    return mapping


def _is_byte_level(tokenizer: PreTrainedTokenizerFast) -> bool:
    decoder = json.loads(tokenizer.backend_tokenizer.to_str()).get("decoder") or {}
    kinds = [decoder.get("type")] + [d.get("type") for d in decoder.get("decoders", [])]
    return "ByteLevel" in kinds


@dataclass(frozen=True)
class TokenTable:
    """Per token id: its bytes, whether it is hidden from text (special tokens), and its display string."""

    pieces: tuple[bytes, ...]
    hidden: frozenset[int]

    @classmethod
    def build(cls, tokenizer: PreTrainedTokenizerFast, vocab_size: int) -> TokenTable:
        """Table for ids 0..vocab_size-1 (ids the tokenizer does not know are hidden and empty).

        For a tokenizer that is not byte-level (SentencePiece style) a token's bytes are those of its
        decoded text, which can drop a leading space; byte-level BPE (Qwen, Llama 3, GPT-2) is exact.
        """
        added = tokenizer.added_tokens_decoder
        byte_decoder = {c: b for b, c in bytes_to_unicode().items()} if _is_byte_level(tokenizer) else None
        known = len(tokenizer)
        pieces: list[bytes] = []
        hidden: set[int] = set()
        for token_id in range(vocab_size):
            if token_id >= known:
                pieces.append(b"")
                hidden.add(token_id)
                continue
            added_token = added.get(token_id)
            if added_token is not None:
                pieces.append(added_token.content.encode("utf-8"))
                if added_token.special:
                    hidden.add(token_id)
                continue
            token = str(tokenizer.convert_ids_to_tokens(token_id))
            if byte_decoder is not None and all(c in byte_decoder for c in token):
                pieces.append(bytes(byte_decoder[c] for c in token))
            else:
                pieces.append(str(tokenizer.decode([token_id])).encode("utf-8"))
        return cls(pieces=tuple(pieces), hidden=frozenset(hidden))

    def display(self, token_id: int) -> str:
        """The token as a string for logprob entries (invalid UTF-8 shown as U+FFFD)."""
        return self.pieces[token_id].decode("utf-8", errors="replace")
