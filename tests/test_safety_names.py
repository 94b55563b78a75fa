"""Names holding a newline: paired as they are, and shown whole (escaped) by the CLI."""

from __future__ import annotations

import torch

import tdinspect
from tdinspect.cli import main
from tdinspect.naming import parse_key, split_call


def test_split_call_keeps_a_final_newline():
    """``$`` matched before a final newline: ``split_call("m.a\\n")`` gave ``("m.a", 0)``."""
    assert split_call("m.a\n") == ("m.a\n", 0)
    assert split_call("m.a\n::call2") == ("m.a\n", 2)
    assert split_call("m.a::call2\n") == ("m.a::call2\n", 0)
    assert parse_key("m.a[in0\n]").labels == ("in0\n",)


def _model():
    torch.manual_seed(0)
    m = torch.nn.Sequential()
    m.add_module("a\n", torch.nn.Linear(4, 4))
    m.add_module("a", torch.nn.Linear(4, 4))  # "model.a" and "model.a\n": two names
    return m


def test_a_module_named_with_a_final_newline_pairs_with_itself(tmp_path):
    x = torch.randn(2, 4)
    for name in ("a", "b"):
        m = _model()
        with torch.no_grad(), tdinspect.capture(m, tmp_path / name, environ={}) as cap:
            m(x)
            m(x)  # a second call: "model.a\n::call1"
            cap.step()
    diff = tdinspect.DumpSet.open(tmp_path / "a").diff(tmp_path / "b")
    table = diff.table(progress=False)
    keys = set(table["key"])
    assert {"model.a\n", "model.a\n::call1"} <= keys
    assert not table["structural"].any(), table[["key", "reason"]]
    assert diff.first_divergence() is None
    # calls put end to end: "model.a\n" was read as a call of "model.a" and joined to it
    joined = tdinspect.DumpSet.open(tmp_path / "a").concat("call", dim=0)
    keys = set(
        joined.diff(tdinspect.DumpSet.open(tmp_path / "b").concat("call", dim=0)).table(progress=False)["key"]
    )
    assert {"model.a\n", "model.a"} <= keys, keys
    assert joined.tensor("model.a\n").shape == (4, 4) and joined.tensor("model.a").shape == (4, 4)


def test_cli_errors_show_a_path_with_a_newline_whole(tmp_path, capsys):
    bad = tmp_path / "runs\nmore"
    assert main(["ls", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path}/runs\\nmore" in err, err
    assert len(err.strip().splitlines()) == 1
    assert main(["diff", str(bad), str(tmp_path / "x\x1b[2J")]) == 2
    err = capsys.readouterr().err
    assert "runs\\nmore" in err and "\x1b" not in err


def test_no_pattern_over_names_from_files_lets_a_final_newline_through():
    """'$' matches before a final newline: a file named 'pass00000.pt\\n' was a pass file, a
    folder 'rank0_pid1\\n' a rank folder, a dims token or op name with a newline accepted."""
    from tdinspect.align.dims import _TOKEN
    from tdinspect.compare.health import _INPUT, _OUTPUT
    from tdinspect.rerun import _NAME
    from tdinspect.store.format import PASS_RE, RANK_DIR_RE, SIDECAR_RE

    for pattern, name in [
        (PASS_RE, "pass00000.pt"),
        (SIDECAR_RE, "pass00000.json"),
        (RANK_DIR_RE, "rank0_pid1"),
        (_TOKEN, "h(tp)"),
        (_NAME, "gelu"),
    ]:
        assert pattern.match(name) and not pattern.match(name + "\n"), pattern.pattern
    for pattern, name in [(_INPUT, "m/aten.add[in0]"), (_OUTPUT, "m/aten.add[out0]")]:
        assert pattern.search(name) and not pattern.search(name + "\n"), pattern.pattern


def test_a_call_number_before_the_labels_is_refused_not_read_as_a_module_name():
    """parse_key('model.layers.0.attn::call2[0][logits]') gave module 'model.layers.0.attn::call2':
    the call number belongs at the end of a key ('...[0][logits]::call2')."""
    import pytest

    from tdinspect.errors import KeyGrammarError
    from tdinspect.naming import parse_key

    with pytest.raises(KeyGrammarError, match="expected 'module"):
        parse_key("model.layers.0.attn::call2[0][logits]")
    with pytest.raises(KeyGrammarError):
        parse_key("model/aten.add.Tensor::call1[out0]")
    good = parse_key("model.layers.0.attn[0][logits]::call2")
    assert (good.module, good.call, good.labels) == ("model.layers.0.attn", 2, ("0", "logits"))
