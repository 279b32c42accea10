"""The local stack's credentials: a NATS user per service and a Postgres password, in the data dir.

`rollwire up` generates them once into `<data-dir>/credentials.json` (mode 0600, in a 0700 data
dir) and gives each service only its own, inside the URL it already reads:

    gateway     NATS_URL=nats://gateway:PW@127.0.0.1:14222     publishes events (the only writer
                                                                 besides the trainer)
    projector   NATS_URL=nats://projector:PW@...  DATABASE_URL=postgresql://postgres:PW@...
    controller  NATS_URL=nats://controller:PW@...              reads events, never publishes them
    trainer     the embedded trainer's own user: appends its train steps and phases
    monitor     read-only, for `rollwire tail`, monitors and dashboards

Agents get none of them. The per-user permissions (`NATS_PERMISSIONS`) are enforced by
nats-server: a reader's publish to `rl.>` is refused ("Permissions Violation"), a connection
without a user or with a wrong password is refused ("Authorization Violation").
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit

from services.devstack import endpoints_file
from services.devstack.embedded import die_with_parent

FILE = "credentials.json"

_JS_READ = [
    "$JS.API.INFO",
    "$JS.API.STREAM.INFO.>",
    "$JS.API.STREAM.NAMES",
    "$JS.API.STREAM.LIST",
    "$JS.API.STREAM.MSG.GET.>",
    "$JS.API.DIRECT.GET.>",
    "$JS.API.CONSUMER.CREATE.>",
    "$JS.API.CONSUMER.DURABLE.CREATE.>",
    "$JS.API.CONSUMER.INFO.>",
    "$JS.API.CONSUMER.MSG.NEXT.>",
    "$JS.API.CONSUMER.DELETE.>",
    "$JS.API.CONSUMER.NAMES.>",
    "$JS.API.CONSUMER.LIST.>",
    "$JS.ACK.>",
    "$JS.FC.>",
    "_INBOX.>",
]
"""What a reader may publish: JetStream requests that read, its consumers' acks, its inboxes."""

_SERVICE_READ = [*_JS_READ, "$JS.API.STREAM.CREATE.>", "$JS.API.STREAM.UPDATE.>"]
"""A reading service also ensures the stream's settings at start (`EventStore.connect`), never an event."""

NATS_PERMISSIONS: dict[str, dict[str, object]] = {
    "gateway": {"publish": [">"], "subscribe": [">"]},
    "trainer": {"publish": [">"], "subscribe": [">"]},
    "projector": {"publish": {"allow": _SERVICE_READ, "deny": ["rl.>", "$KV.>"]}, "subscribe": [">"]},
    "controller": {"publish": {"allow": _SERVICE_READ, "deny": ["rl.>", "$KV.>"]}, "subscribe": [">"]},
    "monitor": {"publish": {"allow": _JS_READ, "deny": ["rl.>", "$KV.>"]}, "subscribe": [">"]},
}
"""Each NATS user's permissions, in nats-server's configuration syntax."""


@dataclass(frozen=True)
class Credentials:
    """The passwords of one data dir: one per NATS user, one for Postgres' `postgres` role."""

    nats: dict[str, str]
    postgres: str

    def nats_url(self, url: str, user: str) -> str:
        """`url` (nats://host:port) with `user`'s name and password in it."""
        return with_userinfo(url, user, self.nats[user])

    def postgres_url(self, url: str) -> str:
        """`url` (postgresql://postgres@host:port/db) with the password in it."""
        return with_userinfo(url, "postgres", self.postgres)


def with_userinfo(url: str, user: str, password: str) -> str:
    """`url` with `user:password@` in front of its host (any userinfo it had is replaced)."""
    parts = urlsplit(url)
    host = parts.netloc.rpartition("@")[2]
    netloc = f"{quote(user, safe='')}:{quote(password, safe='')}@{host}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def without_userinfo(url: str) -> str:
    """`url` with no user or password: what may be printed or written to `endpoints.json`."""
    parts = urlsplit(url)
    user = parts.username
    host = parts.netloc.rpartition("@")[2]
    keep = f"{user}@" if user and parts.scheme.startswith("postgres") else ""
    return urlunsplit((parts.scheme, keep + host, parts.path, parts.query, parts.fragment))


def load_or_create(data_dir: Path) -> Credentials:
    """The data dir's credentials, generated (and saved with mode 0600) the first time, and for new users."""
    path = data_dir / FILE
    try:
        stored = json.loads(path.read_text())
    except (OSError, ValueError):
        stored = {}
    nats = {str(k): str(v) for k, v in dict(stored.get("nats") or {}).items()}
    changed = False
    for user in NATS_PERMISSIONS:
        if not nats.get(user):
            nats[user] = secrets.token_urlsafe(24)
            changed = True
    postgres = str(stored.get("postgres") or "")
    if not postgres:
        postgres, changed = secrets.token_urlsafe(24), True
    if changed:
        staging = path.with_name(f".{FILE}.partial")
        fd = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            json.dump({"nats": nats, "postgres": postgres}, handle, indent=2)
        os.replace(staging, path)
    return Credentials(nats=nats, postgres=postgres)


def nats_authorization(credentials: Credentials) -> str:
    """nats-server's `authorization { users = [...] }` block for these credentials."""
    users = [
        {"user": user, "password": credentials.nats[user], "permissions": NATS_PERMISSIONS[user]}
        for user in NATS_PERMISSIONS
    ]
    return "authorization {\n  users = " + json.dumps(users, indent=2) + "\n}\n"


def password_variable(user: str) -> str:
    """The environment variable that holds `user`'s NATS password in docker-compose.yml and Kubernetes."""
    return f"NATS_{user.upper()}_PASSWORD"


def nats_config_from_env() -> str:
    """infra/nats/nats.conf: the same users and permissions, passwords from `password_variable`s."""
    block = nats_authorization(
        Credentials(nats={u: f"@{password_variable(u)}@" for u in NATS_PERMISSIONS}, postgres="")
    )
    for user in NATS_PERMISSIONS:  # nats-server reads `$NAME` (unquoted) from the environment
        block = block.replace(f'"@{password_variable(user)}@"', f"${password_variable(user)}")
    header = (
        "# nats-server users for docker-compose.yml and Kubernetes: one per Rollwire service, agents none.\n"
        "# Generated by services/devstack/credentials.py (nats_config_from_env); `rollwire up` writes its own.\n"
    )
    return header + "jetstream {\n  store_dir: /data\n}\nmax_payload: 8MB\nhttp_port: 8222\n" + block


def read_or_create_secret(path: Path, env: str) -> tuple[str, bool]:
    """The secret from `env`, else from `path`, else a new one written to `path` (True = generated)."""
    if os.environ.get(env):
        return os.environ[env], False
    if path.exists():
        return path.read_text().strip(), False
    value = secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(value)
    return value, True


def child_setup() -> None:
    """A `preexec_fn` for every child: die with `rollwire up`, create files only its user can read."""
    os.umask(0o077)
    die_with_parent()


def restrict_data_dir(data_dir: Path) -> None:
    """Make the data dir private: 0700 (0711 as root, where agents run as another user and must reach
    their workspaces through it), its secrets 0600, its logs and servers' directories 0700."""
    data_dir.chmod(0o711 if os.geteuid() == 0 else 0o700)
    for name in ("admin_token", "secret", FILE, endpoints_file.NAME, "stack.lock"):
        with contextlib.suppress(FileNotFoundError):
            (data_dir / name).chmod(0o600)
    for name in ("logs", "nats"):
        with contextlib.suppress(FileNotFoundError):
            (data_dir / name).chmod(0o700)
    with contextlib.suppress(FileNotFoundError):  # as root, Postgres runs as its own user through it
        (data_dir / "postgres").chmod(0o711 if os.geteuid() == 0 else 0o700)


def local_credentials(url: str, user: str = "monitor", data_dir: Path | None = None) -> str:
    """`url` with `user`'s password when it names none and is the NATS of the stack running in the data dir.

    So `rollwire tail`, `replay`, `runs` and the monitors keep working against `rollwire up` with
    no credentials to pass: the operator can read the data dir, agents cannot. Any other URL is
    returned as it is. The data dir is `$ROLLWIRE_DATA_DIR`, else `./.rollwire`.
    """
    if urlsplit(url).username:
        return url
    directory = data_dir or Path(os.environ.get("ROLLWIRE_DATA_DIR") or ".rollwire")
    running = endpoints_file.read(directory).get("nats")
    if running is None or urlsplit(running).netloc != urlsplit(url).netloc:
        return url
    try:
        password = json.loads((directory / FILE).read_text())["nats"][user]
    except (OSError, ValueError, KeyError, TypeError):
        return url
    return with_userinfo(url, user, str(password))
