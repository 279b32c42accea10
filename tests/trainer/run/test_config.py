"""`rollwire train` configs: the example parses, and every mistake names its key and the allowed values."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, cast

import msgspec
import pytest

from schemas import RunStarted
from schemas.runs import AttemptBudget, CallLimits, RunSpec
from services.common.eventstore import StoredEvent
from services.gateway.state import GatewayState
from trainer.run.load import config_from_mapping, config_to_mapping, load_config
from trainer.run.sections import ConfigError
from trainer.run.spec import run_spec

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "quickstart" / "train.toml"


def minimal(**sections: dict[str, Any]) -> dict[str, Any]:
    base: dict[str, Any] = {"data": {"path": "tasks.jsonl"}, "agent": {"command": ["agent"]}, "model": {"path": "m"}}
    for name, values in sections.items():
        base.setdefault(name.rstrip("_"), {}).update(values)
    return base


def test_example_config_loads_with_paths_resolved_against_its_directory() -> None:
    config = load_config(EXAMPLE)
    assert config.run.mode == "sync"
    assert Path(config.data.path) == EXAMPLE.parent / "tasks.jsonl"
    assert Path(config.stack.data_dir).resolve() == (EXAMPLE.parent / "../../.rollwire").resolve()
    assert config.agent.command[0] == sys.executable  # a leading `python` is this interpreter
    assert config.adapter.norm == "token-mean"
    assert config.min_groups() == 6


def test_defaults_and_round_trip() -> None:
    config = config_from_mapping(minimal())
    assert config.run.steps == 20 and config.run.mode == "sync"
    assert config.min_groups() == config.data.tasks_per_step
    assert config_from_mapping(config_to_mapping(config)) == config


@pytest.mark.parametrize(
    ("sections", "expected"),
    [
        ({"run": {"mode": "fast"}}, "run.mode: Invalid enum value 'fast'; choose one of: sync, async"),
        ({"run": {"stepz": 3}}, "run.stepz: unknown key in [run]; the keys are: name, out_dir"),
        ({"backend": {"kind": "tpu"}}, "backend.kind: Invalid enum value 'tpu'; choose one of: cpu, verl"),
        ({"engine": {"kind": "embedded"}}, "engine.kind: Invalid enum value 'embedded'; choose one of: vllm; Rollwire"),
        ({"backend": {"lora_rank": -1}}, "backend.lora_rank: must be >= 0"),
        ({"backend": {"lora_adapters": {"planner": "p"}}}, "backend.lora_adapters: needs backend.lora_rank > 0"),
        ({"backend": {"dtype": "fp8"}}, "backend.dtype: Invalid enum value 'fp8'; choose one of: float32, bfloat16"),
        ({"algorithm": {"adapter": {"norm": "x"}}}, "algorithm.adapter: norm = 'x' is not allowed; choose one of"),
        ({"algorithm": {"loss": {"clip_low": "x"}}}, "algorithm.loss.clip_low: Expected `float`, got `str`"),
        ({"algorithm": {"loss": {"ratio_cap": 0.5}}}, "algorithm.loss.ratio_cap: must be > 1"),
        ({"algorithm": {"lr": 0}}, "algorithm.lr: must be positive"),
        ({"async_": {"min_groups": 99}}, "async.min_groups: must be between 1 and async.max_groups_in_flight"),
        ({"async_": {"max_groups_in_flight": 2}}, "async.max_groups_in_flight: must be at least data.tasks_per_step"),
        ({"data": {"rollouts_per_task": 0}}, "data.rollouts_per_task: must be at least 1"),
        ({"agent": {"command": []}}, "agent.command: must name the program to run"),
        ({"bogus": {"x": 1}}, "bogus: unknown section in the top level; the sections are: data, agent, model"),
    ],
)
def test_errors_name_the_key_and_the_allowed_values(sections: dict[str, Any], expected: str) -> None:
    with pytest.raises(ConfigError) as raised:
        config_from_mapping(minimal(**sections))
    assert str(raised.value).startswith(expected), str(raised.value)


def test_missing_required_key_and_bad_files(tmp_path: Path) -> None:
    mapping = minimal()
    del mapping["data"]["path"]
    with pytest.raises(ConfigError, match=r"^data.path: required but missing"):
        config_from_mapping(mapping)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[run\nname = 1")
    with pytest.raises(ConfigError, match="is not valid TOML"):
        load_config(bad)
    wrong = tmp_path / "wrong.toml"
    wrong.write_text('[data]\npath = "t.jsonl"\n[agent]\ncommand = ["a"]\n[model]\npath = "m"\n[run]\nmode = "x"\n')
    with pytest.raises(ConfigError, match=r"wrong.toml: run.mode: .*choose one of: sync, async"):
        load_config(wrong)


def test_the_realmodel_config_prepares_its_model_and_validates_before_training() -> None:
    config = load_config(EXAMPLE.parents[1] / "realmodel" / "train.toml")
    here = str(EXAMPLE.parents[1] / "realmodel")
    assert config.run.prepare == [sys.executable, f"{here}/prepare.py"]  # `python` and {config_dir} read
    assert config.model.path == str(Path.home() / ".cache/rollwire/models/smollm2-135m-instruct")
    assert config.validation is not None and config.validation.at_start
    assert config.engine.kind == "vllm" and config.model.prompt_mode == "continuous"


def test_train_runs_the_prepare_command_first_and_stops_when_it_fails(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from services.devstack.cli import app

    config = tmp_path / "train.toml"
    mark = tmp_path / "prepared"
    config.write_text(
        f'[run]\nprepare = ["sh", "-c", "touch {mark}; exit 3"]\n[data]\npath = "t.jsonl"\n'
        '[agent]\ncommand = ["agent"]\n[model]\npath = "m"\n[stack]\nembedded = false\n'
    )
    result = CliRunner().invoke(app, ["train", str(config)])
    assert mark.exists() and result.exit_code == 1
    assert "run.prepare" in result.output and "exited with 3" in result.output


def test_every_run_spec_field_of_agent_can_be_set_in_train_toml_and_reaches_the_run(tmp_path: Path) -> None:
    """`[agent]` is the run spec's `AgentSpec`: budget, limits and model aliases set in `train.toml`
    are in the spec the trainer declares (`POST /api/runs`), and the gateway checks calls against them."""
    (tmp_path / "train.toml").write_text(
        '[data]\npath = "t.jsonl"\n[model]\npath = "m"\nprompt_mode = "continuous"\n'
        '[agent]\ncommand = ["python", "a.py"]\nmodel_aliases = {"claude-sonnet-4-5" = "policy"}\n'
        "[agent.budget]\ncalls = 7\ntokens = 5000\n[agent.limits]\nmax_n = 2\n"
    )
    config = load_config(tmp_path / "train.toml")
    assert config.agent.concurrency == RunSpec(run_id="x").concurrency == 8  # one default, the contract's
    body = msgspec.json.encode(msgspec.to_builtins(run_spec(config, "r1")))  # what the trainer posts
    spec = msgspec.json.decode(body, type=RunSpec)  # what the registry reads and records
    assert spec.budget == AttemptBudget(calls=7, tokens=5000) and spec.limits == CallLimits(max_n=2)
    assert spec.model_aliases == {"claude-sonnet-4-5": "policy"} and spec.prompt_mode == "continuous"
    state = GatewayState(cast(Any, None))  # applying an event reads no store
    state.apply(StoredEvent(seq=1, subject="rl.r1.run", event=RunStarted(run_id="r1", spec=spec)))
    assert state.spec("r1").budget.calls == 7 and state.model_alias("r1", "claude-sonnet-4-5") == "policy"
    with pytest.raises(ConfigError, match=r"agent\.budget\.calls"):
        config_from_mapping(minimal(agent={"command": ["a"], "budget": {"calls": 0}}))
