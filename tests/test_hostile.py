"""Hostile dumps: a dump file can make tdinspect read its tensors, nothing else.

Each test doctors a real dump the way an attacker (or an unlucky edit) would,
and checks that tdinspect neither acts on the machine nor gives a wrong answer.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils._pytree import tree_flatten, treespec_dumps

import tdinspect
from tdinspect import DumpFormatError, DumpSet
from tdinspect.cli import main

from .conftest import only_folder, rewrite_sidecar

VIEW, ADD_IN = "model/aten.view.default[out0]", "model/aten.add.Tensor[in0]"


def _capture(path):
    x = torch.arange(4.0)
    with tdinspect.capture_ops(path, inputs=True) as dump:
        y = x * 3
        z = y.view(2, 2)
        z + 1
        dump.step()
    return only_folder(path) / "pass00000.json"


def _edit(sidecar, change, bind=True):
    """Doctor a sidecar; ``bind`` re-binds it to its pass file, as a careful attacker would."""
    doc = json.loads(sidecar.read_text())
    change(doc, doc["entries"])
    rewrite_sidecar(sidecar, doc, bind)


def _call(op, *args):
    leaves, spec = tree_flatten((args, {}))
    return {
        "aten": op,
        "spec": treespec_dumps(spec),
        "leaves": [{"t": a[1:]} if isinstance(a, str) and a.startswith("@") else a for a in leaves],
    }


@pytest.fixture
def canary(tmp_path):
    path = tmp_path / "canary.bin"
    path.write_bytes(b"SECRET-bytes-of-a-file-you-own!!")
    return path


def _from_file_then_copy(canary):
    """The reported attack: a view 'rebuilt' by from_file(shared=True), then copy_ into it."""

    def change(doc, e):
        v = e["key"].index("model/aten.view.default[out0]")
        a = e["key"].index("model/aten.add.Tensor[in0]")
        e["ref"][v] = {"kind": "view", "of": "model/aten.mul.Tensor[out0]"}
        e["call_args"][v] = _call("aten.from_file.default", str(canary), True, 4)
        e["ref"][a] = {"kind": "view", "of": "model/aten.view.default[out0]"}
        e["call_args"][a] = _call(
            "aten.copy_.default", "@model/aten.view.default[out0]", "@model/aten.mul.Tensor[out0]"
        )
        out = e["key"].index("model/aten.add.Tensor[out0]")
        e["call_args"][out] = _call("aten.from_file.default", str(canary), True, 4)

    return change


def test_views_are_never_rebuilt_by_running_a_named_operator(tmp_path, canary):
    sidecar = _capture(tmp_path / "a")
    _capture(tmp_path / "b")
    _edit(sidecar, _from_file_then_copy(canary))
    before = canary.read_bytes(), canary.stat().st_mtime_ns
    ds = DumpSet.open(tmp_path / "a", on_error="warn")
    for key in ("model/aten.view.default[out0]", "model/aten.add.Tensor[in0]"):
        try:
            t = ds.tensor(key)
        except DumpFormatError as exc:
            assert "pass00000" in str(exc)
        else:  # the sidecar was ignored, or the view re-indexed: the stored values, never the file's
            assert b"SECRET" not in t.numpy().tobytes()
    assert main(["first-divergence", str(tmp_path / "a"), str(tmp_path / "b")]) in (0, 1, 2)
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "b")]) in (0, 1, 2)
    with pytest.raises(DumpFormatError, match="pass00000.*from_file.*not run"):
        tdinspect.replay(tmp_path / "a", "model/aten.add.Tensor")
    assert (canary.read_bytes(), canary.stat().st_mtime_ns) == before


@pytest.mark.parametrize(
    "op, why",
    [
        ("aten.from_file.default", "never runs"),
        ("aten.stft.center", "string 'pad_mode'"),
        ("aten.copy_.default", "never runs"),
        ("aten.mul_.Tensor", "written or aliased"),
        ("aten.add_.Tensor", "written or aliased"),
        ("aten.add.out", "written or aliased"),
        ("aten.save.default", "never runs"),
        ("aten._copy_from.default", "never runs"),
        ("aten.bernoulli.default", "random"),
        ("aten.view.default", "aliased"),
        ("prims.add.default", "not an aten operator"),
        ("aten.__class__.default", "no such operator"),
        ("aten.add.__init__", "no such operator"),
        ("os.system.default", "not an aten operator"),
        ("aten.add", "not an aten operator"),
    ],
)
def test_replay_runs_only_operators_without_side_effects(op, why):
    from tdinspect.errors import ReplayRefused
    from tdinspect.rerun import safe_op

    with pytest.raises(ReplayRefused, match=why):
        safe_op(op, "f.json")
    assert safe_op("aten.gelu.default") is torch.ops.aten.gelu.default  # a fixed-choice string
    assert safe_op("aten.addmm.default") is torch.ops.aten.addmm.default


@pytest.mark.parametrize(
    "leaf",
    [
        {"dtype": "load"},
        {"layout": "save"},
        {"device": 3},
        {"f": "__import__('os')"},
        {"t": ["x"]},
        {"a": 1, "b": 2},
        [1, 2],
        {"memory_format": "__class__"},
        {"complex": 5},
        {"complex": ["a", "b"]},
    ],
)
def test_replay_arguments_are_plain_data(tmp_path, leaf):
    sidecar = _capture(tmp_path / "a")
    _capture(tmp_path / "b")

    def change(doc, e):
        i = e["key"].index("model/aten.mul.Tensor[out0]")
        e["call_args"][i]["leaves"][1] = leaf

    _edit(sidecar, change)
    with pytest.raises(DumpFormatError, match="pass0000"):
        tdinspect.replay(tmp_path / "a", "model/aten.mul.Tensor")
    # the diff names the differing argument as text, whatever the sidecar holds there
    div = DumpSet.open(tmp_path / "b").diff(tmp_path / "a").first_divergence()
    assert div is None or div.key.startswith("model/")


def test_replay_argument_structure_names_no_other_type(tmp_path):
    sidecar = _capture(tmp_path)

    def change(doc, e):
        i = e["key"].index("model/aten.mul.Tensor[out0]")
        spec = json.loads(e["call_args"][i]["spec"])
        spec[1]["type"] = "collections.namedtuple"
        e["call_args"][i]["spec"] = json.dumps(spec)

    _edit(sidecar, change)
    with pytest.raises(DumpFormatError, match="pass00000.*malformed argument structure"):
        tdinspect.replay(tmp_path, "model/aten.mul.Tensor")


# -- sidecars: caches bound to their pass file ------------------------------------------------
def _module_dump(path, scale=1.0):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    torch.nn.init.constant_(model[0].weight, 0.1)
    torch.nn.init.constant_(model[0].bias, 0.0)
    with torch.no_grad(), tdinspect.capture(model, path) as dump:
        model(torch.arange(8.0).reshape(2, 4) * scale)
        dump.step()
    return only_folder(path) / "pass00000.json"


def _true_max(path, key):
    return float(tdinspect.load_pass(only_folder(path) / "pass00000.pt")[key].max())


def _max(path, key):
    rows = DumpSet.open(path).entries(progress=False)
    return float(rows.loc[rows.key == key, "max"].iloc[0])


def test_edited_statistics_are_ignored_with_a_warning(tmp_path):
    side = _module_dump(tmp_path)
    true = _true_max(tmp_path, "model.0")
    _edit(side, lambda doc, e: e["stats"][e["key"].index("model.0")].__setitem__(1, 999.0), bind=False)
    with pytest.warns(RuntimeWarning, match=r"pass00000\.json: sidecar was edited.*recomputed"):
        assert _max(tmp_path, "model.0") == pytest.approx(true)


def test_stale_sidecar_of_another_run_is_ignored(tmp_path):
    side = _module_dump(tmp_path / "a")
    other = _module_dump(tmp_path / "b", scale=1e-3)
    side.write_bytes(other.read_bytes())  # the sidecar of a run with 1000x smaller values
    true = _true_max(tmp_path / "a", "model.0")
    with pytest.warns(RuntimeWarning, match=r"does not describe pass00000\.pt"):
        assert _max(tmp_path / "a", "model.0") == pytest.approx(true)
    # a pass file replaced after its sidecar was written: the same
    _module_dump(tmp_path / "c", scale=2.0)
    (only_folder(tmp_path / "c") / "pass00000.pt").write_bytes(
        (only_folder(tmp_path / "a") / "pass00000.pt").read_bytes()
    )
    with pytest.warns(RuntimeWarning, match="stale"):
        assert _max(tmp_path / "c", "model.0") == pytest.approx(true)


def test_edited_shape_does_not_make_identical_runs_differ(tmp_path):
    side = _module_dump(tmp_path / "a")
    _module_dump(tmp_path / "b")
    _edit(side, lambda doc, e: e["shape"].__setitem__(e["key"].index("model.0"), [8, 2]), bind=False)
    with pytest.warns(RuntimeWarning, match="edited"):
        ds = DumpSet.open(tmp_path / "a")
    assert ds.diff(tmp_path / "b").first_divergence() is None
    with pytest.warns(RuntimeWarning, match="edited"):
        assert main(["first-divergence", str(tmp_path / "a"), str(tmp_path / "b")]) == 0


@pytest.mark.parametrize("bind", [False, True])
def test_forged_stats_only_does_not_switch_the_diff(tmp_path, bind):
    side = _module_dump(tmp_path / "a")
    _module_dump(tmp_path / "b")
    _edit(side, lambda doc, e: doc.__setitem__("stats_only", True), bind=bind)
    with pytest.warns(RuntimeWarning, match="statistics only" if bind else "edited"):
        ds = DumpSet.open(tmp_path / "a")
    assert not ds.stats_only
    assert ds.diff(tmp_path / "b").mode == "tensor"


def test_sidecar_without_binding_is_recomputed_and_named_once(tmp_path, recwarn):
    side = _module_dump(tmp_path)
    _edit(side, lambda doc, e: doc.pop("binding"), bind=False)  # older tdinspect, another tool
    ds = DumpSet.open(tmp_path)
    assert ds.ops == list(tdinspect.load_pass(side.with_suffix(".pt")))
    msgs = [str(w.message) for w in recwarn if "sidecar" in str(w.message)]
    assert len(msgs) == 1 and "pass00000.json" in msgs[0] and "no binding" in msgs[0]


# -- sidecars: validated, every failure a DumpFormatError naming the file -------------------
@pytest.mark.parametrize(
    "change, match",
    [
        (
            lambda doc, e: e["ref"].__setitem__(e["key"].index(VIEW), {"kind": "view", "of": VIEW}),
            "refers to|lead",
        ),
        (lambda doc, e: e["ref"].__setitem__(e["key"].index(VIEW), {"kind": "same", "of": ADD_IN}), "lead"),
        (lambda doc, e: e["key"].__setitem__(0, 7), "column 'key'"),
        (lambda doc, e: e["key"].__setitem__(0, ["a"]), "column 'key'"),
        (lambda doc, e: e["key"].__setitem__(1, e["key"][0]), "key twice"),
        (lambda doc, e: e["stats"].__setitem__(0, ["x"] * 9), "column 'stats'"),
        (lambda doc, e: e["stats"].__setitem__(0, [1.0, 2.0]), "column 'stats'"),
        (lambda doc, e: e["shape"].__setitem__(0, "2x3"), "column 'shape'"),
        (lambda doc, e: e["shape"].__setitem__(0, [2, -1]), "column 'shape'"),
        (lambda doc, e: e["stored"].__setitem__(0, "yes"), "column 'stored'"),
        (lambda doc, e: e["ref"].__setitem__(0, "model.x"), "column 'ref'"),
        (lambda doc, e: e["ref"].__setitem__(0, {"kind": "view", "of": 3}), "column 'ref'"),
        (lambda doc, e: e["call_args"].__setitem__(0, [1]), "column 'call_args'"),
        (lambda doc, e: e.__setitem__("dtype", {"a": 1}), "column 'dtype'"),
        (lambda doc, e: doc.__setitem__("entries", []), "no entries.key"),
        (lambda doc, e: doc.__setitem__("level", ["op"]), "'level'"),
    ],
)
def test_malformed_sidecar_is_a_dump_format_error_naming_the_file(tmp_path, change, match):
    sidecar = _capture(tmp_path / "a")
    _capture(tmp_path / "b")
    _edit(sidecar, change)
    with pytest.raises(DumpFormatError, match=rf"pass00000\.(json|pt).*({match})"):
        ds = DumpSet.open(tmp_path / "a")
        for key in ds.pass_indexes()[0].keys:
            ds.tensor(key)
    if "lead" not in match:  # found at open: on_error="warn" skips the pass, naming the file
        with pytest.warns(RuntimeWarning, match=r"pass00000\.json"):
            with pytest.raises(DumpFormatError, match=r"no readable pass \(1 skipped\)"):
                DumpSet.open(tmp_path / "a", on_error="warn")
    assert main(["first-divergence", str(tmp_path / "a"), str(tmp_path / "b")]) == 2


def test_deeply_nested_sidecar(tmp_path):
    sidecar = _capture(tmp_path)
    sidecar.write_text(
        '{"format": "tdinspect.pass", "version": 1, "entries": ' + "[" * 100000 + "]" * 100000 + "}"
    )
    with pytest.raises(DumpFormatError, match=r"pass00000\.json: unreadable sidecar"):
        DumpSet.open(tmp_path)
    with pytest.warns(RuntimeWarning, match=r"pass00000\.json"):
        with pytest.raises(DumpFormatError, match=r"no readable pass \(1 skipped\)"):
            DumpSet.open(tmp_path, on_error="warn")


# -- fuzz: hostile sidecars give a DumpFormatError naming the file, or a correct answer --------
def _json_values(canary):
    scalars = (
        st.none()
        | st.booleans()
        | st.integers(-(2**70), 2**70)
        | st.floats()
        | st.text(max_size=8)
        | st.sampled_from(
            [
                str(canary),
                "/etc/passwd",
                VIEW,
                ADD_IN,
                "aten.from_file.default",
                "aten.copy_.default",
                "view",
                "same",
                "t",
                "dtype",
            ]
        )
    )
    return st.recursive(
        scalars,
        lambda inner: (
            st.lists(inner, max_size=4)
            | st.dictionaries(
                st.sampled_from(
                    [
                        "kind",
                        "of",
                        "t",
                        "aten",
                        "spec",
                        "leaves",
                        "base",
                        "view",
                        "dtype",
                        "x",
                        "complex",
                        "f",
                        "repr",
                        "device",
                        "layout",
                        "memory_format",
                    ]
                ),
                inner,
                max_size=4,
            )
        ),
        max_leaves=12,
    )


class _FileAudit:
    """Every path opened while active (an audit hook: it also sees C-level opens made through
    Python's ``open``/``os.open``)."""

    def __init__(self):
        self.active, self.opened = False, []
        sys.addaudithook(self._hook)

    def _hook(self, event, args):
        if self.active and event in ("open", "os.open") and isinstance(args[0], (str, bytes, Path)):
            mode = args[1] if len(args) > 1 else None
            self.opened.append((os.fsdecode(args[0]), mode))


_AUDIT = None


def test_fuzzed_sidecars_only_ever_raise_dump_format_error(tmp_path_factory):
    global _AUDIT
    _AUDIT = _AUDIT or _FileAudit()
    root = tmp_path_factory.mktemp("fuzz")
    canary = root / "canary.bin"
    canary.write_bytes(b"SECRET-bytes-of-a-file-you-own!!")
    clean = _capture(root / "clean")
    original = json.loads(clean.read_text())
    dump = root / "dump"
    _capture(dump)
    sidecar = only_folder(dump) / "pass00000.json"
    pt_bytes = sidecar.with_suffix(".pt").read_bytes()
    columns = sorted(original["entries"])
    n = len(original["entries"]["key"])

    @settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(
        edits=st.lists(
            st.tuples(
                st.sampled_from(columns + ["<header>", "<stats_only>"]),
                st.integers(0, n - 1),
                _json_values(canary),
            ),
            min_size=1,
            max_size=4,
        ),
        bind=st.booleans(),
        stats_only=st.booleans(),
    )
    def run(edits, bind, stats_only):
        doc = json.loads(json.dumps(original))
        for col, row, value in edits:
            if col == "<header>":
                doc[["level", "partial", "pass", "entries"][row % 4]] = value
            elif col == "<stats_only>":
                doc["stats_only"] = value
            elif isinstance(doc.get("entries"), dict):
                old = doc["entries"].get(col)
                old = old if isinstance(old, list) else []
                doc["entries"][col] = (
                    value if row == 0 and isinstance(value, list) else [*old[:row], value, *old[row + 1 :]]
                )
        pt = sidecar.with_suffix(".pt")
        pt.write_bytes(pt_bytes)
        if stats_only:  # a statistics-only pass: the sidecar alone
            pt.unlink()
        rewrite_sidecar(sidecar, doc, bind)
        _AUDIT.opened.clear()
        _AUDIT.active = True
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                ds = DumpSet.open(dump)
                for pi in ds.pass_indexes():
                    for key in pi.keys:
                        try:
                            ds.tensor(key)
                        except DumpFormatError as exc:
                            assert "pass00000" in str(exc), exc
                    for key in pi.keys:
                        if "[out0]" in key and pi.call_args[pi.position[key]] is not None:
                            try:
                                tdinspect.replay(ds, key)
                            except (DumpFormatError, KeyError) as exc:
                                assert "pass00000" in str(exc), exc
                ds.diff(clean.parent).first_divergence()
                ds.entries(progress=False)
        except DumpFormatError as exc:
            assert "pass00000" in str(exc) or str(dump) in str(exc), exc
        finally:
            _AUDIT.active = False
        outside = [
            (p, m)
            for p, m in _AUDIT.opened  # lazily imported modules aside
            if not p.startswith(str(root))
            and not p.endswith((".py", ".pyc", ".so"))
            and not p.startswith((sys.prefix, sys.base_prefix, "/proc/", "/sys/", "/usr/share/zoneinfo/"))
        ]  # CPU count probes, time zones
        assert not outside, outside
        assert not any(p.startswith(str(canary)) for p, _ in _AUDIT.opened)
        assert not any(
            isinstance(m, str) and set(m) & set("wax+") and not p.startswith(str(dump))
            for p, m in _AUDIT.opened
        )

    run()
    assert canary.read_bytes() == b"SECRET-bytes-of-a-file-you-own!!"


# -- filter_fn is trusted code; exiting at import is a ConfigError -------------------------
@pytest.mark.parametrize("how", ["file", "env"])
def test_filter_fn_exiting_at_import_is_a_config_error(tmp_path, monkeypatch, how):
    from tdinspect.errors import ConfigError

    exiting = tmp_path / "exiting.py"
    exiting.write_text("import sys\nsys.exit(3)\ndef keep(name, module):\n    return True\n")
    model = torch.nn.Linear(2, 2)
    if how == "env":
        monkeypatch.setenv("TDINSPECT_DUMP_DIR", str(tmp_path / "d"))
        monkeypatch.setenv("TDINSPECT_DUMP_FILTER_FN", f"{exiting}:keep")
        kwargs = {}
    else:
        kwargs = {"filter_fn": f"{exiting}:keep"}
    with pytest.raises(ConfigError, match=r"exiting\.py.*SystemExit: 3"):
        tdinspect.capture(model, tmp_path / "d" if how == "file" else None, **kwargs).start()
