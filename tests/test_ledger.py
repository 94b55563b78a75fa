"""The ledger behind a verdict: every entry both sides hold after both selections is compared,
set aside or allowed; nothing compared is never "matches"; a recompute is checked, not skipped."""

from __future__ import annotations

import json
import re

import pytest
import torch

import tdinspect
from tdinspect import DumpSet
from tdinspect.cli import main
from tdinspect.compare.thresholds import Verdict
from tdinspect.examples.models import make_model, make_tokens

transformers = pytest.importorskip("transformers")

LAYERS = r"^model\.model\.layers\."  # the decoder layers: what checkpointing recomputes
ANY_LAYER = r"layers\.\d+\."  # a name that covers every recompute: allowing it allowed them all


def _ledger(diff, verdict) -> None:
    """The verdict's counts account for every row of the table: each entry both sides hold
    after both selections (a pair once), compared, set aside or allowed."""
    rows = diff.table(progress=False)
    assert verdict.compared + verdict.uncompared + verdict.allowed == len(rows)


def _kept(ds: DumpSet, other: DumpSet) -> int:
    """Entries (pairs counted once) that both selections keep, from metadata alone."""
    n = 0
    for k in set(ds.pass_map) | set(other.pass_map):
        names = set()
        for side in (ds, other):
            pi = side.pass_map.get(k)
            names |= {key for key in (pi.keys if pi else ()) if ds.keeps(key) and other.keeps(key)}
        n += len(names)
    return n


# -- case 1: a selection that names nothing -------------------------------------------------------
def test_a_typo_in_sel_or_filter_is_an_error_naming_it(runs):
    a = DumpSet.open(runs["ref"])
    with pytest.raises(
        KeyError, match=r"model\.layers\.2\.mlp\.dwn.*did you mean 'model\.layers\.2\.mlp\.down'"
    ):
        a.sel(op="model.layers.2.mlp.dwn")
    with pytest.raises(KeyError, match="'nonexistent' matches no entry"):
        a.filter("nonexistent")
    with pytest.raises(KeyError, match="without ::callN"):
        a.sel(op="model.expert::call1")
    with pytest.raises(KeyError, match="lm_head"):  # one name of two missing: still an error
        a.sel(op=["model.layers.0.ln1", "model.lm_hed"])
    with pytest.raises(KeyError, match="ln1"):  # there, but not in what the filter kept
        a.filter(r"layers\.1\.").sel(op="model.layers.0.ln1")
    assert a.sel(op=["model.lm_head", "model.embed"]).ops == ["model.embed", "model.lm_head"]


def test_a_verdict_that_compared_nothing_is_incomplete(runs):
    a, wrong = DumpSet.open(runs["ref"]), DumpSet.open(runs["wrong"])
    # both selections valid, sharing no entry: B's layer 2 (the broken one) is never compared
    diff = a.filter(r"layers\.0\.").diff(wrong.filter(r"layers\.2\."))
    v = diff.verdict()
    assert v.outcome == "incomplete" and v.compared == 0
    assert "selection matched nothing" in v.gap and "nothing was compared" in v.text
    with pytest.warns(tdinspect.UncomparedWarning, match="selection matched nothing"):
        assert diff.first_divergence() is None
    assert diff.summary()["outcome"] == "incomplete"
    with pytest.raises(ValueError, match="never 'matches'"):
        Verdict("matches", compared=0)


def _capture_part(path, pattern: str):
    model = make_model(seed=0)
    with torch.no_grad(), tdinspect.capture(model, path, filter=pattern, environ={}) as dump:
        model(make_tokens(seed=0))
        dump.step()
    return path


def test_cli_every_entry_allowed_and_none_compared_exits_3_with_the_ledger(tmp_path, capsys):
    a = _capture_part(tmp_path / "a", r"layers\.0\.")
    b = _capture_part(tmp_path / "b", r"layers\.1\.")
    args = ["first-divergence", str(a), str(b), "--allow-uncompared", "layers", "--json"]
    assert main(args) == 3
    out = json.loads(capsys.readouterr().out)
    held = len(DumpSet.open(a).ops) + len(DumpSet.open(b).ops)
    assert out["outcome"] == "incomplete" and out["compared"] == 0
    assert out["uncompared"] == 0 and out["allowed"] == held > 0
    assert main(args[:-1]) == 3
    assert "nothing was compared" in capsys.readouterr().out


# -- case 2: B's selection --------------------------------------------------------------------------
def test_b_selection_is_honoured_as_a_selection(runs):
    a, wrong = DumpSet.open(runs["ref"]), DumpSet.open(runs["wrong"])  # wrong: layers.2.mlp.down
    early = wrong.filter(r"layers\.[01]\.")
    diff = a.diff(early)
    v = diff.verdict()
    assert v.outcome == "matches", v.text
    assert v.compared == _kept(a, early) > 0 and set(diff.table(progress=False)["op"]) == set(early.ops)
    _ledger(diff, v)
    assert diff.one_sided()["entries"] == {"A": [], "B": []}  # outside B's selection: outside both
    one = wrong.sel(op="model.layers.1.mlp.down")
    v = a.diff(one).verdict()
    assert (v.outcome, v.compared) == ("matches", len(one.passes))
    # narrowing both sides: the entries both keep
    both = a.filter(r"mlp").diff(wrong.filter(r"layers\.2\."))
    v = both.verdict()
    assert v.outcome == "diverges" and v.divergence.key == "model.layers.2.mlp.down"
    assert set(both.table(progress=False)["op"]) <= {o for o in a.ops if "mlp" in o and "layers.2." in o}


# -- case 5: a recompute (activation checkpointing) ---------------------------------------------------
def _llama_config():
    return transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
    )


def _train_step(path, *, checkpointed=False, recompute_off=None, twice=False):
    """One forward and backward of a tiny Llama under capture; ``recompute_off``: a module
    whose second call (the recompute) is moved by 0.1 x its mean |output|."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_llama_config()).train()
    if checkpointed:
        model.gradient_checkpointing_enable()
    if recompute_off:
        calls = []

        def moved(module, args, out):  # the same ops on every call: checkpoint's own check passes
            calls.append(1)
            return out + (0.1 if len(calls) == 2 else 0.0) * out.abs().mean()

        model.get_submodule(recompute_off).register_forward_hook(moved)
    ids = torch.randint(1, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    with tdinspect.capture(model, path, filter=LAYERS, environ={}) as dump:
        model(ids, labels=ids).loss.backward()
        if twice:  # a second, shorter request in the same pass: every module's ::call1, another shape
            with torch.no_grad():
                model(ids[:, :7])
        dump.step()
    return DumpSet.open(path)


@pytest.fixture(scope="module")
def steps(tmp_path_factory):
    root = tmp_path_factory.mktemp("ledger")
    return {
        "plain": _train_step(root / "plain"),
        "checkpointed": _train_step(root / "checkpointed", checkpointed=True),
        "bad_recompute": _train_step(
            root / "bad_recompute", checkpointed=True, recompute_off="model.layers.0.mlp.up_proj"
        ),
        "twice": _train_step(root / "twice", twice=True),
    }


def test_a_correct_recompute_is_compared_with_its_original_and_matches(steps):
    plain, ckpt = steps["plain"], steps["checkpointed"]
    recomputed = [k for k in ckpt.pass_map[(0, 0)].keys if k.endswith("::call1")]
    assert len(recomputed) == 18  # every module of both layers but the layers themselves
    for a, b in ((plain, ckpt), (ckpt, plain)):  # the recompute on B's side, then on A's
        diff = a.diff(b)
        for structural in ("diverge", "report"):
            v = diff.verdict(structural=structural)
            assert v.outcome == "matches", v.text
            assert v.compared == len(plain.ops) + len(recomputed)  # counted as compared
            _ledger(diff, v)


def test_a_recompute_that_differs_diverges_naming_it_even_when_allowed(steps):
    plain, bad = steps["plain"], steps["bad_recompute"]
    diff = plain.diff(bad)
    for kwargs in ({}, {"structural": "report"}, {"allow_uncompared": ANY_LAYER}):
        v = diff.verdict(**kwargs)
        assert v.outcome == "diverges", v.text
        assert v.divergence.key == "model.model.layers.0.mlp.up_proj::call1"
        assert re.search(r"B's \S+up_proj::call1 differs from its call 0 \(a recompute\?\): rel_diff", v.text)
        assert v.divergence.value == pytest.approx(0.00317, rel=0.5)
    assert (
        bad.diff(plain).verdict().divergence.reason.startswith("A's model.model.layers.0.mlp.up_proj::call1")
    )


def test_allow_uncompared_names_the_keys_the_verdict_prints(steps):
    plain, twice = steps["plain"], steps["twice"]
    diff = plain.diff(twice)
    v = diff.verdict()
    assert v.outcome == "diverges" and v.divergence.key.endswith("::call1") and "only in B" in v.text
    v = diff.verdict(allow_uncompared="::call1")  # the key as printed, call included
    assert v.outcome == "matches", v.text
    assert v.allowed == len(plain.ops) and v.compared == len(plain.ops)
    _ledger(diff, v)
    assert diff.verdict(allow_uncompared=r"up_proj::call1$").outcome == "diverges"
    assert plain.diff(twice, allow_uncompared="::call1").verdict().outcome == "matches"
