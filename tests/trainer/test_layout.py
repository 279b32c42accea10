"""GPU layouts: `rollwire train --check` and config loading refuse one that cannot fit, naming the numbers;
every example's GPU settings (the TOML of its README's "Run it on GPUs") fit."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

from trainer.layout import check_layout, model_shape
from trainer.run.load import config_from_mapping
from trainer.run.sections import ConfigError

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ["calc", "coding", "search", "sql"]


def merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`over`'s sections over `base`'s, key by key."""
    out = dict(base)
    for key, value in over.items():
        out[key] = merged(out.get(key, {}), value) if isinstance(value, dict) else value
    return out


def gpu_settings(example: str) -> dict[str, Any]:
    """The example's train.toml with its README's GPU TOML block over it."""
    readme = (ROOT / "examples" / example / "README.md").read_text()
    section = readme.split("## Run it on GPUs", 1)[1]
    block = re.search(r"```toml\n(.*?)```", section, re.S)
    assert block, f"{example}: no TOML block under 'Run it on GPUs'"
    base = tomllib.loads((ROOT / "examples" / example / "train.toml").read_text())
    return merged(base, tomllib.loads(block.group(1)))


@pytest.mark.parametrize("example", EXAMPLES)
def test_every_examples_gpu_settings_fit_and_say_which_gpus(example: str) -> None:
    document = gpu_settings(example)
    assert document["backend"]["gpus"] and document["engine"]["gpus"], "which GPUs train and which serve"
    config = config_from_mapping(document, ROOT / "examples" / example)
    lines, problems = check_layout(config)
    print("\n".join([example, *lines]))
    assert not problems
    readme = (ROOT / "examples" / example / "README.md").read_text()
    needed = re.search(r"= ([\d.]+) GB per GPU", lines[2])
    assert needed and f"{needed.group(1)} GB" in readme, f"{example}: the README gives the arithmetic's total"


def test_calc_as_it_was_does_not_fit_and_the_numbers_are_named() -> None:
    """A 1.5B full fine-tune beside vLLM at 0.5 on one 40 GB GPU: about 25 GB of weights, gradients and Adam in 20."""
    document = gpu_settings("calc")
    document["engine"]["gpu_memory_utilization"] = 0.5
    with pytest.raises(ConfigError) as refused:
        config_from_mapping(document, ROOT / "examples" / "calc")
    message = str(refused.value)
    assert "Adam 12.4" in message and "vLLM's share 20.0" in message and "has 20.0 GB" in message


def test_a_32b_full_fine_tune_on_four_gpus_is_refused() -> None:
    document = gpu_settings("coding")
    document["backend"]["lora_rank"] = 0
    with pytest.raises(ConfigError, match=r"Adam 65\.5"):
        config_from_mapping(document, ROOT / "examples" / "coding")


def test_the_shape_comes_from_config_json_when_the_model_is_here(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(
        '{"hidden_size": 896, "num_hidden_layers": 24, "vocab_size": 151936, "num_attention_heads": 14,'
        ' "num_key_value_heads": 2, "intermediate_size": 4864, "tie_word_embeddings": true}'
    )
    shape = model_shape(str(tmp_path / "m"))
    assert shape is not None and shape.params == pytest.approx(0.494e9, rel=0.01)  # Qwen2-0.5B
    assert model_shape(str(tmp_path / "nothing")) is None


def to_toml(document: dict[str, Any], prefix: str = "") -> str:
    """A TOML document of sections whose values are scalars, lists, inline tables (`env`) or subsections."""
    lines, subsections = [], []
    for key, value in document.items():
        if isinstance(value, dict) and key != "env":
            subsections.append((key, value))
        elif isinstance(value, dict):
            lines.append(f"{key} = {{ " + ", ".join(f"{k} = {json.dumps(v)}" for k, v in value.items()) + " }")
        else:
            lines.append(f"{key} = {json.dumps(value)}")
    out = (f"[{prefix}]\n" if prefix else "") + "".join(f"{line}\n" for line in lines)
    for key, value in subsections:
        out += to_toml(value, f"{prefix}.{key}" if prefix else key)
    return out


def test_rollwire_train_check_prints_the_arithmetic_and_exits_2(tmp_path: Path) -> None:
    document = gpu_settings("calc")
    document["engine"]["gpu_memory_utilization"] = 0.5
    path = tmp_path / "calc.toml"
    path.write_text(to_toml(document))
    try:
        done = subprocess.run([sys.executable, "-m", "services.devstack.cli", "train", "--check", str(path)],
                              capture_output=True, text=True, cwd=ROOT, timeout=120)  # fmt: skip
    finally:
        path.unlink()
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Adam 12.4" in done.stdout and "does not fit: training needs" in done.stdout


def test_each_started_replica_sees_its_share_of_engine_gpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`[engine] gpus = [4, 5, 6, 7]`, 2 replicas of tensor parallel 2: the first sees GPUs 4,5, the second 6,7.

    vLLM's Python is a stand-in script that records the devices it was given (vLLM itself
    needs GPUs); it follows `vllm serve`'s argv only in being started with it.
    """
    from services.common.vllm import VllmServeSettings, start_replicas

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    fake = tmp_path / "python"  # vLLM's Python, started with `-m vllm.entrypoints.openai.api_server`
    fake.write_text(f'#!/bin/sh\necho "$CUDA_VISIBLE_DEVICES" >> {tmp_path}/seen\n')
    fake.chmod(0o755)
    settings = VllmServeSettings(executable=str(fake), port=18100, extra_args=["--tensor-parallel-size", "2"])
    started = start_replicas(settings, "m", "policy", 2, tmp_path / "logs", gpus=[4, 5, 6, 7])
    for _, process in started:
        process.wait(timeout=30)
    assert sorted((tmp_path / "seen").read_text().split()) == ["4,5", "6,7"]
