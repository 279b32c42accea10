"""Training throughput on one GPU: `VerlBackend` against the CPU backend's code moved to CUDA.

    python bench/bench_gpu_train.py                  # one H200: Qwen2 ~0.5B, bf16, 4k and 16k sequences
    python bench/bench_gpu_train.py --tiny           # a 2-layer model on the CPU: checks the script end to end

The model has Qwen2-0.5B's architecture (24 layers, hidden 896, vocabulary 151,936, tied
embeddings), built with random weights on the machine (speed does not depend on the values). Each
measured update trains on `--tokens-per-step` tokens of sequences of one length (half prompt,
half sampled), micro-batches of at most one sequence, bf16 compute, gradient checkpointing, one
AdamW step; the first update of each configuration is a warm-up and not timed.

Printed per backend and sequence length: tokens/s (all tokens of the trained sequences) and MFU =
(6·N + 6·L·H·S) · tokens/s / peak, with N the parameter count, L layers, H hidden size, S the
sequence length (causal attention), and the peak dense bf16 rate of the GPU (`--peak-tflops`, 989
for an H100/H200 SXM). Anchor: prime-rl reports about 11.9k tokens/s (MFU 11%) for full
fine-tuning of Qwen3-0.6B on one H100 at 16k. A configuration that fails (out of memory, a missing
package) prints its error and the others still run. Budget: about 10 minutes on one H200.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import transformers

from trainer.core import Sample
from trainer.run.sections import AlgorithmSection, BackendSection


def model_config(tiny: bool) -> transformers.Qwen2Config:
    """Qwen2-0.5B's architecture, or a 2-layer miniature of it for `--tiny`."""
    if tiny:
        return transformers.Qwen2Config(
            vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=32768, tie_word_embeddings=True,
        )  # fmt: skip
    return transformers.Qwen2Config(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, max_position_embeddings=32768, tie_word_embeddings=True,
    )  # fmt: skip


def build_model(directory: Path, config: transformers.Qwen2Config, device: str) -> int:
    """Random weights on the device, saved as a model directory; returns the parameter count."""
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.Qwen2ForCausalLM(config).to(torch.bfloat16)  # type: ignore[arg-type]
    count = sum(p.numel() for p in model.parameters())
    model.save_pretrained(directory)
    del model
    return count


def samples(length: int, total_tokens: int, vocab: int, seed: int) -> list[Sample]:
    """Sequences of `length` tokens, the second half sampled, `total_tokens` in all, token-mean weights."""
    rng = random.Random(seed)
    count = max(total_tokens // length, 1)
    half = length // 2
    out = []
    for i in range(count):
        tokens = [rng.randrange(1, vocab) for _ in range(length)]
        mask = [0] * half + [1] * (length - half)
        out.append(Sample(
            rollout_id=f"r{i}", group_id="g", index=0, tokens=tokens, loss_mask=mask,
            logprobs=[-rng.uniform(8.0, 14.0) if m else 0.0 for m in mask], call_ids=[f"c{i}"],
            response_tokens=length - half, advantage=1.0 if i % 2 else -1.0,
            token_weight=1.0 / (count * (length - half)),
        ))  # fmt: skip
    return out


def measure(backend: object, batch: list[Sample], repeats: int, device: str) -> float:
    """Tokens per second of `backend.update` on `batch` (after one untimed warm-up update)."""
    update = backend.update  # type: ignore[attr-defined]
    update(batch)
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        update(batch)
    if device == "cuda":
        torch.cuda.synchronize()
    return repeats * sum(len(s.tokens) for s in batch) / (time.perf_counter() - start)


def make_backend(kind: str, model_dir: Path, length: int, device: str) -> object:
    """The backend `kind` on the model, one sequence per micro-batch; on a GPU bf16 and gradient checkpointing."""
    algorithm = AlgorithmSection(lr=1e-5, micro_batch_tokens=length)
    gpu = device == "cuda"
    settings = BackendSection(kind="verl" if kind == "verl" else "cpu", dtype="bfloat16" if gpu else "float32",
                              gradient_checkpointing=gpu)  # fmt: skip
    if kind == "verl":
        from trainer.backends.verl import VerlBackend

        return VerlBackend(model_dir, algorithm, seed=0, settings=settings)
    from trainer.backends.cpu import CpuBackend

    return CpuBackend(model_dir, algorithm, seed=0, settings=settings, device=device)


def main() -> None:
    """Measure every (backend, sequence length) pair and print one line each."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model on the CPU (checks the script)")
    parser.add_argument("--lengths", default=None, help="comma-separated sequence lengths (default 4096,16384)")
    parser.add_argument("--tokens-per-step", type=int, default=65536)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--peak-tflops", type=float, default=989.0)
    parser.add_argument("--backends", default="verl,cpu-code-on-cuda")
    args = parser.parse_args()
    device = "cpu" if args.tiny or not torch.cuda.is_available() else "cuda"
    lengths = [int(x) for x in (args.lengths or ("128,512" if args.tiny else "4096,16384")).split(",")]
    tokens = 1024 if args.tiny else args.tokens_per_step
    repeats = 1 if args.tiny else args.repeats
    config = model_config(args.tiny)
    directory = Path(tempfile.mkdtemp(prefix="bench-gpu-train-"))
    params = build_model(directory, config, device)
    gpu = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    dtype = "bf16" if device == "cuda" else "fp32"
    print(f"device {gpu}; model Qwen2 {params / 1e6:.2f}M parameters, {dtype}; {tokens} tokens per update")
    layers, hidden = config.num_hidden_layers, config.hidden_size
    for kind in args.backends.split(","):
        for length in lengths:
            label = f"{kind:>17} seq {length:>6}"
            try:
                backend = make_backend(kind, directory, length, device)
                rate = measure(backend, samples(length, tokens, config.vocab_size, length), repeats, device)
                flops = (6 * params + 6 * layers * hidden * length) * rate
                mfu = flops / (args.peak_tflops * 1e12) if device == "cuda" else float("nan")
                print(f"{label}: {rate:10.0f} tokens/s  MFU {mfu:6.1%}", flush=True)
                close = getattr(backend, "close", None)
                if close is not None:
                    close()
                del backend
            except Exception as exc:
                print(f"{label}: failed: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                traceback.print_exc(limit=3, file=sys.stderr)
            if device == "cuda":
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
