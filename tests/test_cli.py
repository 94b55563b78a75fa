"""The command line: exit codes 0/1/2, tables and JSON, same answers as the API."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys

import pytest
import torch

import tdinspect
from tdinspect.cli import main

from .recorded import record_dump


def test_first_divergence_exit_codes_and_json(runs, capsys):
    assert main(["first-divergence", str(runs["ref"]), str(runs["ref2"])]) == 0
    assert "no divergence" in capsys.readouterr().out
    assert main(["first-divergence", str(runs["ref"]), str(runs["wrong"]), "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["first_divergence"]["key"] == "model.layers.2.mlp.down"
    assert out["first_divergence"]["pass"] == 0
    assert (
        main(
            [
                "first-divergence",
                str(runs["ref"]),
                str(runs["wrong"]),
                "--threshold",
                r"layers\.2\.mlp\.down=1",
                "--threshold",
                "1e-5",
            ]
        )
        == 1
    )
    assert "model.layers.3.ln1" in capsys.readouterr().out


def test_diff_table_and_metric(runs, capsys):
    assert (
        main(["diff", str(runs["ref"]), str(runs["wrong"]), "--metric", "max_abs", "--threshold", "1e-4"])
        == 1
    )
    out = capsys.readouterr().out
    assert "divergent entries (max_abs)" in out and "model.layers.2.mlp.down" in out
    assert main(["diff", str(runs["ref"]), str(runs["ref2"]), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["n_divergences"] == 0


def test_ls_and_stats(runs, capsys):
    assert main(["ls", str(runs["ref"])]) == 0
    out = capsys.readouterr().out
    assert "model.expert" in out and "3 passes" in out
    assert main(["stats", str(runs["ref"]), "--op", r"lm_head", "--pass", "1", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["key"] for r in rows] == ["model.lm_head"] and rows[0]["pass"] == 1


def test_errors_exit_2_with_one_line(tmp_path, capsys):
    assert main(["ls", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tdinspect ls: error:") and "missing" in err and "Traceback" not in err
    assert main(["first-divergence", str(tmp_path), str(tmp_path), "--threshold", "x=y"]) == 2


def test_every_failure_exits_2_with_one_line(runs, capsys, monkeypatch):
    ref, wrong = str(runs["ref"]), str(runs["wrong"])
    assert main(["first-divergence", ref, wrong, "--threshold", "nan"]) == 2
    err = capsys.readouterr().err
    assert "--threshold" in err and "NaN" in err and len(err.strip().splitlines()) == 1
    assert main(["diff", ref, wrong, "--threshold", "([=1"]) == 2
    err = capsys.readouterr().err
    assert "([" in err and "regular expression" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1

    # an unexpected exception inside a command: still 2 (1 would read as "divergence found")
    from tdinspect import dumpset

    def broken(self, other, **kw):
        raise RuntimeError("view of a storage that is too small\nsecond line")

    monkeypatch.setattr(dumpset.DumpSet, "diff", broken)
    assert main(["first-divergence", ref, wrong]) == 2
    err = capsys.readouterr().err
    assert err.strip() == (
        "tdinspect first-divergence: error: RuntimeError: view of a storage "
        "that is too small (--debug shows the traceback)"
    )
    assert main(["first-divergence", ref, wrong, "--debug"]) == 2
    assert "Traceback" in capsys.readouterr().err


def test_api_rejects_nan_threshold_and_bad_regex(runs):
    import pytest

    from tdinspect import DumpSet

    d = DumpSet.open(runs["ref"]).diff(DumpSet.open(runs["wrong"]))
    with pytest.raises(ValueError, match="NaN"):
        d.first_divergence(threshold=float("nan"))
    with pytest.raises(ValueError, match=r"\(\[=1"):
        d.first_divergence(threshold={"([=1": 1e-3})


def test_a_cli_diff_of_small_dumps_stays_light():
    """Small dumps diff without loading numba (pairs under its threshold), xarray (no cube) or
    dask.distributed (which dask imports when a scheduler is given by name)."""
    import subprocess
    import sys

    from .conftest import ROOT

    a, b = ROOT / "sample_dumps" / "float32", ROOT / "sample_dumps" / "wrong_layer"
    code = (
        "import sys; from tdinspect.cli import main; "
        f"codes = [main(['diff', {str(a)!r}, {str(b)!r}]), "
        f"main(['first-divergence', {str(a)!r}, {str(b)!r}])]; "
        "print(codes, [m for m in ('distributed', 'numba', 'xarray') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip().splitlines()[-1] == "[1, 1] []"


def test_diff_table_tells_a_divergent_cosine_from_1(runs, capsys):
    assert main(["diff", str(runs["ref"]), str(runs["wrong"]), "--metric", "cosine"]) == 1
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.startswith("0 ")]
    assert rows and all(float(r[3]) < 1 for r in rows)  # each shown value is the diverging one
    assert all(r[3] in " ".join(r[4:]) for r in rows)  # the same digits as its reason


def test_a_reader_that_leaves_ends_the_command_quietly(runs):
    """``tdinspect diff a b | head``: no "error: Broken pipe", the status of a command ended
    by SIGPIPE."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    read, write = os.pipe()
    os.close(read)  # the reader is gone before anything is written
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")]),
    }
    for command in (["diff", "--json"], ["first-divergence"], ["ls"]):
        args = [
            command[0],
            str(runs["ref"]),
            *([str(runs["wrong"])] if command[0] != "ls" else []),
            *command[1:],
        ]
        proc = subprocess.run(
            [sys.executable, "-m", "tdinspect", *args],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            timeout=300,
        )
        assert (proc.returncode, proc.stderr) == (141, ""), command
    os.close(write)


def test_stats_of_a_pass_the_dump_does_not_hold_is_an_error(tmp_path, capsys):
    """``stats --pass 99`` printed an empty table and exited 0, as if the pass held nothing."""
    record_dump(tmp_path, [{"m.a": torch.ones(2)}] * 3)
    assert main(["stats", str(tmp_path), "--pass", "99"]) == 2
    assert "--pass 99: " in capsys.readouterr().err
    assert main(["stats", str(tmp_path), "--pass", "2"]) == 0
    assert "m.a" in capsys.readouterr().out


def test_warnings_are_one_line_of_the_command_never_a_source_line(tmp_path, capsys):
    """The CLI printed '/.../tdinspect/cli.py:107: RunWarning: ...' (tdinspect's own source
    location); now one line of its own, and --op / --threshold errors name their option."""
    m = torch.nn.Linear(2, 2)
    for i in range(2):
        with pytest.warns(tdinspect.RunWarning) if i else contextlib.nullcontext():
            with tdinspect.capture(m, tmp_path / "d") as cap:
                m(torch.ones(1, 2))
                cap.step()
    capsys.readouterr()
    out = subprocess.run(  # pytest records warnings in-process: the command's own output, as a user sees it
        [sys.executable, "-m", "tdinspect", "ls", str(tmp_path / "d")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0
    assert "holds 2 runs" in out.stderr and "[RunsNote]" in out.stderr and ".py:" not in out.stderr
    assert main(["stats", str(tmp_path / "d"), "--op", "["]) == 2
    assert "error: --op: invalid regex '['" in capsys.readouterr().err
    assert main(["first-divergence", str(tmp_path / "d"), str(tmp_path / "d"), "--threshold", "abc"]) == 2
    assert "error: --threshold abc: expected auto" in capsys.readouterr().err
