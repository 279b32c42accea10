"""The quickstart's warm start: a short supervised fine-tune of the tiny model on generated transcripts.

The tiny model's weights are random, so before RL can do anything it must learn the chat format,
the tool-call syntax, and to copy the key into its call and the tool's result into its answer. It
learns them here from conversations of the quickstart task (`trainer.quickstart.task`) rendered
with its own chat template, with the loss on the assistant tokens only, in two phases:

1. skills: the two copies, each in the shortest piece of conversation that holds it, until the
   model reproduces held-out pieces exactly. Copying the key is an induction pattern, learned
   abruptly after a plateau (about 125 steps at lr 1e-3 for seeds 0-2; at 3e-3 it did not form
   in 600), so the phase runs until it is done rather than for a fixed count;
2. conversations: whole conversations with the tools' system turn. In most of them
   (1 - `TOOL_RATE`) the assistant answers straight away with a guess instead of calling the
   tool, and only those "decision" conversations train the first assistant token, so the
   warm-started model calls the tool on roughly `TOOL_RATE` of the tasks and its starting reward
   is low: RL has to raise the rate of tool use.

Everything is seeded (data, initial weights, batch order), so the same seed gives the same model;
the result is cached next to the tiny model and reused.

    python -m trainer.quickstart.warmstart --cache-dir DIR [--seed 0]
"""

from __future__ import annotations

import argparse
import hashlib
import math
import random
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec
import torch
from transformers import PreTrainedTokenizerFast, Qwen2ForCausalLM

from services.common.tinymodel.build import build_dir_atomically, ensure_tiny_model
from services.common.tinymodel.tokenizer import load_tokenizer
from trainer.forward import forward_logits
from trainer.quickstart.task import TOOLS, VALUES, Task, make_tasks, transcript

WARMSTART_VERSION = 1
TOOL_RATE = 0.2


class WarmStartConfig(msgspec.Struct, frozen=True, kw_only=True):
    """How the warm start trains (the defaults are the quickstart's).

    Phase 1 trains on short skill fragments until `target` of the held-out ones are reproduced
    exactly (checked every `check_every` steps, at most `skill_max_steps`); phase 2 trains on whole
    conversations for at least `steps` and until the held-out whole conversations reach `target`
    (at most `max_steps`). One AdamW optimizer throughout: linear warmup to `lr`, constant through
    phase 1, then cosine down to a tenth over phase 2's first `steps`.
    """

    seed: int = 0
    tool_rate: float = TOOL_RATE
    fragments: int = 1024
    skill_batch_size: int = 128
    skill_max_steps: int = 600
    transcripts: int = 512
    skill_transcripts: int = 1536
    batch_size: int = 32
    steps: int = 100
    max_steps: int = 400
    held_out: int = 48
    check_every: int = 25
    target: float = 0.95
    lr: float = 1e-3
    warmup_steps: int = 30
    weight_decay: float = 0.0


class WarmStartReport(msgspec.Struct, frozen=True, kw_only=True):
    """What a warm start did: steps and held-out exact-match accuracy per phase, and the time taken."""

    skill_steps: int
    skill_accuracy: float
    steps: int
    accuracy: float
    seconds: float


Rows = list[tuple[list[int], list[int]]]


def encode_conversation(
    tokenizer: PreTrainedTokenizerFast, messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None = None
) -> tuple[list[int], list[int]]:
    """Token ids of a whole conversation and a mask that is 1 on what the assistant generates.

    Each assistant turn contributes its text and the end-of-turn token (`<|im_end|>`) with mask 1,
    exactly the tokens the engine samples for that turn; the template's glue after it and every
    other turn get mask 0. The conversation is encoded piece by piece at turn boundaries, which
    are special tokens, so the ids equal those of encoding the whole rendered text.
    """

    def render(part: Sequence[dict[str, Any]], generation: bool) -> str:
        text = tokenizer.apply_chat_template(
            list(part),
            tools=tools,  # type: ignore[arg-type]
            tokenize=False,
            add_generation_prompt=generation,
        )
        assert isinstance(text, str)
        return text

    def encode(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    end_id = tokenizer.convert_tokens_to_ids(str(tokenizer.eos_token))
    assert isinstance(end_id, int)
    ids: list[int] = []
    mask: list[int] = []
    done = ""
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = render(messages[:i], True)
        ids += encode(prompt[len(done) :])
        mask += [0] * (len(ids) - len(mask))
        turn = render(messages[: i + 1], False)
        reply = encode(turn[len(prompt) :])
        cut = reply.index(end_id) + 1
        ids += reply
        mask += [1] * cut + [0] * (len(reply) - cut)
        done = turn
    return ids, mask


def _mask_decision(encoded: tuple[list[int], list[int]]) -> tuple[list[int], list[int]]:
    """No loss on the first assistant token: where the model decides to call the tool or answer."""
    ids, mask = encoded
    mask = list(mask)
    mask[mask.index(1)] = 0
    return ids, mask


def skill_fragments(tokenizer: PreTrainedTokenizerFast, tasks: Sequence[Task]) -> Rows:
    """Phase 1 data: the two copying skills, each in the shortest piece of conversation that holds it.

    Key fragments are the question and the tool call (the key is copied from one into the other,
    the decision token untrained); value fragments are the tool's result and the answer (the
    value is copied). A dozen to three dozen tokens each instead of about 260, so both skills are
    learned at a fraction of the cost; the relative positions that matter are those of whole
    conversations.
    """
    rows: Rows = []
    for task in tasks:
        _, question, call, result, answer = transcript(task, use_tool=True, guess="")
        rows.append(_mask_decision(encode_conversation(tokenizer, [question, call])))
        rows.append(encode_conversation(tokenizer, [result, answer]))
    return rows


def warm_transcripts(tokenizer: PreTrainedTokenizerFast, config: WarmStartConfig) -> Rows:
    """Phase 2 data: whole conversations (system turn with the tool), decision transcripts then skill ones.

    Decision transcripts (`config.transcripts`) train every assistant token; a `tool_rate` share
    of them call the tool, the rest answer with a guess. Skill transcripts
    (`config.skill_transcripts`) all call the tool, but the first assistant token, where the
    model decides between calling the tool and answering, has no loss: they teach the call syntax
    and copying the key and the value without moving the decision, which only the decision
    transcripts train (so the warm-started model calls the tool at about `tool_rate`).
    """
    rng = random.Random(config.seed + 1)
    data: Rows = []
    tasks = make_tasks(config.transcripts + config.skill_transcripts, seed=10_000 + config.seed)
    for i, task in enumerate(tasks):
        if i < config.transcripts:
            use_tool = rng.random() < config.tool_rate
            messages = transcript(task, use_tool=use_tool, guess=rng.choice(VALUES))
            data.append(encode_conversation(tokenizer, messages, TOOLS))
        else:
            data.append(
                _mask_decision(encode_conversation(tokenizer, transcript(task, use_tool=True, guess=""), TOOLS))
            )
    return data


def _batch(rows: Sequence[tuple[list[int], list[int]]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids [B, T], attention mask [B, T] and labels [B, T] (-100 where there is no loss)."""
    length = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    attention = torch.zeros((len(rows), length), dtype=torch.long)
    labels = torch.full((len(rows), length), -100, dtype=torch.long)
    for r, (ids, mask) in enumerate(rows):
        input_ids[r, : len(ids)] = torch.tensor(ids)
        attention[r, : len(ids)] = 1
        labels[r, : len(ids)] = torch.tensor([t if m else -100 for t, m in zip(ids, mask, strict=True)])
    return input_ids, attention, labels


def sft_loss(model: Qwen2ForCausalLM, rows: Sequence[tuple[list[int], list[int]]], pad_id: int) -> torch.Tensor:
    """Mean next-token loss over the masked tokens of `rows`.

    Every transcript opens with the same system turn (the tool's description: most of its
    tokens), which `forward_logits` runs once for the whole batch.
    """
    input_ids, attention, labels = _batch(rows, pad_id)  # [B, T] each
    logits = forward_logits(model, input_ids, attention)  # [B, T, V]
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1), ignore_index=-100
    )


@torch.no_grad()
def exact_match(model: Qwen2ForCausalLM, rows: Rows, pad_id: int) -> float:
    """The share of rows whose every masked token is the model's greedy next-token choice."""
    was_training = model.training
    model.eval()
    input_ids, attention, labels = _batch(rows, pad_id)
    predicted = forward_logits(model, input_ids, attention)[:, :-1].argmax(-1)  # [B, T-1]
    targets = labels[:, 1:]  # [B, T-1]
    right = ((predicted == targets) | (targets == -100)).all(dim=1)  # [B]
    model.train(was_training)
    return float(right.float().mean())


class _Trainer:
    """One optimizer and learning-rate schedule over both phases (see `WarmStartConfig`)."""

    def __init__(self, model: Qwen2ForCausalLM, config: WarmStartConfig, pad_id: int) -> None:
        self.model = model
        self.config = config
        self.pad_id = pad_id
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
        self.order = random.Random(config.seed + 2)
        self.step = 0

    def train_step(self, rows: Rows, batch_size: int, lr_scale: float) -> float:
        for group in self.optimizer.param_groups:
            group["lr"] = self.config.lr * lr_scale * min(1.0, (self.step + 1) / self.config.warmup_steps)
        loss = sft_loss(self.model, self.order.sample(rows, batch_size), self.pad_id)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.step += 1
        return loss.item()

    def phase(
        self,
        rows: Rows,
        held_out: Rows,
        batch_size: int,
        min_steps: int,
        max_steps: int,
        lr_scale: Callable[[int], float],
        progress: Callable[[str], None] | None,
        name: str,
    ) -> tuple[int, float]:
        """Train until `min_steps` are done and the held-out rows reach the target, or `max_steps`."""
        accuracy = 0.0
        for step in range(1, max_steps + 1):
            loss = self.train_step(rows, batch_size, lr_scale(step))
            if step % self.config.check_every == 0 or step == max_steps:
                accuracy = exact_match(self.model, held_out, self.pad_id)
                if progress is not None:
                    progress(f"{name}: step {step}, loss {loss:.3f}, held-out exact {accuracy:.2f}")
                if step >= min_steps and accuracy >= self.config.target:
                    return step, accuracy
        return max_steps, accuracy


def supervised_finetune(
    model: Qwen2ForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    config: WarmStartConfig,
    progress: Callable[[str], None] | None = None,
) -> WarmStartReport:
    """Run both phases on `model` in place (see `WarmStartConfig`); returns what they did."""
    start = time.monotonic()
    torch.manual_seed(config.seed)
    pad_id = tokenizer.pad_token_id if isinstance(tokenizer.pad_token_id, int) else 0
    trainer = _Trainer(model, config, pad_id)
    model.train()
    fragments = skill_fragments(tokenizer, make_tasks(config.fragments, seed=20_000 + config.seed))
    held_fragments = skill_fragments(tokenizer, make_tasks(config.held_out, seed=30_000 + config.seed))
    skill_steps, skill_accuracy = trainer.phase(
        fragments,
        held_fragments,
        config.skill_batch_size,
        1,
        config.skill_max_steps,
        lambda _: 1.0,
        progress,
        "warm start 1/2 (skills)",
    )
    held = [
        _mask_decision(encode_conversation(tokenizer, transcript(task, use_tool=True, guess=""), TOOLS))
        for task in make_tasks(config.held_out, seed=40_000 + config.seed)
    ]

    def cosine(step: int) -> float:
        done = min(1.0, step / config.steps)
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * done))

    steps, accuracy = trainer.phase(
        warm_transcripts(tokenizer, config),
        held,
        config.batch_size,
        config.steps,
        config.max_steps,
        cosine,
        progress,
        "warm start 2/2 (conversations)",
    )
    model.eval()
    return WarmStartReport(
        skill_steps=skill_steps,
        skill_accuracy=skill_accuracy,
        steps=steps,
        accuracy=accuracy,
        seconds=time.monotonic() - start,
    )


def build_warm_model(
    base_dir: Path, out_dir: Path, config: WarmStartConfig, progress: Callable[[str], None] | None = None
) -> WarmStartReport:
    """Fine-tune the model in `base_dir` and save it with its tokenizer (and `warmstart.json`) to `out_dir`."""
    tokenizer = load_tokenizer(base_dir)
    model = Qwen2ForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    report = supervised_finetune(model, tokenizer, config, progress)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (base_dir / name).is_file():
            shutil.copyfile(base_dir / name, out_dir / name)
    (out_dir / "warmstart.json").write_bytes(msgspec.json.encode({"config": config, "report": report}))
    return report


def warm_model_name(base_name: str, config: WarmStartConfig) -> str:
    """The cache directory name of a warm start: the default config has a short stable name."""
    name = f"{base_name}-quickstart-v{WARMSTART_VERSION}-seed{config.seed}"
    if msgspec.structs.replace(config, seed=0) != WarmStartConfig():
        name += "-" + hashlib.sha256(msgspec.json.encode(config)).hexdigest()[:10]
    return name


def ensure_warm_model(
    cache_dir: Path | None = None,
    config: WarmStartConfig = WarmStartConfig(),
    progress: Callable[[str], None] | None = None,
) -> Path:
    """The warm-started quickstart model under `cache_dir`, built (tiny model first) on first use.

    Built in a temporary sibling directory renamed into place, so a directory that exists is complete.
    """
    base = ensure_tiny_model(cache_dir)
    target = base.parent / warm_model_name(base.name, config)
    if target.is_dir():
        return target
    return build_dir_atomically(target, lambda staging: build_warm_model(base, staging, config, progress))


def main(argv: list[str] | None = None) -> None:
    """CLI: build (or find) the warm-started model and print its path and the time taken."""
    parser = argparse.ArgumentParser(description="Build the quickstart's warm-started tiny model.")
    parser.add_argument("--cache-dir", type=Path, default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    start = time.monotonic()
    path = ensure_warm_model(args.cache_dir, WarmStartConfig(seed=args.seed), progress=print)
    print(f"{path} ({time.monotonic() - start:.1f}s)")


if __name__ == "__main__":
    main()
