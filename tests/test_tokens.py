"""Token alignment: a tiny Hugging Face Llama run one request at a time, or padded, against the
same model served packed with continuous batching (tdinspect.examples.engine)."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import warnings

import pytest
import torch

import tdinspect
from tdinspect.dumper.recorder import Recorder
from tdinspect.errors import AlignError, DumpFormatError, TokenLayoutError, UncomparedWarning
from tdinspect.examples.engine import (
    CONTINUOUS,
    PACKED,
    PackedLlama,
    capture_engine,
    capture_reference,
    engine_prompts,
)
from tdinspect.examples.port import make_hf_llama
from tdinspect.numerics.metrics import compare_tensors


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokens")
    hf = make_hf_llama(seed=0)
    prompts = engine_prompts()
    out = {
        "hf": capture_reference(hf, prompts, root / "hf"),
        "padded": capture_reference(hf, prompts, root / "padded", padded=True),
        "packed": capture_engine(PackedLlama(hf), prompts, PACKED, root / "packed"),
        "continuous": capture_engine(PackedLlama(hf), prompts, CONTINUOUS, root / "continuous"),
        "bug": capture_engine(PackedLlama(hf, bug=(1, 6)), prompts, CONTINUOUS, root / "bug"),
        "last": capture_engine(PackedLlama(hf, logits="last"), prompts, PACKED, root / "last"),
        "short": capture_engine(PackedLlama(hf), prompts, CONTINUOUS[:-2], root / "short"),
    }
    return {k: tdinspect.DumpSet.open(v) for k, v in out.items()}


# -- the layout ------------------------------------------------------------------------------


def test_layout_from_engine_tensors():
    packed = tdinspect.tokens(
        request_ids=torch.tensor([4, 2]),
        positions=torch.tensor([7, 0, 1, 2]),
        cu_seqlens=torch.tensor([0, 1, 4]),
    )
    assert packed.shape == (4,) and packed.segments == ((4, 7, 1), (2, 0, 3))
    padded = tdinspect.tokens(attention_mask=torch.tensor([[0, 1, 1], [1, 1, 1]]), request_ids=[9, 3])
    assert padded.shape == (2, 3) and padded.segments == ((None, 0, 1), (9, 0, 2), (3, 0, 3))
    per_token = tdinspect.tokens(request_ids=[1, 1, 0], positions=[3, 4, 0], shape=(1, 3))
    assert per_token.segments == ((1, 3, 2), (0, 0, 1))


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(request_ids=[0, 1], seq_lens=[2, 3], positions=[0, 1, 2]), "positions has 3 values"),
        (dict(request_ids=[0], seq_lens=[2, 3]), "request_ids has 1 values for 2 sequences"),
        (dict(cu_seqlens=[1, 3]), "cu_seqlens"),
        (dict(cu_seqlens=[0, 3, 2]), "non-decreasing"),
        (
            dict(seq_lens=[2, 2], request_ids=[5, 5], positions=[0, 1, 1, 2]),
            "request 5 position 1 is in rows",
        ),
        (dict(seq_lens=[4], shape=(3,)), "shape [3] holds 3 rows"),
        (dict(seq_lens=[2], positions=[0, -1]), "positions[1] = -1"),
        (dict(attention_mask=[[1, 2]]), "0 (pad) and 1"),
        (dict(attention_mask=[[1, 1]], seq_lens=[2]), "padded batch"),
        (dict(positions=[0, 1]), "give cu_seqlens or seq_lens"),
        (dict(seq_lens=torch.tensor([1.0])), "floating-point"),
        # a forged length: refused before a list of 10^12 positions is made (MemoryError before)
        (dict(cu_seqlens=[0, 10**12]), "cu_seqlens give 1000000000000 tokens, but a pass holds"),
        (
            dict(seq_lens=[10**12], shape=(1, 4)),
            "seq_lens give 1000000000000 tokens, but shape [1, 4] holds 4 rows",
        ),
    ],
)
def test_layout_errors_name_the_argument(kwargs, words):
    with pytest.raises(TokenLayoutError, match=re.escape(words)):
        tdinspect.tokens(**kwargs)


def test_step_writes_the_layout_and_refuses_one_no_entry_fits(tmp_path):
    model = torch.nn.Linear(4, 4)
    with torch.no_grad(), tdinspect.capture(model, tmp_path / "d") as dump:
        model(torch.randn(5, 4))
        with pytest.raises(TokenLayoutError, match=r"shape \[6\] \(6 token rows\) leads no entry"):
            dump.step(tokens=tdinspect.tokens(seq_lens=[6]))
        dump.step(tokens=tdinspect.tokens(request_ids=[3, 4], seq_lens=[2, 3]))  # the pass stayed open
        model(torch.randn(2, 4))
        dump.step()  # without a layout: as before
    ds = tdinspect.DumpSet.open(tmp_path / "d")
    assert ds.get_pass(0).tokens.segments == ((3, 0, 2), (4, 0, 3))
    assert ds.get_pass(1).tokens is None
    sidecar = next((tmp_path / "d").glob("rank*/pass00000.json"))
    assert json.loads(sidecar.read_text())["tokens"] == {"shape": [5], "segments": [[3, 0, 2], [4, 0, 3]]}


def test_a_malformed_layout_on_disk_names_the_file(tmp_path):
    model = torch.nn.Linear(4, 4)
    with torch.no_grad(), tdinspect.capture(model, tmp_path / "d", stats_only=True) as dump:
        model(torch.randn(5, 4))
        dump.step(tokens=tdinspect.tokens(seq_lens=[5]))
    sidecar = next((tmp_path / "d").glob("rank*/pass00000.json"))
    doc = json.loads(sidecar.read_text())
    doc["tokens"]["segments"] = [[0, 0, 4]]  # 4 rows for a shape of 5
    doc.pop("binding", None)
    sidecar.write_text(json.dumps(doc))
    with pytest.raises(
        DumpFormatError, match=r"pass00000.json: malformed 'tokens' field \(segments cover 4 rows"
    ):
        tdinspect.DumpSet.open(tmp_path / "d").get_pass(0)


# -- the aligner ----------------------------------------------------------------------------


def test_plan_maps_each_token_before_any_tensor_is_read(dumps):
    d = dumps["hf"].diff(dumps["continuous"], tokens=True)
    assert str(d.tokens.requests[1]) == (
        "request 1: positions 0..8 (9): A pass 1 rows 0..8 | "
        "B pass 0 rows 3..8, pass 1 row 1, pass 2 row 1, pass 3 row 0"
    )
    rows = d.tokens.rows()
    assert len(rows) == 30
    assert {"request": 2, "position": 12, "a_pass": 2, "a_row": 12, "b_pass": 2, "b_row": 2} in rows
    assert d.passes_read == []


@pytest.mark.parametrize("ref, engine", [("hf", "packed"), ("hf", "continuous"), ("padded", "continuous")])
def test_a_correct_engine_matches_whatever_the_batching(dumps, ref, engine):
    d = dumps[ref].diff(dumps[engine], tokens=True)
    v = d.verdict()
    assert v.outcome == "matches", v.text
    assert v.compared == 3 * 25  # every entry of every request
    # not by luck: the same entries compared by pass would not even line up
    assert dumps[ref].diff(dumps[engine]).verdict().outcome == "diverges"


def test_a_planted_bug_is_named_by_module_request_and_position(dumps):
    d = dumps["hf"].diff(dumps["bug"], tokens=True)
    div = d.first_divergence()
    assert (div.key, div.request, div.position) == ("model.model.layers.0.self_attn.o_proj", 1, 6)
    assert "B pass 1 row 1" in div.reason  # the engine's step and row where position 6 ran
    assert d.verdict().text.startswith(
        "diverges: model.model.layers.0.self_attn.o_proj (request 1, position 6)"
    )
    pp = d.per_position("model.model.layers.0.self_attn.o_proj")
    thr = pp.attrs["threshold"]
    one = pp.sel(request=1, call=0)
    assert (one.sel(position=slice(0, 5)) <= thr).all() and (one.sel(position=slice(6, 8)) > thr).all()
    assert (pp.sel(request=[0, 2]).fillna(0) <= thr).all()
    assert pp["token_position"].sel(request=1).values.tolist()[:9] == list(range(9))


def test_entries_without_token_rows_are_set_aside_not_dropped(dumps):
    d = dumps["hf"].diff(dumps["last"], tokens=True)
    div = d.first_divergence()  # structural="diverge": it is the answer
    assert div.key == "model.lm_head" and div.structural and "not token-major" in div.reason
    with pytest.warns(UncomparedWarning, match="not token-major"):
        assert d.first_divergence(structural="report") is None
    v = d.verdict(structural="report")
    assert v.outcome == "incomplete" and v.compared == 3 * 24


def test_tokens_one_side_did_not_compute_make_the_verdict_incomplete(dumps):
    d = dumps["hf"].diff(dumps["short"], tokens=True)
    v = d.verdict()
    assert v.outcome == "incomplete"
    assert "request 2 positions 14..15 in A only" in v.gap
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert d.first_divergence() is None
    assert any("14..15 in A only" in str(w.message) for w in seen)


def test_a_pass_without_layout_is_an_error_naming_the_dump(dumps, tmp_path):
    hf = make_hf_llama(seed=0)
    with torch.no_grad(), tdinspect.capture(hf, tmp_path / "plain") as dump:
        hf(engine_prompts()[0][None])
        dump.step()
    with pytest.raises(
        AlignError, match=r"plain: pass 0 has no token layout: record it with dump.step\(tokens="
    ):
        dumps["hf"].diff(tmp_path / "plain", tokens=True)


def test_cli_first_divergence_tokens(dumps):
    def run(b):
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "tdinspect",
                "first-divergence",
                str(dumps["hf"].path),
                str(b.path),
                "--tokens",
            ],
            capture_output=True,
            text=True,
        )

    ok, bad = run(dumps["continuous"]), run(dumps["bug"])
    assert ok.returncode == 0 and "no divergence" in ok.stdout, ok.stderr
    assert bad.returncode == 1
    assert "model.model.layers.0.self_attn.o_proj (request 1, position 6, call 0)" in bad.stdout


def _record(root, rank, passes, dims=None, parallel=None):
    """One rank's dump: ``passes`` is a list of ({key: tensor}, TokenLayout)."""
    os.environ["RANK"] = str(rank)
    try:
        rec = Recorder(root, level="module", parallel=parallel, dims=dims, background_write=False)
    finally:
        del os.environ["RANK"]
    for entries, layout in passes:
        for key, t in entries.items():
            rec.record(key, t, module_type="Linear")
        rec.step(tokens=layout)
    rec.close()


def test_tensor_parallel_ranks_are_unsharded_before_tokens_line_up(tmp_path):
    """Two requests run one at a time [1, L, 8] against a TP=2 engine packing them [T, 4] a rank."""
    gen = torch.Generator().manual_seed(0)
    full = [torch.randn(1, n, 8, generator=gen) for n in (3, 5)]
    _record(
        tmp_path / "ref",
        0,
        [
            ({"m.out": t}, tdinspect.tokens(request_ids=[r], seq_lens=[t.shape[1]], shape=(1, t.shape[1])))
            for r, t in enumerate(full)
        ],
    )
    packed = torch.cat([full[0][0, :2], full[1][0, :4]])  # step 0: 2 + 4 tokens
    steps = [
        (packed, tdinspect.tokens(request_ids=[0, 1], seq_lens=[2, 4])),
        (
            torch.cat([full[0][0, 2:], full[1][0, 4:]]),
            tdinspect.tokens(request_ids=[0, 1], positions=[2, 4], seq_lens=[1, 1]),
        ),
    ]
    for name, fault in (("tp2", None), ("tp2_bad", 1)):
        for rank in (0, 1):
            passes = []
            for rows, layout in steps:
                shard = rows[:, rank * 4 : rank * 4 + 4].clone()
                if fault == rank and layout.segments[0][1] == 0:
                    shard[3:] *= 1.01  # request 1 positions 1..3 on rank 1
                passes.append(({"m.out": shard}, layout))
            _record(tmp_path / name, rank, passes, dims={"out$": "s h(tp)"}, parallel={"tp": (rank, 2)})
    ref = tdinspect.DumpSet.open(tmp_path / "ref")
    with pytest.raises(AlignError, match="ranks \\[0, 1\\]: add unshard=True"):
        ref.diff(tmp_path / "tp2", tokens=True)
    assert ref.diff(tmp_path / "tp2", tokens=True, unshard=True).verdict().outcome == "matches"
    div = ref.diff(tmp_path / "tp2_bad", tokens=True, unshard=True).first_divergence()
    assert (div.key, div.request, div.position) == ("m.out", 1, 1)
    assert "in rank 1 (tp 1 of 2): rel_diff" in div.reason and "rank 0 (tp 0" not in div.reason, div.reason


def test_a_token_computed_twice_on_one_side_is_an_error(tmp_path):
    rows = torch.randn(4, 8)
    _record(
        tmp_path / "twice",
        0,
        [
            ({"m.out": rows[:3]}, tdinspect.tokens(request_ids=[0], seq_lens=[3])),
            ({"m.out": rows[3:]}, tdinspect.tokens(request_ids=[0], positions=[2], seq_lens=[1])),  # again
        ],
    )
    _record(tmp_path / "ref", 0, [({"m.out": rows[:3]}, tdinspect.tokens(request_ids=[0], seq_lens=[3]))])
    with pytest.raises(AlignError, match="request 0 position 2 is in pass 0 row 2 and pass 1 row 0"):
        tdinspect.DumpSet.open(tmp_path / "ref").diff(tmp_path / "twice", tokens=True)


def test_a_statistics_only_side_is_refused_naming_it(tmp_path, dumps):
    model = torch.nn.Linear(4, 4)
    with torch.no_grad(), tdinspect.capture(model, tmp_path / "s", stats_only=True) as dump:
        model(torch.randn(5, 4))
        dump.step(tokens=tdinspect.tokens(seq_lens=[5]))
    with pytest.raises(AlignError, match=r"s is statistics-only: tokens=True gathers"):
        dumps["hf"].diff(tmp_path / "s", tokens=True)


def test_the_gap_and_the_nearest_line_name_requests_not_passes(dumps):
    v = dumps["hf"].diff(dumps["last"], tokens=True).verdict(structural="report")
    assert v.outcome == "incomplete" and "model.lm_head (request 0): B: not token-major" in v.gap, v.gap
    assert "entry 24 of 25, request 0)" in v.gap and "(pass " not in v.gap, v.gap
    near = dumps["hf"].diff(dumps["continuous"], tokens=True).nearest()
    assert re.search(r"\(request \d\): ", near["text"]) and "(pass " not in near["text"], near["text"]


def test_large_parts_compared_in_place_and_small_ones_copied_give_the_assembled_answer(tmp_path):
    """Prefill parts of 100 to 400 rows of 1 KB (the large ones compared where they lie) and decode
    rows one a pass (copied together): the metrics are those of the assembled tensors, and a
    fault is found in either kind of part."""
    gen = torch.Generator().manual_seed(0)
    lengths, decode = (300, 400), 3
    ref = [torch.randn(1, n + decode, 256, generator=gen) for n in lengths]
    _record(
        tmp_path / "ref",
        0,
        [
            ({"m.out": t}, tdinspect.tokens(request_ids=[r], seq_lens=[t.shape[1]], shape=(1, t.shape[1])))
            for r, t in enumerate(ref)
        ],
    )
    pieces = [[(0, 0, 300), (1, 0, 100)], [(1, 100, 300)]]  # request 1 cut across two passes
    pieces += [[(0, 300 + d, 1), (1, 400 + d, 1)] for d in range(decode)]
    for name, (request, position) in (("ok", (None, None)), ("late", (1, 401)), ("early", (1, 250))):
        served = [t + 1e-6 * torch.randn(t.shape, generator=gen) for t in ref]
        if request is not None:
            served[request][0, position] *= 1.01
        steps = []
        for step in pieces:
            rows = torch.cat([served[r][0, p : p + k] for r, p, k in step])
            layout = tdinspect.tokens(
                request_ids=[r for r, _, _ in step],
                positions=torch.cat([torch.arange(p, p + k) for _, p, k in step]),
                seq_lens=[k for _, _, k in step],
            )
            steps.append(({"m.out": rows}, layout))
        _record(tmp_path / name, 0, steps)
        d = tdinspect.DumpSet.open(tmp_path / "ref").diff(tmp_path / name, tokens=True)
        if request is None:
            assert d.verdict().outcome == "matches"
            table = d.table(progress=False).set_index("pass")
            for r in (0, 1):
                whole = compare_tensors(served[r][0], ref[r][0])
                for metric in ("rel_diff", "max_abs", "mean_abs", "max_rel", "mismatch"):
                    assert table.at[r, metric] == pytest.approx(whole[metric], rel=1e-9, abs=1e-300), metric
        else:
            div = d.first_divergence()
            assert (div.key, div.request, div.position) == ("m.out", request, position)


def _served_entries(seed: int, lengths: list[int], decode: int, wrong: bool) -> list[dict]:
    """Per request, entries of every stored dtype and of each special road, ``[1, L, 256]``:
    identical, NaN on both sides, Inf on one, float64 beyond the range of its squares, far
    norms (Σxy summed directly), -0.0 against 0.0, an integer entry."""
    from tdinspect.numerics.metrics import STORED

    out = []
    for r, n in enumerate(lengths):
        g, h = torch.Generator().manual_seed(r), torch.Generator().manual_seed(seed + r)
        shape = (1, n + decode, 256)

        def big(gen, scale=1.0, shape=shape):
            return torch.randn(shape, generator=gen, dtype=torch.float64) * scale

        e = {}
        for dt in STORED:
            e[f"m.{str(dt)[6:]}"] = (big(g) + (1e-2 * big(h) if wrong else 0)).to(dt)
        e["m.same"] = big(g).float()
        both = big(g).float() + (1e-3 * big(h).float() if wrong else 0)
        both[0, 2, 7] = math.nan
        e["m.nan_both"] = both
        one = big(g).float()
        if wrong:
            one[0, -1, 3] = math.inf
        e["m.inf_one"] = one
        e["m.huge"] = big(g, scale=1e200) * (2 if wrong else 1)
        e["m.far"] = big(g).float() * (1e-4 if wrong else 1)
        e["m.negzero"] = torch.zeros(shape) * (-1 if wrong else 1)
        e["m.int"] = torch.arange(math.prod(shape)).reshape(shape) + (1 if wrong else 0)
        out.append(e)
    return out


def _record_served_pair(tmp_path, lengths: tuple[int, int], decode: int, keys=None) -> None:
    """``tmp_path/ref``: two requests of :func:`_served_entries` one at a time (``[1, L, 256]``);
    ``tmp_path/served``: the wrong ones packed, both prefills in one pass, then ``decode``
    passes of one row each (``keys``: the entries kept, all by default)."""
    ref, served = _served_entries(1, lengths, decode, False), _served_entries(2, lengths, decode, True)
    keys = keys or list(served[0])
    _record(
        tmp_path / "ref",
        0,
        [
            (
                {k: e[k] for k in keys},
                tdinspect.tokens(request_ids=[r], seq_lens=[n + decode], shape=(1, n + decode)),
            )
            for r, (e, n) in enumerate(zip(ref, lengths))
        ],
    )
    a, b = lengths
    steps = [[(0, 0, a), (1, 0, b)]] + [[(0, a + d, 1), (1, b + d, 1)] for d in range(decode)]
    passes = []
    for step in steps:
        entries = {k: torch.cat([served[r][k][:, p : p + c] for r, p, c in step], 1) for k in keys}
        layout = tdinspect.tokens(
            request_ids=[r for r, _, _ in step],
            positions=torch.cat([torch.arange(p, p + c) for _, p, c in step]),
            seq_lens=[c for _, _, c in step],
            shape=(1, sum(c for _, _, c in step)),
        )
        passes.append((entries, layout))
    _record(tmp_path / "served", 0, passes)


def test_token_pairs_read_from_the_files_have_the_pair_by_pair_rows(tmp_path, monkeypatch):
    """A reference run one request at a time against an engine run packed (a prefill of 300
    rows of 1 KB, compared where it lies; one of 40, and decode rows one a pass, copied
    together): the rows the span road fills (numpy views, no torch call) are those of
    compare_pair bit for bit, for every stored dtype and every special road; a pair the
    road cannot settle, or whose pass files are not mapped, goes to compare_pair."""
    from tdinspect.compare import spanpairs
    from tdinspect.numerics.metrics import STORED

    from .test_smallbatch import _assert_bitwise_equal

    _record_served_pair(tmp_path, (300, 40), 3)

    def table():
        return (
            tdinspect.DumpSet.open(tmp_path / "ref")
            .diff(tmp_path / "served", tokens=True)
            .table(progress=False)
        )

    seen = []
    real = spanpairs.stored_pieces_metrics
    monkeypatch.setattr(
        spanpairs,
        "stored_pieces_metrics",
        lambda pieces, dtype, slices=None: seen.append((len(pieces), dtype)) or real(pieces, dtype, slices),
    )
    spans = table()
    with monkeypatch.context() as m:
        m.setattr("tdinspect.compare.passes.span_dtypes", lambda pi: None)
        single = table()
    with monkeypatch.context() as m:
        m.setenv("TDINSPECT_MMAP", "0")  # pass files read into memory: no mapped spans
        unmapped_seen = len(seen)
        unmapped = table()
    _assert_bitwise_equal(spans, single)
    _assert_bitwise_equal(unmapped, single)
    assert len(seen) == unmapped_seen  # nothing mapped: compare_pair's road alone
    # every stored dtype, same, NaN on both, Inf on one, huge, far, negzero, in each request;
    # request 0 in two pieces (its prefill where it lies, its decode rows copied), request 1 in one
    assert len(seen) == 2 * (len(STORED) + 6) and {dt for _, dt in seen} == set(STORED)
    assert sorted({n for n, _ in seen}) == [1, 2]
    rows = spans.set_index(["pass", "key"])
    assert rows.loc[(0, "m.inf_one"), "reason"] == "NaN/Inf on one side (1 elements)"
    assert not rows.loc[(0, "m.nan_both"), "structural"] and rows.loc[(0, "m.nan_both"), "max_abs"] > 0
    assert rows.loc[(1, "m.same"), "equal"] == 1.0 and rows.loc[(1, "m.negzero"), "equal"] == 0.0
    assert rows.loc[(0, "m.huge"), "rel_diff"] == pytest.approx(0.2, rel=1e-14)  # rescaled
    assert rows.loc[(1, "m.int"), "max_abs"] == 1.0


@pytest.mark.parametrize("lie", ["dtype", "shape"])
def test_a_sealed_sidecar_whose_record_layout_contradicts_it_diffs_as_the_honest_dump(tmp_path, lie):
    """A sidecar edited and sealed again (its binding recomputed) whose ``raw`` layout gives an
    entry another dtype or a shorter view than its own columns: the token diff (both roads)
    raised TypeError from torch.cat (an int32 view among float32 rows) or RuntimeError from
    narrow. Its entries are now read from the file (torch.load), as for the honest dump."""
    from tdinspect.store.sidecars import seal

    _record_served_pair(tmp_path, (6, 3), 2, keys=["m.float32", "m.bfloat16"])

    def table():
        return (
            tdinspect.DumpSet.open(tmp_path / "ref")
            .diff(tmp_path / "served", tokens=True)
            .table(progress=False)
        )

    honest = table()
    sidecar = next((tmp_path / "served").glob("*/pass00000.json"))
    doc = json.loads(sidecar.read_text())
    doc.pop("binding")
    raw = doc["entries"]["raw"][0]
    if lie == "dtype":
        raw[4] = "torch.int32"
    else:
        raw[2] = [1, 3, 256]
    sidecar.write_bytes(seal(json.dumps(doc).encode(), sidecar.with_suffix(".pt")))
    from .test_smallbatch import _assert_bitwise_equal

    _assert_bitwise_equal(table(), honest)
