"""The trajectory viewer: a static page under `/ui` and the JSON endpoints it reads (`/ui/api/...`).

    mount_viewer(app, PostgresRolloutReader(database_url), authorize=check_admin)

No build step: `static/` holds plain HTML, CSS and JavaScript. Everything it shows comes from the
projector's tables (`queries.py`); the JSON endpoints need the admin token (trajectories hold
prompts and rewards an untrusted agent must not read), which the page asks for once and keeps
in the browser (or takes from `/ui/#token=...`).
"""

from services.projector.viewer.app import bearer_check, mount_viewer

__all__ = ["bearer_check", "mount_viewer"]
