"""/dashboard of a running proxy in headless Chromium: the real proxy in front of three simulated servers
under load, one of them slowed by stall faults until the proxy marks it a hot spot. The page must show one
heat-map cell per backend and window, the hot spot marked on that backend only, and the fleet table; the
screenshot, dashboard.png, goes to the test's folder (or to $AFFINITY_PROXY_SCREENSHOTS, e.g. loadtest/results).

Selenium blocks, so every browser call runs in a thread while the proxy, the simulator and the load keep
running on the test's event loop.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path
from typing import Any, AsyncIterator

import pytest

from proxy.app import AffinityProxy
from proxy.config import parse_config
from sim.fleet import Fleet, start_fleet
from tests.observability.simload import Load, slowed
from tests.support import until

selenium = pytest.importorskip("selenium", reason="selenium is not installed (pip install -e '.[test]')")
from selenium import webdriver  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402

CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
CHROMEDRIVER = shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None or CHROMEDRIVER is None,
    reason="headless Chromium not found: apt-get install -y chromium chromium-driver",
)

SCREENSHOT_NAME = "dashboard.png"
HISTORY = 40


@pytest.fixture
async def fleet() -> AsyncIterator[Fleet]:
    f = await start_fleet(3, speed=50.0)
    yield f
    await f.stop()


@pytest.fixture
async def proxy(fleet: Fleet) -> AsyncIterator[AffinityProxy]:
    backends = "\n".join(f"  - {{name: {s.name}, url: '{s.url}'}}" for s in fleet.servers)
    p = AffinityProxy(parse_config(
        "listen: {port: 0}\nadmin: {port: 0}\ntelemetry: {enabled: true, interval_ms: 200, timeout_ms: 150}\n"
        "health_checks: {enabled: false}\noutlier_detection: {enabled: false}\nretries: {enabled: false}\n"
        "logging: {access_log: {enabled: false}}\n"
        f"hotspots: {{window_s: 1, history_windows: {HISTORY}, windows: 3, clear_windows: 2, baseline_windows: 10,"
        " min_baseline_windows: 3, min_requests: 3, min_p99_s: 0.15}\n"
        f"routing: {{policy: round_robin}}\nbackends:\n{backends}\n", "<test>"))
    await p.start()
    yield p
    await p.stop()


def _browser() -> Any:
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1440,900", "--hide-scrollbars"):
        options.add_argument(arg)
    return webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)


CELLS = ("return [...document.querySelectorAll('#heatmap .cell')].map(c => [c.dataset.backend, c.dataset.window,"
         " c.dataset.mark || null])")


async def test_the_dashboard_of_a_running_proxy_marks_its_stalled_backend(fleet: Fleet, proxy: AffinityProxy,
                                                                            screenshot_dir: Path) -> None:
    screenshot = screenshot_dir / SCREENSHOT_NAME
    model = fleet.servers[0].backend.engine.model_name
    names = [s.name for s in fleet.servers]
    browser = await asyncio.to_thread(_browser)
    try:
        async with Load(proxy, model, clients=18):
            await until(lambda: all(proxy.observer.hotspots()["backends"].get(n, {}).get("baseline_windows", 0) >= 3
                                    for n in names), timeout=30, interval=0.2)
            async with slowed(fleet, ("sim-1",)):
                await until(lambda: proxy.observer.hotspots()["backends"]["sim-1"]["latency_hot_spot"],
                            timeout=30, interval=0.2)
                await asyncio.to_thread(browser.get, proxy.admin_url + "/dashboard")

                async def page_shows_the_hot_spot() -> list[list[Any]] | None:
                    if not await asyncio.to_thread(browser.execute_script,
                                                   "return document.body.dataset.updates"):
                        return None
                    cells = await asyncio.to_thread(browser.execute_script, CELLS)
                    return cells if any(c[0] == "sim-1" and c[2] == "hot" for c in cells) else None

                cells = await until(page_shows_the_hot_spot, timeout=20, interval=0.3)
                rows = await asyncio.to_thread(browser.execute_script, (
                    "return [...document.querySelectorAll('#fleet tbody tr')].map(r => [r.dataset.backend, r.innerText])"))
                await asyncio.to_thread(browser.save_screenshot, str(screenshot))
    finally:
        await asyncio.to_thread(browser.quit)
    assert len(cells) == len(names) * HISTORY, "one cell per backend and window"
    per_backend = {n: [c for c in cells if c[0] == n] for n in names}
    assert all(len(v) == HISTORY for v in per_backend.values())
    assert all([c[1] for c in v] == [c[1] for c in per_backend["sim-0"]] for v in per_backend.values())
    assert "hot" in [c[2] for c in per_backend["sim-1"]]
    assert not any(c[2] in ("hot", "spreading") for n in ("sim-0", "sim-2") for c in per_backend[n])
    assert {r[0] for r in rows} == set(names) and all(r[1] for r in rows)
    assert os.path.getsize(screenshot) > 10_000
