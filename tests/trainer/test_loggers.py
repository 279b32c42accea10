"""The trainer's loggers chosen in `[metrics]`: W&B and MLflow in offline mode write a run that their own
readers load back (steps and values), a resumed run continues the same tracker run, and the
Prometheus endpoint serves the last step's figures."""

from __future__ import annotations

import json
import struct
import sys
import threading
import time
import zlib
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from trainer.loggers import open_sinks, tensorboard_dir
from trainer.metrics import MetricsLog
from trainer.run.load import config_from_mapping
from trainer.run.sections import ConfigError, TrainConfig

ROWS = [
    {"step": s, "reward_mean": 0.25 * s, "loss": 1.0 / s, "rollouts": 8, "rollouts_failed": s - 1,
     "time_wait_s": 1.5, "time_update_s": 0.5 * s, "time_step_s": 2.0 + s, "weights_version": s, "note": "text"}
    for s in (1, 2, 3)
]  # fmt: skip


def config(tmp_path: Path, **metrics: Any) -> TrainConfig:
    return config_from_mapping(
        {
            "run": {"name": "trk", "out_dir": str(tmp_path / "runs")},
            "data": {"path": "tasks.jsonl"},
            "agent": {"command": ["python", "agent.py"]},
            "model": {"path": "model"},
            "metrics": metrics,
        }
    )


def log_rows(cfg: TrainConfig, rows: list[dict[str, Any]]) -> None:
    """Open the sinks in a worker thread (as the training loop does) and log the rows."""
    opened: list[Any] = []
    thread = threading.Thread(target=lambda: opened.extend(open_sinks(cfg, say=lambda _: None)))
    thread.start()
    thread.join()
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    log = MetricsLog(cfg.run_dir / "metrics.csv", tensorboard_dir(cfg, cfg.run_dir / "tb"), sinks=opened)
    for row in rows:
        log.add(row)
    log.close()


def wandb_records(path: Path) -> list[Any]:
    """The records of a W&B transaction log (`run-<id>.wandb`), decoded with W&B's own protobuf schema.

    The file is a LevelDB-style log (a 7-byte `:W&B` header, then 32 KiB blocks of records, each with
    a CRC32, a length and a FULL/FIRST/MIDDLE/LAST type) of `wandb_internal_pb2.Record` messages, as
    wandb's `sdk/internal/datastore.py` (wandb <= 0.19) and its Go core read it.
    """
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert struct.unpack("<4sHB", data[:7]) == (b":W&B", 0xBEE1, 0)
    block, pos, pending, records = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if pos + 7 + length > len(data):
            break  # a record still being written
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 0:
            continue
        assert zlib.crc32(bytes([kind]) + chunk) == crc
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()  # type: ignore[attr-defined]
            record.ParseFromString(pending)
            records.append(record)
    return records


def test_wandb_offline_writes_a_run_wandb_reads_back(tmp_path: Path) -> None:
    pytest.importorskip("wandb")
    cfg = config(tmp_path, loggers=["csv", "wandb"], wandb_mode="offline")
    log_rows(cfg, ROWS)
    (path,) = (cfg.run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    # wandb's service process may still be writing the file's tail when finish() returns.
    deadline = time.monotonic() + 30
    records = wandb_records(path)
    while not any(r.WhichOneof("record_type") == "exit" for r in records):
        assert time.monotonic() < deadline, "the W&B run never recorded its exit"
        time.sleep(0.2)
        records = wandb_records(path)
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run.display_name == "trk" and run.project == "rollwire"
    history = [
        {i.key or ".".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
        for r in records
        if r.HasField("history")
    ]
    assert [h["_step"] for h in history] == [1, 2, 3]
    assert [h["reward_mean"] for h in history] == [0.25, 0.5, 0.75]
    assert all("note" not in h and "step" not in h for h in history)  # numbers only, the step as W&B's step
    assert not (cfg.run_dir / "tb").exists()  # tensorboard not chosen


def test_mlflow_file_store_run_reads_back_and_resumes(tmp_path: Path) -> None:
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    cfg = config(tmp_path, loggers=["csv", "mlflow"])
    log_rows(cfg, ROWS)
    log_rows(cfg, [{**ROWS[0], "step": 4, "reward_mean": 0.9}])  # a resumed run continues the same MLflow run
    client = MlflowClient(tracking_uri=(cfg.run_dir / "mlruns").resolve().as_uri())
    experiment = client.get_experiment_by_name("rollwire")
    assert experiment is not None
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "trk" and run.info.status == "FINISHED" and run.data.tags["rollwire.run"] == "trk"
    assert run.data.params["run.name"] == "trk" and run.data.params["metrics.loggers"] == "['csv', 'mlflow']"
    history = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "reward_mean"))
    assert history == [(1, 0.25), (2, 0.5), (3, 0.75), (4, 0.9)]
    assert "note" not in run.data.metrics


def test_prometheus_endpoint_serves_the_last_step(tmp_path: Path) -> None:
    cfg = config(tmp_path, loggers=["csv"], prometheus_port=0)
    said: list[str] = []
    sinks = open_sinks(cfg, say=said.append)
    (url,) = [line.split(": ", 1)[1] for line in said]
    log = MetricsLog(tmp_path / "metrics.csv", sinks=sinks)
    try:
        for row in ROWS:
            log.add(row)
        text = httpx.get(url, timeout=10).text
    finally:
        log.close()
    values = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    run = (("run", "trk"),)
    assert values[("rollwire_trainer_step", run)] == 3
    assert values[("rollwire_trainer_reward_mean", run)] == 0.75
    assert values[("rollwire_trainer_weights_version", run)] == 3
    assert values[("rollwire_trainer_step_seconds", run)] == 5.0
    assert values[("rollwire_trainer_phase_seconds_total", (("phase", "update"), *run))] == 3.0
    assert values[("rollwire_trainer_phase_seconds_total", (("phase", "wait"), *run))] == 4.5
    assert values[("rollwire_trainer_rollouts_total", run)] == 24
    assert values[("rollwire_trainer_rollouts_failed_total", run)] == 3
    assert values[("rollwire_trainer_steps_total", run)] == 3
    with pytest.raises(httpx.HTTPError):
        httpx.get(url, timeout=2)  # closed with the log


def test_a_missing_tracker_package_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb now raises ImportError
    with pytest.raises(ConfigError, match=r"pip install 'rollwire\[wandb\]'"):
        open_sinks(config(tmp_path, loggers=["wandb"]))
    with pytest.raises(ConfigError, match="choose one of: csv, tensorboard, wandb, mlflow"):
        config(tmp_path, loggers=["neptune"])
    with pytest.raises(ConfigError, match=r"metrics\.prometheus_port"):
        config(tmp_path, prometheus_port=70000)
