"""The one client of the gateway's API: every caller gets the same error family, over a real gateway.

The trainer cancels a rollout that already ended (409: left as it is), the controller re-reads a
rollout on a conflict (`GatewayConflict.current`), and the `rollwire` commands print one line for
a refused or unreachable call; all three read the same `GatewayError` subclasses.
"""

from __future__ import annotations

import pytest
from served import Served

from services.common.eventstore import EventStore
from services.common.gateway_api import (
    GatewayClient,
    GatewayConflict,
    GatewayError,
    GatewayRejected,
    GatewayUnavailable,
    NewRollout,
    SyncGatewayClient,
)
from services.gateway import GatewaySettings, create_app

ADMIN = "api-admin"


async def test_one_error_family_for_async_and_sync_callers(store: EventStore, nats_url: str, run_id: str) -> None:
    settings = GatewaySettings(nats_url=nats_url, admin_token=ADMIN, secret="g" * 32, port=0)
    with Served(create_app(settings)) as server:
        gateway = GatewayClient(server.url, ADMIN)
        try:
            rid = f"{run_id}-r0"
            await gateway.create_rollouts(run_id, [NewRollout(rollout_id=rid, group_id="g", input={})], key="k0")
            grant = await gateway.start_attempt(rid, "test", key="k1")
            await gateway.set_status(rid, "running", attempt_id=grant.attempt_id, reason=None, key="k2")
            await gateway.set_status(rid, "succeeded", attempt_id=grant.attempt_id, reason=None, key="k3")
            assert await gateway.cancel_rollout(rid, "no longer needed") is None  # ended: a 409, left alone
            with pytest.raises(GatewayConflict) as conflict:
                await gateway.start_attempt(rid, "test", key="k4")
            assert conflict.value.status_code == 409 and conflict.value.current.get("status") == "succeeded"
            with pytest.raises(GatewayRejected) as missing:
                await gateway.start_attempt("no-such-rollout", "test", key="k5")
            assert missing.value.status_code == 404 and str(missing.value).startswith("POST /api/rollouts/")

            cli = SyncGatewayClient(server.url, ADMIN)
            try:
                assert cli.call("GET", f"/api/rollouts/{rid}")["status"]["state"] == "succeeded"
                with pytest.raises(GatewayRejected, match="404"):
                    cli.call("GET", "/api/rollouts/no-such-rollout")
            finally:
                cli.close()
        finally:
            await gateway.close()
    down = SyncGatewayClient(server.url, ADMIN)  # the server has stopped
    with pytest.raises(GatewayUnavailable, match="cannot be reached") as unreachable:
        down.call("GET", "/api/rollouts")
    assert isinstance(unreachable.value, GatewayError)
    down.close()
