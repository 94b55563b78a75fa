"""`tdinspect dashboard` serves the dumps' data only to its own URL: a token, a local Host, a
valid port."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from tdinspect.cli import main
from tdinspect.jupyter.dashboard import serve

from .conftest import ROOT

A, B = str(ROOT / "sample_dumps" / "float32"), str(ROOT / "sample_dumps" / "wrong_layer")


@pytest.mark.parametrize("port", ["-1", "70000", "65536", "http", "8866.5"])
def test_a_port_outside_0_to_65535_is_an_argument_error(port, capsys):
    """--port -1 was a traceback; --port 70000 served on 4464 while printing 70000."""
    with pytest.raises(SystemExit) as info:
        main(["dashboard", A, B, f"--port={port}", "--no-browser"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "argument --port" in err and "0 to 65535" in err and port in err, err
    with pytest.raises(ValueError, match="0 to 65535"):
        serve(A, B, port=int(port) if port.lstrip("-").isdigit() else port, open_browser=False)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *a, **kw):
        return None


def _get(url: str, host: str | None = None) -> tuple[int, str]:
    request = urllib.request.Request(url, headers={"Host": host} if host else {})
    try:
        with urllib.request.build_opener(_NoRedirect).open(request, timeout=60) as r:
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


@pytest.fixture
def dashboard(tmp_path):
    pytest.importorskip("voila")
    port = _free_port()
    env = {
        **os.environ,
        "JUPYTER_CONFIG_DIR": str(tmp_path / "config"),
        "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime"),
        "JUPYTER_TOKEN": "",  # the command makes its own, whatever the environment says
        "PYTHONPATH": str(ROOT),
    }
    log = open(tmp_path / "voila.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "tdinspect", "dashboard", A, B, f"--port={port}", "--no-browser"],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        cwd=tmp_path,
    )
    try:
        deadline = time.time() + 120
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError((tmp_path / "voila.log").read_text()) from None
                time.sleep(0.5)
        text = (tmp_path / "voila.log").read_text()
        url = re.search(rf"http://127\.0\.0\.1:{port}/\?token=(\w+)", text)
        yield port, url.group(1) if url else ""
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def test_the_dashboard_needs_its_token_and_a_local_host(dashboard):
    """GET / answered anyone with the dump's data: no token, and Host: attacker.example (a
    DNS-rebinding page) was served."""
    port, token = dashboard
    base = f"http://127.0.0.1:{port}"
    status, body = _get(f"{base}/")
    assert status in (302, 401, 403) and "kernelId" not in body, status
    assert len(token) >= 32  # printed in the URL
    for path in ("/api/kernels", "/api/status", "/?token=wrong"):
        status, body = _get(base + path)
        assert status in (302, 401, 403) and "kernelId" not in body, (path, status)
    for host in ("attacker.example", f"attacker.example:{port}", f"localhost.attacker.example:{port}"):
        status, body = _get(f"{base}/?token={token}", host=host)
        assert status == 403 and "kernelId" not in body, (host, status)
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}"):
        status, body = _get(f"{base}/?token={token}", host=host)
        assert status == 200 and "kernelId" in body, (host, status)
