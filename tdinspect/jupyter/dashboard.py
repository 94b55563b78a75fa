"""``tdinspect.dashboard(a, b)``: one page with the summary, the divergence plot, the health
table, the module tree and the side-by-side view; ``tdinspect dashboard A B`` serves it with Voilà.

The page is an ipywidgets layout around a :class:`~tdinspect.jupyter.widgets.DiffExplorer`
(which caches what does not change); picking a row of the health table or a node of the tree
shows that entry side by side and marks it on the plot, and the entry on show is marked in both.

Examples
--------
>>> tdinspect.dashboard("runs/fp32", "runs/bf16")          # doctest: +SKIP
"""

from __future__ import annotations

import os
import re
import time

import ipywidgets as W
from IPython.display import display

from tdinspect.jupyter.widgets import DiffExplorer
from tdinspect.util.terminal import html_text

ENV_A, ENV_B, ENV_OPTIONS = "TDINSPECT_DASHBOARD_A", "TDINSPECT_DASHBOARD_B", "TDINSPECT_DASHBOARD_OPTIONS"


class Dashboard:
    """The dashboard's widgets; displays itself.

    Attributes
    ----------
    explorer : DiffExplorer
        The plot, threshold and metric pickers and the side-by-side view.
    health : HealthTable
        The explorer's health table (:mod:`tdinspect.jupyter.healthview`): one row per
        compared entry (share of threshold, value, growth, NaN/Inf, one-sided; divergent rows
        marked), sortable, with a name filter; picking one shows it side by side, and the row
        of the entry on show is highlighted.
    entries : ipywidgets.Select
        The health table's rows.
    tree : TreePanel
        The explorer's module tree (:mod:`tdinspect.jupyter.treeview`).
    widget : ipywidgets.AppLayout
    build_seconds : float
        How long building the first view took.
    """

    def __init__(self, diff, *, metric: str | None = None, threshold: float | str | None = None):
        t0 = time.perf_counter()
        self.diff = diff
        self.explorer = ex = DiffExplorer(diff, metric=metric, threshold=threshold)
        self.header = W.HTML(layout=W.Layout(padding="0 0 4px 0"))
        self.tree = ex.overview.tree
        self.health = ex.overview.table
        self.entries = self.health.rows  # follows the view: the entry and pass on show
        self.health.rows.rows = 20
        # the columns' widths add up to less than the cell's (padding and borders included)
        table = W.VBox(
            [
                W.HTML("<b>entries</b> <small>(pick one to see it; sort and filter them)</small>"),
                self.health.widget,
                self.tree.widget,
            ],
            layout=W.Layout(width="32%", min_width="0"),
        )
        main = W.VBox(
            [ex.controls(), ex.label, ex.plot.widget, ex.pickers(), ex.message, ex.view.widget],
            layout=W.Layout(width="66%", min_width="0"),
        )
        self.header.value = (
            f"<b>tdinspect dashboard</b> &nbsp; A (reference): "
            f"<code>{html_text(diff.a.path)}</code> &nbsp; B: <code>{html_text(diff.b.path)}</code>"
            + (
                f" &nbsp; compared with: <code>{html_text(diff.spec.describe())}</code>"
                if diff.spec.describe()
                else ""
            )
        )
        self.widget = W.VBox(
            [
                self.header,
                W.HBox([table, main], layout=W.Layout(width="100%", justify_content="space-between")),
            ],
            layout=W.Layout(width="100%", max_width="100%", overflow="hidden"),
        )
        self.build_seconds = time.perf_counter() - t0

    def _ipython_display_(self) -> None:
        display(self.widget)


def dashboard(
    a=None, b=None, *, metric: str | None = None, threshold: float | str | None = None, **diff_kwargs
) -> Dashboard:
    """One page to find where two runs part: summary, divergence plot, entry table, side by side.

    Parameters
    ----------
    a, b : DumpSet, Diff or path
        Reference and compared dump (or a Diff as ``a`` alone). Without
        either, the paths come from ``TDINSPECT_DASHBOARD_A`` / ``_B`` (how
        ``tdinspect dashboard A B`` hands them to the Voilà page).
    metric, threshold : optional
        What the page opens on (default: the diff's own, from its
        :attr:`~tdinspect.Diff.spec`: ``rel_diff`` at ``"auto"`` unless it says otherwise).
    **diff_kwargs
        Passed to :meth:`DumpSet.diff` (``spec=``, ``mapping=``, ``structural="report"``,
        ...). A Diff given brings its own spec: the page answers what the diff answers.

    Returns
    -------
    Dashboard
        Displays itself.

    Examples
    --------
    >>> tdinspect.dashboard("sample_dumps/float32", "sample_dumps/wrong_layer")   # doctest: +SKIP
    """
    from tdinspect.compare.diff import Diff
    from tdinspect.dumpset import DumpSet

    if isinstance(a, Diff):
        return Dashboard(a, metric=metric, threshold=threshold)
    if a is None:  # the page `tdinspect dashboard A B` serves: its spec comes as JSON (data)
        from tdinspect.compare.spec import CompareSpec

        a, b = os.environ.get(ENV_A), os.environ.get(ENV_B)
        if not a or not b:
            raise ValueError("dashboard() needs two dumps (or TDINSPECT_DASHBOARD_A and _B set)")
        diff_kwargs = {"spec": CompareSpec.from_json(os.environ.get(ENV_OPTIONS) or "{}"), **diff_kwargs}
    ref = DumpSet.coerce(a)
    return Dashboard(ref.diff(b, **diff_kwargs), metric=metric, threshold=threshold)


def page_environment(a, b, spec) -> dict[str, str]:
    """What :func:`serve` hands its page (read back by :func:`dashboard` without arguments):
    the two dump paths and ``spec`` (a :class:`~tdinspect.compare.spec.CompareSpec`) as JSON."""
    from pathlib import Path

    return {ENV_A: str(Path(a).resolve()), ENV_B: str(Path(b).resolve()), ENV_OPTIONS: spec.to_json()}


def check_port(port) -> int:
    """``port`` as an int in 0-65535 (0: a free one is picked), else ``ValueError`` naming it."""
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"port {port!r}: expected a TCP port, 0 to 65535 (0: any free port)")
    return port


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(
    a,
    b,
    *,
    port: int = 8866,
    spec=None,
    open_browser: bool = True,
    **options,
) -> int:
    """Serve :func:`dashboard` of ``a`` and ``b`` with Voilà on 127.0.0.1 (until Ctrl-C).

    ``spec`` (a :class:`~tdinspect.compare.spec.CompareSpec`) and ``options`` (its fields:
    ``mapping=``, ``structural=``, ``metric=``...) make the comparison the page shows, as
    ``tdinspect first-divergence`` makes it from the same flags.

    The page shows the dumps' data, so only its URL opens it, as with Jupyter: a
    random token (printed in the URL, never on a command line other users can
    read) is required by Voilà's Jupyter-server login, and requests whose
    ``Host`` is not this machine (``127.0.0.1``, ``localhost``, ``[::1]``: a
    DNS-rebinding page) are refused (Jupyter server's ``allow_remote_access=False``).
    The dump paths and the spec (JSON) reach the page through environment
    variables, never as code. ``port`` 0 picks a free one. Returns Voilà's exit status.

    Raises
    ------
    RuntimeError
        When Voilà is not installed (``pip install 'tdinspect[dashboard]'``).
    ValueError
        When ``port`` is not 0-65535.
    """
    import importlib.util
    import json
    import secrets
    import shutil
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    import nbformat

    from tdinspect.compare.spec import CompareSpec
    from tdinspect.dumpset import DumpSet

    check_port(port)
    spec = CompareSpec.coerce(spec).replace(**options)
    spec.to_json()  # data, never code: a callable transform is refused before anything starts
    if importlib.util.find_spec("voila") is None:
        raise RuntimeError("tdinspect dashboard needs Voilà: pip install 'tdinspect[dashboard]'")
    for path in (a, b):
        DumpSet.open(path)  # a clear error now, not a broken page later
    port = port or _free_port()
    token = secrets.token_hex(24)
    url = f"http://127.0.0.1:{port}/?token={token}"
    folder = Path(tempfile.mkdtemp(prefix="tdinspect-dashboard-"))  # 0700: the token stays ours
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("import tdinspect\ntdinspect.dashboard()")]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, folder / "tdinspect_dashboard.ipynb")
    # Voilà reads voila.json from its working folder first (over the user's Jupyter config)
    config = {
        "Voila": {
            "token": token,
            "port_retries": 0,  # this port or none: the printed URL is the one served
            "open_browser": False,
            "tornado_settings": {"allow_remote_access": False, "local_hostnames": ["localhost"]},
        }
    }
    fd = os.open(folder / "voila.json", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(config, f)
    env = {**os.environ, **page_environment(a, b, spec)}
    env.pop("JUPYTER_TOKEN", None)
    template = offline_template(folder)
    if template is not None:  # Voilà looks for templates in JUPYTER_PATH's voila/templates
        env["JUPYTER_PATH"] = os.pathsep.join(p for p in (str(folder), env.get("JUPYTER_PATH")) if p)
    cmd = [
        sys.executable,
        "-m",
        "voila",
        str(folder / "tdinspect_dashboard.ipynb"),
        f"--port={port}",
        "--Voila.ip=127.0.0.1",
        "--strip_sources=True",
        "--preheat_kernel=True",
        "--no-browser",
        *([f"--template={template}"] if template is not None else []),
    ]
    print(
        f"tdinspect: serving the dashboard of {a} vs {b} (Ctrl-C stops); open it at\n    {url}",
        flush=True,
    )
    try:
        proc = subprocess.Popen(cmd, env=env, cwd=folder)
        if open_browser:
            _open_when_up(port, url, folder, proc)
        return proc.wait()
    except KeyboardInterrupt:
        return 0
    finally:
        shutil.rmtree(folder, ignore_errors=True)


OFFLINE_TEMPLATE = "tdinspect-offline"
# what Voilà's lab page loads from the network: Font Awesome's stylesheets (a CDN), and the
# mermaid.js that nbconvert's page imports from cdnjs
_EXTERNAL = re.compile(r"""^.*(href|src)=["']https?://.*$\n?""", re.MULTILINE)
_NO_MERMAID = "{%- block html_head_js_mermaidjs -%}{%- endblock html_head_js_mermaidjs -%}\n"


def offline_template(folder) -> str | None:
    """Write, under ``folder/voila/templates``, Voilà's ``lab`` page without what it loads from
    the network (a page of local dumps on a machine without one waited on a CDN, and told it
    who was looking); returns its name for ``--template``, or ``None`` when Voilà's own ``lab``
    template cannot be found (its page is then served as it is)."""
    from pathlib import Path

    try:
        from jupyter_core.paths import jupyter_path
    except ImportError:
        return None
    source = next(
        (
            Path(p) / "index.html.j2"
            for p in jupyter_path("voila", "templates", "lab")
            if (Path(p) / "index.html.j2").is_file()
        ),
        None,
    )
    if source is None:
        return None
    page = _EXTERNAL.sub("", source.read_text(encoding="utf-8")) + _NO_MERMAID
    out = Path(folder) / "voila" / "templates" / OFFLINE_TEMPLATE
    out.mkdir(parents=True, exist_ok=True)
    (out / "index.html.j2").write_text(page, encoding="utf-8")
    (out / "conf.json").write_text('{"base_template": "lab"}', encoding="utf-8")
    return OFFLINE_TEMPLATE


def _open_when_up(port: int, url: str, folder, proc) -> None:
    """Open ``url`` in a browser once the server answers, through a redirect file (as Jupyter
    does: the token never appears on a browser's command line)."""
    import html
    import socket
    import threading
    import webbrowser

    page = folder / "open.html"
    fd = os.open(page, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(f'<meta http-equiv="refresh" content="0;url={html.escape(url)}">')

    def wait_then_open():
        deadline = time.time() + 120
        while proc.poll() is None and time.time() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
            except OSError:
                time.sleep(0.3)
                continue
            webbrowser.open(page.as_uri())
            return

    threading.Thread(target=wait_then_open, daemon=True).start()
