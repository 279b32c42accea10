"""The tiny default model: a ~1M-parameter Qwen2 causal LM and its byte-level BPE tokenizer, built offline.

Nothing is downloaded. The tokenizer is trained with `tokenizers` on the shipped corpus
(`services.common.tinymodel.corpus`), the weights are drawn from a seeded generator, and both are saved the
standard way (`save_pretrained`: config.json, generation_config.json, model.safetensors, tokenizer
files, chat_template.jinja), so any transformers code can load the result. The same arguments give
byte-identical files, which tests check by hash.

    python -m services.common.tinymodel --out DIR [--seed 0] [--vocab-size 2048] [--hidden 160] [--layers 2]

The weights are random: the model is a fast stand-in for a real LLM and a starting point for
training (`build_tiny_model` takes the sizes a trainer may want to change).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from services.common.tinymodel.chat_template import CHAT_TEMPLATE
from services.common.tinymodel.corpus import corpus_lines

BUILDER_VERSION = 2  # 2: head dim 32 (vLLM's CPU attention supports 32, 64, ...; v1 had 40)
HEAD_DIM = 32
PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (PAD_TOKEN, IM_START, IM_END)
# Plain added tokens: atomic when encoded, but kept in decoded text (the tool-call parser reads them).
TEXT_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
INIT_STD = 0.02
DEFAULT_CACHE_ENV = "ROLLWIRE_CACHE_DIR"


class TinyModelError(RuntimeError):
    """The tiny model could not be built as asked; the message says what to change."""


def train_tokenizer(vocab_size: int) -> Tokenizer:
    """A byte-level BPE tokenizer of exactly `vocab_size` ids trained on the shipped corpus."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(TEXT_TOKENS),
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus_lines(), trainer=trainer)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in TEXT_TOKENS])
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    if size != vocab_size:
        raise TinyModelError(f"the corpus supports {size} tokens, asked for {vocab_size}: use a smaller vocab_size")
    return tokenizer


def _init_weights(model: torch.nn.Module, seed: int) -> None:
    """Draw every parameter from one seeded generator, in name order: N(0, 0.02), zero biases, unit norms."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters(), key=lambda item: item[0]):
            if name.endswith(".bias"):
                param.zero_()
            elif param.dim() == 1:
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=generator, dtype=param.dtype) * INIT_STD)


def tiny_config(
    vocab_size: int, hidden: int, layers: int, max_positions: int, token_ids: dict[str, int]
) -> Qwen2Config:
    """Qwen2 config for the tiny model: heads of 32 dims (hidden / 32 of them, as many KV heads), MLP 3x hidden,
    tied embeddings. vLLM's CPU attention refuses other head sizes than 32, 64, 80, 96, 112, 128, ...
    ("Unsupported CPU attention configuration: head_dim=40"), so the head size is fixed and the
    head count follows the width."""
    if hidden % HEAD_DIM != 0:
        raise TinyModelError(f"hidden must be a multiple of {HEAD_DIM} (the head size vLLM's CPU build supports)")
    return Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // HEAD_DIM,
        num_key_value_heads=hidden // HEAD_DIM,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=token_ids[IM_END],
        pad_token_id=token_ids[PAD_TOKEN],
        dtype="float32",
    )


def build_tiny_model(
    out_dir: Path,
    seed: int = 0,
    vocab_size: int = 2048,
    hidden: int = 160,
    layers: int = 2,
    max_positions: int = 16384,
) -> Path:
    """Build the tokenizer and a randomly initialised model into `out_dir` (created); return it."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    backend = train_tokenizer(vocab_size)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token=IM_END, pad_token=PAD_TOKEN, chat_template=CHAT_TEMPLATE
    )
    token_ids: dict[str, int] = {}
    for token in (*SPECIAL_TOKENS, *TEXT_TOKENS):
        token_id = backend.token_to_id(token)
        if token_id is None:
            raise TinyModelError(f"the trained tokenizer lacks the token {token}")
        token_ids[token] = token_id
    config = tiny_config(vocab_size, hidden, layers, max_positions, token_ids)
    model = Qwen2ForCausalLM(config)
    _init_weights(model, seed)
    model.generation_config.eos_token_id = [token_ids[IM_END], token_ids[PAD_TOKEN]]
    model.generation_config.pad_token_id = token_ids[PAD_TOKEN]
    model.generation_config.bos_token_id = None
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def default_cache_dir() -> Path:
    """Where built models are kept: $ROLLWIRE_CACHE_DIR, else ~/.cache/rollwire/models."""
    configured = os.environ.get(DEFAULT_CACHE_ENV)
    return Path(configured) if configured else Path.home() / ".cache" / "rollwire" / "models"


def tiny_model_dir(cache_dir: Path | None = None, seed: int = 0) -> Path:
    """Where `ensure_tiny_model` keeps the tiny model (built or not)."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return root / f"tiny-qwen2-v{BUILDER_VERSION}-seed{seed}"


def ensure_tiny_model(cache_dir: Path | None = None, seed: int = 0) -> Path:
    """The default tiny model under `cache_dir`, built on first use and reused afterwards.

    The build goes to a temporary sibling directory that is renamed into place, so a directory that
    exists is complete, and two processes racing to build it both end up with the same files.
    """
    target = tiny_model_dir(cache_dir, seed)
    if target.is_dir():
        return target
    return build_dir_atomically(target, lambda staging: build_tiny_model(staging, seed=seed))


def build_dir_atomically(target: Path, build: Callable[[Path], object]) -> Path:
    """`target`, built by `build(staging)` in a temporary sibling directory then renamed into place.

    A directory that exists is therefore complete; when two processes race, the loser's rename
    fails, it finds the winner's copy and uses that.
    """
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".building-", dir=target.parent))
    try:
        build(staging)
        try:
            staging.rename(target)
        except OSError:
            if not target.is_dir():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def file_digest(path: Path) -> str:
    """SHA-256 of a file, hex (used to check that builds are reproducible)."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def main(argv: list[str] | None = None) -> None:
    """CLI: build the tiny model into --out and print its path and parameter count."""
    parser = argparse.ArgumentParser(description="Build Rollwire's tiny default model (no download).")
    parser.add_argument("--out", type=Path, required=True, help="directory to write the model into")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab-size", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=160)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--max-positions", type=int, default=16384)
    args = parser.parse_args(argv)
    out = build_tiny_model(args.out, args.seed, args.vocab_size, args.hidden, args.layers, args.max_positions)
    print(f"built {out} (weights sha256 {file_digest(out / 'model.safetensors')[:16]})")


if __name__ == "__main__":
    main()
