"""``tdinspect demo``: capture two runs of the bundled model, find where they part, plot it."""

from __future__ import annotations

import tempfile
from pathlib import Path

from tdinspect.store.runs import clear_runs


def run_demo(out: str | None = None) -> int:
    """Capture a float32 run and one with a deliberately wrong layer, diff, plot.

    Prints the first divergence and the entries that add the most error, and
    writes ``divergence.png``. Returns 0. A rerun into the same ``out`` replaces
    the runs it wrote in ``out/reference`` and ``out/wrong_layer``, nothing else.

    Raises
    ------
    ConfigError
        When ``out/reference`` or ``out/wrong_layer`` holds anything tdinspect did
        not write (nothing is removed).
    """
    import matplotlib

    matplotlib.use("Agg")
    from tdinspect.dumpset import DumpSet
    from tdinspect.examples.samples import capture_model_run
    from tdinspect.jupyter.plots import divergence

    root = Path(out) if out else Path(tempfile.mkdtemp(prefix="tdinspect-demo-"))
    # a rerun replaces the runs it wrote, nothing else: a folder holding anything else is
    # refused (ConfigError naming it) before anything is removed
    clear_runs(root / "reference", root / "wrong_layer")
    root.mkdir(parents=True, exist_ok=True)
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
