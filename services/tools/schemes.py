"""Schemes: named `AdapterConfig`s, from the replay command's options and `--compare` specs.

A scheme is the adapter's config with some switches changed. On the command line a scheme is one
or more parts joined by `+`, each either `key=value` or a bare value that belongs to one key:

    per-call                      merge=per-call
    rloo+no-std                   estimator=rloo, scale_std=false
    norm=token-mean+sample        norm=token-mean, advantage_level=sample

Keys: `merge`, `advantage` (the advantage level), `estimator`, `std`, `norm` (and the
`AdapterConfig` field names themselves). The allowed values come from the adapter's own types, and
a wrong one raises the adapter's `AdapterConfigError`, naming the key and the values it takes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, get_args

import msgspec

from trainer.core import NORMS, AdapterConfig, AdapterConfigError, AdvantageLevel, Estimator, MergeMode

# Option name on the command line → AdapterConfig field.
OPTION_KEYS: dict[str, str] = {
    "merge": "merge",
    "advantage": "advantage_level",
    "estimator": "estimator",
    "std": "scale_std",
    "norm": "norm",
    "agents": "agents",
    "models": "models",
}

_CHOICES: dict[str, tuple[str, ...]] = {
    "merge": get_args(MergeMode),
    "advantage_level": get_args(AdvantageLevel),
    "estimator": get_args(Estimator),
    "norm": NORMS,
}
_BOOLEANS = {"std": True, "no-std": False, "true": True, "false": False}

# Every bare value names exactly one key (checked at import: a clash would make specs ambiguous).
_BARE: dict[str, tuple[str, Any]] = {value: (key, value) for key, values in _CHOICES.items() for value in values}
assert len(_BARE) == sum(len(v) for v in _CHOICES.values()), "scheme values must be unique across keys"
_BARE["std"] = ("scale_std", True)
_BARE["no-std"] = ("scale_std", False)


class Scheme(msgspec.Struct, frozen=True, kw_only=True):
    """A named adapter config: `name` is how the report and the plot label it."""

    name: str
    config: AdapterConfig


def describe(config: AdapterConfig) -> str:
    """A short label for a config: its five switches, `+`-joined (a valid scheme spec itself)."""
    return "+".join(
        [
            config.merge,
            config.advantage_level,
            config.estimator,
            "std" if config.scale_std else "no-std",
            config.norm,
        ]
    )


def names(option: str, value: str | None) -> tuple[str, ...] | None:
    """A comma-separated `--agents` / `--models` value as names (None: not given; "" or "all": every one)."""
    if value is None:
        return None
    if value.strip() in ("", "all"):
        return ()
    found = tuple(n.strip() for n in value.split(",") if n.strip())
    bad = [n for n in found if any(c in n for c in "./*> \t")]
    if bad:
        raise AdapterConfigError(f"--{option}: {bad[0]!r} is not a name; give names joined by ',' (or 'all')")
    return found


def spec_help() -> str:
    """One line listing what a scheme spec may contain (for errors and `--help`)."""
    keys = ", ".join(f"{opt}={'|'.join(_CHOICES[key])}" for opt, key in OPTION_KEYS.items() if key in _CHOICES)
    return f"{keys}, std|no-std; join parts with '+' (for example per-call+token-mean)"


def _part(part: str) -> tuple[str, Any]:
    if "=" in part:
        key, _, value = part.partition("=")
        field = OPTION_KEYS.get(key, key)
        if field not in AdapterConfig.__struct_fields__:
            raise AdapterConfigError(f"unknown scheme key {key!r} in {part!r}; the keys are: {', '.join(OPTION_KEYS)}")
        if field == "scale_std":
            if value not in _BOOLEANS:
                raise AdapterConfigError(f"std = {value!r} is not allowed; choose true or false")
            return field, _BOOLEANS[value]
        return field, value
    if part in _BARE:
        return _BARE[part]
    raise AdapterConfigError(f"unknown scheme {part!r}; a scheme is made of {spec_help()}")


def parse_spec(spec: str, base: AdapterConfig) -> AdapterConfig:
    """The config `base` with the switches named in `spec` changed (see the module docstring)."""
    parts = [p.strip() for p in spec.split("+") if p.strip()]
    if not parts:
        raise AdapterConfigError(f"empty scheme {spec!r}; a scheme is made of {spec_help()}")
    changes: dict[str, Any] = {}
    for part in parts:
        field, value = _part(part)
        if field in changes and changes[field] != value:
            raise AdapterConfigError(f"scheme {spec!r} sets {field} twice ({changes[field]!r} and {value!r})")
        changes[field] = value
    return _with(base, changes)


def _with(base: AdapterConfig, changes: Mapping[str, Any]) -> AdapterConfig:
    # Building through from_mapping runs the adapter's own checks, whose messages list allowed values.
    return AdapterConfig.from_mapping({**msgspec.structs.asdict(base), **changes})


def base_config(recorded: Mapping[str, Any] | None, options: Mapping[str, Any]) -> AdapterConfig:
    """The replay's base config: the run's recorded adapter config, with the options given changed.

    `options` maps option names (`merge`, `advantage`, `estimator`, `std`, `norm`) to values; None
    means "not given". A bad value raises `AdapterConfigError` prefixed with the option's flag.
    """
    config = AdapterConfig.from_mapping(dict(recorded)) if recorded else AdapterConfig()
    for option, value in options.items():
        if value is None:
            continue
        try:
            config = _with(config, {OPTION_KEYS[option]: value})
        except AdapterConfigError as exc:
            raise AdapterConfigError(f"--{option}: {exc}") from None
    return config


def schemes(base: AdapterConfig, compare: Sequence[str]) -> list[Scheme]:
    """The schemes to replay: the base, then each `--compare` spec applied to it, without repeats.

    A compare spec equal to the base config replaces the base's label rather than repeating it,
    so `--compare rollout-mean seq-mean-token-mean` gives exactly those two columns.
    """
    result: list[Scheme] = [Scheme(name=describe(base), config=base)]
    base_named = False
    for spec in compare:
        config = parse_spec(spec, base)
        if config == base and not base_named:
            result[0] = Scheme(name=spec, config=base)
            base_named = True
            continue
        if any(s.config == config for s in result):
            continue
        if any(s.name == spec for s in result):
            raise AdapterConfigError(f"scheme {spec!r} is given twice")
        result.append(Scheme(name=spec, config=config))
    return result
