"""A person's view: JupyterLab and Voila in headless Chromium.

Notebook 02: move the threshold slider, switch the metric, pick a pass.
Notebook 05: re-run a capture cell, open again (exactly the new run).
``tdinspect dashboard A B``: the Voila page's first view, then a pick in its table.
A notebook of its own: the module tree without a kernel, the explorer's tree and health table
linked both ways to the view, and the tree of a port diff with its mapping; the dashboard's
table following the pass on show, filtered and sorted (screenshots in ``docs/images/``).

Servers are started and stopped by the fixtures (by their own PIDs), with
temporary Jupyter config and runtime folders, on free loopback ports.
Screenshots and the measured interaction times (``browser_timings.json``)
are kept in ``test-artifacts/`` (paths printed).
"""

from __future__ import annotations

import json
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
from pathlib import Path

import pytest

from .conftest import ROOT

CHROMIUM = "/usr/bin/chromium"
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
ARTIFACTS = ROOT / "test-artifacts"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(proc, log) -> None:
    """End a server started in its own process group (SIGTERM, then SIGKILL after 20 s) and close its log."""
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    log.close()


def _wait_for_server(url: str, proc, log: Path, what: str) -> None:
    """Return once ``url`` answers (any HTTP status); fail with ``log`` if ``proc`` exits or
    90 s pass first."""
    deadline = time.time() + 90
    while True:
        try:
            urllib.request.urlopen(url, timeout=2)
            return
        except urllib.error.HTTPError:
            return  # the server answers
        except OSError:
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"{what} did not start:\n" + log.read_text()) from None
            time.sleep(0.5)


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
    for name in ("02_compare_two_runs.ipynb", "05_magics.ipynb"):
        shutil.copy(ROOT / "notebooks" / name, served / "notebooks")
    env = {
        **os.environ,
        "JUPYTER_CONFIG_DIR": str(tmp_path / "config"),
        "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime"),
        "MPLBACKEND": "module://matplotlib_inline.backend_inline",
    }
    log = open(tmp_path / "jupyter.log", "w")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jupyter",
            "lab",
            "--no-browser",
            f"--port={port}",
            "--ip=127.0.0.1",
            f"--ServerApp.root_dir={served}",
            f"--IdentityProvider.token={token}",
            "--LabApp.news_url=",
            "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
            "--ServerApp.open_browser=False",
            "--allow-root",
        ],
        cwd=served,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_for_server(f"{base}/api/status?token={token}", proc, tmp_path / "jupyter.log", "JupyterLab")
        yield base, token
    finally:
        _stop(proc, log)


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


def _open_and_run_all(page, base, token, name, ready):
    page.goto(f"{base}/lab/tree/notebooks/{name}?token={token}")
    page.wait_for_selector(".jp-Notebook", timeout=90_000)
    page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=90_000)
    for attempt in range(3):  # a kernel still starting can drop the first request: ask again
        time.sleep(2)
        _accept_dialogs(page)
        page.get_by_role("menuitem", name="Run", exact=True).click()
        page.locator("li[data-command='runmenu:run-all']").click()
        time.sleep(2)
        _accept_dialogs(page)
        try:
            ready.first.wait_for(timeout=60_000)
            return
        except Exception:
            page.screenshot(path=str(ARTIFACTS / f"browser_{name}_attempt{attempt}.png"))
            _accept_dialogs(page)
    raise AssertionError(f"{name} never rendered; see test-artifacts/browser_{name}_attempt*.png")


def _until(read, before, timeout=60.0):
    """Poll ``read()`` until it differs from ``before``; returns (value, seconds)."""
    t0 = time.perf_counter()
    value = read()
    while value == before and time.perf_counter() - t0 < timeout:
        time.sleep(0.02)
        value = read()
    return value, time.perf_counter() - t0


def _dropdown(page, description: str):
    return page.locator(
        ".widget-dropdown", has=page.locator("label", has_text=re.compile(f"^{description}$"))
    ).last.locator("select")


def _save_timings(new: dict) -> None:
    path = ARTIFACTS / "browser_timings.json"
    data = json.loads(path.read_text()) if path.exists() else {}
    data.update(new)
    path.write_text(json.dumps(data, indent=1))


def _browser(pw):
    return pw.chromium.launch(executable_path=CHROMIUM, args=FLAGS, chromium_sandbox=False)


def test_explorer_in_jupyterlab_threshold_metric_and_pass(jupyterlab, tmp_path):
    from playwright.sync_api import sync_playwright

    base, token = jupyterlab
    ARTIFACTS.mkdir(exist_ok=True)
    times = {}
    with sync_playwright() as pw:
        browser = _browser(pw)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        _open_and_run_all(
            page,
            base,
            token,
            "02_compare_two_runs.ipynb",
            page.locator(".widget-html-content", has_text="first divergence"),
        )
        before = _label(page)
        plot = page.locator(".widget-image").nth(-2)  # the divergence plot; the last is the view

        def redrawn(action, label_before):
            """Seconds until both the label and the plot image have changed."""
            src = plot.get_attribute("src")
            t0 = time.perf_counter()
            action()
            label, _ = _until(lambda: _label(page), label_before)
            _until(lambda: plot.get_attribute("src"), src)
            return label, time.perf_counter() - t0

        readout = page.locator(".widget-readout").last
        readout.click()
        page.keyboard.press("Control+A")
        page.keyboard.type("1e-7")
        after, times["threshold_s"] = redrawn(lambda: page.keyboard.press("Enter"), before)
        page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=60_000)
        time.sleep(1.0)  # let the re-drawn figures reach the page
        shots = [ARTIFACTS / "browser_02_threshold.png"]
        page.locator(".widget-html-content", has_text="first divergence").last.scroll_into_view_if_needed()
        page.screenshot(path=str(shots[-1]))
        # switch the metric: its own threshold ("auto"), direction and scale come with it
        cosine, times["metric_s"] = redrawn(lambda: _dropdown(page, "metric").select_option("cosine"), after)
        page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=60_000)
        readout_text = page.locator(".widget-readout").last.inner_text()
        time.sleep(1.0)
        shots.append(ARTIFACTS / "browser_02_metric_cosine.png")
        page.screenshot(path=str(shots[-1]))
        # pick a pass: the side-by-side view (the last image) is redrawn for it
        view = page.locator(".widget-image").last
        src = view.get_attribute("src")
        t0 = time.perf_counter()
        _dropdown(page, "pass").select_option("1")
        _until(lambda: view.get_attribute("src"), src)
        times["pass_s"] = time.perf_counter() - t0
        time.sleep(1.0)
        view.scroll_into_view_if_needed()
        shots.append(ARTIFACTS / "browser_02_pass1.png")
        page.screenshot(path=str(shots[-1]))
        # pick an entry the view has not shown (the last: another tensor shape)
        entry = _dropdown(page, "entry")
        src = view.get_attribute("src")
        t0 = time.perf_counter()
        entry.select_option(index=entry.locator("option").count() - 1)
        _until(lambda: view.get_attribute("src"), src)
        times["entry_s"] = time.perf_counter() - t0
        browser.close()
    _save_timings({f"explorer_{k}": round(v, 3) for k, v in times.items()})
    print(
        f"\nscreenshots: {[str(p) for p in shots]}\ntimes (s): {times}\nbefore: {before}\n"
        f"after:  {after}\ncosine: {cosine}"
    )
    assert before.startswith("first divergence:")
    assert after != before and after.startswith("first divergence:")
    # the metric switch brings threshold "auto" back: bfloat16's 1 - u/4 for these entries
    assert "cosine threshold auto (cosine 1 - u/4" in cosine and "bfloat16 0.999" in cosine
    assert readout_text.strip() == "0.999023"
    assert times["pass_s"] < 60


def test_rerunning_a_capture_cell_opens_exactly_the_new_run(jupyterlab):
    from playwright.sync_api import sync_playwright

    base, token = jupyterlab
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as pw:
        browser = _browser(pw)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        _open_and_run_all(
            page,
            base,
            token,
            "05_magics.ipynb",
            page.locator(".widget-html-content", has_text="first divergence"),
        )
        cells = page.locator(".jp-Notebook .jp-CodeCell")

        def run(index):
            cells.nth(index).locator(".jp-InputArea-editor").click()
            page.keyboard.press("Control+Enter")
            time.sleep(1.0)
            page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=60_000)
            return cells.nth(index).locator(".jp-OutputArea").inner_text()

        captured = run(1)  # %%tdi_capture $out/good --model good, a second time
        opened = run(3)  # %tdi_open ref $out/good
        cells.nth(3).scroll_into_view_if_needed()
        shot = ARTIFACTS / "browser_05_rerun_capture.png"
        page.screenshot(path=str(shot))
        browser.close()
    print(f"\nscreenshot: {shot}\ncapture: {captured}\nopen: {opened}")
    assert "wrote" in captured and "pass00000" in captured
    # the new run alone, not the old pass beside it: one short note, then its summary
    assert "opened the newest" in opened and "passes\t1\n" in opened


@pytest.fixture
def voila_dashboard(tmp_path):
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"{CHROMIUM} not installed (apt-get install -y chromium)")
    pytest.importorskip("playwright")
    pytest.importorskip("voila")
    port = _free_port()
    env = {
        **os.environ,
        "JUPYTER_CONFIG_DIR": str(tmp_path / "config"),
        "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime"),
        "MPLBACKEND": "module://matplotlib_inline.backend_inline",
    }
    log = open(tmp_path / "voila.log", "w")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tdinspect",
            "dashboard",
            str(ROOT / "sample_dumps" / "float32"),
            str(ROOT / "sample_dumps" / "wrong_layer"),
            f"--port={port}",
            "--no-browser",
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_for_server(f"{base}/api/status", proc, tmp_path / "voila.log", "Voila")
        # the page opens only with the token the command printed in its URL
        url = re.search(rf"{re.escape(base)}/\?token=\w+", (tmp_path / "voila.log").read_text())
        assert url, (tmp_path / "voila.log").read_text()
        yield url.group()
    finally:
        _stop(proc, log)


def test_dashboard_served_by_voila(voila_dashboard):
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as pw:
        browser = _browser(pw)
        page = browser.new_page(viewport={"width": 1500, "height": 1100})
        t0 = time.perf_counter()
        page.goto(voila_dashboard)
        label = page.locator(".widget-html-content", has_text="first divergence")
        label.first.wait_for(timeout=120_000)
        page.locator(".widget-image").last.wait_for(timeout=60_000)
        first_view = time.perf_counter() - t0
        text = label.first.inner_text()
        body = page.locator("body").inner_text()
        shot = ARTIFACTS / "browser_dashboard.png"
        page.screenshot(path=str(shot), full_page=True)
        table = page.locator(".widget-select select").first
        view = page.locator(".widget-image").last
        src = view.get_attribute("src")
        table.select_option(index=len(table.locator("option").all()) - 1)  # the last entry
        _, pick = _until(lambda: view.get_attribute("src"), src)
        shot2 = ARTIFACTS / "browser_dashboard_pick.png"
        page.screenshot(path=str(shot2), full_page=True)
        time.sleep(10)  # the server pre-heats a kernel (runs the page) for the next visitor
        again = browser.new_page(viewport={"width": 1500, "height": 1100})
        t0 = time.perf_counter()
        again.goto(voila_dashboard)
        again.locator(".widget-html-content", has_text="first divergence").first.wait_for(timeout=120_000)
        again.locator(".widget-image").last.wait_for(timeout=60_000)
        warm_view = time.perf_counter() - t0
        browser.close()
    _save_timings(
        {
            "dashboard_first_view_s": round(first_view, 3),
            "dashboard_pick_s": round(pick, 3),
            "dashboard_preheated_view_s": round(warm_view, 3),
        }
    )
    print(
        f"\nscreenshots: {shot}, {shot2}\nfirst view {first_view:.2f} s (pre-heated: "
        f"{warm_view:.2f} s), pick {pick:.2f} s\n{text}"
    )
    assert "model.layers.2.mlp.down" in text and "(auto: float32)" in text  # threshold "auto"
    assert "None" not in body.split()  # no stray None outputs on the page
    assert pick < 60


TREE_NOTEBOOK = [
    "import tdinspect\n"
    "diff = tdinspect.DumpSet.open('../sample_dumps/float32').diff('../sample_dumps/wrong_layer')\n"
    "diff.tree()",
    "ex = tdinspect.explore(diff)\nex",
    "import tempfile\n"
    "from tdinspect.examples.port import capture_port_pair\n"
    "root = tempfile.mkdtemp()\n"
    "ref_dir, port_dir = capture_port_pair(root + '/good')\n"
    "_, bug_dir = capture_port_pair(root + '/bug', rope='interleaved')\n"
    "ref = tdinspect.DumpSet.open(ref_dir)\n"
    "rules = dict(tdinspect.suggest_mapping(ref, tdinspect.DumpSet.open(port_dir)).rules)\n"
    "rules[r'model\\.model\\.layers\\.(\\d+)\\.self_attn\\.v_proj'] = "
    "[r'model.blocks.\\1.attn.qkv', 'narrow(-1, 48, 16)']\n"
    "port = ref.diff(bug_dir, mapping=rules)\n"
    "display(port.plan()[['a_key', 'b_key', 'transform', 'status']].head(6))\n"
    "port.tree(allow_uncompared='rotary_emb')",
]


def _text_box(page, description: str):
    return page.locator(
        ".widget-text", has=page.locator("label", has_text=re.compile(f"^{description}$"))
    ).last.locator("input")


def _selected_text(select) -> str:
    return select.evaluate("s => s.selectedIndex < 0 ? '' : s.options[s.selectedIndex].textContent").replace(
        "\xa0", " "
    )


def test_tree_and_health_table_in_jupyterlab_linked_to_the_view(jupyterlab, tmp_path):
    """The static module tree (no kernel needed), the explorer's tree and health table linked
    both ways to the side-by-side view, and the tree of a port diff with its mapping."""
    import nbformat
    from playwright.sync_api import sync_playwright

    base, token = jupyterlab
    ARTIFACTS.mkdir(exist_ok=True)
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(src) for src in TREE_NOTEBOOK]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, tmp_path / "served" / "notebooks" / "tree.ipynb")
    times, shots = {}, {}
    with sync_playwright() as pw:
        browser = _browser(pw)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        _open_and_run_all(page, base, token, "tree.ipynb", page.locator("th", has_text="b_key"))
        page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=120_000)
        time.sleep(1.0)
        static = page.locator(".jp-OutputArea-output", has_text="module tree").first
        opened = static.locator("details[open] > summary").all_inner_texts()
        static.scroll_into_view_if_needed()
        shots["tree_static"] = ARTIFACTS / "browser_tree_static.png"
        static.screenshot(path=str(shots["tree_static"]))
        table = page.locator(".tdi-mono select").first
        view = page.locator(".widget-image").last
        first_row = _selected_text(table)
        # the view moves to pass 1: the table's highlighted row follows
        t0 = time.perf_counter()
        _dropdown(page, "pass").select_option("1")
        followed, _ = _until(lambda: _selected_text(table), first_row)
        times["pass_to_row_s"] = time.perf_counter() - t0
        # a row picked: the view shows it
        src = view.get_attribute("src")
        t0 = time.perf_counter()
        table.select_option(index=table.locator("option").count() - 1)
        _until(lambda: view.get_attribute("src"), src)
        times["row_to_view_s"] = time.perf_counter() - t0
        picked = _selected_text(table)
        # the name filter (applied on Enter)
        n_rows = table.locator("option").count()
        t0 = time.perf_counter()
        _text_box(page, "filter").fill("mlp")
        _text_box(page, "filter").press("Enter")
        filtered, _ = _until(lambda: table.locator("option").count(), n_rows)
        times["filter_s"] = time.perf_counter() - t0
        # a node clicked: it opens and the view shows its worst entry
        node = page.locator(".jupyter-button", has_text=re.compile(r"^▸ 3 ")).first
        src = view.get_attribute("src")
        t0 = time.perf_counter()
        node.click()
        page.locator(".jupyter-button", has_text=re.compile(r"^▾ 3 ")).first.wait_for(timeout=60_000)
        _until(lambda: view.get_attribute("src"), src)
        times["node_to_view_s"] = time.perf_counter() - t0
        time.sleep(1.0)
        overview = page.locator(".tdi-overview").first
        overview.scroll_into_view_if_needed()
        shots["tree_explorer"] = ARTIFACTS / "browser_tree_explorer.png"
        overview.screenshot(path=str(shots["tree_explorer"]))
        port = page.locator(".jp-OutputArea-output", has_text="module tree").last
        port_text = port.inner_text()
        port.scroll_into_view_if_needed()
        shots["tree_port"] = ARTIFACTS / "browser_tree_port.png"
        page.locator(".jp-Cell").last.screenshot(path=str(shots["tree_port"]))
        browser.close()
    _save_timings({f"tree_{k}": round(v, 3) for k, v in times.items()})
    print(f"\nscreenshots: {[str(p) for p in shots.values()]}\ntimes (s): {times}")
    assert [t.split()[0] for t in opened] == ["model", "layers", "2", "mlp"]  # the path to the divergence
    assert "model.layers.2.mlp.down" in first_row and " p0 " in first_row
    assert "model.layers.2.mlp.down" in followed and " p1 " in followed
    assert picked.endswith("model.lm_head") and " p1 " in picked
    assert 0 < filtered < n_rows
    assert (
        "first divergence: model.model.layers.0.self_attn" in port_text
    )  # the RoPE bug, through the mapping


def test_dashboard_table_filters_and_follows_the_view_in_voila(voila_dashboard):
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(exist_ok=True)
    times = {}
    with sync_playwright() as pw:
        browser = _browser(pw)
        page = browser.new_page(viewport={"width": 1500, "height": 1100})
        page.goto(voila_dashboard)
        page.locator(".widget-html-content", has_text="first divergence").first.wait_for(timeout=120_000)
        page.locator(".widget-image").last.wait_for(timeout=60_000)
        table = page.locator(".tdi-mono select").first
        table.wait_for(timeout=60_000)
        before = _selected_text(table)
        t0 = time.perf_counter()
        _dropdown(page, "pass").select_option("1")
        after, _ = _until(lambda: _selected_text(table), before)
        times["pass_to_row_s"] = time.perf_counter() - t0
        n_rows = table.locator("option").count()
        t0 = time.perf_counter()
        _text_box(page, "filter").fill("lm_head")
        _text_box(page, "filter").press("Enter")
        n, _ = _until(lambda: table.locator("option").count(), n_rows)
        times["filter_s"] = time.perf_counter() - t0
        _dropdown(page, "sort").select_option(label="share of threshold (worst first)")
        time.sleep(1.5)
        shot = ARTIFACTS / "browser_dashboard_table.png"
        page.screenshot(path=str(shot), full_page=True)
        browser.close()
    _save_timings({f"dashboard_table_{k}": round(v, 3) for k, v in times.items()})
    print(f"\nscreenshot: {shot}\ntimes (s): {times}\nbefore: {before}\nafter: {after}")
    assert "model.layers.2.mlp.down" in before and " p0 " in before
    assert "model.layers.2.mlp.down" in after and " p1 " in after  # it kept pass 0's row
    assert n == 2  # model.lm_head in passes 0 and 1
