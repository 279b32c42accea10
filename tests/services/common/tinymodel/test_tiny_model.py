"""The tiny default model: reproducible build, tokenizer and chat template, build-once cache."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from services.common.tinymodel.build import (
    IM_END,
    IM_START,
    PAD_TOKEN,
    TEXT_TOKENS,
    build_tiny_model,
    ensure_tiny_model,
    file_digest,
)

TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather of a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


def test_same_seed_gives_byte_identical_files(tiny_model_dir: Path, tmp_path: Path) -> None:
    again = build_tiny_model(tmp_path / "again", seed=0)
    other = build_tiny_model(tmp_path / "other", seed=1)
    for name in ("model.safetensors", "tokenizer.json", "config.json", "chat_template.jinja"):
        assert file_digest(again / name) == file_digest(tiny_model_dir / name), name
    assert file_digest(other / "model.safetensors") != file_digest(tiny_model_dir / "model.safetensors")
    assert file_digest(other / "tokenizer.json") == file_digest(tiny_model_dir / "tokenizer.json")


def test_model_is_a_standard_qwen2_of_about_a_million_parameters(tiny_model_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert config["model_type"] == "qwen2"
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    params = sum(p.numel() for p in model.parameters())
    assert 700_000 <= params <= 1_300_000, params
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([[1, 2, 3]])).logits
    assert logits.shape == (1, 3, config["vocab_size"])
    assert torch.isfinite(logits).all()


def test_tokenizer_special_tokens_and_round_trip(tiny_tokenizer: PreTrainedTokenizerFast) -> None:
    tok = tiny_tokenizer
    assert len(tok) == 2048
    assert tok.eos_token == IM_END and tok.pad_token == PAD_TOKEN
    for token in (IM_START, IM_END, PAD_TOKEN, *TEXT_TOKENS):
        ids = tok.encode(token, add_special_tokens=False)
        assert len(ids) == 1, token
    text = 'Héllo wörld! def f(x):\n    return x * 2  # 12345 {"a": [1, 2]} 日本'
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    # Tool tags are plain added tokens: kept when special tokens are skipped, so the parser sees them.
    ids = tok.encode('<tool_call>\n{"name": "f"}\n</tool_call><|im_end|>', add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=True) == '<tool_call>\n{"name": "f"}\n</tool_call>'


def test_chat_template_renders_chatml_with_tools_and_tool_messages(tiny_tokenizer: PreTrainedTokenizerFast) -> None:
    messages: list[Any] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": '{"celsius": 21}'},
    ]
    text = tiny_tokenizer.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert isinstance(text, str)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert "<tools>\n" + json.dumps(TOOLS[0]) + "\n</tools>" in text
    assert "<|im_start|>user\nWeather in Paris?<|im_end|>\n" in text
    call = '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert call + "<|im_end|>\n" in text
    assert '<|im_start|>tool\n<tool_response>\n{"celsius": 21}\n</tool_response><|im_end|>\n' in text
    assert text.endswith("<|im_start|>assistant\n")
    plain = tiny_tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert plain == "<|im_start|>user\nhi<|im_end|>\n"


def test_ensure_tiny_model_builds_once_and_reuses(tmp_path: Path) -> None:
    first = ensure_tiny_model(tmp_path)
    weights = first / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    second = ensure_tiny_model(tmp_path)
    assert second == first
    assert weights.stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no staging leftovers
