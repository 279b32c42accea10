"""Re-training schemes: the replay's schemes (`services.tools.schemes`) plus the loss's switches.

A re-training scheme is one or more parts joined by `+`. Parts the replay knows (`grpo`, `rloo`,
`token-mean`, `rollout-mean`, `seq-mean-token-mean`, `per-call`, `std`/`no-std`, `merge=..`,
`advantage=..`, `estimator=..`, `norm=..`) change the adapter; these change the loss:

    clip=0.2            both clip bounds (ε_low = ε_high)
    clip-low=0.2        ε_low
    clip-high=0.28      ε_high
    ratio-cap=3         the dual clip's cap c (`ratio-cap=none` turns it off)
    kl=0.01             the KL coefficient β (to the run's base model)
    is-cap=2            C, the truncation of the importance weight π_prox / π_behav (`trainer.retrain`)

Bare names are matched without case (`GRPO` is `grpo`). Everything a scheme does not name is the
run's own: its recorded adapter config and its `[algorithm.loss]` section.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

from services.tools.schemes import parse_spec, spec_help
from trainer.core import AdapterConfig, AdapterConfigError
from trainer.retrain import DEFAULT_IS_CAP
from trainer.run.sections import LossSection

LOSS_KEYS: dict[str, str] = {
    "clip-low": "clip_low",
    "clip-high": "clip_high",
    "ratio-cap": "ratio_cap",
    "kl": "kl_coef",
    "kl-coef": "kl_coef",
}


class RetrainScheme(msgspec.Struct, frozen=True, kw_only=True):
    """A named way to re-train: the adapter's config, the loss's settings and the weight cap C."""

    name: str
    adapter: AdapterConfig
    loss: LossSection
    is_cap: float = DEFAULT_IS_CAP

    @property
    def slug(self) -> str:
        """The scheme's name as a directory name."""
        return re.sub(r"[^A-Za-z0-9._+=-]", "_", self.name) or "scheme"


def _number(key: str, value: str) -> float | None:
    if value.lower() == "none" and key == "ratio-cap":
        return None
    try:
        return float(value)
    except ValueError:
        raise AdapterConfigError(f"{key} = {value!r} is not a number") from None


def _loss_part(part: str) -> tuple[str, float | None] | None:
    """(field, value) for a loss part, None for a part that is not about the loss."""
    if "=" not in part:
        return None
    key, _, value = part.partition("=")
    key = key.strip().lower().replace("_", "-")
    if key == "clip":
        return "clip", _number(key, value)
    if key == "is-cap":
        return "is_cap", _number(key, value)
    if key in LOSS_KEYS:
        return LOSS_KEYS[key], _number(key, value)
    return None


LOSS_HELP = "clip=, clip-low=, clip-high=, ratio-cap= (a number or none), kl=, is-cap="


def scheme_help() -> str:
    """What a re-training scheme may contain (for errors and `--help`)."""
    return f"{spec_help()}; the loss's parts: {LOSS_HELP}"


def parse_scheme(spec: str, adapter: AdapterConfig, loss: LossSection) -> RetrainScheme:
    """The scheme `spec` names, on top of the run's `adapter` config and `loss` section.

    Raises `AdapterConfigError` (the replay's error for a wrong scheme) naming what is allowed.
    """
    parts = [p.strip() for p in spec.split("+") if p.strip()]
    if not parts:
        raise AdapterConfigError(f"empty scheme {spec!r}; a scheme is made of {scheme_help()}")
    changes: dict[str, Any] = {}
    is_cap = DEFAULT_IS_CAP
    rest: list[str] = []
    for part in parts:
        found = _loss_part(part)
        if found is None:
            rest.append(part if "=" in part else part.lower())
            continue
        field, value = found
        if field == "is_cap":
            if value is None or value <= 0:
                raise AdapterConfigError(f"is-cap must be a positive number, got {part!r}")
            is_cap = value
        elif field == "clip":
            changes["clip_low"] = changes["clip_high"] = value
        else:
            changes[field] = value
    try:
        config = parse_spec("+".join(rest), adapter) if rest else adapter
    except AdapterConfigError as exc:
        raise AdapterConfigError(f"{exc}; the loss's parts: {LOSS_HELP}") from None
    try:
        section = msgspec.convert({**msgspec.to_builtins(loss), **changes}, LossSection)
        _check_loss(section)
    except (msgspec.ValidationError, ValueError) as exc:
        raise AdapterConfigError(f"scheme {spec!r}: {exc}") from None
    return RetrainScheme(name=spec, adapter=config, loss=section, is_cap=is_cap)


def _check_loss(section: LossSection) -> None:
    """The loss's own checks (`trainer.loss.PolicyLossConfig` raises `ValueError` saying what is allowed)."""
    from trainer.loss import PolicyLossConfig

    PolicyLossConfig(**msgspec.to_builtins(section))
