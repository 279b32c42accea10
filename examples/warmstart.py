"""A short supervised warm start of the tiny model on an example's gold conversations.

The tiny default model's weights are random: it would never write a tool call, so RL would have
nothing to reinforce. Each example's builder writes `transcripts.jsonl` (one gold conversation per
line: `{"messages": [...], "tools": [...]}` in OpenAI shape); this fine-tunes the tiny model on
them, with the loss on what the assistant generates only (the quickstart's
`encode_conversation`), so the model learns the chat format, the tool-call syntax and the shape of
an answer. It does not learn to solve the task: that is what a real model brings (see each
example's README for the GPU settings).

    python -m examples.warmstart --transcripts examples/calc/data/transcripts.jsonl --out examples/calc/data/model
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from transformers import Qwen2ForCausalLM

from services.common.tinymodel.build import ensure_tiny_model
from services.common.tinymodel.tokenizer import load_tokenizer
from trainer.quickstart.warmstart import encode_conversation, sft_loss

MAX_TOKENS = 1536  # conversations are cut to this many tokens (the tiny model trains fast on short rows)


def load_transcripts(path: Path) -> list[dict[str, Any]]:
    """The gold conversations of a `transcripts.jsonl` file."""
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]


def encode_rows(tokenizer: Any, transcripts: list[dict[str, Any]]) -> list[tuple[list[int], list[int]]]:
    """Token ids and assistant masks of each conversation, cut to `MAX_TOKENS`."""
    rows = []
    for item in transcripts:
        ids, mask = encode_conversation(tokenizer, item["messages"], item.get("tools") or None)
        if any(mask[:MAX_TOKENS]):
            rows.append((ids[:MAX_TOKENS], mask[:MAX_TOKENS]))
    return rows


def warm_start(
    transcripts: Path,
    out_dir: Path,
    *,
    steps: int = 200,
    batch_size: int = 16,
    lr: float = 2e-3,
    seed: int = 0,
    cache_dir: Path | None = None,
    say: Any = print,
) -> Path:
    """Fine-tune the tiny model (built or found in `cache_dir`) on `transcripts`; save it to `out_dir`."""
    start = time.monotonic()
    base = ensure_tiny_model(cache_dir)
    tokenizer = load_tokenizer(base)
    model = Qwen2ForCausalLM.from_pretrained(base, dtype=torch.float32)
    rows = encode_rows(tokenizer, load_transcripts(transcripts))
    if not rows:
        raise ValueError(f"{transcripts} holds no conversation with an assistant turn")
    torch.manual_seed(seed)
    order = random.Random(seed)
    pad_id = tokenizer.pad_token_id if isinstance(tokenizer.pad_token_id, int) else 0
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    for step in range(1, steps + 1):
        for group in optimizer.param_groups:
            group["lr"] = lr * min(1.0, step / 20)
        loss = sft_loss(model, order.sample(rows, min(batch_size, len(rows))), pad_id)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % 50 == 0 or step == steps:
            say(f"warm start: step {step}/{steps}, loss {loss.item():.3f}")
    model.eval()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (base / name).is_file():
            shutil.copyfile(base / name, out_dir / name)
    say(f"warm start: {len(rows)} conversations, {steps} steps in {time.monotonic() - start:.1f}s -> {out_dir}")
    return out_dir


def main(argv: list[str] | None = None) -> None:
    """CLI: warm-start the tiny model on a transcripts file."""
    parser = argparse.ArgumentParser(description="Warm-start the tiny model on an example's gold conversations.")
    parser.add_argument("--transcripts", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    warm_start(args.transcripts, args.out, steps=args.steps, lr=args.lr, seed=args.seed, cache_dir=args.cache_dir)


if __name__ == "__main__":
    main()
