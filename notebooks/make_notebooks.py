"""Writes and executes the three notebooks: ``python notebooks/make_notebooks.py`` from the
repository root (after ``python -m tdinspect.samples sample_dumps``). They are committed with
their outputs; CI executes them again with nbmake.

Importing this file writes nothing (pytest's doctest collection imports it).
"""

import nbformat as nbf
from nbclient import NotebookClient

MD, CODE = nbf.v4.new_markdown_cell, nbf.v4.new_code_cell


def save(name, cells):
    nb = nbf.v4.new_notebook()
    nb.cells = cells
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    NotebookClient(nb, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": "notebooks"}}).execute()
    nbf.write(nb, f"notebooks/{name}")


def main():
    save("01_capture_and_explore.ipynb", [
        MD("# 1. Capture a model and explore what it did\n\nWe capture every leaf module of the bundled "
           "`TinyTransformer` for two steps, then open the dump as an xarray cube."),
        CODE("import tempfile, torch, tdinspect\nfrom tdinspect.examples import make_model, make_tokens\n"
             "model = make_model(seed=0)\nout = tempfile.mkdtemp()\n"
             "with torch.no_grad(), tdinspect.capture(model, out) as dump:\n"
             "    for step in range(2):\n        model(make_tokens(seed=step))\n        dump.step()\n"
             "dump.folder"),
        MD("`DumpSet.open` reads only metadata (the sidecars). The cube has dims `op × call × pass`; "
           "`call` is 0-based (`model.expert::call2` is call 2)."),
        CODE("ds = tdinspect.DumpSet.open(out)\nds"),
        CODE("cube = ds.to_xarray()\ncube[['absmax', 'std', 'order']].sel(op='model.expert')"),
        MD("Where do activations get large? The largest absolute value of every layer's leaves:"),
        CODE("fig = tdinspect.plot.heatmap(ds, 'absmax')"),
        MD("Tensors stay on disk until asked for:"),
        CODE("t = ds.tensor('model.expert', call=2, pass_=1)\nt.shape, t.dtype"),
        MD("The explorer: search an op, move the call and pass sliders."),
        CODE("tdinspect.explore(ds)"),
    ])

    save("02_compare_two_runs.ipynb", [
        MD("# 2. Compare two runs: which layer went wrong?\n\n`sample_dumps/wrong_layer` was captured with "
           "one weight (`layers.2.mlp.down`) scaled by 1.2. Which entry parts first from the float32 "
           "reference?"),
        CODE("import tdinspect\nref = tdinspect.DumpSet.open('../sample_dumps/float32')\n"
             "diff = ref.diff('../sample_dumps/wrong_layer')\ndiff.first_divergence()"),
        MD("The first entry over the threshold is the layer we broke. Everything after it carries the "
           "error; `growth` tells which entry *adds* error (growth ≫ 1) and which only inherit it:"),
        CODE("diff.growth().query('`pass` == 0').sort_values('growth', ascending=False).head(5)"),
        CODE("fig = tdinspect.plot.divergence(diff, threshold=1e-3)"),
        MD("## float32 vs bfloat16\n\nA precision change is not a bug: errors are small everywhere and grow "
           "along the network. The dtype difference is shown, not counted as a divergence."),
        CODE("bf = ref.diff('../sample_dumps/bfloat16')\nprint(bf.first_divergence())\n"
             "print(bf.first_divergence(threshold=1e-5))\n"
             "bf.table(progress=False)[['key', 'dtype_b', 'rel_diff', 'rel_diff_cast']].head(8)"),
        CODE("fig = tdinspect.plot.divergence(bf, threshold=1e-5)"),
        MD("Move the threshold: the first-divergence marker and its description follow."),
        CODE("explorer = tdinspect.explore(bf, threshold=1e-5)\nexplorer"),
    ])

    save("03_op_level.ipynb", [
        MD("# 3. One level down: aten ops, forward and backward\n\nThe design document's LayerNorm "
           "example, captured with `capture_ops(..., inputs=True)` in bfloat16 and float32."),
        CODE("import tdinspect, io, torch\nfrom tdinspect.examples import layernorm_test\n"
             "buf = io.StringIO()\nwith tdinspect.capture_ops(trace=buf):\n"
             "    layernorm_test(torch.bfloat16)\nprint(buf.getvalue())"),
        CODE("bf16 = tdinspect.DumpSet.open('../sample_dumps/ops_layernorm')\nbf16.ops"),
        MD("Compare the bf16 run against the float32 one (the reference):"),
        CODE("f32 = tdinspect.DumpSet.open('../sample_dumps/ops_layernorm_f32')\n"
             "d = f32.diff(bf16)\nd.table(progress=False)[['key', 'dtype_a', 'dtype_b', 'rel_diff', "
             "'reason']].head(12)"),
        MD("Is `native_layer_norm` itself wrong in bf16, or did it receive rounded inputs? Replay it on "
           "its recorded inputs in float64:"),
        CODE("tdinspect.replay(bf16, 'model.LayerNorm/aten.native_layer_norm.default')"),
        CODE("tdinspect.replay(bf16, 'model.LayerNorm/aten.native_layer_norm_backward.default')"),
    ])


if __name__ == "__main__":
    main()
