"""LoRA adapters through peft, shared by both backends: which adapters a run trains and how they are saved.

`[backend] lora_rank > 0` trains low-rank adapters on `lora_target_modules` of a frozen base model.
`lora_adapters` maps an agent role to the adapter that trains that role's calls, so one base
model can carry one adapter per trained role (several roles may share one); without it there is
one adapter, `default`, for every call. A sample's role is the agent recorded on its calls
(`Sample.agent`; `role_of` may override it); calls of a role the mapping does not name are not
trained, and say so: a warning names an adapter that gets no sample of a step and the agents no
adapter takes, and a step none of whose samples any adapter takes is an error
(`NoSamplesForAdapters`), never a silent update of 0 optimizer steps.

Saved layout (what the engines serve): `<weights dir>/adapters/<name>/` holds
`adapter_model.safetensors` and `adapter_config.json` (peft's format, which vLLM's
`/v1/load_lora_adapter` reads). Whatever loads plain weights (an engine without LoRA, an export)
gets the base model with the single adapter merged in, in `<weights dir>` itself.
"""

from __future__ import annotations

import copy
import logging
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from trainer.backends.base import ADAPTERS_DIR
from trainer.core import Sample

if TYPE_CHECKING:
    from trainer.run.sections import BackendSection

log = logging.getLogger(__name__)
DEFAULT_ADAPTER = "default"
RoleOf = Callable[[Sample], str | None]


class NoSamplesForAdapters(ValueError):
    """A step with samples, none of which any adapter trains: the role mapping names no agent they carry."""


def sample_role(sample: Sample) -> str | None:
    """The agent role that made a sample's calls (`Sample.agent`, recorded on every call), else None."""
    return sample.agent


def adapter_names(settings: BackendSection) -> list[str]:
    """The adapters a run trains, in a fixed order (`default` when no role mapping is given)."""
    return sorted(set(settings.lora_adapters.values())) if settings.lora_adapters else [DEFAULT_ADAPTER]


def split_by_adapter(
    samples: Sequence[Sample], settings: BackendSection, role_of: RoleOf = sample_role
) -> dict[str, list[Sample]]:
    """The samples each adapter trains on: all of them for `default`, else by role (unmapped roles: none)."""
    if not settings.lora_adapters:
        return {DEFAULT_ADAPTER: list(samples)}
    groups: dict[str, list[Sample]] = {name: [] for name in adapter_names(settings)}
    unmapped: Counter[str | None] = Counter()
    for sample in samples:
        role = role_of(sample)
        if role is not None and role in settings.lora_adapters:
            groups[settings.lora_adapters[role]].append(sample)
        else:
            unmapped[role] += 1
    counts = {name: len(group) for name, group in groups.items()}
    if samples and not any(counts.values()):
        raise NoSamplesForAdapters(
            f"no adapter gets any of the step's {len(samples)} samples: their agents {dict(unmapped)} are not "
            f"among backend.lora_adapters' roles {sorted(settings.lora_adapters)}"
        )
    for name, count in counts.items():
        if samples and not count:
            roles = sorted(r for r, a in settings.lora_adapters.items() if a == name)
            seen = dict(unmapped) or sorted({str(s.agent) for s in samples})
            log.warning(
                "adapter %r trains on 0 of the step's %d samples: no sample's agent is %s (agents seen: %s)",
                name,
                len(samples),
                roles,
                seen,
            )
    if unmapped:
        log.warning(
            "%d samples are trained by no adapter: their agents %s are not in backend.lora_adapters",
            sum(unmapped.values()),
            dict(unmapped),
        )
    log.info("samples per adapter: %s", counts)
    return groups


def lora_config(settings: BackendSection) -> Any:
    """The peft `LoraConfig` of the run's settings."""
    from peft import LoraConfig, TaskType

    return LoraConfig(
        task_type=TaskType.CAUSAL_LM,
        r=settings.lora_rank,
        lora_alpha=settings.lora_alpha,
        target_modules=list(settings.lora_target_modules),
        lora_dropout=0.0,
        bias="none",
    )


def add_adapters(model: torch.nn.Module, settings: BackendSection, *, seed: int) -> Any:
    """`model` as a peft model with every adapter of the run, each initialised from `seed` (B = 0)."""
    from peft import get_peft_model

    names = adapter_names(settings)
    torch.manual_seed(seed)
    peft_model = get_peft_model(model, lora_config(settings), adapter_name=names[0])
    for name in names[1:]:
        torch.manual_seed(seed)
        peft_model.add_adapter(name, lora_config(settings))
    return peft_model


def adapter_state(model: Any, name: str) -> dict[str, torch.Tensor]:
    """One adapter's tensors under peft's saved names (no adapter name inside)."""
    from peft import get_peft_model_state_dict

    return {k: v.detach().cpu().contiguous() for k, v in get_peft_model_state_dict(model, adapter_name=name).items()}


def save_adapter(model: Any, name: str, out_dir: Path, tensors: dict[str, torch.Tensor] | None = None) -> Path:
    """Write adapter `name` as `out_dir/adapters/<name>/` in peft's format (what vLLM loads)."""
    from safetensors.torch import save_file

    target = Path(out_dir) / ADAPTERS_DIR / name
    target.mkdir(parents=True, exist_ok=True)
    save_file(tensors if tensors is not None else adapter_state(model, name), str(target / "adapter_model.safetensors"))
    config = copy.deepcopy(model.peft_config[name])
    config.base_model_name_or_path = None
    config.save_pretrained(str(target))
    return target


def load_adapter_tensors(model: Any, weights_dir: Path) -> None:
    """Load every adapter saved under `weights_dir/adapters/` into `model` (same names, same shapes)."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    for name in model.peft_config:
        path = Path(weights_dir) / ADAPTERS_DIR / name / "adapter_model.safetensors"
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing: the saved weights have no adapter {name!r}")
        set_peft_model_state_dict(model, load_file(str(path)), adapter_name=name)


def save_merged(model: Any, name: str, out_dir: Path) -> None:
    """Write the base model with adapter `name` merged in, as a plain transformers directory."""
    merged = copy.deepcopy(model)
    merged.set_adapter(name)
    merged.merge_and_unload().save_pretrained(out_dir, safe_serialization=True)
