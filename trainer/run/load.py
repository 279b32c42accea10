"""Reading `train.toml` into a checked `TrainConfig` (`load_config`), and back to plain data.

A mistake is a `ConfigError` naming the key (`algorithm.adapter.norm`) and, for a choice, the
allowed values; unknown keys are errors too, so a typo never silently falls back to a default.
Relative paths are resolved against the config file's directory; a leading `python` in a command
is the Python running the trainer, `{config_dir}` the config file's directory.
"""

from __future__ import annotations

import os
import re
import sys
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, get_args

import msgspec

from trainer.run.checks import check_gpu_layout, check_settings
from trainer.run.sections import AVAILABLE_BACKENDS, AgentSection, ConfigError, TrainConfig


def _choices(kind: Any) -> tuple[str, ...] | None:
    """The allowed strings of a Literal field type (or of a Literal inside an Optional)."""
    args = get_args(kind)
    if args and all(isinstance(a, str) for a in args):
        return args
    if len(args) == 1:  # list[Literal[...]]
        return _choices(args[0])
    return None


REMOVED_ENGINE = (
    'Rollwire\'s own CPU engine ("embedded") was removed: vLLM serves on CPUs too (`rollwire vllm install`); '
    'set engine.kind = "vllm" or leave it out'
)


def _decode_error(exc: msgspec.ValidationError) -> ConfigError:
    """msgspec's `... - at $.algorithm.loss.clip_low` as `algorithm.loss.clip_low: ...`, naming allowed values."""
    text = str(exc)
    message, _, where = text.rpartition(" - at `$")
    if not message:
        message, where = text, ""
    section = where.rstrip("`").lstrip(".")
    unknown = re.fullmatch(r"Object contains unknown field `(.+)`", message)
    if unknown:
        keys = ", ".join(f.encode_name for f in msgspec.structs.fields(_struct_at(section)))
        where_text = f"[{section}]" if section else "the top level"
        kind = "key" if section else "section"
        key = _join(section, unknown.group(1))
        return ConfigError(f"{key}: unknown {kind} in {where_text}; the {kind}s are: {keys}")
    missing = re.fullmatch(r"Object missing required field `(.+)`", message)
    if missing:
        return ConfigError(f"{_join(section, missing.group(1))}: required but missing")
    allowed = _allowed_for(section)
    suffix = f"; choose one of: {', '.join(allowed)}" if allowed else ""
    if section == "engine.kind" and "'embedded'" in message:
        suffix += f"; {REMOVED_ENGINE}"
    return ConfigError(f"{section}: {message}{suffix}")


def _join(section: str, key: str) -> str:
    """`section.key`, or `key` at the top level."""
    return f"{section}.{key}" if section else key


def _struct_at(section: str) -> Any:
    """The Struct type of a dotted section (`algorithm.loss`), or TrainConfig for the top level."""
    struct: Any = TrainConfig
    for part in filter(None, section.split(".")):
        struct = {f.encode_name: f.type for f in msgspec.structs.fields(struct)}[part]
    return struct


def _allowed_for(key: str) -> tuple[str, ...] | None:
    """The allowed values of a choice setting, looked up by its dotted key."""
    if key == "backend.kind":
        return AVAILABLE_BACKENDS
    section, _, name = re.sub(r"\[\d+\]$", "", key).rpartition(".")
    try:
        struct = _struct_at(section)
        fields = {f.encode_name: f.type for f in msgspec.structs.fields(struct)}
    except (KeyError, TypeError):
        return None
    return _choices(fields.get(name))


def _resolve(base: Path, value: str) -> str:
    """`value` (`~` expanded) as a path, relative ones against `base`."""
    path = Path(os.path.expanduser(value))
    return str(path if path.is_absolute() else (base / path))


CONFIG_DIR = "{config_dir}"


def _command(argv: list[str], base_dir: Path | None) -> list[str]:
    """`python` as this interpreter and `{config_dir}` as the config's directory in one command."""
    where = str(base_dir.resolve()) if base_dir is not None else "."
    argv = [part.replace(CONFIG_DIR, where) for part in argv]
    return [sys.executable, *argv[1:]] if argv[0] == "python" else argv


def _agent_commands(agent: AgentSection, base_dir: Path | None) -> AgentSection:
    """`python` as this interpreter and `{config_dir}` as the config's directory in the agent's settings."""
    where = str(base_dir.resolve()) if base_dir is not None else "."

    def command(argv: list[str] | None) -> list[str] | None:
        return None if argv is None else _command(argv, base_dir)

    return msgspec.structs.replace(
        agent,
        command=command(agent.command) or [],
        evaluator_command=command(agent.evaluator_command),
        env={key: value.replace(CONFIG_DIR, where) for key, value in agent.env.items()},
    )


def config_from_mapping(mapping: Mapping[str, Any], base_dir: Path | None = None) -> TrainConfig:
    """A checked `TrainConfig` from plain data (a parsed TOML document); paths resolved against `base_dir`."""
    try:
        config = msgspec.convert(dict(mapping), TrainConfig, strict=True)
    except msgspec.ValidationError as exc:
        raise _decode_error(exc) from None
    check_settings(config)
    config = msgspec.structs.replace(config, agent=_agent_commands(config.agent, base_dir))
    if config.run.prepare:
        prepare = _command(config.run.prepare, base_dir)
        config = msgspec.structs.replace(config, run=msgspec.structs.replace(config.run, prepare=prepare))
    if base_dir is not None:
        config = msgspec.structs.replace(
            config,
            run=msgspec.structs.replace(config.run, out_dir=_resolve(base_dir, config.run.out_dir)),
            data=msgspec.structs.replace(config.data, path=_resolve(base_dir, config.data.path)),
            model=msgspec.structs.replace(config.model, path=_resolve(base_dir, config.model.path)),
            stack=msgspec.structs.replace(config.stack, data_dir=_resolve(base_dir, config.stack.data_dir)),
        )
        config = _resolve_models(config, base_dir)
    check_gpu_layout(config)
    return config


def _resolve_models(config: TrainConfig, base_dir: Path) -> TrainConfig:
    """The paths of `[[policies]]`, `[[frozen]]`, `[validation]` and the job template, against `base_dir`."""
    val = config.validation
    template = config.agent.job_template
    return msgspec.structs.replace(
        config,
        policies=[msgspec.structs.replace(p, path=_resolve(base_dir, p.path)) for p in config.policies],
        frozen=[msgspec.structs.replace(f, path=_resolve(base_dir, f.path) if f.path else None) for f in config.frozen],
        validation=msgspec.structs.replace(val, path=_resolve(base_dir, val.path)) if val else None,
        agent=msgspec.structs.replace(config.agent, job_template=_resolve(base_dir, template) if template else None),
    )


def load_config(path: Path) -> TrainConfig:
    """Read and check a TOML config file; `ConfigError` names the file and the bad key."""
    path = Path(path)
    try:
        document = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path} is not valid TOML: {exc}") from None
    try:
        return config_from_mapping(document, path.resolve().parent)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None


def config_to_mapping(config: TrainConfig) -> dict[str, Any]:
    """The config as plain data (what a checkpoint stores and a run records)."""
    return msgspec.to_builtins(config)
