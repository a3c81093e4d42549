"""Acceptance 3: the dashboard in headless Chromium (Debian's `chromium`, driven by Playwright
through `executable_path`): it renders live figures, a click on a scale control changes the
pool's size, and a screenshot is saved to tests/artifacts/dashboard.png (git-ignored).

Needs /usr/bin/chromium (tests/install_browser.sh installs it; tests/run.sh calls it). Without
it the test fails with that message, unless RADIXSERVE_SKIP_BROWSER=1 asks to skip.
CPU cluster shared with test_admin*.py (pools_harness.py).
"""

import os
import pathlib
import shutil

import pytest

from pools_harness import (
    ADMIN_KEY,
    API_KEY,
    USER,
    http,
    pool,
    pools_cluster,
    running_ids,  # noqa: F401
    scale,
    settle,
    wait_for,
)

pytestmark = pytest.mark.slow

CHROMIUM = os.environ.get("RADIXSERVE_CHROMIUM", "/usr/bin/chromium")
ARTIFACTS = pathlib.Path(__file__).parents[1] / "artifacts"
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture(scope="module")
def browser():
    if os.environ.get("RADIXSERVE_SKIP_BROWSER") == "1":
        pytest.skip("RADIXSERVE_SKIP_BROWSER=1")
    if not (os.path.exists(CHROMIUM) or shutil.which(CHROMIUM)):
        pytest.fail(
            f"{CHROMIUM} not found: install Debian's chromium (bash tests/install_browser.sh), or set "
            "RADIXSERVE_SKIP_BROWSER=1 to skip the dashboard test",
            pytrace=False,
        )
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
        yield b
        b.close()


@pytest.fixture()
def page(browser, pools_cluster):
    context = browser.new_context(viewport={"width": 1280, "height": 1100})
    pg = context.new_page()
    errors = []
    pg.on("pageerror", lambda exc: errors.append(str(exc)))
    pg.goto(f"{pools_cluster}/dashboard")
    yield pg
    context.close()
    assert errors == [], errors


def _login(pg, key: str) -> None:
    pg.fill("#admin-key", key)
    pg.click("#login button[type=submit]")


def test_wrong_keys_are_refused(page):
    for key in ("wrong-key", API_KEY):
        _login(page, key)
        page.wait_for_selector("#login-error:not([hidden])", timeout=30_000)
        assert "401" in page.inner_text("#login-error")
    assert page.locator("section.pool").count() == 0


def test_dashboard_renders_live_figures_and_scales_a_pool(page, http):
    scale(http, replicas=1)
    settle(http, 1)
    _login(page, ADMIN_KEY)
    card = page.locator('section.pool[data-pool="unified"]')
    card.wait_for(timeout=30_000)
    (rid,) = running_ids(pool(http))
    page.wait_for_selector(f'section.pool[data-pool="unified"] tr[data-replica="{rid}"]', timeout=30_000)
    assert card.locator(f'tr[data-replica="{rid}"] td').nth(1).inner_text() == "running"
    # its GPUs, from its own reports: none on this CPU cluster, one rank
    replica = wait_for(
        lambda: next((r for r in pool(http)["replicas"] if r["replica_id"] == rid and r["gpus"] is not None), None),
        30,
        "the replica's first report",
    )
    assert (replica["gpus"], replica["tensor_parallel_size"]) == (0.0, 1)
    wait_for(lambda: card.locator(f'tr[data-replica="{rid}"] td').nth(2).inner_text() == "CPU", 30, "the GPUs cell")
    assert card.locator('[data-field="ready_replicas"]').inner_text() == "1"
    assert card.locator('[data-field="kv_usage"]').inner_text().endswith("%")
    for i in range(3):  # traffic now, so the page shows fresh TTFT / ITL figures (a 10 s window)
        assert (
            http.post(
                "/generate",
                headers=USER,
                json={"text": f"Dashboard {i}", "sampling_params": {"temperature": 0, "max_new_tokens": 8}},
            ).status_code
            == 200
        )
    page.wait_for_function(
        """() => ['ttft_p90_ms', 'itl_p90_ms'].every(f => document.querySelector(
        `section.pool[data-pool="unified"] [data-field="${f}"]`).textContent.endsWith(' ms'))""",
        timeout=30_000,
    )
    # live: the status line ticks and the charts get drawn from the pool's history
    first = page.inner_text("#status")
    page.wait_for_function("f => document.querySelector('#status').textContent !== f", arg=first, timeout=30_000)
    assert page.inner_text("#status").startswith("live")
    page.wait_for_function(
        """() => [...document.querySelectorAll('section.pool canvas')].every(c => {
        const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
        for (let i = 3; i < d.length; i += 4) if (d[i] !== 0) return true;
        return false; })""",
        timeout=30_000,
    )
    assert card.locator("canvas").count() == 6

    card.locator('button[data-action="inc"]').click()  # the "+" control
    wait_for(lambda: pool(http)["target_replicas"] == 2, 30, "the click to reach the admin API")
    p = pool(http)
    assert (p["mode"], p["target_replicas"]) == ("manual", 2)
    page.wait_for_selector('section.pool[data-pool="unified"][data-target="2"]', timeout=30_000)
    settle(http, 2)
    page.wait_for_selector('section.pool[data-pool="unified"][data-ready="2"]', timeout=30_000)
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "dashboard.png"), full_page=True)
    assert (ARTIFACTS / "dashboard.png").stat().st_size > 10_000

    card.locator('button[data-action="dec"]').click()  # and back with "−"
    wait_for(lambda: pool(http)["target_replicas"] == 1, 30, "the second click")
    settle(http, 1)
