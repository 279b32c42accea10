"""`rollwire rollouts create|list|show|cancel`, `rollwire attempts start`, `rollwire reward`, `rollwire models list`.

Each command is one or two calls of the gateway's HTTP API (see `services/gateway/README.md`),
printed as a table, or as the gateway's JSON with `--json`. Where the gateway and the admin token
come from: `services.devstack.api_client`. Errors print one line and exit 1 (2 for usage).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import typer

from services.common.gateway_api import SyncGatewayClient
from services.devstack.api_client import ApiCliError, fields, resolve, table

rollouts_app = typer.Typer(help="Rollouts: create, list, show, cancel.", no_args_is_help=True)
attempts_app = typer.Typer(help="Attempts of a rollout.", no_args_is_help=True)

ROLLOUT_COLUMNS = ("rollout_id", "run_id", "group_id", "mode", "state", "attempt_count", "reward", "reason")
ROLLOUT_FIELDS = (
    "rollout_id",
    "run_id",
    "group_id",
    "mode",
    "state",
    "reason",
    "attempt_id",
    "attempt_count",
    "max_attempts",
    "reward",
    "input",
    "metadata",
    "created_at",
    "updated_at",
)
MODEL_COLUMNS = ("run_id", "name", "base_url", "served_model", "weights_version")
STATES = ("queuing", "preparing", "running", "requeuing", "succeeded", "failed", "cancelled")

GatewayUrl = typer.Option(None, "--gateway-url", envvar="ROLLWIRE_GATEWAY_URL", help="The gateway.")
AdminToken = typer.Option(None, "--admin-token", envvar="ROLLWIRE_ADMIN_TOKEN", help="The gateway's admin token.")
DataDir = typer.Option(
    Path(".rollwire"), "--data-dir", envvar="ROLLWIRE_DATA_DIR", help="The data dir of `rollwire up`."
)
AsJson = typer.Option(False, "--json", help="Print the gateway's JSON instead of a table.")


def _session(gateway_url: str | None, admin_token: str | None, data_dir: Path) -> SyncGatewayClient:
    url, token = resolve(gateway_url, admin_token, data_dir)
    return SyncGatewayClient(url, token)


def _run(
    gateway_url: str | None,
    admin_token: str | None,
    data_dir: Path,
    as_json: bool,
    work: Callable[[SyncGatewayClient], Any],
    render: Callable[[Any], str],
) -> None:
    """Open a client, do the work, print the result (JSON or rendered), close."""
    api = _session(gateway_url, admin_token, data_dir)
    try:
        result = work(api)
    finally:
        api.close()
    print(json.dumps(result, indent=2) if as_json else render(result))


def _json_arg(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise ApiCliError(f"{what} is not valid JSON ({exc}): {text[:80]}", 2) from None


def _inputs(inputs: list[str], file: Path | None) -> Iterator[Any]:
    for text in inputs:
        yield _json_arg(text, "INPUT")
    if file is not None:
        try:
            lines = file.read_text().splitlines()
        except OSError as exc:
            raise ApiCliError(f"cannot read {file}: {exc.strerror}", 2) from None
        for number, line in enumerate(lines, 1):
            if line.strip():
                yield _json_arg(line, f"{file} line {number}")


@rollouts_app.command("create")
def rollouts_create(
    inputs: list[str] = typer.Argument(None, help="Each rollout's input, as JSON (one rollout per argument)."),
    file: Path | None = typer.Option(None, "--file", help="A JSONL file: one rollout input per line."),
    run_id: str | None = typer.Option(None, help="The run (default: the gateway's default run)."),
    group_id: str | None = typer.Option(None, help="The task group (the advantage baseline)."),
    mode: str = typer.Option("train", help="train or val."),
    max_attempts: int | None = typer.Option(None, help="Attempts allowed (default: the run's)."),
    metadata: str | None = typer.Option(None, help="Free-form JSON object kept with each rollout."),
    idempotency_key: str | None = typer.Option(None, help="Repeat-safe key (default: a fresh one)."),
    gateway_url: str | None = GatewayUrl,
    admin_token: str | None = AdminToken,
    data_dir: Path = DataDir,
    as_json: bool = AsJson,
) -> None:
    """Declare rollouts (status `queuing`): `POST /api/rollouts`."""
    if mode not in ("train", "val"):
        raise ApiCliError(f"--mode {mode!r}: use train or val", 2)
    extra: dict[str, Any] = {"mode": mode}
    for name, value in (("run_id", run_id), ("group_id", group_id), ("max_attempts", max_attempts)):
        if value is not None:
            extra[name] = value
    if metadata is not None:
        extra["metadata"] = _json_arg(metadata, "--metadata")
    items = [{"input": value, **extra} for value in _inputs(inputs or [], file)]
    if not items:
        raise ApiCliError("no rollout to create: give each input as a JSON argument or pass --file", 2)
    key = idempotency_key or f"cli-{uuid.uuid4().hex}"

    def work(api: SyncGatewayClient) -> Any:
        return api.call("POST", "/api/rollouts", body={"rollouts": items}, key=key)

    _run(gateway_url, admin_token, data_dir, as_json, work, lambda r: table(r["rollouts"], ROLLOUT_COLUMNS))


@rollouts_app.command("list")
def rollouts_list(
    run_id: str | None = typer.Option(None, help="Only this run."),
    state: str | None = typer.Option(None, help=f"Only these states, comma-separated ({', '.join(STATES)})."),
    group_id: str | None = typer.Option(None, help="Only this task group."),
    mode: str | None = typer.Option(None, help="Only train or val rollouts."),
    limit: int = typer.Option(50, help="At most this many (the next page: --cursor)."),
    cursor: int | None = typer.Option(None, help="Start after this cursor (printed after a full page)."),
    gateway_url: str | None = GatewayUrl,
    admin_token: str | None = AdminToken,
    data_dir: Path = DataDir,
    as_json: bool = AsJson,
) -> None:
    """List rollouts in creation order: `GET /api/rollouts`."""
    if state is not None:
        unknown = [s for s in state.split(",") if s and s not in STATES]
        if unknown:
            raise ApiCliError(f"--state {','.join(unknown)}: use {', '.join(STATES)}", 2)
    if limit < 1:
        raise ApiCliError("--limit must be at least 1", 2)
    params = {"run_id": run_id, "state_in": state, "group_id": group_id, "mode": mode, "limit": limit}
    params["cursor"] = cursor
    query = {k: v for k, v in params.items() if v is not None}

    def render(rollouts: Any) -> str:
        text = table(rollouts, ROLLOUT_COLUMNS)
        if len(rollouts) >= limit and rollouts:
            text += f"\n(more: --cursor {rollouts[-1].get('cursor')})"
        return text

    def work(api: SyncGatewayClient) -> Any:
        return api.call("GET", "/api/rollouts", params=query)

    _run(gateway_url, admin_token, data_dir, as_json, work, render)


@rollouts_app.command("show")
def rollouts_show(
    rollout_id: str = typer.Argument(..., help="The rollout."),
    gateway_url: str | None = GatewayUrl,
    admin_token: str | None = AdminToken,
    data_dir: Path = DataDir,
    as_json: bool = AsJson,
) -> None:
    """One rollout with its attempts and reward: `GET /api/rollouts/{id}`."""

    def work(api: SyncGatewayClient) -> Any:
        rollout = api.call("GET", f"/api/rollouts/{rollout_id}")
        rollout.pop("rollout", None)  # the Agent Lightning copy of the same object
        return rollout

    _run(gateway_url, admin_token, data_dir, as_json, work, lambda r: fields(r, ROLLOUT_FIELDS))


@rollouts_app.command("cancel")
def rollouts_cancel(
    rollout_id: str = typer.Argument(..., help="The rollout."),
    reason: str = typer.Option("cancelled from the command line", help="Why (kept in the status event)."),
    gateway_url: str | None = GatewayUrl,
    admin_token: str | None = AdminToken,
    data_dir: Path = DataDir,
    as_json: bool = AsJson,
) -> None:
    """Cancel a rollout (the controller stops its execution): `PATCH /api/rollouts/{id}` to `cancelled`."""
    body = {"status": "cancelled", "reason": reason}

    def work(api: SyncGatewayClient) -> Any:
        answer = api.call("PATCH", f"/api/rollouts/{rollout_id}", body=body, key=f"cli-cancel-{uuid.uuid4().hex}")
        answer.pop("rollout", None)
        return answer

    _run(gateway_url, admin_token, data_dir, as_json, work, lambda r: table([r], ROLLOUT_COLUMNS))


@attempts_app.command("start")
def attempts_start(
    rollout_id: str = typer.Argument(..., help="A queuing or requeuing rollout."),
    executor: str | None = typer.Option(None, help="Who runs the attempt (recorded with it)."),
    gateway_url: str | None = GatewayUrl,
    admin_token: str | None = AdminToken,
    data_dir: Path = DataDir,
    as_json: bool = AsJson,
) -> None:
    """Start an attempt by hand: its agent token and proxy URL (`POST /api/rollouts/{id}/attempts`)."""
    body = {"executor": executor} if executor else {}
    keys = ("rollout_id", "run_id", "attempt_id", "sequence", "token", "proxy_base_url", "events_url")

    def work(api: SyncGatewayClient) -> Any:
        path = f"/api/rollouts/{rollout_id}/attempts"
        return api.call("POST", path, body=body, key=f"cli-attempt-{uuid.uuid4().hex}")

    _run(gateway_url, admin_token, data_dir, as_json, work, lambda r: fields(r, keys))


def reward(
    rollout_id: str = typer.Argument(..., help="The rollout."),
    value: float = typer.Argument(..., help="The reward (a finite number)."),
    attempt_id: str | None = typer.Option(None, help="The attempt (default: the rollout's current one)."),
    name: str | None = typer.Option(None, help="The reward's name, e.g. pass."),
    step: int | None = typer.Option(None, help="The step it belongs to, if any."),
    gateway_url: str | None = GatewayUrl,
    admin_token: str | None = AdminToken,
    data_dir: Path = DataDir,
    as_json: bool = AsJson,
) -> None:
    """Report a reward for a rollout's attempt: `POST /api/rollouts/{id}/attempt/{aid}/events`."""
    body: dict[str, Any] = {"type": "reward", "value": value}
    if name is not None:
        body["name"] = name
    if step is not None:
        body["step"] = step

    def work(api: SyncGatewayClient) -> Any:
        attempt = attempt_id or api.call("GET", f"/api/rollouts/{rollout_id}").get("attempt_id")
        if not attempt:
            raise ApiCliError(f"rollout {rollout_id} has no attempt yet; start one with `rollwire attempts start`")
        path = f"/api/rollouts/{rollout_id}/attempt/{attempt}/events"
        return api.call("POST", path, body=body, key=f"cli-reward-{uuid.uuid4().hex}")

    keys = ("rollout_id", "attempt_id", "value", "name", "source", "seq")
    _run(gateway_url, admin_token, data_dir, as_json, work, lambda r: fields(r, keys))


def models_list(
    run_id: str | None = typer.Option(None, help="Only this run's endpoints."),
    gateway_url: str | None = GatewayUrl,
    admin_token: str | None = AdminToken,
    data_dir: Path = DataDir,
    as_json: bool = AsJson,
) -> None:
    """The inference endpoints the proxy routes to: `GET /api/models`."""
    query = {"run_id": run_id} if run_id else None
    _run(
        gateway_url,
        admin_token,
        data_dir,
        as_json,
        lambda api: api.call("GET", "/api/models", params=query),
        lambda r: table(r["models"], MODEL_COLUMNS),
    )


def register(app: typer.Typer, models_app: typer.Typer) -> None:
    """Add these commands to the `rollwire` app (`models list` next to `models register`)."""
    app.add_typer(rollouts_app, name="rollouts")
    app.add_typer(attempts_app, name="attempts")
    app.command("reward")(reward)
    models_app.command("list")(models_list)
