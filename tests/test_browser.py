"""A person's view: JupyterLab in headless Chromium runs notebook 02 and moves the threshold slider.

The server is started and stopped by the fixture (by its own PID), with
temporary Jupyter config and runtime folders, on a free loopback port. The
screenshot is kept in ``test-artifacts/`` (its path is printed).
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from .conftest import ROOT

CHROMIUM = "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]
ARTIFACTS = ROOT / "test-artifacts"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def jupyterlab(tmp_path):
    if not os.path.exists(CHROMIUM):
        if os.environ.get("CI"):
            pytest.fail(f"{CHROMIUM} missing: .ci/run installs Debian's chromium")
        pytest.skip(f"{CHROMIUM} not installed (apt-get install -y chromium)")
    pytest.importorskip("playwright")
    port, token = _free_port(), secrets.token_hex(16)
    served = tmp_path / "served"  # a copy: autosave must never touch the repository's notebooks
    shutil.copytree(ROOT / "sample_dumps", served / "sample_dumps")
    (served / "notebooks").mkdir()
    shutil.copy(ROOT / "notebooks" / "02_compare_two_runs.ipynb", served / "notebooks")
    env = {**os.environ, "JUPYTER_CONFIG_DIR": str(tmp_path / "config"),
           "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime"), "MPLBACKEND": "module://matplotlib_inline.backend_inline"}
    log = open(tmp_path / "jupyter.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "jupyter", "lab", "--no-browser", f"--port={port}", "--ip=127.0.0.1",
         f"--ServerApp.root_dir={served}", f"--IdentityProvider.token={token}",
         "--LabApp.news_url=", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
         "--ServerApp.open_browser=False", "--allow-root"],
        cwd=served, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 90
        while True:
            try:
                urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2)
                break
            except OSError:
                if proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError("JupyterLab did not start:\n" + (tmp_path / "jupyter.log").read_text())
                time.sleep(0.5)
        yield base, token
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def _accept_dialogs(page) -> None:
    """Answer JupyterLab's modal dialogs (e.g. "Select Kernel" on a fresh machine) with their default."""
    for _ in range(3):
        accept = page.locator(".jp-Dialog .jp-mod-accept")
        if not accept.count():
            return
        accept.first.click()
        time.sleep(0.5)


def _label(page) -> str:
    loc = page.locator(".widget-html-content", has_text=re.compile("first divergence|no divergence"))
    return loc.last.inner_text()


def test_threshold_slider_moves_first_divergence_in_jupyterlab(jupyterlab, tmp_path):
    from playwright.sync_api import sync_playwright

    base, token = jupyterlab
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=FLAGS,
                                     chromium_sandbox=False)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(f"{base}/lab/tree/notebooks/02_compare_two_runs.ipynb?token={token}")
        page.wait_for_selector(".jp-Notebook", timeout=90_000)
        page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=90_000)
        label = page.locator(".widget-html-content", has_text="first divergence")
        for attempt in range(3):  # a kernel still starting can drop the first request: ask again
            time.sleep(2)
            _accept_dialogs(page)
            page.get_by_role("menuitem", name="Run", exact=True).click()
            page.locator("li[data-command='runmenu:run-all']").click()
            time.sleep(2)
            _accept_dialogs(page)
            try:
                label.first.wait_for(timeout=60_000)
                break
            except Exception:
                page.screenshot(path=str(ARTIFACTS / f"browser_02_attempt{attempt}.png"))
                _accept_dialogs(page)
        else:
            raise AssertionError("the explorer never rendered; see test-artifacts/browser_02_attempt*.png")
        before = _label(page)
        readout = page.locator(".widget-readout").last
        readout.click()
        page.keyboard.press("Control+A")
        page.keyboard.type("1e-7")
        page.keyboard.press("Enter")
        deadline = time.time() + 60
        after = before
        while after == before and time.time() < deadline:
            time.sleep(0.5)
            after = _label(page)
        page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=60_000)
        time.sleep(1.0)  # let the re-drawn figure reach the page
        shot = ARTIFACTS / "browser_02_threshold.png"
        page.locator(".widget-html-content", has_text="first divergence").last.scroll_into_view_if_needed()
        page.screenshot(path=str(shot))
        print(f"\nscreenshot: {shot}\nbefore: {before}\nafter:  {after}")
        browser.close()
    assert before.startswith("first divergence:")
    assert after != before and after.startswith("first divergence:")
