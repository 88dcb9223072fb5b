"""The HTML report in a real browser: headless Chromium (Debian's, driven by Playwright; no
browser download). Pages load with no console error and no network request, every chart
renders, the summary's incident links scroll to their sections, and a capture full of markup
runs none of it. `scripts/install-browser` installs what these tests need.

Screenshots go to pytest's tmp dir; with KVDOCTOR_SCREENSHOT_DIR set, the top of each page is
also saved there as report-<case>.png (scripts/make-reports uses this for docs/img/).
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

import kvdoctor
from kvdoctor.diagnosis import diagnose, load_rules
from kvdoctor.report.html import render_report

from conftest import CASES, ROOT
from test_report import HOSTILE, make_hostile_capture, make_hostile_rules

pytestmark = pytest.mark.browser

CHROMIUM = next((p for p in (os.environ.get("KVDOCTOR_CHROMIUM"), "/usr/bin/chromium", shutil.which("chromium"),
                             shutil.which("chromium-browser")) if p and Path(p).exists()), None)
try:
    from playwright.sync_api import sync_playwright
except ImportError:  # pragma: no cover - depends on the machine
    sync_playwright = None

if CHROMIUM is None:
    pytest.skip("headless Chromium not found (/usr/bin/chromium); run scripts/install-browser", allow_module_level=True)
if sync_playwright is None:
    pytest.skip("the playwright Python package is not installed; run scripts/install-browser", allow_module_level=True)

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]
VIEWPORT = {"width": 1360, "height": 1000}
RENDER_TIMEOUT_MS = 90_000


class Browser:
    """Chromium as a persistent context (--user-data-dir in a temp folder), started again if it
    died, so one crashed browser cannot fail every test after it."""

    def __init__(self, pw):
        self.pw = pw
        self.ctx = None
        self.profile = None

    def start(self) -> None:
        self.close()
        self.profile = tempfile.mkdtemp(prefix="kvd-chromium-")
        self.ctx = self.pw.chromium.launch_persistent_context(self.profile, executable_path=CHROMIUM, headless=True,
                                                              args=FLAGS, viewport=VIEWPORT, device_scale_factor=1)

    def new_page(self):
        if self.ctx is None:
            self.start()
        try:
            return self.ctx.new_page()
        except Exception:  # the browser went away: a fresh one
            self.start()
            return self.ctx.new_page()

    def close(self) -> None:
        if self.ctx is not None:
            try:
                self.ctx.close()
            except Exception:
                pass
            self.ctx = None
        if self.profile:
            shutil.rmtree(self.profile, ignore_errors=True)
            self.profile = None


@pytest.fixture(scope="module")
def browser():
    with sync_playwright() as pw:
        b = Browser(pw)
        try:
            yield b
        finally:
            b.close()


class Opened:
    def __init__(self, page, errors, requests):
        self.page, self.errors, self.requests = page, errors, requests


def open_report(browser, path: Path) -> Opened:
    page = browser.new_page()
    errors: list[str] = []
    requests: list[str] = []
    page.on("console", lambda m: errors.append(f"console.{m.type}: {m.text}") if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(f"pageerror: {e}"))
    page.on("request", lambda r: requests.append(r.url) if not r.url.startswith(("file:", "data:", "blob:", "about:")) else None)
    page.goto(path.resolve().as_uri())
    page.wait_for_function("window.__kvdoctorRendered === true || !!window.__kvdoctorRenderError", timeout=RENDER_TIMEOUT_MS)
    return Opened(page, errors, requests)


def screenshot(page, tmp_path: Path, name: str, publish: bool = True) -> Path:
    shot = tmp_path / f"report-{name}.png"
    page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 10_000
    out_dir = os.environ.get("KVDOCTOR_SCREENSHOT_DIR")
    if out_dir and publish:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        page.evaluate("window.scrollTo(0, 0)")
        page.screenshot(path=str(Path(out_dir) / f"report-{name}.png"))  # the top of the page: summary first
    return shot


CAPTURES = {
    "context-overflow": CASES / "context-overflow",
    "preemption": CASES / "preemption",
    "leak": CASES / "leak",
    "multi-turn": CASES / "multi-turn",
    "prefix-cache-off": CASES / "prefix-cache-off",
    "concurrency": CASES / "concurrency",
    "healthy": CASES / "healthy",
    "aibrix-qps-4.1": ROOT / "samples" / "aibrix-qps-4.1",
    "mooncake-conversation": ROOT / "samples" / "mooncake-conversation",
    "llmperf-anyscale-7b": ROOT / "samples" / "llmperf-anyscale-7b",
}


@pytest.mark.parametrize("name", list(CAPTURES))
def test_report_renders_every_chart_without_errors(browser, tmp_path, name):
    diag = diagnose(kvdoctor.load(CAPTURES[name]))
    path = render_report(diag, tmp_path / f"{name}.html")
    r = open_report(browser, path)
    page = r.page
    try:
        assert page.evaluate("window.__kvdoctorRenderError || null") is None
        assert r.errors == [], r.errors
        assert r.requests == [], f"the report reached the network: {r.requests}"
        n_charts = page.evaluate("document.querySelectorAll('.kvd-chart').length")
        rendered = page.evaluate("[...document.querySelectorAll('.kvd-chart')].filter(d => d.querySelector('.main-svg')).length")
        assert n_charts >= 1 and rendered == n_charts, f"{rendered} of {n_charts} charts rendered"
        assert page.evaluate("window.__kvdoctorRenderMs") > 0
        n_inc = len(diag.incidents)
        assert page.evaluate("document.querySelectorAll('section.incident').length") == n_inc
        text = page.evaluate("document.getElementById('summary').innerText")
        pages = [i for i in diag.incidents if not i.observation]
        assert ("No incident" in text) if not pages else ("Likely cause" in text and "First fix" in text)
        first = next(ln for ln in text.splitlines()[1:] if ln.strip())  # after the 'Summary' heading
        assert first.startswith(("CRITICAL", "WARNING", "OK", "NOTHING")), first  # the verdict first
        screenshot(page, tmp_path, name)
    finally:
        page.close()


PICTURES = sorted((ROOT / "docs" / "img").glob("report-*.txt"))


@pytest.mark.parametrize("shown", PICTURES, ids=lambda p: p.stem)
def test_docs_pictures_show_what_the_report_says_now(browser, tmp_path, shown):
    """Each report screenshot in docs/img comes with the text it shows (scripts/make-reports writes
    both); a fresh render of the same sample must show that text, so a picture of an incident the
    current version no longer reports fails until `scripts/make-docs --pictures` regenerates it."""
    from importlib.machinery import SourceFileLoader

    make_reports = SourceFileLoader("make_reports", str(ROOT / "scripts" / "make-reports")).load_module()
    name = shown.stem.removeprefix("report-")
    assert (shown.with_suffix(".png")).exists(), f"{shown} has no picture beside it"
    cwd = os.getcwd()
    os.chdir(ROOT)  # the page names its capture as samples/..., as make-reports renders it
    try:
        diag = diagnose(kvdoctor.load(Path("samples") / name))
        path = render_report(diag, tmp_path / f"{name}.html", title=f"kvdoctor report · {name}")
    finally:
        os.chdir(cwd)
    r = open_report(browser, path)
    try:
        assert make_reports.shown_text(r.page) == shown.read_text(), \
            f"{shown.name} is stale: regenerate with scripts/make-docs --pictures"
    finally:
        r.page.close()


def test_incident_links_scroll_to_their_sections(browser, tmp_path):
    diag = diagnose(kvdoctor.load(CASES / "context-overflow"))
    assert len(diag.incidents) >= 3
    r = open_report(browser, render_report(diag, tmp_path / "links.html"))
    page = r.page
    try:
        for n in (3, 1, len(diag.incidents)):
            if n == 1:  # the sticky bar's links work too
                page.click('nav a[href="#incident-1"]')
            else:
                page.click(f'#summary a.inc-link[href="#incident-{n}"]')
            page.wait_for_function(f"location.hash === '#incident-{n}'", timeout=5_000)
            # smooth scrolling: wait until the section's top sits just under the sticky bar
            page.wait_for_function(
                f"(() => {{ const t = document.getElementById('incident-{n}').getBoundingClientRect().top; return t > -2 && t < 120; }})()",
                timeout=10_000)
        assert page.evaluate("window.scrollY") > 500
        assert r.errors == []
    finally:
        page.close()


def test_hostile_capture_runs_nothing_and_shows_the_text(browser, tmp_path):
    cap = make_hostile_capture(tmp_path / "cap")
    rules = load_rules([make_hostile_rules(tmp_path / "rules")])
    diag = diagnose(kvdoctor.load(cap), rules)
    r = open_report(browser, render_report(diag, tmp_path / "hostile.html", title=HOSTILE))
    page = r.page
    try:
        assert page.evaluate("typeof window.__pwned") == "undefined"
        assert r.errors == [], r.errors
        assert r.requests == [], r.requests  # <img src=x> never became an element
        assert page.title() == HOSTILE
        text = page.evaluate("document.body.innerText")
        assert text.count(HOSTILE) >= 3  # model in the header, the error message table, the rule's texts
        assert page.evaluate("document.querySelectorAll('main img, main script, header img, header script').length") == 0
        # hovering the OOM marker shows its text as text, too
        assert page.evaluate("[...document.querySelectorAll('.kvd-chart')].every(d => d.querySelector('.main-svg'))")
        screenshot(page, tmp_path, "hostile", publish=False)
        assert page.evaluate("typeof window.__pwned") == "undefined"
    finally:
        page.close()


def test_fleet_page_renders_and_runs_no_label_markup(browser, tmp_path):
    """`kvdoctor report --prometheus` output: both charts drawn, no console error or network
    request, and an instance label that is markup shows as text and runs nothing."""
    from kvdoctor.diagnosis import Options
    from kvdoctor.fleet import diagnose_fleet
    from kvdoctor.report.fleet_html import render_fleet_html

    from test_fleet import HOSTILE_NAME, _fleet

    names = ["a:1", "b:1", "c:1", HOSTILE_NAME]
    d = _fleet({n: (6 if n == HOSTILE_NAME else 0) for n in names}, {n: (300 if n == HOSTILE_NAME else 100) for n in names})
    fd = diagnose_fleet(d, load_rules(), Options(lookback_s=120, step_s=10))
    path = tmp_path / "fleet.html"
    path.write_text(render_fleet_html(fd), encoding="utf-8")
    r = open_report(browser, path)
    page = r.page
    try:
        assert page.evaluate("window.__kvdoctorRenderError || null") is None
        assert r.errors == [] and r.requests == [], (r.errors, r.requests)
        assert page.evaluate("[...document.querySelectorAll('.kvd-chart')].filter(d => d.querySelector('.main-svg')).length") == 2
        assert page.evaluate("typeof window.__pwned") == "undefined"
        assert page.evaluate("document.querySelectorAll('main img, header img').length") == 0
        assert HOSTILE_NAME in page.evaluate("document.getElementById('replicas').innerText")
        assert "queueing-saturation" in page.evaluate("document.getElementById('findings').innerText")
        screenshot(page, tmp_path, "fleet")
    finally:
        page.close()
