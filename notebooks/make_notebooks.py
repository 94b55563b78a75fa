"""Writes and executes the notebooks: ``python notebooks/make_notebooks.py`` from the
repository root (after ``python -m tdinspect.examples.samples sample_dumps``). They are committed with
their outputs; CI executes them again with nbmake.

Importing this file writes nothing (pytest's doctest collection imports it).
"""

import sys

import nbformat as nbf
from nbclient import NotebookClient

MD, CODE = nbf.v4.new_markdown_cell, nbf.v4.new_code_cell


ONLY = ()  # name prefixes given on the command line: write only those notebooks


def save(name, cells):
    if ONLY and not name.startswith(ONLY):
        return
    nb = nbf.v4.new_notebook()
    nb.cells = cells
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": "notebooks"}}
    ).execute()
    nbf.write(nb, f"notebooks/{name}")


def main():
    save(
        "01_capture_and_explore.ipynb",
        [
            MD(
                "# 1. Capture a model and explore what it did\n\nWe capture every leaf module of the bundled "
                "`TinyTransformer` for two steps, then open the dump as an xarray cube."
            ),
            CODE(
                "import tempfile, torch, tdinspect\nfrom tdinspect.examples.models import make_model, make_tokens\n"
                "model = make_model(seed=0)\nout = tempfile.mkdtemp()\n"
                "with torch.no_grad(), tdinspect.capture(model, out) as dump:\n"
                "    for step in range(2):\n        model(make_tokens(seed=step))\n        dump.step()\n"
                "dump.folder"
            ),
            MD(
                "`DumpSet.open` reads only metadata (the sidecars). The cube has dims `op × call × pass`; "
                "`call` is 0-based (`model.expert::call2` is call 2)."
            ),
            CODE("ds = tdinspect.DumpSet.open(out)\nds"),
            CODE("cube = ds.to_xarray()\ncube[['absmax', 'std', 'order']].sel(op='model.expert')"),
            MD("Where do activations get large? The largest absolute value of every layer's leaves:"),
            CODE("fig = tdinspect.plot.heatmap(ds, 'absmax')"),
            MD("Tensors stay on disk until asked for:"),
            CODE("t = ds.tensor('model.expert', call=2, pass_=1)\nt.shape, t.dtype"),
            MD("The explorer: search an op, move the call and pass sliders."),
            CODE("tdinspect.explore(ds)"),
            MD(
                "## In memory\n\nFor quick work in a notebook, `memory=True` keeps the passes in this "
                "process instead of a folder (up to 2 GB of tensors; `memory='8GB'` sets another limit). "
                "`cap.dumpset` is a DumpSet like any other:"
            ),
            CODE(
                "with torch.no_grad(), tdinspect.capture(model, memory=True) as cap:\n"
                "    model(make_tokens(seed=0))\n    cap.step()\nmem = cap.dumpset\nmem"
            ),
            CODE("mem.diff(ds.sel(pass_=0)).verdict()"),
            MD(
                "`cap.save(folder)` writes it as a normal dump, the same files a capture to that folder writes:"
            ),
            CODE("saved = cap.save(tempfile.mkdtemp())\nsorted(p.name for p in saved.iterdir())"),
        ],
    )

    save(
        "02_compare_two_runs.ipynb",
        [
            MD(
                "# 2. Compare two runs: which layer went wrong?\n\n`sample_dumps/wrong_layer` was captured with "
                "one weight (`layers.2.mlp.down`) scaled by 1.2. Which entry parts first from the float32 "
                "reference?"
            ),
            CODE(
                "import tdinspect\nref = tdinspect.DumpSet.open('../sample_dumps/float32')\n"
                "diff = ref.diff('../sample_dumps/wrong_layer')\ndiff.first_divergence()"
            ),
            MD(
                'The first entry over the threshold is the layer we broke. The threshold is `"auto"` by '
                "default: each entry's comes from its two dtypes, `u/4` for `rel_diff` with `u` the unit "
                "roundoff of the coarser one (float32: 1.5e-8, so an entry diverges once the runs agree "
                "to fewer than about half of float32's digits); the reason says where it came from. A "
                "number sets one threshold for every entry:"
            ),
            CODE("print(diff.summary()['threshold'])\nprint(diff.first_divergence(threshold=1e-3))"),
            MD(
                "Everything after the broken layer carries the error; `growth` lists only the entries "
                "that *add* error (growth = error / largest error before it), not those that inherit it:"
            ),
            CODE("diff.growth().query('`pass` == 0').sort_values('growth', ascending=False).head(5)"),
            CODE("fig = tdinspect.plot.divergence(diff)"),
            MD(
                "## float32 vs bfloat16\n\nA precision change is not a bug: errors are small everywhere and grow "
                "along the network. The dtype difference is shown, not counted as a divergence, and "
                '`"auto"` takes the coarser side\'s precision: for a bfloat16 entry against a float32 one '
                "the threshold is bfloat16's `u/4` = 9.8e-4, which bfloat16 rounding stays under "
                "(the dashed line). A fixed 1e-5 shows where the error grows past that."
            ),
            CODE(
                "bf = ref.diff('../sample_dumps/bfloat16')\nprint(bf.first_divergence())\n"
                "print(bf.first_divergence(threshold=1e-5))\n"
                "bf.table(progress=False)[['key', 'dtype_b', 'rel_diff', 'rel_diff_cast']].head(8)"
            ),
            CODE("fig = tdinspect.plot.divergence(bf)"),
            MD(
                "Move the threshold: the first-divergence marker and its description follow. The explorer "
                "starts here at a fixed 1e-5; tick `auto` to go back to each entry's dtype-derived "
                "threshold (switching the metric does too)."
            ),
            CODE("explorer = tdinspect.explore(bf, threshold=1e-5)\nexplorer"),
        ],
    )

    save(
        "03_op_level.ipynb",
        [
            MD(
                "# 3. One level down: aten ops, forward and backward\n\nThe design document's LayerNorm "
                "example, captured with `capture_ops(..., inputs=True)` in bfloat16 and float32."
            ),
            CODE(
                "import tdinspect, io, torch\nfrom tdinspect.examples.models import layernorm_test\n"
                "buf = io.StringIO()\nwith tdinspect.capture_ops(trace=buf):\n"
                "    layernorm_test(torch.bfloat16)\nprint(buf.getvalue())"
            ),
            CODE("bf16 = tdinspect.DumpSet.open('../sample_dumps/ops_layernorm')\nbf16.ops"),
            MD(
                "Compare the bf16 run against the float32 one (the reference). The bf16 run casts its "
                "inputs with `_to_copy` ops that the float32 run never calls: those entries exist only in "
                "B. One-sided entries are *structural* divergences, so they come first by default, and "
                "say nothing about precision:"
            ),
            CODE(
                "f32 = tdinspect.DumpSet.open('../sample_dumps/ops_layernorm_f32')\n"
                "d = f32.diff(bf16)\nd.first_divergence()"
            ),
            MD(
                '`structural="report"` sets the casts aside (listed, not hidden) and looks for the first '
                "*numeric* divergence:"
            ),
            CODE("div = d.first_divergence(structural='report')\ndiv"),
            MD(
                "It is the `sum` of the LayerNorm output, the test's loss. A LayerNorm output has mean 0 "
                "by construction, so its sum is a cancellation: float32 gets about -4e-6, bfloat16 "
                "(rounding every partial sum to 8 bits of mantissa) about -0.05. A large *relative* "
                "difference of a number that should be 0, and harmless: the backward pass starts from "
                "`ones_like` (identical on both sides, rel_diff 0), not from the loss value. Where bf16 "
                "really loses precision is the LayerNorm itself and its backward:"
            ),
            CODE(
                "import pandas as pd\n"
                "pd.set_option('display.max_colwidth', None)  # whole keys: [inN] / [outN] at their end\n"
                "t = d.table(progress=False)\n"
                "t[t['key'].str.contains('native_layer_norm|sum|ones_like') & (t['reason'] == '')][\n"
                "    ['key', 'dtype_b', 'rel_diff', 'rel_diff_cast']]"
            ),
            MD(
                "`rel_diff_cast` compares after rounding the float32 side to bfloat16: near 0 for the "
                "forward inputs (bf16 got exactly the rounded inputs), not 0 for the outputs."
            ),
            MD(
                "Is `native_layer_norm` itself wrong in bf16, or did it receive rounded inputs? Replay it on "
                "its recorded inputs in float64:"
            ),
            CODE("tdinspect.replay(bf16, 'model.LayerNorm/aten.native_layer_norm.default')"),
            CODE("tdinspect.replay(bf16, 'model.LayerNorm/aten.native_layer_norm_backward.default')"),
        ],
    )

    save(
        "04_compare_a_port.ipynb",
        [
            MD(
                "# 4. Compare a port against its reference\n\nAn engine rarely runs the reference's code: "
                "here a hand-written port of a tiny Hugging Face Llama (`tdinspect.examples.port`) with other "
                "attribute names, fused `qkv` and `gate_up` projections and its own RMSNorm class, loaded with "
                "the same weights. We capture both, let tdinspect *suggest* how their entries pair, look at "
                "the plan, find a porting bug and see where along the tokens it starts."
            ),
            CODE(
                "import tempfile, tdinspect\nfrom tdinspect.examples.port import capture_port_pair\n"
                "root = tempfile.mkdtemp()\n"
                "ref_dir, port_dir = capture_port_pair(root + '/good')           # same weights, Llama's RoPE\n"
                "_, buggy_dir = capture_port_pair(root + '/bug', rope='interleaved')  # the porting bug\n"
                "ref, port = tdinspect.DumpSet.open(ref_dir), tdinspect.DumpSet.open(port_dir)\n"
                "print(ref.ops[:6])\nprint(port.ops[:6])"
            ),
            MD("By name, nothing lines up: the first answer is an entry only the reference has."),
            CODE("ref.diff(port).first_divergence()"),
            MD(
                "## Suggest a mapping\n\n`suggest_mapping` pairs entries by name, then by **values** (an A "
                "tensor equal to a B tensor, or to a slice of one: `q_proj` is a chunk of the fused `qkv`), "
                "then by execution order, shape and module type. Per-layer pairs become one rule with a "
                "group. Pairs it cannot support are listed, never used."
            ),
            CODE("s = tdinspect.suggest_mapping(ref, port)\ns"),
            CODE("s.pairs.head(10)"),
            MD(
                "## Edit a rule, look at the plan\n\nRules are plain data: `{a_regex: b_template}` or "
                "`{a_regex: [b_template, transform]}`, the transform in a small language (parsed, never "
                "evaluated). Write the `v_proj` slice as a `narrow` instead of a chunk. The plan shows which "
                "A entry meets which B entry through which transform **before any tensor is read**."
            ),
            CODE(
                "rules = dict(s.rules)\n"
                "rules[r'model\\.model\\.layers\\.(\\d+)\\.self_attn\\.v_proj'] = "
                "[r'model.blocks.\\1.attn.qkv', 'narrow(-1, 48, 16)']\n"
                "d = ref.diff(port, mapping=rules)\n"
                "plan = d.plan()\nplan[['a_key', 'b_key', 'transform', 'shape_b_after', 'status']].head(12)"
            ),
            MD(
                "Same weights: with the rules, nothing diverges even at a float32-noise threshold. The "
                "entries only the reference has (its rotary-embedding module, the activation the port computes "
                "inline) are set aside and listed with `structural='report'`; the verdict is *incomplete* "
                "until they are named as one-sided by design (`allow_uncompared`): then it *matches*."
            ),
            CODE(
                "print(d.verdict(threshold=1e-10, structural='report'))\n"
                "print(d.verdict(threshold=1e-10, structural='report', allow_uncompared=r'rotary_emb|act_fn'))\n"
                "d.structural_entries(progress=False)"
            ),
            MD(
                "## The bug\n\nThe second port rotates interleaved pairs instead of the two halves of each "
                "head (a classic RoPE porting bug). q, k and v come out of their projections before the "
                "rotation, so the first entry to part is the attention output. Its error is small "
                "(rel_diff 2e-5: a fixed 1e-3 would let it through), but the default threshold, "
                '`"auto"`, takes it from the dtypes: float32\'s `u/4` = 1.5e-8.'
            ),
            MD(
                "The options go into the diff once (its `spec`): every answer, plot, the explorer and the "
                "dashboard of this diff then use them."
            ),
            CODE(
                "bug = ref.diff(buggy_dir, mapping=rules, structural='report', allow_uncompared=r'rotary_emb|act_fn')\n"
                "print(bug)\ndiv = bug.first_divergence()\ndiv"
            ),
            MD("Per entry, in execution order (A key, the B entry it met, the error):"),
            CODE(
                "t = bug.table(progress=False)\n"
                "t[~t['structural']][['key', 'key_b', 'rel_diff', 'cosine']].head(14)"
            ),
            CODE("fig = tdinspect.plot.divergence(bug)"),
            MD(
                "## Where along the tokens?\n\nThe error per position of the token dim tells a position "
                "bug from a layer bug at a glance. Position 0 is rotated by angle 0 whatever the pairing, so "
                "a RoPE bug leaves it exact and parts from the second token on; a wrong weight would show at "
                "every position."
            ),
            CODE(
                "da = bug.per_position('model.model.layers.0.self_attn.o_proj', dim=1)\n"
                "print('first divergent position:', da.attrs['first_position'])\nda.isel(call=0).round(9).to_pandas()  # pass x position"
            ),
            CODE("fig = tdinspect.plot.per_position(bug, dim=1)"),
            MD(
                "The rules go to a file for the command line:\n\n"
                "```\ntdinspect suggest-mapping ref/ port/ > map.yaml\n"
                "tdinspect first-divergence ref/ port/ --mapping map.yaml --structural report\n```"
            ),
            CODE("print(s.to_yaml()[:600])"),
            MD(
                "## A fault below the threshold: an error budget from a baseline run\n\n"
                "Some faults stay under float32's `auto` threshold. Here a float32 port whose layer 1 "
                "post-attention RMSNorm uses eps 1e-5 instead of 1e-6, against a **float64** reference "
                "(weights of std 0.1: activations of order 1). Judged by `auto`, it matches:"
            ),
            CODE(
                "import copy, torch\n"
                "from tdinspect.examples.port import LlamaPort, make_hf_llama, port_tokens\n"
                "def run(model, path):\n"
                "    with torch.no_grad(), tdinspect.capture(model, path) as dump:\n"
                "        model(port_tokens(0))\n        dump.step()\n    return path\n"
                "hf = make_hf_llama(0, initializer_range=0.1)\n"
                "eps_port = LlamaPort.from_hf(hf)\neps_port.blocks[1].mlp_norm.eps = 1e-5\n"
                "ref64 = run(copy.deepcopy(hf).double(), root + '/ref64')\n"
                "ref32 = run(hf, root + '/ref32')                     # the baseline: the reference in float32\n"
                "good32 = run(LlamaPort.from_hf(hf), root + '/good32')\n"
                "eps32 = run(eps_port, root + '/eps32')\n"
                "rules64 = tdinspect.suggest_mapping(ref64, good32).rules\n"
                "one_sided = 'rotary_emb|act_fn'  # the reference's entries the port computes inline\n"
                "plain = tdinspect.DumpSet.open(ref64).diff(eps32, mapping=rules64)\n"
                "print(plain.verdict(structural='report', allow_uncompared=one_sided).text)\n"
                "t = plain.table(progress=False).set_index('key')\n"
                "print('rel_diff at the faulty norm:', t.at['model.model.layers.1.post_attention_layernorm', 'rel_diff'])"
            ),
            MD(
                "Its error, 5e-10, is far above float32 rounding noise but under `auto`'s 1.5e-8. A "
                "numerical analyst measures the noise with a third run: the reference itself in float32 "
                "(the **baseline**), against the same float64 reference. With `baseline=`, B diverges where "
                "its error exceeds 10x the baseline's at that entry (`baseline_factor`; at least 8 units "
                "of roundoff). The baseline pairs with A by name; the mapping pairs B. The plan shows it:"
            ),
            CODE(
                "budget = tdinspect.DumpSet.open(ref64).diff(eps32, mapping=rules64, baseline=ref32)\n"
                "print(budget)\n"
                "budget.plan()[['a_key', 'b_key', 'baseline', 'status']].head(6)"
            ),
            CODE("budget.verdict(structural='report', allow_uncompared=one_sided).text"),
            MD("The correct port, against the same baseline: no false alarm (its noise is the baseline's)."),
            CODE(
                "ok = tdinspect.DumpSet.open(ref64).diff(good32, mapping=rules64, baseline=ref32)\n"
                "ok.verdict(structural='report', allow_uncompared=one_sided).text"
            ),
            MD(
                "From the command line: `tdinspect first-divergence ref64/ port32/ --mapping map.yaml "
                "--baseline ref32/` (`--baseline-factor K` sets k)."
            ),
        ],
    )

    save(
        "05_magics.ipynb",
        [
            MD(
                "# 5. The magics: capture, open and diff from cells\n\n`%load_ext tdinspect` adds "
                "`%%tdi_capture`, `%tdi_open` and `%tdi_diff`. We capture a model and a copy of it with "
                "one weight (`layers.2.mlp.down`) scaled by 1.2, then find where they part."
            ),
            CODE(
                "%load_ext tdinspect\nimport tempfile, torch, tdinspect\nfrom tdinspect.examples.models import make_model, "
                "make_tokens\ngood, bad = make_model(seed=0), make_model(seed=0)\nwith torch.no_grad():\n"
                "    bad.get_parameter('layers.2.mlp.down.weight').mul_(1.2)\n"
                "x = make_tokens(seed=0)\nout = tempfile.mkdtemp()  # `$out` expands in magic lines"
            ),
            MD("`%%tdi_capture DIR --model VAR` captures what the cell runs, one pass per run of the cell:"),
            CODE("%%tdi_capture $out/good --model good\nwith torch.no_grad():\n    good(x)"),
            CODE("%%tdi_capture $out/bad --model bad\nwith torch.no_grad():\n    bad(x)"),
            MD("`%tdi_open NAME PATH` opens a dump into a variable and shows its summary:"),
            CODE("%tdi_open ref $out/good"),
            MD("`%tdi_diff A B` takes variables or folders and shows one summary; `--as d` keeps the Diff:"),
            CODE("%tdi_diff ref $out/bad --as d"),
            MD("The summary follows `--metric` and `--threshold`:"),
            CODE("%tdi_diff ref $out/bad --metric cosine --threshold 0.9999"),
            MD(
                "A mistake stops the cell with one line saying what was looked up, so *Run All* stops "
                "there instead of failing later:"
            ),
            nbf.v4.new_code_cell("%tdi_diff ref nosuch", metadata={"tags": ["raises-exception"]}),
            MD(
                "With the extension loaded, entry names complete inside `ref.tensor('...` (press Tab); a "
                "misspelt one gets the closest names:"
            ),
            CODE("try:\n    ref.tensor('model.layers.2.mlp.dwn')\nexcept KeyError as exc:\n    print(exc)"),
            CODE("ref.tensor('model.layers.2.mlp.down').shape"),
            MD("The kept Diff goes on to the explorer (metric, threshold, pass and entry pickers):"),
            CODE("tdinspect.explore(d)"),
        ],
    )

    save(
        "06_which_module_introduces_the_error.ipynb",
        [
            MD(
                "# 6. Which module introduces the error? Grafting\n\nRun B scales one weight "
                "(`layers.2.mlp.down`) by 1%. An ordinary diff shows the first module that differs, and "
                "then every module after it differs too: they *inherit* the error. To tell a module that "
                "makes an error from one that only carries it, feed every module the reference's own "
                "inputs (`tdinspect.graft`) and look at what still differs."
            ),
            CODE(
                "import tempfile, torch, tdinspect\nfrom tdinspect.examples.models import make_model, make_tokens\n"
                "root = tempfile.mkdtemp()\n\n"
                "def run(path, scale=1.0, graft_from=None):\n"
                "    model = make_model(seed=0)\n"
                "    with torch.no_grad():\n"
                "        model.layers[2].mlp.down.weight.mul_(scale)\n"
                "        with tdinspect.capture(model, path, record=('inputs', 'outputs', 'params')) as dump:\n"
                "            g = tdinspect.graft(model, graft_from, capture=dump) if graft_from else None\n"
                "            for step in range(2):\n"
                "                model(make_tokens(seed=step))\n"
                "                dump.step()          # also moves the graft to the reference's next pass\n"
                "            if g: g.close()\n"
                "    return path\n\n"
                "a = run(root + '/a')                          # the reference\n"
                "b = run(root + '/b', scale=1.01)              # one weight 1% off\n"
                "b_grafted = run(root + '/bg', scale=1.01, graft_from=a)"
            ),
            MD(
                "With `record=('inputs', 'outputs', 'params')` the dump holds each module's parameters "
                "(`name.weight`, stored again only when they change), its inputs (`name[in][0]`) and its "
                "outputs. The first bitwise difference is the parameter itself:"
            ),
            CODE("ref = tdinspect.DumpSet.open(a)\nref.diff(b).first_divergence(metric='equal')"),
            MD(
                "Without the parameters, the ordinary diff of outputs sees the error spread from that "
                "module to everything after it:"
            ),
            CODE(
                "plain = ref.filter(r'^(?!.*\\.(weight|bias)$)').diff(b)\n"
                "t = plain.table(progress=False)\n"
                "outs = t[~t['key'].str.contains(r'\\[in\\]') & (t['pass'] == 0)]\n"
                "print((outs['rel_diff'] > 1e-12).sum(), 'of', len(outs), 'module outputs differ')\n"
                "outs[outs['rel_diff'] > 1e-12][['key', 'rel_diff']].head(8)"
            ),
            MD(
                "## Grafted\n\nIn the grafted run every leaf module received the reference's recorded "
                "inputs, so each output error is the module's own. `Diff.introduced()` ranks modules by "
                "it: one module made the error, every other agrees with the reference to float32 noise."
            ),
            CODE(
                "ranked = ref.filter(r'^(?!.*\\.(weight|bias)$)').diff(b_grafted).introduced(progress=False)\n"
                "ranked.head(6)"
            ),
            MD(
                "`what='outputs'` does the converse: the selected modules' outputs are replaced by the "
                "reference's, so a suspect can be switched off. Replacing the output of the module that "
                "introduced the error makes the rest of the run bitwise equal to the reference:"
            ),
            CODE(
                "model = make_model(seed=0)\n"
                "with torch.no_grad():\n"
                "    model.layers[2].mlp.down.weight.mul_(1.01)\n"
                "    with tdinspect.graft(model, a, modules=[r'layers\\.2\\.mlp\\.down$'], what='outputs'):\n"
                "        logits = model(make_tokens(seed=0))\n"
                "torch.equal(logits, ref.tensor('model.lm_head', pass_=0))"
            ),
            MD(
                "## Determinism without tensors: checksums\n\n`capture(..., stats_only=True, checksum=True)` "
                "stores a 64-bit fingerprint of every tensor's bits (computed on its device) next to its "
                "statistics. `metric='equal'` then compares runs bit for bit without writing any tensor."
            ),
            CODE(
                "def checksums(path, scale=1.0):\n"
                "    model = make_model(seed=0)\n"
                "    with torch.no_grad():\n"
                "        model.layers[2].mlp.down.weight.mul_(scale)\n"
                "        with tdinspect.capture(model, path, stats_only=True, checksum=True) as dump:\n"
                "            model(make_tokens(seed=0))\n"
                "            dump.step()\n"
                "    return tdinspect.DumpSet.open(path)\n\n"
                "c1, c2, c3 = checksums(root + '/c1'), checksums(root + '/c2'), checksums(root + '/c3', 1.01)\n"
                "print(c1.diff(c2).first_divergence(metric='equal'))\n"
                "print(c1.diff(c3).first_divergence(metric='equal'))"
            ),
        ],
    )

    save(
        "07_live.ipynb",
        [
            MD(
                "# 7. Check while the model runs: live comparison and NaN/Inf\n\nTwo full dumps and a "
                "diff afterwards cost disk for an answer that is one entry. Here the reference is "
                "`sample_dumps/float32` (two steps of the bundled model); the run under test has one "
                "weight (`layers.2.mlp.down`) scaled by 1.2, and is compared with the reference **as it "
                "runs**: it stops at the first entry past the threshold, with the same answer as an "
                "offline diff, and writes nothing."
            ),
            CODE(
                "import tempfile, os, torch, tdinspect\nfrom tdinspect.examples.models import make_model, "
                "make_tokens\nREF = '../sample_dumps/float32'\n"
                "run = make_model(seed=0)\nwith torch.no_grad():\n"
                "    run.get_parameter('layers.2.mlp.down.weight').mul_(1.2)\n"
                "work = tempfile.mkdtemp()\n"
                "try:\n    with torch.no_grad(), tdinspect.capture(run, compare_to=REF) as cap:\n"
                "        for step in range(2):\n            run(make_tokens(seed=step))\n"
                "            cap.step()\nexcept tdinspect.DivergenceError as err:\n"
                "    live = err.divergence\nlive"
            ),
            MD(
                "The same answer as the offline diff of two full dumps (same metric, same threshold, same "
                "rule: live comparison calls `Diff`'s own per-pair function):"
            ),
            CODE(
                "offline = tdinspect.DumpSet.open(REF).diff('../sample_dumps/wrong_layer')"
                ".first_divergence()\n"
                "print(live.key, live.pass_, live.value)\nprint(offline.key, offline.pass_, offline.value)\n"
                "live.before"
            ),
            MD(
                "## Evidence, not a full dump\n\nWith a `dump_dir`, only the divergent entry and the "
                "five before it are written, from both sides, in the usual format:"
            ),
            CODE(
                "ev = os.path.join(work, 'ev')\n"
                "try:\n    with torch.no_grad(), tdinspect.capture(run, ev, compare_to=REF) as cap:\n"
                "        for step in range(2):\n            run(make_tokens(seed=step))\n"
                "            cap.step()\nexcept tdinspect.DivergenceError as err:\n"
                "    print(err)\n"
                "for root, _, files in sorted(os.walk(ev)):\n"
                "    for f in sorted(files):\n        print(os.path.relpath(os.path.join(root, f), ev))"
            ),
            CODE(
                "tdinspect.DumpSet.open(ev + '/evidence/ref').diff(ev + '/evidence/run')"
                ".table(progress=False)[['key', 'rel_diff', 'cosine']]"
            ),
            MD(
                "`on_divergence='record'` goes on and keeps every entry's metrics (and with a `dump_dir`, one "
                "CSV per pass in `dump_dir/live/`):"
            ),
            CODE(
                "with torch.no_grad(), tdinspect.capture(run, compare_to=REF, on_divergence='record') as cap:\n"
                "    for step in range(2):\n        run(make_tokens(seed=step))\n        cap.step()\n"
                "t = cap.live.table()\nt[t['pass'] == 1][['key', 'rel_diff', 'max_abs']].tail(6)"
            ),
            MD(
                "In a notebook cell: `%%tdi_capture --model VAR --compare-to REF` (evidence directory "
                "optional, `--on-divergence raise|warn|record`)."
            ),
            CODE("%load_ext tdinspect"),
            CODE(
                "%%tdi_capture --model run --compare-to ../sample_dumps/float32 --on-divergence record\n"
                "with torch.no_grad():\n    run(make_tokens(seed=0))"
            ),
            MD(
                "## NaN and Inf: the first one, named\n\n`on_nonfinite='raise'` checks every output with "
                "one fused reduction on its device (on a GPU the flags stay there until `step()`), with or "
                "without a dump. Here a hook puts NaN into one module's output in the third step:"
            ),
            CODE(
                "sick = make_model(seed=0)\ncalls = []\n"
                "def inject(mod, args, out):\n    calls.append(1)\n"
                "    if len(calls) == 3:\n        out = out.clone(); out[0, 0, :3] = float('nan')\n"
                "    return out\n"
                "hook = sick.layers[1].mlp.up.register_forward_hook(inject)\n"
                "try:\n    with torch.no_grad(), tdinspect.capture(sick, on_nonfinite='raise') as cap:\n"
                "        for step in range(4):\n            sick(make_tokens(seed=step))\n"
                "            cap.step()\nexcept tdinspect.NonFiniteError as err:\n    print(err)"
            ),
            MD(
                "An existing dump answers the same (from its statistics), in Python or with "
                "`tdinspect first-nonfinite DIR` (exit status 1 when found):"
            ),
            CODE(
                "with torch.no_grad(), tdinspect.capture(sick, work + '/sick') as cap:\n"
                "    calls.clear()\n    for step in range(4):\n        sick(make_tokens(seed=step))\n"
                "        cap.step()\ntdinspect.DumpSet.open(work + '/sick').first_nonfinite()"
            ),
            MD(
                "At op level the check covers backward ops too, and says whether an op **created** the "
                "non-finite values or inherited them. `sqrt(relu(x))` is finite going forward; at a "
                "negative `x` its backward divides by `sqrt(0)`:"
            ),
            CODE(
                "class SqrtRelu(torch.nn.Module):\n    def forward(self, x):\n"
                "        return torch.sqrt(torch.relu(x))\n"
                "m, x = SqrtRelu(), torch.tensor([4.0, -1.0, 9.0], requires_grad=True)\n"
                "try:\n    with tdinspect.capture_ops(model=m, on_nonfinite='raise'):\n"
                "        y = m(x)\n        print('forward finite:', bool(torch.isfinite(y).all()))\n"
                "        y.sum().backward()\nexcept tdinspect.NonFiniteError as err:\n    print(err)"
            ),
        ],
    )

    save(
        "08_serving_engine.ipynb",
        [
            MD(
                "# 8. A serving engine against its reference, token by token\n\n"
                "An engine packs the tokens of many requests into one batch and batches them differently "
                "at every step; the Hugging Face reference runs one request at a time. Entry by entry and "
                "pass by pass they never line up; tokens do, by (request, position). "
                "`tdinspect.examples.engine.PackedLlama` serves a tiny Llama (random weights) with its own "
                "modules the way an engine does: packed `[1, T, hidden]` steps, continuous batching, one "
                "flat KV cache behind a block-diagonal causal mask."
            ),
            CODE(
                "import tempfile, torch, tdinspect\n"
                "from tdinspect.examples.port import make_hf_llama\n"
                "from tdinspect.examples.engine import (CONTINUOUS, PackedLlama, capture_engine,\n"
                "                                       capture_reference, engine_prompts)\n"
                "work = tempfile.mkdtemp()\nhf = make_hf_llama(seed=0)\n"
                "prompts = engine_prompts()                      # three requests of 5, 9 and 16 tokens\n"
                "for step, batch in enumerate(CONTINUOUS):       # (request, tokens fed) per engine step\n"
                "    print(f'step {step}:', ', '.join(f'request {r} x{n}' for r, n in batch))"
            ),
            MD(
                "The reference runs each request alone; the engine serves them by that schedule (request 0 "
                "prefills beside a chunk of request 1, request 2 joins in step 1, requests leave when done). "
                "Each step is recorded with its token layout, built from the engine's own tensors "
                "(`dump.step(tokens=tdinspect.tokens(request_ids=..., positions=..., seq_lens=...))`):"
            ),
            CODE(
                "ref = capture_reference(hf, prompts, work + '/hf')\n"
                "engine = capture_engine(PackedLlama(hf), prompts, CONTINUOUS, work + '/engine')\n"
                "tdinspect.DumpSet.open(engine).get_pass(1).tokens"
            ),
            MD(
                "`diff(..., tokens=True)` plans first, from the sidecars alone: which pass and row hold each "
                "request's positions on each side. Then each request's rows are gathered in position order "
                "and compared with the usual metrics and thresholds."
            ),
            CODE(
                "d = tdinspect.DumpSet.open(ref).diff(engine, tokens=True)\nprint(d.tokens)\nprint(d.verdict().text)"
            ),
            MD(
                "No divergence, and no false alarm: every entry of every request compared, all within "
                "float32's threshold. Now a KV-cache bug: from position 6 on, request 1's tokens do not "
                "see the request's first token."
            ),
            CODE(
                "buggy = capture_engine(PackedLlama(hf, bug=(1, 6)), prompts, CONTINUOUS, work + '/buggy')\n"
                "bad = tdinspect.DumpSet.open(ref).diff(buggy, tokens=True)\n"
                "div = bad.first_divergence()\nprint(div.key, '| request', div.request, '| position', div.position)\n"
                "div"
            ),
            MD(
                "The module, the request and the first position, with the engine steps and rows where "
                "they ran. Per position, request by request (`rel_diff`; 0 is identical):"
            ),
            CODE(
                "pp = bad.per_position(div.key).sel(call=0)\n"
                "pp.to_pandas().map(lambda v: f'{v:.1e}' if v == v else '')"
            ),
            MD(
                "Only request 1 parts, from position 6. Entries that have no token rows cannot be "
                "compared by token, and are said to be set aside, never dropped: an engine that runs its "
                "head on each sequence's last token only makes the verdict *incomplete*:"
            ),
            CODE(
                "last = capture_engine(PackedLlama(hf, logits='last'), prompts, CONTINUOUS, work + '/last')\n"
                "print(tdinspect.DumpSet.open(ref).diff(last, tokens=True).verdict(structural='report').text)"
            ),
            MD(
                "## Fused tensor-parallel shards too\n\n"
                "`tdinspect.examples.engine_tp.TPPackedLlama` is the same engine serving a port of the model "
                "sharded over TP=2, as engines shard it: each rank's fused `qkv` holds `[q_r | k_r | v_r]` and "
                "its `gate_up` `[gate_r | up_r]`; `o` and `down` are row-parallel (partial sums, all-reduced). "
                "`capture_tp_engine` starts two processes in a real `gloo` group (the ranks are child "
                "processes: the kernel itself joins no group), each serving the requests by the same schedule "
                "and recording its steps' token layouts, its rank and the fused dims. `bug=(rank, request, k)` "
                "plants a bug on one rank: layer 0's k segment is wrong for that request's positions >= k."
            ),
            CODE(
                "from tdinspect.examples.engine_tp import capture_tp_engine\n"
                "from tdinspect.examples.port_tp import hf_port_mapping, tp_port_dims\n"
                "tp = capture_tp_engine(work + '/tp2')                          # 2 processes, gloo\n"
                "tp_buggy = capture_tp_engine(work + '/tp2_bug', bug=(1, 1, 6))  # rank 1, request 1, positions >= 6\n"
                "tp_port_dims(hf.config)"
            ),
            MD(
                "The port names its modules its own way (`blocks.0.attn.qkv`): `hf_port_mapping` cuts q, k "
                "and v (gate and up) out of the fused entries. With `unshard=True` each engine step's ranks "
                "are reassembled first (the fused segments put back in the model's `[q | k | v]`), then the "
                "tokens line up by (request, position):"
            ),
            CODE(
                "m = hf_port_mapping(hf.config)\n"
                "tp_ok = tdinspect.DumpSet.open(ref).diff(tp, tokens=True, unshard=True, mapping=m)\n"
                "print(tp_ok.verdict(structural='report', allow_uncompared='rotary_emb|act_fn').text)\n"
                "tp_bad = tdinspect.DumpSet.open(ref).diff(tp_buggy, tokens=True, unshard=True, mapping=m)\n"
                "print(tp_bad.verdict(structural='report').text)"
            ),
            MD(
                "No false alarm on the correct run (the reference's rotary embedding and activation have "
                "no module in the port, hence `allow_uncompared`). With the bug: the module (the "
                "reference's `k_proj`, cut out of the fused `qkv`; `q_proj` before it matches), the rank "
                "and segment (`rank 1 (tp 1 of 2) k`), the request and the first position, then the "
                "engine steps and rows where those tokens ran."
            ),
            MD(
                "The same from the command line: `tdinspect first-divergence dumps/hf dumps/engine --tokens` "
                "(exit status 0, 1 or 3)."
            ),
        ],
    )

    save(
        "09_eager_vs_compiled.ipynb",
        [
            MD(
                "# 9. Eager against `torch.compile`, module by module\n\n`capture` records a compiled "
                "model inside its compiled graphs: every selected module's output, as the compiled "
                "code computed it, under the eager run's names. The model here is the bundled "
                "transformer whose `layers.1.mlp.act` is a GELU that is tanh-approximated only under "
                "compile (`tdinspect.examples.models.CompiledGELU`), as a kernel a compiler swaps. "
                "The notebook compiles with `backend='aot_eager'` (seconds); the tests run the same "
                "on inductor."
            ),
            CODE(
                "import glob, json, tempfile, torch, tdinspect\n"
                "from tdinspect.examples.models import make_compile_sensitive, make_tokens\n"
                "work, tokens = tempfile.mkdtemp(), make_tokens()\n"
                "model = make_compile_sensitive(seed=0)\n"
                "with torch.no_grad(), tdinspect.capture(model, work + '/eager') as dump:\n"
                "    eager_out = model(tokens); dump.step()\n"
                "compiled = torch.compile(model, backend='aot_eager', fullgraph=True)\n"
                "with torch.no_grad(), tdinspect.capture(compiled, work + '/compiled') as dump:\n"
                "    compiled_out = compiled(tokens); dump.step()\n"
                "print('graphs, graph breaks, recompiles while capturing:', dump.compile_counts)"
            ),
            MD("The two dumps line up entry for entry; the first divergence is the module that moved:"),
            CODE(
                "eager, comp = tdinspect.DumpSet.open(work + '/eager'), tdinspect.DumpSet.open(work + '/compiled')\n"
                "print(eager.ops == comp.ops, len(eager.ops), 'entries')\n"
                "eager.diff(comp).first_divergence()"
            ),
            MD(
                "The sidecar of each pass says how it was captured and what dynamo counted during it; "
                "the compiled output is the one the model gives without capture:"
            ),
            CODE(
                "side = sorted(glob.glob(work + '/compiled/*/pass00000.json'))[0]\n"
                "print(json.load(open(side))['compile'])\n"
                "with torch.no_grad():\n    print(torch.equal(compiled(tokens), compiled_out))"
            ),
            MD(
                "`compile='eager'` runs the compiled model eagerly while capturing (with a warning), "
                "the values then are the eager ones. Op level (`capture_ops`) always records the eager "
                "aten ops of a compiled model and says so: the compiled graph runs fused kernels."
            ),
            CODE(
                "import warnings\nwith warnings.catch_warnings(record=True) as said, torch.no_grad():\n"
                "    warnings.simplefilter('always')\n"
                "    with tdinspect.capture(compiled, work + '/as_eager', compile='eager') as dump:\n"
                "        compiled(tokens); dump.step()\n"
                "print(said[0].message)\n"
                "print(eager.diff(work + '/as_eager').first_divergence())"
            ),
        ],
    )


if __name__ == "__main__":
    ONLY = tuple(sys.argv[1:])  # e.g. "06" rewrites notebooks/06_*.ipynb alone
    main()
