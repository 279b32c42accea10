"""The run spec a config declares (`schemas.runs.RunSpec`): how agents execute, what is trained, who goes where."""

from __future__ import annotations

from pathlib import Path

import msgspec

from schemas.runs import RunSpec
from trainer.run.models import agent_routes, trained_models
from trainer.run.sections import ConfigError, TrainConfig


def run_spec(config: TrainConfig, run_id: str) -> RunSpec:
    """The run spec the trainer declares: `[agent]` as it is, the job template's text, the trained
    agents and models (the adapter's selection, else every trained model) and the agents' routes."""
    agent = config.agent
    template = None
    if agent.job_template:
        try:
            template = Path(agent.job_template).read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"agent.job_template: cannot read {agent.job_template}: {exc.strerror}") from None
    adapter = config.adapter
    return RunSpec(
        **{**msgspec.structs.asdict(agent), "job_template": template},
        run_id=run_id,
        name=run_id,
        train_agents=list(adapter.agents),
        train_models=list(adapter.models) or trained_models(config),
        agent_models=agent_routes(config),
        prompt_mode=config.model.prompt_mode,
    )
