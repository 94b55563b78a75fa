"""Commands that write into a folder remove only what tdinspect wrote there."""

from __future__ import annotations

import shutil

import pytest

from tdinspect.cli import main
from tdinspect.errors import ConfigError
from tdinspect.examples import samples

from .conftest import ROOT


def test_demo_refuses_a_folder_holding_the_users_files_and_reruns_over_its_own(tmp_path, capsys):
    """`tdinspect demo --out DIR` removed DIR/reference and DIR/wrong_layer whatever they held
    (a my_notes.txt was lost)."""
    out = tmp_path / "out"
    assert main(["demo", "--out", str(out)]) == 0
    assert main(["demo", "--out", str(out)]) == 0  # a rerun replaces its own runs
    assert len(list((out / "reference").iterdir())) == 1
    capsys.readouterr()
    notes = out / "wrong_layer" / "my_notes.txt"
    notes.write_text("mine")
    before = sorted(p.name for p in (out / "reference").iterdir())
    assert main(["demo", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"{out / 'wrong_layer'} holds what tdinspect did not write (my_notes.txt)" in err, err
    assert notes.read_text() == "mine"
    assert sorted(p.name for p in (out / "reference").iterdir()) == before  # nothing removed


def test_sample_generation_refuses_a_folder_it_did_not_write(tmp_path):
    root = tmp_path / "samples"
    shutil.copytree(ROOT / "sample_dumps", root)
    (root / "bfloat16" / "rank0_pid0" / "keep.txt").write_text("mine")
    with pytest.raises(
        ConfigError, match=r"bfloat16 holds what tdinspect did not write \(rank0_pid0/keep.txt\)"
    ):
        samples.generate(root)
    assert (root / "bfloat16" / "rank0_pid0" / "keep.txt").read_text() == "mine"
    assert (root / "float32" / "rank0_pid0" / "run.json").exists()  # checked first: nothing removed
    (root / "bfloat16" / "rank0_pid0" / "keep.txt").unlink()
    samples.generate(root)  # its own runs: replaced
    for name in ("float32", "bfloat16", "wrong_layer", "ops_layernorm", "ops_layernorm_f32"):
        assert [p.name for p in (root / name).iterdir()] == ["rank0_pid0"], name
