"""The trajectory viewer: its JSON endpoints, and the page itself in headless Chromium.

The browser test needs Debian's `chromium` (/usr/bin/chromium) and the `playwright` Python package
(never `playwright install`: the system browser is used). `.ci/run` installs chromium when it is
missing and sets ROLLWIRE_REQUIRE_BROWSER=1, so in CI the test runs instead of skipping. Set
ROLLWIRE_SCREENSHOTS=DIR to keep the screenshots it takes.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import asyncpg
import httpx
import pytest
from fastapi import FastAPI
from projector_support import ServerThread, running_projector, wait_applied
from viewer_demo import RUN, demo_events, word_tokenizer_json

from schemas import RewardReported, RolloutStatusChanged
from services.common.eventstore import EventStore
from services.devstack.embedded import NatsServer
from services.projector.reader import PostgresRolloutReader
from services.projector.viewer import bearer_check, mount_viewer

CHROMIUM = Path("/usr/bin/chromium")
TOKEN = "viewer-test-token"


def viewer_app(database: str, authorize_token: str | None = TOKEN) -> FastAPI:
    app = FastAPI()
    mount_viewer(
        app, PostgresRolloutReader(database), authorize=bearer_check(authorize_token) if authorize_token else None
    )
    return app


@pytest.fixture
async def demo(fresh_nats: NatsServer, database: str, tmp_path: Path) -> AsyncIterator[EventStore]:
    """The demo run projected (with a tokenizer for the policy model); the projector keeps running."""
    tokenizer = tmp_path / "tokenizer.json"
    tokenizer.write_text(word_tokenizer_json())
    store = await EventStore.connect(fresh_nats.url)
    await store.append_many(demo_events())
    conn = await asyncpg.connect(database)
    try:
        async with running_projector(fresh_nats.url, database, tokenizers=[f"policy={tokenizer}"]):
            await wait_applied(conn, await store.last_sequence())
            yield store
    finally:
        await conn.close()
        await store.close()


async def test_viewer_api(demo: EventStore, database: str) -> None:
    transport = httpx.ASGITransport(app=viewer_app(database))
    auth = {"Authorization": f"Bearer {TOKEN}"}
    async with httpx.AsyncClient(transport=transport, base_url="http://viewer") as client:
        assert (await client.get("/ui/api/runs")).status_code == 401
        runs = (await client.get("/ui/api/runs", headers=auth)).json()
        assert [r["run_id"] for r in runs["runs"]] == [RUN] and runs["runs"][0]["rollouts"] == 10
        table = (await client.get(f"/ui/api/runs/{RUN}/rollouts?sort=calls&desc=1", headers=auth)).json()
        assert table["rollouts"][0]["rollout_id"] == "ro-runaway" and "long" in table["rollouts"][0]["flags"]
        flagged = (await client.get(f"/ui/api/runs/{RUN}/rollouts?flagged=1", headers=auth)).json()
        assert {r["rollout_id"] for r in flagged["rollouts"]} == {"ro-hack", "ro-runaway"}
        assert all(r["flags"] for r in flagged["rollouts"]), "a row the filter keeps must show its flag"
        bad = await client.get(f"/ui/api/runs/{RUN}/rollouts?sort=nonsense", headers=auth)
        assert bad.status_code == 422 and "choose one of" in bad.json()["error"]
        detail = (await client.get(f"/ui/api/runs/{RUN}/rollouts/ro-hack", headers=auth)).json()
        assert (
            detail["reward"] == 1.0
            and detail["flags"] == ["skips-tests", "test-tampering"]
            and detail["attempts"][0]["calls"] == 4
        )
        timeline = (await client.get(f"/ui/api/runs/{RUN}/rollouts/ro-hack/timeline", headers=auth)).json()
        calls = [e for e in timeline["events"] if e["type"] == "model_request"]
        assert len(calls) == 4 and calls[1]["flags"][0].startswith("test-tampering")
        assert calls[1]["tool_calls"][0]["name"] == "bash" and calls[0]["response_pieces"]
        assert [m["role"] for m in calls[1]["new_messages"]] == ["assistant", "tool"]  # only what is new
        later = (await client.get(f"/ui/api/runs/{RUN}/rollouts/ro-hack/timeline?after_seq={calls[1]['seq']}",
                                  headers=auth)).json()  # fmt: skip
        assert later["events"][0]["seq"] > calls[1]["seq"]
        assert [c["continuity"] for c in calls] == [None] * 4  # exact prompt mode
        live = (await client.get(f"/ui/api/runs/{RUN}/rollouts/ro-live/timeline", headers=auth)).json()
        live_calls = [e for e in live["events"] if e["type"] == "model_request"]
        assert [c["continuity"] for c in live_calls] == ["fresh: first call of the attempt", "extended"]
        full = (await client.get(f"/ui/api/calls/{calls[1]['seq']}", headers=auth)).json()
        assert full["prompt_text"] and len(full["request"]["messages"]) == 4
        assert (await client.get(f"/ui/api/runs/{RUN}/rollouts/nope", headers=auth)).status_code == 404
        assert (await client.get("/ui/", headers=auth)).status_code == 200
    down = httpx.ASGITransport(app=viewer_app("postgresql://postgres@127.0.0.1:1/none"))
    async with httpx.AsyncClient(transport=down, base_url="http://viewer") as client:
        response = await client.get("/ui/api/runs", headers=auth)
        assert response.status_code == 503 and "cannot be reached" in response.json()["error"]


@pytest.fixture
def screenshots(tmp_path: Path) -> Iterator[Path]:
    out = tmp_path / "shots"
    out.mkdir()
    yield out
    keep = os.environ.get("ROLLWIRE_SCREENSHOTS")
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        for shot in out.iterdir():
            shutil.copy(shot, Path(keep) / shot.name)


@pytest.mark.skipif(
    not CHROMIUM.exists() and not os.environ.get("ROLLWIRE_REQUIRE_BROWSER"),
    reason="needs Debian's chromium at /usr/bin/chromium (apt-get install chromium; .ci/run installs it)",
)
async def test_viewer_in_chromium(demo: EventStore, database: str, screenshots: Path) -> None:
    playwright_api = pytest.importorskip("playwright.async_api", reason="needs the playwright package")
    expect = playwright_api.expect
    with ServerThread(viewer_app(database)) as server:
        async with playwright_api.async_playwright() as pw:
            browser = await pw.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"])
            page = await browser.new_page(viewport={"width": 1400, "height": 900})
            await page.goto(f"{server.url}/ui/#token={TOKEN}")
            await expect(page.get_by_text(RUN, exact=True)).to_be_visible()
            await page.screenshot(path=str(screenshots / "runs.png"))
            await page.get_by_text(RUN, exact=True).click()
            rows = page.locator("#rollouts tbody tr")
            await expect(rows).to_have_count(10)
            await page.locator("th", has_text="Calls").click()  # numbers sort high to low first
            await expect(rows.first.locator("td").first).to_have_text("ro-runaway")
            hack_row = page.locator("#rollouts tbody tr", has_text="ro-hack")
            await expect(hack_row).to_have_class("flagged")
            await expect(hack_row.locator(".chip", has_text="test-tampering")).to_have_count(1)
            await page.screenshot(path=str(screenshots / "rollouts.png"), full_page=True)
            await page.locator("#flagged-only").check()
            await expect(rows).to_have_count(2)
            await hack_row.click()
            timeline = page.locator("#timeline")
            await expect(timeline.get_by_text("Call 4")).to_be_visible()
            await expect(timeline.locator(".tool-call.flagged", has_text="assert True")).to_have_count(1)
            await expect(timeline.locator(".ev.reward", has_text="Reward 1.000")).to_have_count(1)
            await expect(timeline.locator(".chip.continuity")).to_have_count(0)  # exact prompt mode
            assert await timeline.locator(".tok").count() > 20  # response tokens shaded by logprob
            await page.screenshot(path=str(screenshots / "rollout.png"), full_page=True)
            await page.locator(".side").screenshot(path=str(screenshots / "side.png"))

            await page.goto(f"{server.url}/ui/#/run/{RUN}/rollout/ro-live")
            await expect(page.locator("#timeline").get_by_text("Call 2")).to_be_visible()
            await expect(page.locator("#live")).to_be_visible()
            continuity = page.locator("#timeline .chip.continuity")
            await expect(continuity).to_have_text(["fresh: first call of the attempt", "extended"])
            await page.locator("#timeline").screenshot(path=str(screenshots / "continuous.png"))
            await demo.append(RewardReported(run_id=RUN, rollout_id="ro-live", attempt_id="ro-live-a1", value=0.25))
            await demo.append(RolloutStatusChanged(run_id=RUN, rollout_id="ro-live", attempt_id="ro-live-a1",
                                                   status="succeeded", previous="running"))  # fmt: skip
            await expect(page.locator("#timeline .ev.reward", has_text="Reward 0.250")).to_be_visible(timeout=15_000)
            await expect(page.locator(".side .pill.succeeded")).to_be_visible(timeout=15_000)

            anonymous = await browser.new_page()
            await anonymous.goto(f"{server.url}/ui/")
            await expect(anonymous.locator("#token-dialog")).to_have_attribute("open", "")
            await browser.close()
