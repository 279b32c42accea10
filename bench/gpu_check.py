"""Every check that needs a GPU, in one run that fits in 10 minutes of device time (`bench/gpu_check.sh`).

    python bench/gpu_check.py --out DIR             # one H200: Qwen2-0.5B shape, bf16 (about 5 minutes)
    python bench/gpu_check.py --cpu-smoke --out DIR # tiny sizes on the CPU: proves the script runs end to end

1. Throughput: every backend (`VerlBackend`, the CPU backend's code on CUDA) at sequences of 4,096
   and 16,384 tokens, 65,536 tokens per update, packed micro-batches of 16,384 tokens, bf16,
   gradient checkpointing; tokens/s and MFU = (6·N + 6·L·H·S) · tokens/s / peak (989 TFLOP/s dense
   bf16 for an H100/H200 SXM), as `bench/bench_gpu_train.py` defines them.
2. Equality: the two backends' loss and gradients on the same packed bf16 micro-batch (varied
   lengths), and in float32 on the same GPU (there they must agree to 1e-4).
3. The quickstart on CUDA (`rollwire quickstart --backend verl`, a few steps), its last lines.

Each part prints its lines as it goes and a failing part does not stop the others; `DIR/gpu_check.json`
holds every figure.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from bench_gpu_train import build_model, model_config, samples  # noqa: E402

from trainer.core import Sample  # noqa: E402
from trainer.run.sections import AlgorithmSection, BackendSection, Dtype, LossSection  # noqa: E402

RESULTS: dict[str, Any] = {}


def say(line: str) -> None:
    """Print a line now (the device tool keeps the output's tail)."""
    print(line, flush=True)


def make(kind: str, model_dir: Path, *, micro: int, device: str, dtype: Dtype, kl: float = 0.0) -> Any:
    """A backend (`verl`, or `cpu`: the CPU backend's code on `device`), packed micro-batches of `micro` tokens."""
    algorithm = AlgorithmSection(lr=1e-5, micro_batch_tokens=micro, loss=LossSection(kl_coef=kl))
    settings = BackendSection(kind="verl" if kind == "verl" else "cpu", dtype=dtype,
                              gradient_checkpointing=device == "cuda", threads=None)  # fmt: skip
    if kind == "verl":
        from trainer.backends.verl import VerlBackend

        return VerlBackend(model_dir, algorithm, seed=0, settings=settings)
    from trainer.backends.cpu import CpuBackend

    return CpuBackend(model_dir, algorithm, seed=0, settings=settings, device=device)


def timed_updates(backend: Any, batch: list[Sample], repeats: int, device: str) -> float:
    """Tokens/s of `backend.update(batch)` over `repeats` updates after one untimed warm-up."""
    backend.update(batch)
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        backend.update(batch)
    if device == "cuda":
        torch.cuda.synchronize()
    return repeats * sum(len(s.tokens) for s in batch) / (time.perf_counter() - start)


def throughput(args: argparse.Namespace, model_dir: Path, params: int, config: Any, device: str) -> None:
    """Part 1: the table."""
    dtype: Dtype = "bfloat16" if device == "cuda" else "float32"
    table = RESULTS.setdefault("throughput", [])
    for kind in args.backends.split(","):
        for length in args.lengths:
            label = f"{kind:>4} seq {length:>6}"
            try:
                backend = make(kind, model_dir, micro=max(length, args.micro_tokens), device=device, dtype=dtype)
                rate = timed_updates(backend, samples(length, args.tokens, config.vocab_size, length), args.repeats,
                                     device)  # fmt: skip
                flops = (6 * params + 6 * config.num_hidden_layers * config.hidden_size * length) * rate
                mfu = flops / (args.peak_tflops * 1e12) if device == "cuda" else float("nan")
                peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else 0.0
                say(f"throughput {label}: {rate:10.0f} tokens/s  MFU {mfu:6.1%}  peak memory {peak:5.1f} GiB")
                table.append({"backend": kind, "seq": length, "tokens_per_s": rate, "mfu": mfu, "peak_gib": peak})
                getattr(backend, "close", lambda: None)()
                del backend
            except Exception as exc:
                say(f"throughput {label}: failed: {type(exc).__name__}: {str(exc)[:300]}")
                traceback.print_exc(limit=4)
            if device == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()


def varied(vocab: int, total: int, seed: int = 1) -> list[Sample]:
    """Samples of varied lengths (a quarter prompt), `total` tokens at most, token-mean weights: one packed
    micro-batch. Behaviour logprobs near the random model's (about -log V), so ratios stay inside the clip
    range and the gradient is not zero; temperatures 0.7 / 1.0 and top_p off / 0.95 vary by sample."""
    rng = random.Random(seed)
    lengths: list[int] = []
    while sum(lengths) < total * 0.9:
        lengths.append(rng.randint(total // 64, total // 6))
    lengths[-1] -= max(0, sum(lengths) - total)
    sampled = sum(n - n // 4 for n in lengths)
    near = -math.log(vocab)
    out = []
    for i, n in enumerate(lengths):
        mask = [0] * (n // 4) + [1] * (n - n // 4)
        out.append(Sample(
            rollout_id=f"r{i}", group_id="g", index=0, tokens=[rng.randrange(1, vocab) for _ in range(n)],
            loss_mask=mask, logprobs=[near + rng.uniform(-0.2, 0.2) if m else 0.0 for m in mask],
            call_ids=[f"c{i}"], response_tokens=n - n // 4, advantage=1.0 if i % 2 else -1.0,
            token_weight=1.0 / sampled, temperature=rng.choice([0.7, 1.0]), top_p=rng.choice([None, 0.95]),
        ))  # fmt: skip
    return out


def compare(model_dir: Path, batch: list[Sample], device: str, dtype: Dtype, kl: float) -> dict[str, float]:
    """Both backends' loss and gradients on one packed micro-batch: relative differences."""
    micro = sum(len(s.tokens) for s in batch)
    cpu = make("cpu", model_dir, micro=micro, device=device, dtype=dtype, kl=kl)
    cpu_loss, cpu_grads = cpu.loss_and_gradients(batch)
    cpu_grads = {k: v.float().cpu() for k, v in cpu_grads.items()}
    del cpu
    verl = make("verl", model_dir, micro=micro, device=device, dtype=dtype, kl=kl)
    verl_loss, verl_grads = verl.loss_and_gradients(batch)
    verl.close()
    rel = []
    for name, grad in cpu_grads.items():
        if name in verl_grads:
            rel.append(float((verl_grads[name].float().cpu() - grad).norm() / max(float(grad.norm()), 1e-12)))
    rel.sort()
    nan = float("nan")
    return {"loss_cpu": cpu_loss, "loss_verl": verl_loss,
            "loss_rel": abs(verl_loss - cpu_loss) / max(abs(cpu_loss), 1e-12),
            "grad_rel_median": rel[len(rel) // 2] if rel else nan, "grad_rel_max": rel[-1] if rel else nan,
            "grad_norm": sum(float(g.norm()) ** 2 for g in cpu_grads.values()) ** 0.5,
            "tensors": len(rel), "tokens": micro}  # fmt: skip


def equality(args: argparse.Namespace, model_dir: Path, small_dir: Path, config: Any, small: Any, device: str) -> None:
    """Part 2: bf16 on the benchmark's model, float32 on a small one (strict)."""
    half: Dtype = "bfloat16" if device == "cuda" else "float32"
    checks: dict[str, tuple[Path, Any, Dtype, float, int]] = {
        "bf16": (model_dir, config, half, 0.05, args.equal_tokens),
        "fp32": (small_dir, small, "float32", 1e-4, 2048),
    }
    for name, (directory, shape, dtype, tolerance, tokens) in checks.items():
        try:
            result = compare(
                directory, varied(shape.vocab_size, tokens), device, dtype, kl=0.05 if name == "fp32" else 0.0
            )
            ok = result["loss_rel"] < tolerance and result["grad_rel_median"] < tolerance
            result["tolerance"], result["ok"] = tolerance, ok
            RESULTS.setdefault("equality", {})[name] = result
            say(f"equality {name} ({result['tokens']} packed tokens, {dtype}): loss cpu {result['loss_cpu']:.6g} verl "
                f"{result['loss_verl']:.6g} (rel {result['loss_rel']:.2e}); gradients rel median "
                f"{result['grad_rel_median']:.2e} max {result['grad_rel_max']:.2e} over {result['tensors']} tensors "
                f"(gradient norm {result['grad_norm']:.3g}): "
                f"{'OK' if ok else 'DIFFERENT'} (tolerance {tolerance:g})")  # fmt: skip
        except Exception as exc:
            say(f"equality {name}: failed: {type(exc).__name__}: {str(exc)[:300]}")
            traceback.print_exc(limit=4)
        if device == "cuda":
            torch.cuda.empty_cache()


def quickstart(args: argparse.Namespace, out: Path, device: str) -> None:
    """Part 3: `rollwire quickstart` training with the verl backend (on CUDA where there is one)."""
    backend = "verl" if device == "cuda" else "cpu"
    argv = [sys.executable, "-m", "services.devstack.cli", "quickstart", "--steps", str(args.quickstart_steps),
            "--tasks-per-step", "4", "--rollouts-per-task", "2", "--backend", backend, "--heldout-tasks", "0",
            "--data-dir", str(out / "qs-data"), "--out", str(out / "qs-runs")]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    start = time.monotonic()
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=args.quickstart_timeout, env=env, cwd=ROOT)
        code, text = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as exc:
        code, text = (
            124,
            (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else str(exc.stdout or ""),
        )
    (out / "quickstart.log").write_text(text)
    seconds = time.monotonic() - start
    RESULTS["quickstart"] = {"backend": backend, "exit": code, "seconds": seconds, "tail": text.splitlines()[-8:]}
    say(f"quickstart ({backend}, {args.quickstart_steps} steps): exit {code} in {seconds:.0f} s; last lines:")
    for line in text.splitlines()[-8:]:
        say(f"  {line}")


def main() -> None:
    """Run the three parts and write `gpu_check.json` in `--out`."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on the CPU (checks the script)")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", tempfile.mkdtemp())))
    parser.add_argument("--backends", default="verl,cpu")
    parser.add_argument("--parts", default="throughput,equality,quickstart")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--peak-tflops", type=float, default=989.0)
    parser.add_argument("--quickstart-steps", type=int, default=3)
    parser.add_argument("--quickstart-timeout", type=int, default=200)
    args = parser.parse_args()
    device = "cpu" if args.cpu_smoke or not torch.cuda.is_available() else "cuda"
    args.lengths = [128, 512] if args.cpu_smoke else [4096, 16384]
    args.tokens = 1024 if args.cpu_smoke else 65536
    args.micro_tokens = 512 if args.cpu_smoke else 16384
    args.equal_tokens = 1024 if args.cpu_smoke else 16384
    args.repeats = 1 if args.cpu_smoke else args.repeats
    args.quickstart_steps = 1 if args.cpu_smoke else args.quickstart_steps
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    config, small = model_config(args.cpu_smoke), model_config(True)
    params = build_model(work / "model", config, device)
    build_model(work / "small", small, device)
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    say(f"device {name}; torch {torch.__version__}; model Qwen2 {params / 1e6:.1f}M parameters; "
        f"flash-attn {'yes' if _has('flash_attn') else 'no (sdpa)'}")  # fmt: skip
    RESULTS.update(device=name, params=params, torch=torch.__version__, smoke=args.cpu_smoke)
    parts = args.parts.split(",")
    if "throughput" in parts:
        throughput(args, work / "model", params, config, device)
    if "equality" in parts:
        equality(args, work / "model", work / "small", config, small, device)
    if "quickstart" in parts:
        quickstart(args, args.out, device)
    (args.out / "gpu_check.json").write_text(json.dumps(RESULTS, indent=2, default=str))
    say(f"results: {args.out / 'gpu_check.json'}")


def _has(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return False
    return True


if __name__ == "__main__":
    main()
