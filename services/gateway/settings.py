"""Gateway settings, read once from the environment (and the command line in `__main__`)."""

from __future__ import annotations

import os
import secrets
import sys

import msgspec

from schemas.ids import STREAM_NAME

DEFAULT_PORT = 8080
DEFAULT_RUN = "default"


class SettingsError(ValueError):
    """A setting has a value the gateway cannot use; the message names the variable."""


class GatewaySettings(msgspec.Struct, kw_only=True):
    """Everything the gateway needs to know at start.

    `secret` signs attempt tokens; `public_url` is the base URL agents are told to use (it goes
    into `proxy_base_url` and `events_url`); `projector_url` is where reads are answered (empty:
    the gateway folds the stream for each read). `default_run` holds rollouts and models created
    without a run id (Agent Lightning's API has none).
    """

    nats_url: str = "nats://127.0.0.1:4222"
    admin_token: str = ""
    secret: str = ""
    public_url: str = ""
    projector_url: str = ""
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    max_body_bytes: int = 16 * 1024 * 1024
    upstream_timeout_s: float = 600.0
    upstream_connect_timeout_s: float = 10.0
    phase_hold_timeout_s: float = 600.0
    drain_timeout_s: float = 900.0
    default_run: str = DEFAULT_RUN
    stream: str = STREAM_NAME
    cache_bytes: int = 256 * 1024 * 1024
    idempotency_cache_bytes: int = 64 * 1024 * 1024
    budget_cache_bytes: int = 16 * 1024 * 1024
    record_format: str = "compact"
    """`compact` (references and packed arrays, schema version 2 on) or `full` (full lists, as version 1)."""
    chain_cache_bytes: int = 256 * 1024 * 1024
    reaper_interval_s: float = 5.0
    """Heartbeat period; a dead gateway's calls are recorded as aborted within about four of them."""

    @property
    def base_url(self) -> str:
        """The URL agents reach the gateway at (`public_url`, else host and port)."""
        if self.public_url:
            return self.public_url.rstrip("/")
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
        return f"http://{host}:{self.port}"


def _number(env: dict[str, str], name: str, default: float, kind: type = float) -> float:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = kind(raw)
    except ValueError:
        raise SettingsError(f"{name}={raw!r} is not a {kind.__name__}") from None
    if value <= 0:
        raise SettingsError(f"{name} must be positive, got {raw}")
    return value


def _record_format(value: str) -> str:
    if value not in ("compact", "full"):
        raise SettingsError(f"ROLLWIRE_RECORD_FORMAT={value!r}: use compact or full")
    return value


def settings_from_env(env: dict[str, str] | None = None, *, announce: bool = True) -> GatewaySettings:
    """Read settings from environment variables; generate missing tokens and say so on stderr.

    Variables: NATS_URL, ROLLWIRE_ADMIN_TOKEN, ROLLWIRE_SECRET, ROLLWIRE_PUBLIC_URL, ROLLWIRE_PROJECTOR_URL,
    ROLLWIRE_GATEWAY_HOST, ROLLWIRE_GATEWAY_PORT, ROLLWIRE_MAX_BODY_BYTES,
    ROLLWIRE_UPSTREAM_TIMEOUT_S, ROLLWIRE_PHASE_HOLD_TIMEOUT_S, ROLLWIRE_DEFAULT_RUN, ROLLWIRE_STREAM,
    ROLLWIRE_CACHE_BYTES, ROLLWIRE_IDEMPOTENCY_CACHE_BYTES, ROLLWIRE_RECORD_FORMAT (compact | full),
    ROLLWIRE_CHAIN_CACHE_BYTES, ROLLWIRE_REAPER_INTERVAL_S.
    """
    env = dict(os.environ if env is None else env)
    admin = env.get("ROLLWIRE_ADMIN_TOKEN", "")
    secret = env.get("ROLLWIRE_SECRET", "")
    if not admin:
        admin = secrets.token_urlsafe(32)
        if announce:
            print(f"rollwire gateway: ROLLWIRE_ADMIN_TOKEN not set; generated admin token: {admin}", file=sys.stderr)
    if not secret:
        secret = secrets.token_urlsafe(32)
        if announce:
            print(
                "rollwire gateway: ROLLWIRE_SECRET not set; generated a signing key for this process "
                "(attempt tokens will not survive a restart)",
                file=sys.stderr,
            )
    return GatewaySettings(
        nats_url=env.get("NATS_URL", "nats://127.0.0.1:4222"),
        admin_token=admin,
        secret=secret,
        public_url=env.get("ROLLWIRE_PUBLIC_URL", ""),
        projector_url=env.get("ROLLWIRE_PROJECTOR_URL", ""),
        host=env.get("ROLLWIRE_GATEWAY_HOST", "127.0.0.1"),
        port=int(_number(env, "ROLLWIRE_GATEWAY_PORT", DEFAULT_PORT, int)),
        max_body_bytes=int(_number(env, "ROLLWIRE_MAX_BODY_BYTES", 16 * 1024 * 1024, int)),
        upstream_timeout_s=_number(env, "ROLLWIRE_UPSTREAM_TIMEOUT_S", 600.0),
        phase_hold_timeout_s=_number(env, "ROLLWIRE_PHASE_HOLD_TIMEOUT_S", 600.0),
        default_run=env.get("ROLLWIRE_DEFAULT_RUN", DEFAULT_RUN),
        stream=env.get("ROLLWIRE_STREAM") or STREAM_NAME,
        cache_bytes=int(_number(env, "ROLLWIRE_CACHE_BYTES", 256 * 1024 * 1024, int)),
        idempotency_cache_bytes=int(_number(env, "ROLLWIRE_IDEMPOTENCY_CACHE_BYTES", 64 * 1024 * 1024, int)),
        record_format=_record_format(env.get("ROLLWIRE_RECORD_FORMAT") or "compact"),
        chain_cache_bytes=int(_number(env, "ROLLWIRE_CHAIN_CACHE_BYTES", 256 * 1024 * 1024, int)),
        reaper_interval_s=_number(env, "ROLLWIRE_REAPER_INTERVAL_S", 5.0),
    )
