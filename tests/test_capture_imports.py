"""Capture imports torch and the standard library only: its statistics and checksums never
load numba (tdinspect.numerics.onepass serves the analysis side alone)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

HEAVY = ("numba", "llvmlite", "xarray", "pandas", "matplotlib", "IPython", "dask")

CAPTURE = """
import sys, tempfile, torch, tdinspect
from tdinspect.numerics import onepass

class Spread(torch.nn.Module):
    def forward(self, h):
        return h.expand(2, -1, -1)  # an expanded view (dumper/kinds), storing as many

x = torch.randn(32, 8)
model = torch.nn.Sequential(
    torch.nn.Linear(8, 8),
    torch.nn.Linear(8, 4096),  # 32 x 4096 float32 out: past onepass's threshold
    Spread(),
)
assert model[1](model[0](x)).numel() >= onepass.MIN_ELEMENTS
for kw in ({}, {"stats_only": True}, {"checksum": True}, {"stats_only": True, "checksum": True}):
    with tdinspect.capture(model, tempfile.mkdtemp(), **kw) as dump:
        for _ in range(2):
            model(x)
            dump.step()
print([m for m in HEAVY if m in sys.modules])
"""


def test_capture_never_loads_numba_or_analysis_libraries(tmp_path):
    """A small model with one output above onepass's size threshold and an expanded output,
    captured with the defaults, stats_only, checksums and both: none of numba and the
    analysis libraries is imported (numba is in this environment: nothing else kept it out)."""
    pytest.importorskip("numba")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TMPDIR=str(tmp_path))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (root, env.get("PYTHONPATH"))))
    env.pop("TDINSPECT_ONEPASS", None)
    code = f"HEAVY = {HEAVY!r}\n{CAPTURE}"
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_capture_statistics_match_the_compiled_loop():
    """capture_stats (torch's float32 reductions) and tensor_stats (the compiled one-read loop
    where numba loads) agree within capture's bound (1e-6), min and max exactly, on a tensor
    the loop takes; the torch float64 path to float rounding."""
    import torch

    from tdinspect.numerics import onepass
    from tdinspect.numerics.checksum import tensor_checksum
    from tdinspect.numerics.stats import capture_stats, stats_and_checksum, tensor_stats

    x = torch.randn(3 * onepass.MIN_ELEMENTS + 7, generator=torch.Generator().manual_seed(4)) + 0.5
    torch.testing.assert_close(capture_stats(x), tensor_stats(x), rtol=1e-6, atol=0)
    assert capture_stats(x)[[0, 1, 4, 6, 7, 8]].tolist() == tensor_stats(x)[[0, 1, 4, 6, 7, 8]].tolist()
    torch.testing.assert_close(tensor_stats(x, compiled=False), tensor_stats(x), rtol=1e-14, atol=0)
    row, digest = stats_and_checksum(x)
    assert row.tolist() == capture_stats(x).tolist()
    assert int(digest) == int(tensor_checksum(x))
