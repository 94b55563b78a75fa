"""A new user's pass over the release's new surfaces: what was found wrong, each pinned.

A tiny Hugging Face Llama against its hand-written port (``tdinspect.examples.port``): the
report page and ``%tdi_diff``'s summary said "every entry compared" beside a table of
entries left out by ``allow_uncompared``; ``tdinspect report --json`` was accepted and
ignored (an HTML page came out); a comparison spec read from hand-edited JSON crashed on a
wrong type (``AttributeError``, ``TypeError``) or took ``"false"`` for true; an empty
mapping file compared by name as if no ``--mapping`` was given.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from tdinspect import DumpSet, suggest_mapping  # noqa: E402
from tdinspect.cli import main  # noqa: E402
from tdinspect.compare.spec import CompareSpec  # noqa: E402
from tdinspect.errors import MappingError  # noqa: E402
from tdinspect.examples.port import capture_port_pair  # noqa: E402
from tdinspect.report import DiffSummary  # noqa: E402

ONE_SIDED = r"rotary_emb|act_fn"


@pytest.fixture(scope="module")
def port(tmp_path_factory):
    root = tmp_path_factory.mktemp("trial")
    ref, good = capture_port_pair(root / "good")
    rules = suggest_mapping(DumpSet.open(ref), DumpSet.open(good)).save(root / "rules.yaml")
    return {"root": root, "ref": ref, "good": good, "rules": rules}


def test_a_match_with_entries_allowed_out_does_not_claim_every_entry_compared(port):
    d = DumpSet.open(port["ref"]).diff(
        port["good"], mapping=port["rules"], structural="report", allow_uncompared=ONE_SIDED
    )
    summary = DiffSummary(d)
    assert summary.verdict.outcome == "matches"
    for text in (repr(summary), summary._repr_html_()):
        assert "every entry compared" not in text
        assert "all 21 entries compared" in text
        assert "4 left out by allow_uncompared" in text


def test_report_page_says_what_was_left_out(port, capsys):
    out = port["root"] / "report.html"
    argv = [str(port["ref"]), str(port["good"]), "--mapping", str(port["rules"])]
    argv += ["--structural", "report", "--allow-uncompared", ONE_SIDED, "-o", str(out)]
    assert main(["report", *argv]) == 0
    page = out.read_text()
    assert "every entry compared" not in page
    assert "4 left out by allow_uncompared" in page


def test_report_refuses_json_rather_than_ignoring_it(port, capsys):
    out = port["root"] / "r.json"
    with pytest.raises(SystemExit) as exc:
        main(["report", str(port["ref"]), str(port["good"]), "--json", "-o", str(out)])
    assert exc.value.code == 2
    assert "--json" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize(
    "fields, match",
    [
        ({"baseline": 5}, r"baseline=5: expected a dump folder"),
        ({"allow_uncompared": 5}, r"allow_uncompared=5: expected a regex or a list of them"),
        ({"allow_uncompared": ["ok", 3]}, r"allow_uncompared 3: not a regular expression"),
        ({"unshard": "false"}, r"unshard='false': expected true or false"),
        ({"tokens": "yes"}, r"tokens='yes': expected true or false"),
        ({"baseline_factor": True}, r"baseline_factor: expected a number, got True"),
    ],
)
def test_a_spec_from_json_with_a_wrong_type_names_the_field(fields, match):
    with pytest.raises(ValueError, match=match):
        CompareSpec.from_json(json.dumps(fields))


def test_a_spec_from_json_keeps_its_good_values():
    spec = CompareSpec.from_json(json.dumps({"unshard": True, "allow_uncompared": ["a", "b"]}))
    assert spec.unshard is True and spec.allow_uncompared == ("a", "b")


@pytest.mark.parametrize("text", ["", "null\n", "{}\n", "# only comments\n"])
def test_an_empty_mapping_file_is_an_error_naming_it(port, text, capsys):
    path = port["root"] / "empty.yaml"
    path.write_text(text)
    with pytest.raises(MappingError, match=r"empty\.yaml: no rules"):
        DumpSet.open(port["ref"]).diff(port["good"], mapping=path)
    assert main(["first-divergence", str(port["ref"]), str(port["good"]), "--mapping", str(path)]) == 2
    assert "empty.yaml: no rules" in capsys.readouterr().err


def _reseal(sidecar, edit):
    """Edit a sidecar and bind it anew, as a forger (or a tool rewriting it) would."""
    from tdinspect.store.sidecars import seal

    doc = json.loads(sidecar.read_text())
    doc.pop("binding")
    edit(doc)
    data = json.dumps(doc, separators=(",", ":")).encode()
    sidecar.write_bytes(seal(data, sidecar.with_suffix(".pt")))


@pytest.mark.parametrize(
    "rows, match",
    [
        ({"dim": 5, "rows": ["0" * 16]}, r"1 fingerprints along dim 5 of shape \[4, 8\]"),
        ({"dim": 0, "rows": ["0" * 16] * 3}, r"3 fingerprints along dim 0 of shape \[4, 8\]"),
    ],
)
def test_row_fingerprints_that_do_not_fit_the_shape_name_the_sidecar(tmp_path, rows, match):
    import torch

    import tdinspect
    from tdinspect.store.format import DumpFormatError

    model = torch.nn.Sequential(torch.nn.Linear(4, 8))
    with torch.no_grad(), tdinspect.capture(model, tmp_path / "d", checksum=True, checksum_dim=0) as dump:
        model(torch.randn(4, 4))
        dump.step()
    sidecar = next((tmp_path / "d").glob("*/pass00000.json"))
    _reseal(sidecar, lambda doc: doc["entries"]["checksum_rows"].__setitem__(0, rows))
    with pytest.raises(
        DumpFormatError, match=rf"pass00000\.json: sidecar column 'checksum_rows', entry 'model\.0': {match}"
    ):
        DumpSet.open(tmp_path / "d")


@pytest.mark.parametrize("kind", ["missing", "empty folder", "a file"])
def test_a_bad_baseline_is_named_as_the_baseline(port, kind, capsys):
    from tdinspect.store.format import DumpFormatError

    path = port["root"] / f"baseline {kind}"
    if kind == "empty folder":
        path.mkdir()
    elif kind == "a file":
        path.write_text("not a dump")
    with pytest.raises(DumpFormatError, match=r"^baseline .*baseline " + kind):
        DumpSet.open(port["ref"]).diff(port["ref"], baseline=path)
    with pytest.raises(DumpFormatError, match=r"^baseline "):
        DumpSet.open(port["ref"]).diff(port["ref"], spec=CompareSpec(baseline=str(path)))
    assert main(["first-divergence", str(port["ref"]), str(port["ref"]), "--baseline", str(path)]) == 2
    assert "error: --baseline " in capsys.readouterr().err


def test_the_health_table_gives_one_sided_entries_no_threshold(port):
    """Beside float32's 1.49e-08, the port's four one-sided entries showed a threshold of
    0.001 (auto's fallback without a partner's dtype): a number that judged nothing."""
    import math

    d = DumpSet.open(port["ref"]).diff(port["good"], mapping=port["rules"], structural="report")
    h = d.health(progress=False)
    sided = h[h["one_sided"]]
    assert len(sided) == 4 and all(math.isnan(t) for t in sided["threshold"])
    assert list(h[~h["one_sided"]]["threshold"]) == [2.0**-24 / 4] * 21  # float32 auto, u/4


@pytest.fixture(scope="module")
def token_runs(tmp_path_factory):
    """Two identical padded runs of the tiny Llama with their token layouts: ``rotary_emb``'s
    outputs ``[1, S, d]`` are not token-major, so they are set aside."""
    import torch

    import tdinspect
    from tdinspect.examples.port import make_hf_llama, port_tokens

    root = tmp_path_factory.mktemp("trial_tokens")
    model = make_hf_llama(0)
    ids = port_tokens(0, length=6, batch=2)
    mask = torch.ones_like(ids)
    for name in ("a", "b"):
        with torch.no_grad(), tdinspect.capture(model, root / name) as dump:
            model(ids, attention_mask=mask)
            dump.step(tokens=tdinspect.tokens(attention_mask=mask))
    return root / "a", root / "b"


def test_token_summary_and_cli_keep_the_specs_structural_mode(token_runs, capsys):
    """``TokenDiff.summary`` defaulted to ``structural="diverge"`` over the spec's: Python said
    "incomplete", ``first-divergence --tokens --structural report`` said "first divergence:
    rotary_emb[0] (set aside, not compared)" and exited 1."""
    a, b = token_runs
    d = DumpSet.open(a).diff(b, tokens=True, structural="report")
    assert d.verdict().outcome == "incomplete"
    assert d.summary()["outcome"] == "incomplete"
    argv = ["first-divergence", str(a), str(b), "--tokens", "--structural", "report"]
    assert main(argv) == 3
    assert "incomplete" in capsys.readouterr().out
    assert main([*argv, "--json"]) == 3
    assert json.loads(capsys.readouterr().out)["outcome"] == "incomplete"


def test_tokens_with_a_baseline_is_refused_not_judged_incomplete(token_runs, capsys):
    """With ``tokens=True`` every entry read "no baseline entry" (the baseline pairs pass by
    pass, the token aligner by request): "incomplete, 0 entries compared", on runs that match."""
    a, b = token_runs
    with pytest.raises(ValueError, match="tokens=True with a baseline: not supported"):
        DumpSet.open(a).diff(b, tokens=True, baseline=a)
    assert main(["first-divergence", str(a), str(b), "--tokens", "--baseline", str(a)]) == 2
    assert "tokens=True with a baseline" in capsys.readouterr().err


def test_a_token_layout_that_leads_no_entry_is_refused_before_any_allocation(token_runs, tmp_path):
    """A resealed sidecar whose layout claims 10**12 token rows (shape and segments agreeing)
    opened, and ``diff(tokens=True)`` allocated per-token arrays until ``MemoryError`` (15 s
    under a 6 GB limit; without one, the kernel killed the process)."""
    import shutil

    from tdinspect.store.format import DumpFormatError

    dump = tmp_path / "huge"
    shutil.copytree(token_runs[1], dump)
    sidecar = next(dump.glob("*/pass00000.json"))
    huge = {"shape": [10**12], "segments": [[0, 0, 10**12]]}
    _reseal(sidecar, lambda doc: doc.__setitem__("tokens", huge))
    with pytest.raises(
        DumpFormatError,
        match=r"pass00000\.json: sidecar field 'tokens': its shape \[1000000000000\] leads no entry",
    ):
        DumpSet.open(token_runs[0]).diff(DumpSet.open(dump), tokens=True)


@pytest.mark.parametrize("where", ["", None, 3])
def test_saving_a_memory_capture_to_no_path_is_refused(where, tmp_path, monkeypatch):
    """``cap.save("")`` (an unset variable) meant the working folder; ``save(None)`` raised
    a bare ``TypeError``."""
    import torch

    import tdinspect
    from tdinspect.errors import ConfigError

    monkeypatch.chdir(tmp_path)
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    with torch.no_grad(), tdinspect.capture(model, memory=True) as cap:
        model(torch.ones(1, 2))
        cap.step()
    with pytest.raises(ConfigError, match=r"save\(.*\): expected a folder path; nothing written"):
        cap.save(where, if_exists="add")
    assert list(tmp_path.iterdir()) == []
