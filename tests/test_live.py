"""Live comparison: compare_to finds the offline answer while the model runs, writes only evidence."""

from __future__ import annotations

import subprocess
import sys

import pandas as pd
import pytest
import torch

import tdinspect
from tdinspect import DumpSet, load_pass
from tdinspect.cli import main
from tdinspect.examples.models import make_model, make_tokens
from tdinspect.examples.samples import PERTURB_SCALE, capture_model_run

from .conftest import only_folder

LEAF = "layers.2.mlp.down.weight"


def _same(live, offline):
    assert (live.op, live.call, live.pass_, live.key, live.value) == (
        offline.op,
        offline.call,
        offline.pass_,
        offline.key,
        offline.value,
    )


def _perturbed(dtype=torch.float32, leaf=LEAF):
    model = make_model(dtype=dtype)
    with torch.no_grad():
        model.get_parameter(leaf).mul_(PERTURB_SCALE)
    return model


def _steps(model, cap, n=3, on_step=None):
    done = []
    with torch.no_grad():
        for s in range(n):
            if on_step is not None:
                on_step(s)
            model(make_tokens(seed=s))
            done.append(s)
            cap.step()
    return done


def test_perturbed_leaf_found_live_equals_offline_and_writes_nothing(runs, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    offline = DumpSet.open(runs["ref"]).diff(runs["wrong"]).first_divergence()
    model = _perturbed()
    with pytest.raises(tdinspect.DivergenceError) as info:
        with tdinspect.capture(model, compare_to=runs["ref"]) as cap:
            _steps(model, cap)
    live = info.value.divergence
    assert isinstance(live, tdinspect.Divergence)
    _same(live, offline)
    assert live.key == "model.layers.2.mlp.down" and live.reason == offline.reason
    assert live.before == offline.before and len(live.before) == 5
    assert all(not m._forward_hooks for m in model.modules())  # the model is as it was
    assert list(tmp_path.iterdir()) == [] and info.value.evidence is None
    # other metrics and per-name thresholds follow Diff's rule too
    thr = {r"mlp\.down": 0.5, r".*": 1e-7}
    offline = DumpSet.open(runs["ref"]).diff(runs["wrong"]).first_divergence(thr, "max_abs")
    with pytest.raises(tdinspect.DivergenceError) as info:
        with tdinspect.capture(model, compare_to=runs["ref"], metric="max_abs", threshold=thr) as cap:
            _steps(model, cap)
    _same(info.value.divergence, offline)


def test_same_run_passes_and_record_mode_writes_metrics(runs, tmp_path):
    model = make_model()
    with tdinspect.capture(model, compare_to=runs["ref"]) as cap:  # identical run: no error
        _steps(model, cap)
    assert cap.live.first is None
    model = _perturbed()
    with tdinspect.capture(model, tmp_path, compare_to=runs["ref"], on_divergence="record") as cap:
        assert _steps(model, cap) == [0, 1, 2]  # goes on
    offline = DumpSet.open(runs["ref"]).diff(runs["wrong"]).table(progress=False)
    for p in range(3):
        rows = pd.read_csv(tmp_path / "live" / f"pass{p:05d}.csv", keep_default_na=False, na_values=[""])
        expected = offline[offline["pass"] == p].reset_index(drop=True)
        assert rows["key"].tolist() == expected["key"].tolist()
        assert rows["rel_diff"].tolist() == pytest.approx(expected["rel_diff"].tolist(), rel=1e-15)
    table = cap.live.table()
    assert len(table) == len(offline) and table["rel_diff"].max() > 1e-3
    # warn: once per pass, the run goes on
    with pytest.warns(RuntimeWarning, match="live comparison") as rec:
        with tdinspect.capture(model, compare_to=runs["ref"], on_divergence="warn") as cap:
            assert _steps(model, cap) == [0, 1, 2]
    assert len([w for w in rec if "live comparison" in str(w.message)]) == 3


def test_evidence_only_with_dump_dir(runs, tmp_path, capsys):
    model = _perturbed()
    with pytest.raises(tdinspect.DivergenceError) as info:
        with tdinspect.capture(model, tmp_path / "ev", compare_to=runs["ref"]) as cap:
            _steps(model, cap)
    files = sorted(
        p.relative_to(tmp_path / "ev").as_posix() for p in (tmp_path / "ev").rglob("*") if p.is_file()
    )
    assert [f.split("/")[:2] for f in files] == [["evidence", "ref"]] * 2 + [["evidence", "run"]] * 2
    assert [f.rsplit("/", 1)[1] for f in files] == ["pass00000.json", "pass00000.pt"] * 2
    ref_ev, run_ev = tmp_path / "ev/evidence/ref", tmp_path / "ev/evidence/run"
    run_t = load_pass(only_folder(run_ev) / "pass00000.pt")
    ref_t = load_pass(only_folder(ref_ev) / "pass00000.pt")
    div = info.value.divergence
    assert list(run_t) == list(ref_t) == [k for k, _ in div.before] + [div.key]
    full_ref = load_pass(only_folder(runs["ref"]) / "pass00000.pt")
    full_wrong = load_pass(only_folder(runs["wrong"]) / "pass00000.pt")
    assert all(torch.equal(ref_t[k], full_ref[k]) and torch.equal(run_t[k], full_wrong[k]) for k in ref_t)
    _same(DumpSet.open(ref_ev).diff(run_ev).first_divergence(), div)
    assert main(["diff", str(ref_ev), str(run_ev)]) == 1
    assert "model.layers.2.mlp.down" in capsys.readouterr().out


def test_perturbation_in_pass_3_of_5_stops_there(tmp_path):
    ref = capture_model_run(tmp_path / "ref", steps=5)
    model = make_model()
    leaf = model.get_parameter(LEAF)

    def break_at_3(step):
        if step == 3:
            with torch.no_grad():
                leaf.mul_(PERTURB_SCALE)

    ran = []
    with pytest.raises(tdinspect.DivergenceError) as info:
        with tdinspect.capture(model, compare_to=ref) as cap:
            ran = _steps(model, cap, n=5, on_step=lambda s: (ran.append(s), break_at_3(s)))
    assert ran == [0, 1, 2, 3]  # the fifth pass never ran
    assert info.value.divergence.pass_ == 3
    # offline, from a full dump of the same run
    model = make_model()
    leaf = model.get_parameter(LEAF)
    with tdinspect.capture(model, tmp_path / "full") as cap:
        _steps(model, cap, n=5, on_step=break_at_3)
    _same(info.value.divergence, DumpSet.open(ref).diff(tmp_path / "full").first_divergence())


def test_stats_only_reference_and_structural(runs, tmp_path):
    model = _perturbed()
    offline = DumpSet.open(runs["stats"]).diff(runs["wrong"]).first_divergence()
    with pytest.raises(tdinspect.DivergenceError) as info:
        with tdinspect.capture(model, compare_to=runs["stats"]) as cap:
            _steps(model, cap)
    assert info.value.divergence.metric == "stats_rel"
    _same(info.value.divergence, offline)
    with pytest.raises(ValueError, match="statistics only"):
        tdinspect.capture(model, compare_to=runs["stats"], metric="rel_diff")
    # an entry the reference does not have: structural, as in Diff
    model = make_model()
    with tdinspect.capture(model, tmp_path / "narrow", filter=r"lm_head") as cap:
        _steps(model, cap, n=1)
    offline = DumpSet.open(tmp_path / "narrow").diff(runs["ref"]).first_divergence()
    with pytest.raises(tdinspect.DivergenceError) as info:
        with tdinspect.capture(model, compare_to=tmp_path / "narrow") as cap:
            _steps(model, cap, n=1)
    live = info.value.divergence
    assert (
        (live.key, live.pass_, live.reason, live.structural)
        == (offline.key, offline.pass_, offline.reason, True)
        == ("model.embed", 0, "only in B", True)
    )
    # entries this run never produces: found when the pass ends
    offline = DumpSet.open(runs["ref"]).diff(tmp_path / "narrow").first_divergence()
    with pytest.raises(tdinspect.DivergenceError) as info:
        with tdinspect.capture(model, filter=r"lm_head", compare_to=runs["ref"]) as cap:
            with torch.no_grad():
                model(make_tokens(seed=0))
            cap.step()
    live = info.value.divergence
    assert (
        (live.key, live.pass_, live.reason)
        == (offline.key, 0, offline.reason)
        == ("model.embed", 0, "only in A")
    )


def test_mapping_pairs_differently_named_runs(runs, tmp_path):
    rules = {r"model\.(.*)": r"net.\1"}
    model = _perturbed()
    with tdinspect.capture(model, tmp_path / "net", root="net") as cap:
        _steps(model, cap, n=1)
    offline = DumpSet.open(runs["ref"]).diff(tmp_path / "net", mapping=rules).first_divergence()
    assert offline.key == "model.layers.2.mlp.down"
    with pytest.raises(tdinspect.DivergenceError) as info:
        with tdinspect.capture(model, root="net", compare_to=runs["ref"], mapping=rules) as cap:
            _steps(model, cap, n=1)
    _same(info.value.divergence, offline)
    assert info.value.divergence.row["key_b"] == "net.layers.2.mlp.down"


def _small():
    return dict(d_model=32, n_layers=2, n_heads=2, vocab=50, euler_steps=1)


def _train_step(model, cap):
    tokens = make_tokens(batch=1, seq=8, vocab=50, seed=0)
    model(tokens).float().pow(2).mean().backward()
    cap.step()


def test_op_level_forward_and_backward_live_equals_offline(tmp_path, monkeypatch):
    ref = make_model(**_small())
    with tdinspect.capture_ops(tmp_path / "ref", model=ref) as cap:
        _train_step(ref, cap)
    wrong = make_model(**_small())
    with torch.no_grad():
        wrong.get_parameter("layers.1.mlp.down.bias").add_(0.5)
    with tdinspect.capture_ops(tmp_path / "wrong", model=wrong) as cap:
        _train_step(wrong, cap)
    offline = DumpSet.open(tmp_path / "ref").diff(tmp_path / "wrong").first_divergence()
    assert offline.key.startswith("model.layers.1.mlp.down/aten.addmm")
    monkeypatch.chdir(tmp_path / "wrong")
    before = sorted(p.name for p in tmp_path.iterdir())
    wrong.zero_grad()
    with pytest.raises(tdinspect.DivergenceError) as info:
        with tdinspect.capture_ops(model=wrong, compare_to=tmp_path / "ref") as cap:
            _train_step(wrong, cap)
    _same(info.value.divergence, offline)
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert torch.sqrt(torch.tensor(4.0)) == 2.0  # the dispatch mode is gone
    # record: every op, forward and backward, gets Diff's numbers
    wrong.zero_grad()
    with tdinspect.capture_ops(model=wrong, compare_to=tmp_path / "ref", on_divergence="record") as cap:
        _train_step(wrong, cap)
    live = cap.live.table()
    table = DumpSet.open(tmp_path / "ref").diff(tmp_path / "wrong").table(progress=False)
    assert live["key"].tolist() == table["key"].tolist()
    assert any("gelu_backward" in k for k in live["key"])
    assert live["rel_diff"].tolist() == pytest.approx(table["rel_diff"].tolist(), rel=1e-15, nan_ok=True)


def _tiny_llama(seed=0):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return transformers.LlamaForCausalLM(config).eval()


def test_tiny_hf_llama_live_equals_offline(tmp_path, monkeypatch):
    ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(0))

    def run(model, cap, n=2):
        with torch.no_grad():
            for _ in range(n):
                model(ids)
                cap.step()

    ref = _tiny_llama()
    with tdinspect.capture(ref, tmp_path / "ref") as cap:
        run(ref, cap)
    wrong = _tiny_llama()
    with torch.no_grad():
        wrong.get_parameter("model.layers.1.mlp.down_proj.weight").mul_(PERTURB_SCALE)
    with tdinspect.capture(wrong, tmp_path / "wrong") as cap:
        run(wrong, cap)
    offline = DumpSet.open(tmp_path / "ref").diff(tmp_path / "wrong").first_divergence()
    assert offline.key == "model.model.layers.1.mlp.down_proj"
    monkeypatch.chdir(tmp_path / "wrong")
    with pytest.raises(tdinspect.DivergenceError) as info:
        with tdinspect.capture(wrong, compare_to=tmp_path / "ref") as cap:
            run(wrong, cap)
    _same(info.value.divergence, offline)
    with tdinspect.capture(ref, compare_to=tmp_path / "ref") as cap:  # the same model: silent
        run(ref, cap)
    # evidence: both sides, openable, same answer
    with pytest.raises(tdinspect.DivergenceError) as info:
        with tdinspect.capture(wrong, tmp_path / "ev", compare_to=tmp_path / "ref") as cap:
            run(wrong, cap)
    ev = tmp_path / "ev" / "evidence"
    _same(DumpSet.open(ev / "ref").diff(ev / "run").first_divergence(), offline)


def test_capture_stays_light_without_compare_to(tmp_path):
    code = (
        "import sys, torch, tdinspect\n"
        "m = torch.nn.Sequential(torch.nn.Linear(4, 4))\n"
        f"with tdinspect.capture(m, {str(tmp_path)!r}, on_nonfinite='raise') as c:\n"
        "    m(torch.ones(2, 4)); c.step()\n"
        "with tdinspect.capture_ops(on_nonfinite='raise') as c:\n"
        "    m(torch.ones(2, 4)); c.step()\n"
        "print([k for k in ('xarray', 'pandas', 'numba', 'tdinspect.dumper.live') if k in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_recorded_inputs_and_params_are_compared_too(tmp_path):
    what = ("inputs", "outputs", "params")
    model = make_model()
    with tdinspect.capture(model, tmp_path / "ref", record=what) as cap:
        _steps(model, cap, n=2)
    with tdinspect.capture(model, compare_to=tmp_path / "ref", record=what) as cap:
        _steps(model, cap, n=2)  # parameters unchanged since pass 0 on both sides: no error
    wrong = _perturbed()
    with tdinspect.capture(wrong, tmp_path / "wrong", record=what) as cap:
        _steps(wrong, cap, n=2)
    offline = DumpSet.open(tmp_path / "ref").diff(tmp_path / "wrong").first_divergence()
    assert offline.key == "model.layers.2.mlp.down.weight"
    with pytest.raises(tdinspect.DivergenceError) as info:
        with tdinspect.capture(wrong, compare_to=tmp_path / "ref", record=what) as cap:
            _steps(wrong, cap, n=2)
    _same(info.value.divergence, offline)


def test_capture_magic_compare_to(runs, tmp_path):
    pytest.importorskip("nbclient")
    from .test_jupyter import _run, _text

    ref = runs["ref"]
    cells = [
        "%load_ext tdinspect",
        "import torch\nfrom tdinspect.examples.models import make_model, make_tokens\n"
        "m = make_model(); w = make_model()\n"
        "with torch.no_grad(): w.get_parameter('layers.2.mlp.down.weight').mul_(1.2)",
        f"%%tdi_capture --model m --compare-to {ref}\nwith torch.no_grad(): m(make_tokens(seed=0))",
        f"%%tdi_capture {tmp_path / 'ev'} --model w --compare-to {ref} --on-divergence record\n"
        "with torch.no_grad(): w(make_tokens(seed=0))",
        f"%%tdi_capture --model w --compare-to {ref}\nwith torch.no_grad(): w(make_tokens(seed=0))",
        "print(all(not mod._forward_hooks for mod in w.modules()))",
        "%%tdi_capture --model w\n1",
    ]
    nb = _run(cells)
    # the verdict, in the CLI's words: one pass of a reference of three is incomplete
    assert f"tdinspect: against {ref}: incomplete: no divergence among the 42 entries compared" in _text(
        nb.cells[2]
    )
    assert "stopped before the reference's passes 1, 2" in _text(nb.cells[2])
    assert f"tdinspect: against {ref}: diverges: model.layers.2.mlp.down (pass 0)" in _text(nb.cells[3])
    assert "DivergenceError" in _text(nb.cells[4]) and "True" in _text(nb.cells[5])
    assert "give a dump directory" in "".join(o.get("text", "") for o in nb.cells[6].outputs)
    assert sorted(p.name for p in (tmp_path / "ev").iterdir()) == ["evidence", "live"]


class _BumpThenScale(torch.nn.Module):
    """Adds 1 in place to its input (the previous module's output), then scales it."""

    def __init__(self, scale):
        super().__init__()
        self.scale = scale

    def forward(self, x):
        x.add_(1)
        return x * self.scale


@pytest.mark.parametrize("ops", [False, True], ids=["modules", "ops"])
def test_evidence_holds_values_as_recorded_when_the_model_changes_them_later(tmp_path, ops):
    def model(scale):
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(4, 4), _BumpThenScale(scale))

    def run(m, *args, **kw):
        cap = tdinspect.capture_ops(*args, **kw) if ops else tdinspect.capture(m, *args, **kw)
        x = torch.arange(8.0).reshape(2, 4)
        with torch.no_grad(), cap:
            m(x)
            cap.step()

    run(model(1.0), tmp_path / "ref")
    with pytest.raises(tdinspect.DivergenceError) as info:
        run(model(2.0), tmp_path / "ev", compare_to=tmp_path / "ref")
    div = info.value.divergence
    # the linear's output, changed in place after it was recorded
    first = "model.Sequential.Linear/aten.addmm.default[out0]" if ops else "model.0"
    assert first in dict(div.before)
    run_ev = load_pass(only_folder(tmp_path / "ev/evidence/run") / "pass00000.pt")
    ref = load_pass(only_folder(tmp_path / "ref") / "pass00000.pt")
    assert torch.equal(run_ev[first], ref[first])
    assert (
        DumpSet.open(tmp_path / "ev/evidence/ref").diff(tmp_path / "ev/evidence/run").first_divergence().key
        == div.key
    )


def test_statistics_of_an_entry_computed_once_whatever_its_partners(runs, monkeypatch):
    """Statistics mode: an entry met by two reference entries (a mapping) is measured once,
    and an entry's values are never copied when only statistics are compared."""
    import tdinspect.dumper.live as live_mod

    measured, copied = [], []
    real_stats = live_mod.capture_stats  # the live side's statistics, as capture records them
    monkeypatch.setattr(live_mod, "capture_stats", lambda t: measured.append(1) or real_stats(t))
    real_contiguous = torch.Tensor.contiguous
    monkeypatch.setattr(
        torch.Tensor, "contiguous", lambda t, *a, **k: copied.append(1) or real_contiguous(t, *a, **k)
    )
    rules = {r"model\.layers\.1\.(.*)": r"model.layers.0.\1"}  # layers 0 and 1 meet layer 0
    model = make_model()
    with tdinspect.capture(model, compare_to=runs["stats"], mapping=rules, on_divergence="record") as cap:
        _steps(model, cap, n=1)
        table = cap.live.table()
    monkeypatch.undo()
    paired = table[~table["structural"].astype(bool)]
    assert (paired["key_b"] == "model.layers.0.mlp.down").sum() == 2  # two partners
    assert len(measured) == paired["key_b"].nunique() > 0
    assert copied == []
    # the numbers are still those of the offline diff of the same dumps
    offline = DumpSet.open(runs["stats"]).diff(runs["ref"], mapping=rules)
    rows = offline.table()
    rows = rows[rows["pass"] == 0]
    rows = rows[~rows["structural"].astype(bool)]

    def by_pair(t):
        return dict(zip(zip(t["key"], t["key_b"]), t["stats_rel"]))

    assert by_pair(paired) == by_pair(rows)


def test_a_rerun_never_replaces_or_mixes_into_earlier_evidence(runs, tmp_path):
    """A notebook cell run twice is the same process: the second run's evidence went to the
    same rank<R>_pid<P> folders and replaced the first's (or mixed with it, pass by pass);
    with on_divergence="record", its rows replaced the first's CSVs."""
    ev = tmp_path / "ev"
    first = None
    for leaf in (LEAF, "layers.1.mlp.down.weight"):
        model = _perturbed(leaf=leaf)
        with pytest.raises(tdinspect.DivergenceError):
            with tdinspect.capture(model, ev, compare_to=runs["ref"]) as cap:
                _steps(model, cap)
        model = _perturbed(leaf=leaf)
        with tdinspect.capture(model, ev, compare_to=runs["ref"], on_divergence="record") as cap:
            _steps(model, cap)
        if first is None:
            first = {p: p.read_bytes() for p in ev.rglob("*") if p.is_file()}
    for side in ("run", "ref"):
        assert len([p for p in (ev / "evidence" / side).iterdir() if p.is_dir()]) == 4, side
    assert sorted(p.name for p in ev.iterdir() if p.name.startswith("live")) == ["live", "live_run2"]
    assert {p: p.read_bytes() for p in first} == first  # the first runs' files, intact


def test_warning_shows_names_from_the_reference_as_escapes(tmp_path):
    """on_divergence="warn" and "raise" print the entry's name on the terminal: a control
    character in a module name (the reference's files) is written as its escape."""

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.add_module("esc\x1b[2J", torch.nn.Linear(4, 4))

        def forward(self, x):
            return getattr(self, "esc\x1b[2J")(x)

    x = torch.ones(2, 4)
    for name, scale in (("ref", 1.0), ("run", 2.0)):
        torch.manual_seed(0)
        model = Net()
        with torch.no_grad():
            model.get_submodule("esc\x1b[2J").weight.mul_(scale)
            if name == "ref":
                with tdinspect.capture(model, tmp_path / "ref") as cap:
                    model(x)
                    cap.step()
                continue
            with pytest.warns(RuntimeWarning, match="first divergence") as caught:
                with tdinspect.capture(model, compare_to=tmp_path / "ref", on_divergence="warn") as cap:
                    model(x)
                    cap.step()
        with pytest.raises(tdinspect.DivergenceError) as raised:
            with tdinspect.capture(model, compare_to=tmp_path / "ref") as cap:
                model(x)
                cap.step()
    for text in (" ".join(str(w.message) for w in caught), str(raised.value)):
        assert "model.esc\\x1b" in text and "\x1b" not in text


def test_a_rerun_live_cell_keeps_its_newest_evidence_and_nothing_else(runs, tmp_path):
    """``%%tdi_capture DIR --compare-to REF --on-divergence record`` run 5 times added
    ``live``, ``live_run2``..``live_run5`` and as many evidence dumps, without bound; now the
    cell keeps its newest ``--keep-runs`` (2 here) and removes the older ones it made, and
    only those: a folder a script wrote there, and a file put in a cell's folder, stay."""
    pytest.importorskip("nbclient")
    from .test_jupyter import _run, _text

    ref, ev = runs["ref"], tmp_path / "ev"
    (ev / "evidence" / "run" / "rank0_pid1").mkdir(parents=True)  # a script's evidence
    (ev / "evidence" / "run" / "rank0_pid1" / "pass00000.pt").write_bytes(b"kept")
    cell = (
        f"%%tdi_capture {ev} --model w --compare-to {ref} --on-divergence record --keep-runs 2\n"
        "with torch.no_grad(): w(make_tokens(seed=0))"
    )
    cells = [
        "%load_ext tdinspect",
        "import torch\nfrom tdinspect.examples.models import make_model, make_tokens\nw = make_model()\n"
        "with torch.no_grad(): w.get_parameter('layers.2.mlp.down.weight').mul_(1.2)",
        cell,
        cell,
        f"open({str(ev / 'live_run2' / 'notes.txt')!r}, 'w').write('mine')",
        cell,
        cell,
        cell,
    ]
    nb = _run(cells)
    assert "removed" not in _text(nb.cells[3]) and "removed 3 folder(s)" in _text(nb.cells[5])
    # the two newest cells' rows (names are reused once free), and the folder the user's file kept
    rows = {p.name: sorted(c.name for c in p.iterdir()) for p in ev.iterdir() if p.name != "evidence"}
    assert rows.pop("live_run2") == ["notes.txt"] and list(rows.values()) == [["pass00000.csv"]] * 2
    run = sorted(p.name for p in (ev / "evidence" / "run").iterdir())
    assert (
        run[0] == "rank0_pid1"
        and len(run) == 3
        and (ev / "evidence" / "run" / "rank0_pid1" / "pass00000.pt").exists()
    )
    assert len(list((ev / "evidence" / "ref").iterdir())) == 2
