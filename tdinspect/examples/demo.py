"""``tdinspect demo``: capture two runs of the bundled model, find where they part, plot it."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path


def run_demo(out: str | None = None) -> int:
    """Capture a float32 run and one with a deliberately wrong layer, diff, plot.

    Prints the first divergence and the entries that add the most error, and
    writes ``divergence.png``. Returns 0.
    """
    import matplotlib

    matplotlib.use("Agg")
    from tdinspect.dumpset import DumpSet
    from tdinspect.examples.samples import capture_model_run
    from tdinspect.jupyter.plots import divergence

    root = Path(out) if out else Path(tempfile.mkdtemp(prefix="tdinspect-demo-"))
    root.mkdir(parents=True, exist_ok=True)
    for name in ("reference", "wrong_layer"):  # a rerun replaces its own runs, nothing else
        shutil.rmtree(root / name, ignore_errors=True)
    print(f"capturing two runs of TinyTransformer into {root} ...")
    capture_model_run(root / "reference")
    capture_model_run(root / "wrong_layer", perturb="layers.2.mlp.down.weight")
    ref = DumpSet.open(root / "reference")
    print(ref)
    diff = ref.diff(root / "wrong_layer")
    div = diff.first_divergence()  # rel_diff at threshold="auto": u/4 of the entry's dtypes
    print(
        f"first divergence: {div.key} (pass {div.pass_}, call {div.call})\n  {div.reason}"
        if div
        else "no divergence"
    )
    print(f"  threshold: {diff.summary()['threshold']}")
    growth = diff.growth(progress=False).query("`pass` == 0")  # only entries that add error
    growth = growth.sort_values("growth", ascending=False).head(3)
    print("entries that add the most error in pass 0 (growth = error / largest error before it):")
    for row in growth.itertuples():
        grew = "first error" if row.growth == float("inf") else f"x{row.growth:.3g}"
        print(f"  {row.key:40s} error {row.error:.3g}  ({grew})")
    png = root / "divergence.png"
    divergence(diff).savefig(png, dpi=110)
    print(f"wrote {png}")
    return 0
