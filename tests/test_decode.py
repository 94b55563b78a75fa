"""A KV-cache decode run (HF Llama ``generate``) against one full-sequence forward."""

from __future__ import annotations

import warnings

import pytest
import torch

import tdinspect

transformers = pytest.importorskip("transformers")

PROMPT, NEW = 16, 5
FED = PROMPT + NEW - 1  # generate never feeds its last token back through the model
CAPTURED = r"^model\.model\."  # lm_head is computed for the last position only during generate
THRESHOLD = 1e-8  # rel_diff; float32 noise here is ~1e-14


def _llama():
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def _positions_off_by_one_after_prefill(module, args, kwargs):
    """The injected decode bug: RoPE sees position n+1 for every decoded token."""
    x = args[0] if args else kwargs["x"]
    if x.shape[1] == 1:
        kwargs = {**kwargs, "position_ids": kwargs["position_ids"] + 1}
    return args, kwargs


@pytest.fixture(scope="module")
def decode_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("decode")
    model = _llama()
    prompt = torch.randint(1, 64, (1, PROMPT), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        with tdinspect.capture(model, root / "generate", filter=CAPTURED) as dump:
            tokens = model.generate(prompt, max_new_tokens=NEW, do_sample=False)
            dump.step()
        assert tokens.shape == (1, PROMPT + NEW)
        with tdinspect.capture(model, root / "forward", filter=CAPTURED) as dump:
            model(tokens)
            dump.step()
        handle = model.model.rotary_emb.register_forward_pre_hook(
            _positions_off_by_one_after_prefill, with_kwargs=True
        )
        try:
            with tdinspect.capture(model, root / "buggy", filter=CAPTURED) as dump:
                model.generate(prompt, max_new_tokens=NEW, do_sample=False)
                dump.step()
        finally:
            handle.remove()
    return root


def _diff(root, decode: str):
    full = tdinspect.DumpSet.open(root / "forward").narrow(1, 0, FED)
    return full.diff(tdinspect.DumpSet.open(root / decode).concat("call", dim=1))


def test_decode_steps_concatenated_match_the_full_forward(decode_runs):
    gen = tdinspect.DumpSet.open(decode_runs / "generate")
    assert gen.summary()["max_calls"] == NEW  # a prefill call and 4 decode calls per module
    diff = _diff(decode_runs, "generate")
    table = diff.table(progress=False)
    assert len(table) == len(gen.ops) and len(table) > 20
    assert (table["shape"] == str([1, FED, 32])).sum() > 10
    assert not table["structural"].any()
    assert diff.first_divergence(threshold=THRESHOLD) is None
    assert table["rel_diff"].max() < 1e-10
    # without lining the steps up there is nothing to compare
    unaligned = tdinspect.DumpSet.open(decode_runs / "forward").diff(gen).first_divergence()
    assert unaligned.structural and "shape" in unaligned.reason


def test_a_forward_over_every_generated_token_is_told_how_to_line_up(decode_runs):
    """The forward a user runs over generate's output has one token more than generate fed:
    the concat hint (end to end = the other's length) never fired, the reason was a bare
    `shape [1, 21, 32] vs [1, 16, 32]`. Doing what the hint says leaves no divergence."""
    div = tdinspect.DumpSet.open(decode_runs / "forward").diff(decode_runs / "generate").first_divergence()
    assert div.reason.startswith(
        f"shape [1, {PROMPT + NEW}, 32] vs [1, {PROMPT}, 32] (B calls this entry {NEW} times"
    ), div.reason
    assert f"give the first {FED} of A's {PROMPT + NEW} positions" in div.reason
    assert f"A.narrow(1, 0, {FED}) with B.concat('call', dim=1)" in div.reason
    assert _diff(decode_runs, "generate").first_divergence(threshold=THRESHOLD) is None


def test_decode_bug_is_named_and_starts_at_the_first_decode_position(decode_runs):
    diff = _diff(decode_runs, "buggy")
    div = diff.first_divergence(threshold=THRESHOLD)
    assert div.key == "model.model.rotary_emb[0]"
    assert "in call 1" in div.reason  # the first decode call, not the prefill (call 0)
    for key in ("model.model.rotary_emb[0]", "model.model.layers.1.self_attn.o_proj"):
        da = diff.per_position(key, dim=1, threshold=THRESHOLD)
        assert da.dims == ("pass", "call", "position") and da.sizes["position"] == FED
        assert da.attrs["first_position"] == PROMPT
        values = da[0, 0]
        assert float(values[:PROMPT].max()) < 1e-10
        assert bool((values[PROMPT:] > THRESHOLD).all())


def test_per_position_uses_the_one_metric_definition(decode_runs):
    from tdinspect.numerics.metrics import compare_tensors

    diff = _diff(decode_runs, "buggy")
    key = "model.model.layers.0.self_attn.q_proj"
    da = diff.per_position(key, dim=1, metric="max_abs")
    a = diff.a.tensor(key)
    b = diff.b.tensor(key)
    for j in (0, PROMPT, FED - 1):
        assert float(da[0, 0, j]) == compare_tensors(b[:, j], a[:, j])["max_abs"]


def test_per_position_plot_marks_the_first_divergent_position(decode_runs):
    import matplotlib

    matplotlib.use("Agg")
    fig = tdinspect.plot.per_position(_diff(decode_runs, "buggy"), dim=1, threshold=THRESHOLD)
    ax = fig.axes[0]
    assert f"diverges from position {PROMPT} on" in ax.get_title()
    assert len(ax.get_yticklabels()) > 20
    healthy = tdinspect.plot.per_position(_diff(decode_runs, "generate"), dim=1, threshold=THRESHOLD)
    assert "no position past the threshold" in healthy.axes[0].get_title()


def test_explore_shows_the_per_position_panel(decode_runs):
    ex = tdinspect.explore(_diff(decode_runs, "buggy"), positions=1, threshold=THRESHOLD)
    assert ex.positions in ex.widget.children
    assert f"diverges from position {PROMPT} on" in ex.positions_fig.axes[0].get_title()
    ex.threshold.value = 1e2  # nothing is that far off: the panel follows the slider
    assert "no position past the threshold" in ex.positions_fig.axes[0].get_title()


def test_concatenated_calls_are_compared_piece_by_piece_as_if_assembled(decode_runs, monkeypatch):
    """The diff compares each decode call against the matching positions of the forward,
    never assembling the concatenation, and gets the numbers of the assembled pair."""
    from tdinspect.align.logical import LogicalPass
    from tdinspect.numerics.metrics import TENSOR_METRICS, compare_tensors

    diff = _diff(decode_runs, "buggy")
    assembled = {k: diff.b.tensor(k) for k in diff.b.ops}
    reference = {k: diff.a.tensor(k) for k in diff.a.ops}

    def never(self, key, loaded=None):
        raise AssertionError(f"{key} was assembled")

    for pi in diff.b._passes.values():  # the concatenated side (A is a narrowed view)
        assert isinstance(pi, LogicalPass)
        monkeypatch.setattr(pi, "tensor", never.__get__(pi))
    table = diff.table(progress=False)
    assert not table["structural"].any() and (table["equal"] == 0).any()
    for row in table.to_dict("records"):
        want = compare_tensors(assembled[row["key_b"]], reference[row["key"]])
        for k in TENSOR_METRICS:
            if k in ("max_abs", "max_rel", "mismatch", "equal", "max_abs_cast"):
                assert row[k] == want[k], (row["key"], k)
            else:
                assert row[k] == pytest.approx(want[k], rel=1e-9, abs=1e-300), (row["key"], k)


def test_per_position_vectorised_equals_the_per_position_loop(decode_runs):
    from tdinspect.numerics.metrics import compare_tensors

    diff = _diff(decode_runs, "buggy")
    for key in (
        "model.model.layers.0.self_attn.q_proj",
        "model.model.layers.1.mlp.up_proj",
        "model.model.rotary_emb[0]",
    ):
        a, b = diff.a.tensor(key).movedim(1, 0), diff.b.tensor(key).movedim(1, 0)
        for name in ("rel_diff", "cosine", "sqnr_db", "mean_abs", "max_rel", "equal"):
            da = diff.per_position(key, dim=1, metric=name)
            loop = [compare_tensors(b[j], a[j])[name] for j in range(FED)]
            assert da[0, 0].values.tolist() == pytest.approx(loop, rel=1e-12, abs=1e-300), (key, name)


def test_per_position_title_names_a_dict_threshold_as_given(decode_runs):
    """A {regex: number | "auto"} threshold: the title says the rules (it showed one number)
    and the verdict follows each entry's own threshold."""
    import matplotlib

    matplotlib.use("Agg")
    diff = _diff(decode_runs, "buggy")
    keys = ["model.model.rotary_emb[0]", "model.model.layers.1.self_attn.o_proj"]
    rules = {r"rotary": 1e2, r"o_proj$": THRESHOLD}  # rotary never past 1e2; o_proj from PROMPT
    title = tdinspect.plot.per_position(diff, dim=1, keys=keys, threshold=rules).axes[0].get_title()
    assert title == (
        rf"rel_diff per position (threshold rotary=100, o_proj\$={THRESHOLD:g}, "
        rf"else auto): diverges from position {PROMPT} on"
    )
    rules = {r"rotary": 1e2, r"o_proj": 1e2}
    title = tdinspect.plot.per_position(diff, dim=1, keys=keys, threshold=rules).axes[0].get_title()
    assert title.endswith("(threshold rotary=100, o_proj=100, else auto): no position past the threshold")


def test_op_level_decode_calls_of_fewer_dims_are_a_reason_not_a_crash(tmp_path):
    """capture_ops around generate: `aten.ones` makes the mask as [1, 8] at prefill and [1] at
    each decode step. `.concat('call', dim=1)` took [1] as fitting (the dims off dim 1 agree)
    and raised IndexError building the plan; now that entry is a structural divergence and the
    rest lines up with the forward over the tokens generate fed."""
    model = _llama()
    prompt = torch.randint(1, 64, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        with tdinspect.capture_ops(tmp_path / "generate", model=model) as dump:
            tokens = model.generate(prompt, max_new_tokens=3, do_sample=False)
            dump.step()
        with tdinspect.capture_ops(tmp_path / "forward", model=model) as dump:
            model(tokens[:, :-1])
            dump.step()
    from tdinspect.errors import AlignError

    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # module calls recorded: nothing mixed
        gen = tdinspect.DumpSet.open(tmp_path / "generate").concat("call", dim=1)
    with pytest.raises(
        AlignError,
        match=r"shapes do not concatenate along dim 1 "
        r"\(call 0: \[1, 8\], call 1: \[1\]",
    ):
        gen.tensor("model/aten.ones.default[out0]")
    table = tdinspect.DumpSet.open(tmp_path / "forward").diff(gen).table(progress=False)
    compared = table[~table["structural"]]
    assert len(compared) > 30 and compared["key"].str.contains(r"layers\.1\.").any()
    assert compared["rel_diff"].max() < THRESHOLD
    # an RMSNorm runs aten.mul twice a step: each of the two, over prefill and decode steps,
    # meets the forward's own (they were all put end to end: shape [1, 11, 32] vs [1, 22, 32])
    mul = "model.model.layers.0.input_layernorm/aten.mul.Tensor[out0]"
    rows = compared.set_index("key")
    assert rows.loc[mul, "shape"] == rows.loc[mul + "::call1", "shape"] == "[1, 10, 32]"
    # concatenated on both sides (the CLI's --concat): the forward's two muls stay two
    both = tdinspect.DumpSet.open(tmp_path / "forward").diff(tmp_path / "generate", concat="call:1")
    rows = both.table(progress=False).set_index("key")
    assert rows.loc[mul + "::call1", "rel_diff"] < THRESHOLD
