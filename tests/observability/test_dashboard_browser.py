"""/dashboard in a real browser: headless Chromium (Debian's chromium + chromium-driver) through selenium.

A small aiohttp app on 127.0.0.1 serves the observability routes over an Observer fed synthetic traffic in
which gpu-2 stalled (TTFT x12) for eight windows and gpu-4 is stalled now with 15% 5xx. The test finds one
heat-map cell per backend and window, the hot spot and the spreading anomaly marked on those backends only,
switches the metric, sees the page update itself, and saves dashboard-synthetic.png (the running proxy's page is
test_dashboard_live_browser.py's, in dashboard.png) in the test's folder, or in $AFFINITY_PROXY_SCREENSHOTS
(e.g. loadtest/results) where that is set.

Needs `apt-get install -y chromium chromium-driver` (as root); skipped with that reason where they are absent.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import threading
from pathlib import Path

import pytest

from proxy.admin import snapshot_json
from proxy.core.inflight import InflightTable
from proxy.core.snapshot import BackendSpec, Health, Signals, Snapshot
from proxy.observability.admin_routes import observability_routes
from proxy.observability.config import AccessLogConfig

from tests.observability.helpers import Clock, feed_fleet, make_observer

selenium = pytest.importorskip("selenium", reason="selenium is not installed (pip install -e '.[test]')")
from selenium import webdriver  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
CHROMEDRIVER = shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None or CHROMEDRIVER is None,
    reason="headless Chromium not found: apt-get install -y chromium chromium-driver",
)

SCREENSHOT_NAME = "dashboard-synthetic.png"
FLEET = ("gpu-0", "gpu-1", "gpu-2", "gpu-3", "gpu-4")


class Server:
    """The aiohttp app on its own thread and loop (selenium blocks the test's thread)."""

    def __init__(self, app) -> None:
        self.app = app
        self.loop = asyncio.new_event_loop()
        self.port: int | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        from aiohttp import web

        asyncio.set_event_loop(self.loop)
        self.runner = web.AppRunner(self.app, access_log=None)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]
        self._ready.set()
        self.loop.run_forever()
        self.loop.run_until_complete(self.runner.cleanup())
        self.loop.close()

    def __enter__(self) -> "Server":
        self._thread.start()
        assert self._ready.wait(10), "server did not start"
        return self

    def __exit__(self, *exc) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


def fleet_state(clock: Clock):
    snap = Snapshot.initial([BackendSpec(name=n, url=f"http://127.0.0.1:{8001 + i}") for i, n in enumerate(FLEET)])
    for name, health, score in (("gpu-0", Health.HEALTHY, 0.31), ("gpu-1", Health.HEALTHY, 0.44),
                                ("gpu-2", Health.HEALTHY, 0.38), ("gpu-3", Health.UNKNOWN, None),
                                ("gpu-4", Health.UNHEALTHY, 0.93)):
        snap = snap.replace_backend(name, health=health, load_score=score, stale=score is None,
                                    signals=None if score is None else Signals(scraped_at=0.0))
    inflight = InflightTable()
    for name, n in (("gpu-0", 3), ("gpu-1", 5), ("gpu-2", 2), ("gpu-4", 14)):
        for _ in range(n):
            inflight.acquire(name, 100)
    return lambda: snapshot_json(snap, inflight, now=0.4)


@pytest.fixture
def browser():
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1440,1000", "--hide-scrollbars"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def test_dashboard_heatmap_marks_the_stalled_backend(browser, screenshot_dir):
    screenshot = screenshot_dir / SCREENSHOT_NAME
    clock = Clock(1_800_000_000.0)
    obs, _ = make_observer(clock, AccessLogConfig(enabled=False))
    feed_fleet(obs, clock, windows=30, backends=FLEET, seed=1)
    feed_fleet(obs, clock, windows=8, backends=FLEET, stalled="gpu-2", stall_from=0, stall_to=8, stall_factor=12,
               seed=2)
    feed_fleet(obs, clock, windows=14, backends=FLEET, seed=3)
    feed_fleet(obs, clock, windows=6, backends=FLEET, stalled="gpu-4", stall_from=0, stall_to=6, stall_factor=8,
               error_backend="gpu-4", error_rate=0.15, seed=4)
    from aiohttp import web

    app = web.Application()
    app.add_routes(observability_routes(obs, fleet_state(clock)))
    with Server(app) as server:
        browser.get(f"http://127.0.0.1:{server.port}/dashboard")
        wait = WebDriverWait(browser, 20)
        wait.until(lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-updates"))
        # One read of the whole grid from the page (the page redraws every 2 s; element-by-element
        # reads over WebDriver would be slow and race the redraw).
        cells = browser.execute_script(
            "return [...document.querySelectorAll('#heatmap .cell')].map(c => [c.dataset.backend, c.dataset.window,"
            " c.dataset.mark || null, c.dataset.value === undefined ? null : Number(c.dataset.value),"
            " getComputedStyle(c).backgroundColor, getComputedStyle(c).outlineColor])")
        assert len(cells) == len(FLEET) * 90, "one cell per backend and 10 s window over 15 minutes"
        per_backend = {b: [c for c in cells if c[0] == b] for b in FLEET}
        assert all(len(v) == 90 for v in per_backend.values())
        windows = [c[1] for c in per_backend["gpu-0"]]
        assert len(set(windows)) == 90 and all(windows == [c[1] for c in v] for v in per_backend.values())
        marks = {b: [c[2] for c in v] for b, v in per_backend.items()}
        assert marks["gpu-2"].count("hot") >= 5, marks["gpu-2"]
        assert "spreading" in marks["gpu-4"]
        assert all(m in (None, "over") for b in ("gpu-0", "gpu-1", "gpu-3") for m in marks[b])
        names = {e.text: e.get_attribute("class") for e in browser.find_elements(By.CSS_SELECTOR, "#heatmap .name")}
        assert names["gpu-4"] == "name spreading" and names["gpu-0"] == "name"
        # cells with requests are coloured; the stalled windows look different from the healthy ones, and the
        # hot-spot outline is drawn (red), not just an attribute
        k = marks["gpu-2"].index("hot")
        hot_cell, calm_cell = per_backend["gpu-2"][k], per_backend["gpu-0"][k]
        assert hot_cell[4] != calm_cell[4]
        assert hot_cell[3] > 5 * calm_cell[3]
        assert hot_cell[5] == "rgb(255, 59, 48)" and calm_cell[5] != hot_cell[5]
        assert per_backend["gpu-3"][0][3] is None and per_backend["gpu-3"][-2][3] is not None  # no data: blank
        # fleet table, routing mix, transitions
        rows = {r.get_attribute("data-backend"): r.text for r in browser.find_elements(By.CSS_SELECTOR, "#fleet tbody tr")}
        assert "unhealthy" in rows["gpu-4"] and "0.93" in rows["gpu-4"] and "14" in rows["gpu-4"]
        assert "spreading" in rows["gpu-4"] and "never" in rows["gpu-3"]
        mix = [r.get_attribute("data-reason") for r in browser.find_elements(By.CSS_SELECTOR, "#mix .mixrow")]
        assert set(mix) == {"prefix_hit", "exact_hit", "hash", "overload_fallback"}
        events = browser.find_element(By.ID, "events").text
        assert "gpu-2" in events and "left latency hot spot" in events
        browser.save_screenshot(str(screenshot))  # the default metric, as an operator first sees it
        # switch metric: the cells now carry error rates
        browser.find_element(By.CSS_SELECTOR, "button[data-metric='error_rate']").click()
        wait.until(lambda d: "on" in d.find_element(By.CSS_SELECTOR, "button[data-metric='error_rate']").get_attribute("class"))
        err = browser.execute_script("return [...document.querySelectorAll(\"#heatmap .cell[data-backend='gpu-4']\")]"
                                     ".map(c => Number(c.dataset.value || 0))")
        assert max(err) > 0.05
        # live: a new window opens on the server's clock and the next poll shows it
        last_window = "return [...document.querySelectorAll('#heatmap .cell')].pop().dataset.window"
        first = browser.execute_script(last_window)
        clock.now += 10
        wait.until(lambda d: d.execute_script(last_window) != first)
        assert int(browser.execute_script(last_window)) == int(first) + 1
    assert os.path.getsize(screenshot) > 10_000
