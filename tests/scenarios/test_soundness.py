"""The soundness suite of issue 35: families x modes x fault places, two properties per cell.

Each cell of :data:`tests.scenarios.soundness_cases.CELLS` is one test: a planted fault is named
at its module (and its slice, where the mode compares slices), or a correct variant reads
"matches" with entries compared. Cells broken today by a case of issue 35 are strict xfails
naming the case: they turn into failures, and lose their mark, when the case is fixed.

The mutation test changes one slice of B that the comparison reads (on disk, in its pass file)
and asks that the verdict is never "matches".
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from tdinspect.errors import DumpFormatError

pytest.importorskip("transformers")

from .soundness_cases import CASE, CELLS, EPS, FACTOR, FP32, MUTATED, Runs, judge, mutate, mutated_diff  # noqa: E402


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every run the cells compare, each captured once on first use."""
    return Runs(tmp_path_factory.mktemp("soundness"))


def _param(cell):
    marks = [pytest.mark.xfail(strict=True, reason=cell.xfail)] if cell.xfail else []
    return pytest.param(cell, id=cell.id, marks=marks)


@pytest.mark.parametrize("cell", [_param(c) for c in CELLS])
def test_cell(cell, runs):
    if cell.needs is not None and (why := cell.needs(runs)):
        pytest.skip(why)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the verdict is the answer under test
        ok, text = judge(cell, runs)
    if cell.kind == "fault":
        assert ok, f"the fault planted at {cell.module} ({cell.place}) is not named there: {text}"
    else:
        assert ok, f"a correct variant ({cell.place}) does not read 'matches': {text}"


def test_the_matrix_covers_every_family_mode_and_fault_place():
    """The matrix the issue asks for: four families, the seven modes, the six fault places, and
    both properties for each family and mode."""
    assert {c.family for c in CELLS} == {"dense", "moe", "encoder", "decode"}
    assert {"plain", "mapping", "unshard", "concat", "tokens", "baseline", "ops"} <= {c.mode for c in CELLS}
    places = " ".join(c.place for c in CELLS if c.kind == "fault")
    for place in ("element", "call", "token", "rank", "replica", "expert"):
        assert place in places
    pairs = {(c.family, c.mode, c.kind) for c in CELLS}
    for family, mode, _ in pairs:
        assert {(family, mode, "fault"), (family, mode, "correct")} <= pairs, (family, mode)
    for c in CELLS:  # an expected failure names its issue 35 case, or says it is a new finding
        assert (
            c.xfail is None
            or c.xfail.startswith("new finding")
            or int(c.xfail.split()[3].rstrip(":")) in CASE
        )


def test_a_slice_fault_is_sized_past_its_threshold():
    """A slice fault scales its slice by 1 + EPS: rel_diff FACTOR x float32's threshold there."""
    x = torch.randn(64, dtype=torch.float64)
    y = x * (1 + EPS)
    rel = float((x - y).square().sum() / (x.square().sum() + y.square().sum()))
    assert rel == pytest.approx(FACTOR * FP32, rel=0.01)


SEEDS = 6


@pytest.mark.parametrize("mode", list(MUTATED))
def test_one_slice_of_b_changed_never_matches(mode, runs, tmp_path):
    """Change one slice the comparison reads (an entry, a rank's shard, a decode call, a token
    row) of B's pass file on disk, FACTOR x past float32's threshold on that slice: whichever the
    seed picks, the verdict is never "matches"."""
    _, b, slices = MUTATED[mode]
    clean = mutated_diff(mode, runs, runs[b]).verdict()
    assert clean.outcome == "matches" and clean.compared > 0  # B as captured: a correct variant
    missed = []
    for seed in range(SEEDS):
        dst = tmp_path / f"m{seed}"
        where = mutate(runs[b], dst, slices, np.random.default_rng(seed))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the stale sidecar is reported; the file wins
            try:
                v = mutated_diff(mode, runs, dst).verdict()
            except DumpFormatError:  # the edit refused as tampering: not "matches" either
                continue
        if v.outcome == "matches":
            missed.append(f"{where}: {v.text}")
    assert not missed, "a changed slice of B read 'matches':\n" + "\n".join(missed)


@pytest.mark.parametrize("narrow", ["filter", "sel"])
def test_a_selection_of_nothing_never_reads_matches(narrow, runs):
    """A typo in A's selection compares nothing: an error naming it, or any answer but "matches"
    (B holds a fault)."""
    a = runs.open("dense")
    typo = "model.model.layers.1.mlp.dwn"
    try:
        a = a.filter(typo) if narrow == "filter" else a.sel(op=typo)
        v = a.diff(runs["dense_element"]).verdict()
    except (KeyError, ValueError) as exc:
        assert "dwn" in str(exc)
        return
    assert v.outcome != "matches", v.text


@pytest.mark.parametrize("narrow", ["filter", "sel"])
def test_b_selection_is_honoured(narrow, runs):
    """B narrowed to layer 0: the two selections act as one (docs/compare.md, "Three outcomes"),
    so the comparison reads layer 0 alone on both sides: every layer-0 entry compared, B's
    layer-1 fault outside it; without the narrowing that fault is named."""
    b = runs.open("dense_element")
    layer0 = [k for k in b.ops if ".layers.0." in k]
    b = b.filter(r"\.layers\.0\.") if narrow == "filter" else b.sel(op=layer0)
    v = runs.open("dense").diff(b).verdict()
    assert v.outcome == "matches" and v.compared == len(layer0), v.text
    whole = runs.open("dense").diff(runs.open("dense_element")).verdict()
    assert whole.outcome == "diverges" and ".layers.1." in whole.divergence.key, whole.text
