"""Where a step's metrics row goes besides `metrics.csv`: W&B, MLflow, and a Prometheus endpoint.

    sinks = open_sinks(config)           # from [metrics] of the train config
    MetricsLog(csv, tb_dir, sinks=sinks) # each `add(row)` reaches every sink; `close()` closes them

- **Weights & Biases** (`wandb`, extra `rollwire[wandb]`): one W&B run per training run, id derived
  from the run name so a resumed run continues it. `wandb_mode = "offline"` (the default) writes
  under `<run_dir>/wandb/` with no network; `wandb sync` uploads it later.
- **MLflow** (`mlflow`, extra `rollwire[mlflow]`, the `mlflow-skinny` client): one MLflow run per
  training run (found again by its `rollwire.run` tag on resume), in `mlflow_tracking_uri`, by
  default a file store in `<run_dir>/mlruns` (no server, no network; MLflow 3 keeps its file store
  behind `MLFLOW_ALLOW_FILE_STORE`, which this sets for file URIs).
- **Prometheus** (`prometheus_port`): the trainer's gauges at `/metrics` (see `PrometheusSink`).
  A training run is one long-lived process, so Prometheus pulls from it like from any service;
  a Pushgateway would keep the last value of a dead run forever, and a node-exporter textfile
  needs an exporter on the trainer's host. The endpoint runs in its own thread, so a scrape is
  answered even while a step's update holds the CPU. `run` is a label: one process trains one run.

Numbers only: non-finite values and text columns are left out of every sink.
"""

from __future__ import annotations

import hashlib
import math
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from trainer.run.load import config_to_mapping
from trainer.run.sections import ConfigError, TrainConfig

PHASES = ("wait", "replay", "drain", "update", "save", "reload")
GAUGES = {
    "step": "rollwire_trainer_step",
    "weights_version": "rollwire_trainer_weights_version",
    "reward_mean": "rollwire_trainer_reward_mean",
    "reward_std": "rollwire_trainer_reward_std",
    "loss": "rollwire_trainer_loss",
    "entropy": "rollwire_trainer_entropy",
    "approx_kl": "rollwire_trainer_approx_kl",
    "time_step_s": "rollwire_trainer_step_seconds",
}


class StepSink(Protocol):
    """Receives every step's row (`step` first, then the figures) and is closed at the end of the run."""

    def log(self, row: Mapping[str, Any]) -> None: ...

    def close(self) -> None: ...


def numbers(row: Mapping[str, Any]) -> dict[str, float]:
    """The finite numeric columns of a row, `step` excluded."""
    return {
        k: float(v)
        for k, v in row.items()
        if k != "step" and isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
    }


def _missing(package: str, extra: str) -> ConfigError:
    return ConfigError(f"metrics.loggers: {package} is not installed; install it with: pip install 'rollwire[{extra}]'")


class WandbSink:
    """Each row as a W&B history entry at its step (see the module docstring)."""

    def __init__(self, config: TrainConfig) -> None:
        try:
            import wandb
        except ImportError:
            raise _missing("wandb", "wandb") from None
        metrics = config.metrics
        root = config.run_dir.resolve()
        root.mkdir(parents=True, exist_ok=True)
        run_id = hashlib.sha256(str(root).encode()).hexdigest()[:16]
        self.run = wandb.init(
            project=metrics.wandb_project,
            entity=metrics.wandb_entity,
            name=config.run.name,
            id=run_id,
            resume="allow",
            mode=metrics.wandb_mode,
            dir=str(root),
            config=config_to_mapping(config),
            settings=wandb.Settings(silent=True, console="off"),
        )

    def log(self, row: Mapping[str, Any]) -> None:
        self.run.log(numbers(row), step=int(row["step"]))

    def close(self) -> None:
        self.run.finish()


class MlflowSink:
    """Each row as MLflow metrics at its step, through `MlflowClient` (no process-global active run)."""

    def __init__(self, config: TrainConfig) -> None:
        try:
            from mlflow.tracking import MlflowClient
        except ImportError:
            raise _missing("mlflow", "mlflow") from None
        metrics = config.metrics
        uri = metrics.mlflow_tracking_uri or (config.run_dir.resolve() / "mlruns").as_uri()
        if uri.startswith("file:"):
            # MLflow 3 refuses its file store unless asked; it is the one that needs no server or database.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=uri)
        experiment = self.client.get_experiment_by_name(metrics.mlflow_experiment)
        experiment_id = (
            experiment.experiment_id if experiment else self.client.create_experiment(metrics.mlflow_experiment)
        )
        name = config.run.name
        found = self.client.search_runs([experiment_id], filter_string=f"tags.`rollwire.run` = '{name}'")
        if found:
            self.run_id = found[0].info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            run = self.client.create_run(experiment_id, run_name=name, tags={"rollwire.run": name})
            self.run_id = run.info.run_id
            for key, value in _flatten(config_to_mapping(config)).items():
                self.client.log_param(self.run_id, key, value[:500])

    def log(self, row: Mapping[str, Any]) -> None:
        from mlflow.entities import Metric

        now, step = int(time.time() * 1000), int(row["step"])
        entries = [Metric(key, value, now, step) for key, value in numbers(row).items()]
        self.client.log_batch(self.run_id, metrics=entries)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def _flatten(mapping: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in mapping.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(_flatten(value, f"{name}."))
        else:
            out[name] = str(value)
    return out


class PrometheusSink:
    """The trainer's gauges at `/metrics` (families in `GAUGES`, plus per-phase time and rollout counts)."""

    def __init__(self, run: str, port: int, host: str = "127.0.0.1") -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

        self.run = run
        self.registry = CollectorRegistry()
        self.gauges = {
            col: Gauge(name, f"The last step's {col}.", ["run"], registry=self.registry) for col, name in GAUGES.items()
        }
        self.phase = Counter(
            "rollwire_trainer_phase_seconds",
            "Time spent in each phase of the training step.",
            ["run", "phase"],
            registry=self.registry,
        )
        self.rollouts = Counter("rollwire_trainer_rollouts", "Rollouts trained on.", ["run"], registry=self.registry)
        self.failed = Counter(
            "rollwire_trainer_rollouts_failed",
            "Rollouts of a step that ended without succeeding.",
            ["run"],
            registry=self.registry,
        )
        self.steps = Counter("rollwire_trainer_steps", "Training steps completed.", ["run"], registry=self.registry)
        self.server: Any = None
        if port >= 0:
            self.server, _ = start_http_server(port, addr=host, registry=self.registry)
        self.port = self.server.server_address[1] if self.server is not None else None

    def log(self, row: Mapping[str, Any]) -> None:
        values = numbers(row)
        values["step"] = float(row["step"])
        for column, gauge in self.gauges.items():
            if column in values:
                gauge.labels(self.run).set(values[column])
        for phase in PHASES:
            self.phase.labels(self.run, phase).inc(values.get(f"time_{phase}_s", 0.0))
        self.rollouts.labels(self.run).inc(values.get("rollouts", 0.0))
        self.failed.labels(self.run).inc(values.get("rollouts_failed", 0.0))
        self.steps.labels(self.run).inc()

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()


def open_sinks(config: TrainConfig, say: Any = print) -> list[StepSink]:
    """The sinks `[metrics]` asks for (ConfigError naming the extra when a package is missing)."""
    chosen = config.metrics.loggers
    sinks: list[StepSink] = []
    try:
        if "wandb" in chosen:
            sinks.append(WandbSink(config))
        if "mlflow" in chosen:
            sinks.append(MlflowSink(config))
        port = config.metrics.prometheus_port
        if port is not None:
            sink = PrometheusSink(config.run.name, port, config.metrics.prometheus_host)
            say(f"trainer metrics: http://{config.metrics.prometheus_host}:{sink.port}/metrics")
            sinks.append(sink)
    except BaseException:
        close_all(sinks)
        raise
    return sinks


def close_all(sinks: Sequence[StepSink]) -> None:
    """Close every sink (each one even if another fails)."""
    for sink in sinks:
        try:
            sink.close()
        except Exception:  # a tracker that cannot flush must not hide the run's own outcome
            continue


def tensorboard_dir(config: TrainConfig, path: Path) -> Path | None:
    """The TensorBoard directory when `tensorboard` is among the loggers, else None."""
    return path if "tensorboard" in config.metrics.loggers else None
