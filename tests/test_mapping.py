"""Mappings between differently named runs, and the transform language (issue 11, parts 1-2)."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import tdinspect
from tdinspect import DumpSet
from tdinspect.align import Mapping, parse_transform
from tdinspect.cli import main
from tdinspect.errors import MappingError, TransformError

D = 16


class Separate(nn.Module):
    """Reference: separate q/k/v projections, then an output projection."""

    def __init__(self):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(D, D) for _ in range(3))
        self.o_proj = nn.Linear(D, D)

    def forward(self, x):
        return self.o_proj(self.q_proj(x) * self.k_proj(x).sigmoid() + self.v_proj(x))


class Fused(nn.Module):
    """Port: one fused qkv projection under other names; ``fault`` spoils the k rows of qkv."""

    def __init__(self, ref: Separate, fault: bool = False):
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)
        self.out = nn.Linear(D, D)
        with torch.no_grad():
            self.qkv.weight.copy_(torch.cat([ref.q_proj.weight, ref.k_proj.weight, ref.v_proj.weight]))
            self.qkv.bias.copy_(torch.cat([ref.q_proj.bias, ref.k_proj.bias, ref.v_proj.bias]))
            self.out.load_state_dict(ref.o_proj.state_dict())
            if fault:
                self.qkv.weight[D : 2 * D] *= -1

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        return self.out(q * k.sigmoid() + v)


RULES = {r"model\.(q|k|v)_proj": None, r"model\.o_proj": "model.out"}
QKV = {
    r"model\.q_proj": ["model.qkv", "chunk(3, -1)[0]"],
    r"model\.k_proj": ["model.qkv", "chunk(3, -1)[1]"],
    r"model\.v_proj": ["model.qkv", "narrow(-1, 32, 16)"],
    r"model\.o_proj": "model.out",
}


def _capture(model, path, steps=2):
    torch.manual_seed(1)
    with torch.no_grad(), tdinspect.capture(model, path) as dump:
        for _ in range(steps):
            model(torch.randn(2, 5, D))
            dump.step()
    return path


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("mapping")
    torch.manual_seed(0)
    ref = Separate()
    return {
        "a": _capture(ref, root / "a"),
        "b": _capture(Fused(ref), root / "b"),
        "bad": _capture(Fused(ref, fault=True), root / "bad"),
    }


def test_without_a_mapping_nothing_pairs(pair):
    div = DumpSet.open(pair["a"]).diff(pair["b"]).first_divergence()
    assert div.structural and div.reason == "only in A" and div.key == "model.q_proj"


def test_plan_shows_pairs_before_any_tensor_is_read(pair):
    d = DumpSet.open(pair["a"]).diff(pair["b"], mapping=QKV)
    plan = d.plan()
    assert d.passes_read == []  # nothing computed yet
    rows = {r["a_key"]: r for r in plan.to_dict("records")}
    assert rows["model.q_proj"]["b_key"] == "model.qkv"
    assert rows["model.k_proj"]["transform"] == "chunk(3, -1)[1]"
    assert rows["model.v_proj"]["shape_b"] == [2, 5, 3 * D]
    assert rows["model.v_proj"]["shape_b_after"] == [2, 5, D]
    assert rows["model.o_proj"]["rule"] == r"model\.o_proj" and rows["model.o_proj"]["transform"] == ""
    assert set(plan["status"]) == {"ok"}
    assert set(plan["pass"]) == {0}
    assert len(d.plan(pass_=1)) == len(plan)


def test_mapped_identical_weights_do_not_diverge_and_a_fault_is_named(pair):
    a = DumpSet.open(pair["a"])
    d = a.diff(pair["b"], mapping=QKV)
    assert d.first_divergence(threshold=1e-6) is None
    table = d.table(progress=False)
    assert (table["key_b"] == "model.qkv").sum() == 3 * 2  # three slices of one B entry, 2 passes
    assert not table["structural"].any()
    div = a.diff(pair["bad"], mapping=QKV).first_divergence(threshold=1e-6)
    assert div.key == "model.k_proj" and not div.structural and div.value > 0.1


def test_callable_transform_and_json_file(pair, tmp_path):
    rules = dict(QKV, **{r"model\.k_proj": ["model.qkv", lambda t: t[..., D : 2 * D]]})
    assert DumpSet.open(pair["a"]).diff(pair["b"], mapping=rules).first_divergence(1e-6) is None
    f = tmp_path / "map.json"
    f.write_text(json.dumps(QKV))
    assert DumpSet.open(pair["a"]).diff(pair["b"], mapping=str(f)).first_divergence(1e-6) is None


def test_structural_reasons_name_the_rule_and_shapes(pair):
    a = DumpSet.open(pair["a"])
    missing = {r"model\.(q)_proj": r"model.\1_fused", **QKV}
    div = a.diff(pair["b"], mapping=missing).first_divergence()
    assert div.structural and div.key == "model.q_proj"
    assert "model.q_fused" in div.reason and "model\\.(q)_proj" in div.reason

    wrong = dict(QKV, **{r"model\.q_proj": ["model.qkv", "narrow(-1, 0, 8)"]})
    div = a.diff(pair["b"], mapping=wrong).first_divergence()
    assert div.reason == "shape [2, 5, 16] vs [2, 5, 8] (B [2, 5, 48] after 'narrow(-1, 0, 8)')"

    unfit = dict(QKV, **{r"model\.q_proj": ["model.qkv", "reshape(7, 3)"]})
    plan = a.diff(pair["b"], mapping=unfit).plan()
    status = plan.set_index("a_key")["status"]["model.q_proj"]
    assert "does not fit shape [2, 5, 48]" in status

    def boom(t):
        raise RuntimeError("no")

    div = a.diff(pair["b"], mapping=dict(QKV, **{r"model\.q_proj": ["model.qkv", boom]})).first_divergence()
    assert div.key == "model.q_proj" and "failed: RuntimeError: no" in div.reason


def test_first_rule_wins_and_uncovered_entries_pair_by_name():
    m = Mapping({r"a\.(\d+)": r"b.\1", r"a\.1": "never"})
    assert m.partner("a.1") == ("b.1", None)
    assert m.partner("a.x") == ("a.x", None)
    assert m.rule_of("a.1") == r"a\.(\d+)" and m.rule_of("a.x") == ""
    assert m.partner("a.12")[0] == "b.12"  # fullmatch on the name without ::callN
    assert Mapping({r"a": "b"}).partner("ab")[0] == "ab"


@pytest.mark.parametrize(
    "rules, words",
    [
        ({"(": "x"}, "invalid regex"),
        ({r"a(\d)": r"b\2"}, "bad template"),
        ({"a": ["b", "os.system(1)"]}, "rule 'a'"),
        ({"a": ["b"]}, "expected b_template or [b_template, transform]"),
        ({"a": 3}, "B template must be a non-empty string"),
    ],
)
def test_bad_rules_are_clear_errors_naming_the_rule(rules, words):
    with pytest.raises(MappingError, match=None) as exc:
        Mapping(rules)
    assert words in str(exc.value)


def test_cli_mapping_yaml(pair, tmp_path, capsys):
    f = tmp_path / "map.yaml"
    f.write_text(
        "model\\.q_proj: [model.qkv, 'chunk(3, -1)[0]']\n"
        "model\\.k_proj: [model.qkv, 'chunk(3, -1)[1]']\n"
        "model\\.v_proj: [model.qkv, 'chunk(3, -1)[2]']\n"
        "model\\.o_proj: model.out\n"
    )
    args = [str(pair["a"]), str(pair["b"]), "--mapping", str(f), "--threshold", "1e-6"]
    assert main(["first-divergence", *args]) == 0
    assert (
        main(
            ["first-divergence", str(pair["a"]), str(pair["bad"]), "--mapping", str(f), "--threshold", "1e-6"]
        )
        == 1
    )
    assert "model.k_proj" in capsys.readouterr().out
    f.write_text("model\\.q_proj: [model.qkv, '__import__(\"os\")']\n")
    assert main(["diff", *args]) == 2
    err = capsys.readouterr().err
    assert str(f) in err and "rule 'model\\.q_proj'" in err and "not an allowed operation" in err
    f.write_text("- just\n- a list\n")
    assert main(["diff", *args]) == 2
    assert "expected a mapping" in capsys.readouterr().err


# -- the transform language ---------------------------------------------------------------
@pytest.mark.parametrize(
    "spec, expected",
    [
        ("chunk(3, -1)[0]", lambda t: t.chunk(3, -1)[0]),
        ("reshape(2, 6, 4, 1).transpose(1, 2)", lambda t: t.reshape(2, 6, 4, 1).transpose(1, 2)),
        ("permute(2, 0, 1)", lambda t: t.permute(2, 0, 1)),
        ("permute((2, 0, 1))", lambda t: t.permute(2, 0, 1)),
        ("flatten(0, 1).unflatten(0, (2, 2, 2))", lambda t: t.flatten(0, 1).unflatten(0, (2, 2, 2))),
        ("unsqueeze(0).squeeze(0).select(1, 2)", lambda t: t.select(1, 2)),
        ("narrow(-1, 2, 3).float()", lambda t: t.narrow(-1, 2, 3).float()),
        ("flatten()", lambda t: t.flatten()),
    ],
)
def test_transforms_do_what_torch_does(spec, expected):
    t = torch.arange(48, dtype=torch.float64).reshape(2, 4, 6)
    out = parse_transform(spec)(t)
    assert torch.equal(out, expected(t)) and out.dtype == expected(t).dtype
    assert parse_transform(spec).out_shape([2, 4, 6]) == list(expected(t).shape)


HOSTILE = [
    "__import__('os')",
    "__import__('os').system('true')",
    "x.__class__",
    "t.__class__.__bases__",
    "os.system('true')",
    "open('/etc/passwd')",
    "exec('1')",
    "eval('1')",
    "lambda: 0",
    "reshape(x)",
    "reshape(1 + 1)",
    "reshape(10 ** 12)",
    "reshape(99999999999999)",
    "reshape(2, True)",
    "reshape(2.0)",
    "reshape('a')",
    "chunk(3, -1)",
    "chunk(3, -1)[5]",
    "chunk(0, 1)[0]",
    "narrow(1, 2)",
    "float(1)",
    "transpose(dim0=1, dim1=2)",
    "select(0, 1)[0]",
    "chunk(3, -1)[0:1]",
    "chunk(3, -1)[x]",
    "permute(*[1, 0])",
    "reshape((1, 2), 3)",
    "transpose((1, 2), 0)",
    "to('cuda')",
    "numpy()",
    "[1, 2]",
    "(lambda: 0)()",
    "getattr(t, 'x')",
    "float().__class__",
    "float();float()",
    "",
    "transpose(0, 1)." * 20 + "float()",
    "a" * 600,
]


@pytest.mark.parametrize("spec", HOSTILE)
def test_hostile_or_malformed_specs_are_refused(spec):
    with pytest.raises(TransformError):
        parse_transform(spec)


def test_spec_that_does_not_fit_is_a_clear_error():
    t = parse_transform("reshape(2147483647, 2147483647)")  # huge but literal: only shapes change
    with pytest.raises(TransformError, match="does not fit shape"):
        t.out_shape([4, 4])
    with pytest.raises(RuntimeError):
        t(torch.zeros(4, 4))  # a view of the same bytes: never allocates


_SAFE = {
    "permute",
    "transpose",
    "reshape",
    "flatten",
    "unflatten",
    "squeeze",
    "unsqueeze",
    "narrow",
    "select",
    "chunk",
    "float",
}


@settings(max_examples=300, deadline=None)
@given(
    st.text(
        alphabet=st.sampled_from(list("()[].,-_ 0123456789abcdefghijklmnopqrstuvwxyz'\"*=:")), max_size=60
    )
)
def test_random_text_is_parsed_into_allowed_steps_or_refused(spec):
    try:
        t = parse_transform(spec)
    except TransformError:
        return
    assert t.steps and all(s.name in _SAFE for s in t.steps)
    for s in t.steps:
        flat = [v for a in s.args for v in (a if isinstance(a, tuple) else (a,))]
        assert all(type(v) is int for v in flat)


# -- structural="report" ------------------------------------------------------------------
def test_structural_report_sets_one_sided_entries_aside(pair, capsys):
    a = DumpSet.open(pair["a"])
    partial = {k: v for k, v in QKV.items() if "q_proj" not in k}  # q_proj stays unmatched
    d = a.diff(pair["bad"], mapping=partial)
    assert d.first_divergence(1e-6).key == "model.q_proj"  # "diverge": the unmatched entry
    div = d.first_divergence(1e-6, structural="report")
    assert div.key == "model.k_proj" and not div.structural  # the first numerical one
    se = div.structural_entries
    assert list(se["key"]) == ["model.q_proj"] and list(se["pass"]) == [0]  # passes read
    assert list(se["reason"]) == ["only in A"]  # qkv is no B-only entry: k and v take slices
    assert "1 structural entries set aside (model.q_proj: only in A)" in repr(div)
    assert "structural entries set aside" in div._repr_html_()
    assert d.first_divergence(1e-6, structural="diverge").structural_entries is None

    clean = a.diff(pair["b"], mapping=partial)
    assert clean.first_divergence(1e-6, structural="report") is None
    assert list(clean.structural_entries(progress=False)["pass"]) == [0, 1]
    with pytest.raises(ValueError, match="structural='x'"):
        clean.first_divergence(structural="x")

    f = pair["a"].parent / "partial.json"
    f.write_text(json.dumps(partial))
    args = [str(pair["a"]), str(pair["bad"]), "--mapping", str(f), "--threshold", "1e-6"]
    assert main(["first-divergence", *args, "--structural", "report"]) == 1
    out = capsys.readouterr().out
    assert "first divergence: model.k_proj" in out and "1 structural entries set aside" in out
    assert main(["first-divergence", *args, "--structural", "report", "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert [e["key"] for e in doc["structural_entries"]] == ["model.q_proj"]
    assert main(["first-divergence", *args]) == 1
    assert "first divergence: model.q_proj" in capsys.readouterr().out


def test_side_differences_and_html_follow_the_mapping(pair):
    from tdinspect.report import side_differences

    a = DumpSet.open(pair["a"])
    assert any("only in A" in x for x in side_differences(a.diff(pair["b"])))  # by name: all differ
    d = a.diff(pair["b"], mapping=QKV)
    assert side_differences(d) == []
    partial = {k: v for k, v in QKV.items() if "q_proj" not in k}
    lines = side_differences(a.diff(pair["b"], mapping=partial))
    assert lines == ["entry names only in A: 2 in 2 pass(es) (first: pass 0, rank 0: model.q_proj)"]
    assert "model.q_proj" in a.diff(pair["b"], mapping=partial)._repr_html_()


def test_per_position_reports_a_failing_transform_as_the_diff_does(pair):
    """A user's transform that raises: per_position gives the diff's reason (it raised the
    transform's own exception), and the entries the transform serves are still computed."""

    def boom(t):
        raise RuntimeError("no")

    d = DumpSet.open(pair["a"]).diff(pair["b"], mapping=dict(QKV, **{r"model\.q_proj": ["model.qkv", boom]}))
    reason = d.first_divergence().reason
    assert "failed: RuntimeError: no" in reason
    with pytest.raises(KeyError) as info:
        d.per_position("model.q_proj", dim=1)
    assert reason in str(info.value) and "pass 0 call 0" in str(info.value)
    k = d.per_position("model.k_proj", dim=1)  # a working transform of the same B entry
    assert k.sizes["position"] == 5 and k.attrs["first_position"] == -1
