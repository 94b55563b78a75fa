"""Runs, passes and arguments a hostile or unlucky user can meet (issue 36, cases 4 and 8-14):
a pass cut short, empty and out-of-range arguments, runs sharing a PID, readers racing an
overwrite, sizes and depths taken from files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

import tdinspect
from tdinspect import DumpSet

from .conftest import only_folder
from .test_safety_dashboard import _get, dashboard  # noqa: F401  (a fixture)


class _Stops(nn.Module):
    """A block whose forward raises when ``stop`` is set (a model cut short mid-pass)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.stop = False

    def forward(self, x):
        y = self.lin(x)
        if self.stop:
            raise RuntimeError("out of pages")
        return y


def _net(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 4), _Stops(), nn.Linear(4, 4), nn.Linear(4, 4))


def _run(root, stop_at: int | None, passes: int = 2, wrong: bool = False):
    """``passes`` passes of ``_net``; the one numbered ``stop_at`` raises inside ``with capture``
    (``wrong``: its first layer's weights perturbed)."""
    net, x = _net(), torch.randn(2, 4, generator=torch.Generator().manual_seed(1))
    if wrong:
        with torch.no_grad():
            net[0].weight[0, 0] += 1.0
    with pytest.raises(RuntimeError, match="out of pages") if stop_at is not None else _nothing():
        with torch.no_grad(), tdinspect.capture(net, root, modules="all") as dump:
            for p in range(passes):
                net[1].stop = p == stop_at
                net(x)
                dump.step()
    return root


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_a_pass_cut_short_inside_capture_is_marked_failed_and_never_matches(tmp_path):
    """Case 10: an exception inside ``with capture(...)`` wrote the pass without its ``failed``
    mark, and the diff answered "only in A" for the rest of it; two runs cut short at the same
    place answered "matches". Now the pass says it failed and the verdict is incomplete."""
    a = _run(tmp_path / "a", stop_at=None)
    b = _run(tmp_path / "b", stop_at=1)
    doc = json.loads((only_folder(b) / "pass00001.json").read_text())
    assert doc.get("failed", "").startswith("RuntimeError: out of pages")
    v = DumpSet.open(a).diff(b).verdict()
    assert v.outcome == "incomplete", v.text
    assert "cut short" in v.gap and "out of pages" in v.gap
    # both sides cut short at the same place: what ran agrees, but the pass did not end
    v2 = DumpSet.open(b).diff(_run(tmp_path / "b2", stop_at=1)).verdict()
    assert v2.outcome == "incomplete" and "cut short" in v2.gap, v2.text
    # a real divergence before the cut is still named
    v3 = DumpSet.open(a).diff(_run(tmp_path / "c", stop_at=1, wrong=True)).verdict()
    assert v3.outcome == "diverges" and v3.divergence.key == "model.0", v3.text


def _pair(root):
    """Two identical runs of ``_net`` (two passes each): ``(a, b)``."""
    return _run(root / "a", stop_at=None), _run(root / "b", stop_at=None)


def _exits(argv) -> int:
    """The CLI's exit status, argparse's refusals (SystemExit) included."""
    from tdinspect.cli import main

    try:
        return main([str(v) for v in argv])
    except SystemExit as exc:
        return int(exc.code)


def test_empty_paths_and_patterns_are_refused_with_exit_2(tmp_path, monkeypatch, capsys):
    """Case 11: ``first-divergence "" ""`` in a dump folder compared the working folder with
    itself (exit 0); ``--allow-uncompared ""`` allowed every name, so a B missing 2 of 3
    entries answered "matches" (exit 0). Both now exit 2, and the API refuses them too."""
    a, _ = _pair(tmp_path)
    monkeypatch.chdir(a)
    assert _exits(["first-divergence", "", ""]) == 2
    assert "empty" in capsys.readouterr().err
    with pytest.raises(tdinspect.DumpFormatError, match="empty path"):
        DumpSet.open("")
    short = tmp_path / "short"  # B holds only the first of A's three modules
    net = nn.Sequential(nn.Linear(4, 4))
    with torch.no_grad(), tdinspect.capture(net, short) as dump:
        net(torch.randn(2, 4))
        dump.step()
    ref = tmp_path / "ref"
    net3 = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4))
    with torch.no_grad(), tdinspect.capture(net3, ref) as dump:
        net3(torch.randn(2, 4))
        dump.step()
    assert _exits(["first-divergence", ref, short, "--structural", "report", "--allow-uncompared", ""]) == 2
    assert _exits(["first-divergence", ref, short, "--structural", "report"]) in (1, 3)
    with pytest.raises(ValueError, match="empty pattern"):
        DumpSet.open(ref).diff(short, allow_uncompared=[""])
    with pytest.raises(ValueError, match="empty pattern"):
        DumpSet.open(ref).diff(short).verdict(allow_uncompared="  ")


def test_zero_and_empty_values_are_never_read_as_the_default(tmp_path):
    """Case 9: ``--baseline-factor 0`` became 10 (``0 or FACTOR``); ``metric=""`` and
    ``passes_in_flight=0`` became their defaults the same way. Each is now refused."""
    a, b = _pair(tmp_path)
    assert _exits(["first-divergence", a, b, "--baseline", a, "--baseline-factor", "0"]) == 2
    assert _exits(["first-divergence", a, b, "--baseline", a, "--baseline-factor", "10"]) == 0
    ds = DumpSet.open(a)
    with pytest.raises(ValueError, match="unknown metric ''"):
        ds.diff(b, metric="")
    with pytest.raises(ValueError, match="unknown metric ''"):
        ds.diff(b).first_divergence(metric="")
    with pytest.raises(ValueError, match="passes_in_flight=0"):
        ds.diff(b, passes_in_flight=0)
    assert ds.diff(b, passes_in_flight=1).verdict().outcome == "matches"


def test_out_of_range_numbers_are_refused_exactly(tmp_path, capsys):
    """Case 14: ``--threshold -1`` was accepted (every entry diverged), ``--concat
    call:99999999999999999999`` exited 1 (a "divergence" per entry), ``--min-confidence nan``
    was accepted (no pair used); ``memory=`` and ``baseline_factor`` of 10**400 raised
    OverflowError and ``memory=np.int64(4096)`` was refused. Now: exit 2 or a clear error."""
    import numpy as np

    from tdinspect.compare.baseline import check_factor
    from tdinspect.config import parse_memory
    from tdinspect.errors import ConfigError

    a, b = _pair(tmp_path)
    assert _exits(["first-divergence", a, b, "--threshold", "-1"]) == 2
    assert "rel_diff takes thresholds from 0" in capsys.readouterr().err
    assert _exits(["first-divergence", a, b, "--metric", "cosine", "--threshold", "1.5"]) == 2
    assert _exits(["first-divergence", a, b, "--threshold", "model.0=-1"]) == 2
    assert _exits(["first-divergence", a, b, "--threshold", "0"]) == 0
    assert _exits(["first-divergence", a, b, "--concat", "call:99999999999999999999"]) == 2
    assert "no entry of either side has that many dims" in capsys.readouterr().err
    assert _exits(["first-divergence", a, b, "--concat", "call:1"]) == 0
    assert _exits(["suggest-mapping", a, b, "--min-confidence", "nan"]) == 2
    assert _exits(["suggest-mapping", a, b, "--tol", "-1"]) == 2
    assert _exits(["suggest-mapping", a, b]) == 0
    with pytest.raises(ValueError, match=r"baseline_factor: expected a number, got 1000000"):
        check_factor(10**400)
    with pytest.raises(ValueError, match="float can hold"):
        DumpSet.open(a).diff(b).verdict(threshold=10**400)
    with pytest.raises(ConfigError, match="more than"):
        parse_memory(10**400)
    with pytest.raises(ConfigError, match="more than"):
        parse_memory("9" * 400 + "GB")
    assert parse_memory(np.int64(4096)) == 4096
    net = _net()
    with tdinspect.capture(net, memory=np.int64(1 << 20)) as cap:
        net(torch.randn(2, 4))
        cap.step()
    assert len(cap.passes) == 1


def test_checksum_dim_on_expanded_and_sparse_outputs_says_why(tmp_path):
    """Case 14: ``checksum_dim=0`` on an expanded or sparse output warned "no entry has that
    dim (they have 2 dims at most) ... e.g. checksum_dim=0": it has, and 0 was given."""

    class Expanded(nn.Module):
        def forward(self, x):
            return x[:1].expand(4, 3)

    class Sparse(nn.Module):
        def forward(self, x):
            return x.to_sparse()

    for i, m in enumerate((Expanded(), Sparse())):
        with pytest.warns(RuntimeWarning) as seen:
            with tdinspect.capture(m, tmp_path / str(i), checksum=True, checksum_dim=0) as c:
                m(torch.randn(4, 3))
                c.step()
        text = " ".join(str(w.message) for w in seen if "checksum_dim" in str(w.message))
        assert "1 entry with that dim, none of them a plain tensor" in text, text
        assert "no entry" not in text


@pytest.mark.parametrize("moment", ["listing", "listed", "grouping"])
def test_a_run_removed_under_a_reader_is_a_dump_format_error_naming_it(tmp_path, monkeypatch, moment):
    """Case 12: a reader racing ``overwrite=True`` got a bare ``FileNotFoundError`` (43 times in a
    loop of opens). The removal is made to happen at each moment the race hit (while the rank
    folder is listed, after it was listed, while the runs are ordered), deterministically: the
    reader now gets a DumpFormatError naming what vanished."""
    import os
    import shutil

    from tdinspect.store import format as fmt
    from tdinspect.store import runs

    root = tmp_path / "dump"
    for _ in range(2):  # two runs: the second open orders them (by their first write)
        _run(root, stop_at=None)
    folders = sorted(p for p in root.iterdir() if p.is_dir())
    for f in folders:  # runs without manifests are ordered by their files' times
        (f / "run.json").unlink()
    victim = folders[-1]
    if moment == "listing":
        real = os.scandir

        def scandir(path="."):
            if not isinstance(path, int) and os.fspath(path) == os.fspath(victim) and victim.exists():
                shutil.rmtree(victim)
            return real(path)

        monkeypatch.setattr(fmt.os, "scandir", scandir)
    elif moment == "listed":
        real_scan = runs.scan_rank_folder

        def scan(path, rank, pid):
            folder = real_scan(path, rank, pid)
            if path == victim:
                shutil.rmtree(victim)
            return folder

        monkeypatch.setattr(runs, "scan_rank_folder", scan)
    else:
        real_first = runs._first_write

        def first_write(folder):
            if folder.path == victim and victim.exists():
                shutil.rmtree(victim)
            return real_first(folder)

        monkeypatch.setattr(runs, "_first_write", first_write)
    with pytest.raises(tdinspect.DumpFormatError, match=f"{victim.name}.*vanished while being read"):
        DumpSet.open(root)


class _CountingPasses(dict):
    """A DumpSet's passes, counting the walks over all of them (``iter``)."""

    walks = 0

    def __iter__(self):
        type(self).walks += 1
        return super().__iter__()


def test_a_diff_walks_each_sides_passes_a_bounded_number_of_times(tmp_path):
    """Case 8: a diff's time grew with the square of its passes (``DumpSet.ranks`` rebuilt from
    every pass for every pass job: 64,004 times for 8,000 passes, 33 s). Now the walks over all
    the passes are as many for 40 passes as for 10 (the time is measured by bench/passes.py)."""
    from tdinspect.dumper.recorder import Recorder

    walks = {}
    for n in (10, 40):
        sides = []
        for side in "ab":
            rec = Recorder(tmp_path / f"{side}{n}", level="module")
            for _ in range(n):
                rec.record("model.fc", torch.ones(2, 3), module_type="Linear")
                rec.step()
            rec.close()
            ds = DumpSet.open(tmp_path / f"{side}{n}")
            ds._passes = _CountingPasses(ds._passes)
            sides.append(ds)
        _CountingPasses.walks = 0
        assert sides[0].diff(sides[1]).verdict().outcome == "matches"
        walks[n] = _CountingPasses.walks
    assert walks[40] == walks[10], walks


_WRITER = """
import sys, torch, tdinspect
from torch import nn
net = nn.Sequential(nn.Linear(4, 4))
with torch.no_grad(), tdinspect.capture(net, sys.argv[1]) as dump:
    net(torch.ones(2, 4)); dump.step()
    print(dump.recorder.folder, flush=True)
    sys.stdin.readline()  # still open (and writing) until told
    net(torch.ones(2, 4)); dump.step()
"""


def test_overwrite_keeps_a_run_another_open_capture_writes_whatever_its_pid(tmp_path):
    """Case 4: ``overwrite=True`` deleted a run another process with the same PID was still
    writing (PID 1 in two containers, one host): passes gone. A capture now holds a lock on its
    run folder while open; ``overwrite=True`` refuses to remove a folder whose lock is held (a
    RunWarning naming it; its own capture goes on in a folder of its own), and replaces it once
    that capture closed. The other process's manifest is given this
    process's PID, as the second container sees it."""
    import os
    import subprocess
    import sys

    from tdinspect.errors import RunsNote, RunWarning

    from .conftest import ROOT

    root = tmp_path / "dump"
    child = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(root)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        theirs = Path(child.stdout.readline().strip())
        manifest = theirs / "run.json"
        doc = json.loads(manifest.read_text())
        manifest.write_text(json.dumps({**doc, "pid": os.getpid()}))  # the same PID, elsewhere
        net = nn.Sequential(nn.Linear(4, 4))
        with pytest.warns(
            RunWarning, match=f"kept 1 run folder.*being written by another open.*{theirs.name}"
        ):
            with torch.no_grad(), tdinspect.capture(net, root, overwrite=True) as dump:
                net(torch.ones(2, 4))
                dump.step()
        assert (theirs / "pass00000.pt").exists() and (theirs / "run.json").exists()
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.wait(timeout=120) == 0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert DumpSet.open(theirs).passes == [0, 1]  # its second pass was written
    with pytest.warns(RunsNote, match=f"removed 2 earlier run.*{theirs.name}"):
        with torch.no_grad(), tdinspect.capture(net, root, overwrite=True) as dump:  # closed: replaced
            net(torch.ones(2, 4))
            dump.step()
    assert not theirs.exists()


def test_an_op_sidecar_whose_reference_points_at_itself_is_an_error_naming_it(tmp_path):
    """Case 13: an op sidecar whose ``ref`` points at its own entry was ignored with a warning
    (edited after it was sealed), and the entries it alone held then read "only in A" — a
    wrong answer, not an error. Now a DumpFormatError naming the file, sealed or not."""
    from .conftest import rewrite_sidecar

    x = torch.arange(4.0)
    for name in ("a", "b"):
        with tdinspect.capture_ops(tmp_path / name, inputs=True) as dump:
            (x * 2) + 1
            dump.step()
    sidecar = only_folder(tmp_path / "b") / "pass00000.json"
    doc = json.loads(sidecar.read_text())
    key = "model/aten.add.Tensor[in0]"
    i = doc["entries"]["key"].index(key)
    assert doc["entries"]["stored"][i] is False  # held by the sidecar alone: a reference
    doc["entries"]["ref"][i] = {"kind": "same", "of": key}
    for bind in (False, True):  # as an editor leaves it, and re-sealed as a forger would
        rewrite_sidecar(sidecar, doc, bind=bind)
        with pytest.raises(
            tdinspect.DumpFormatError, match=r"pass00000\.json.*(held by it alone|refers to itself)"
        ):
            DumpSet.open(tmp_path / "a").diff(tmp_path / "b").verdict()


def test_a_transform_nested_hundreds_deep_is_a_transform_error_not_a_recursion_error(tmp_path):
    """Case 13: a 400-deep transform (``-(-(...1))`` as an argument, within the 500-character
    limit) ended in ``RecursionError``; a mapping file holding it broke the CLI the same way.
    Now its depth is measured without recursion and refused, quoting the spec."""
    from tdinspect.align.mapping import Mapping
    from tdinspect.align.transforms import parse_transform
    from tdinspect.errors import MappingError, TransformError

    deep = "chunk(2, " + "-" * 400 + "1)[0]"
    with pytest.raises(TransformError, match=r"nested \d+ deep \(at most 64\)"):
        parse_transform(deep)
    with pytest.raises(TransformError, match="nested"):
        parse_transform("-" * 450 + "1")
    long_chain = "chunk(2, -1)[0]" + ".chunk(2, -1)[0]" * 15  # the longest chain allowed still parses
    assert len(parse_transform(long_chain).steps) == 16
    with pytest.raises((MappingError, TransformError), match="nested"):
        Mapping({r"model\.fc": ["model.fc", deep]})


def test_the_dashboard_page_loads_nothing_from_the_network(dashboard):  # noqa: F811  (the fixture)
    """Case 14: the dashboard page loaded Font Awesome's stylesheets from a CDN (and
    nbconvert's page imports mermaid.js from cdnjs): an offline page waited on them, and told
    the CDN who looked at local dumps. The page tdinspect serves is Voilà's lab page without
    them."""
    import re

    port, token = dashboard
    status, body = _get(f"http://127.0.0.1:{port}/?token={token}")
    assert status == 200 and "kernelId" in body, status
    external = re.findall(r"""(?:href|src)=["'](https?://[^"']+)""", body) + re.findall(
        r"""import[^;]*["'](https?://[^"']+)""", body
    )
    assert not external, external


_FORGED_ONES = """
import json, resource, sys
import torch, tdinspect
from tdinspect.errors import ReplayRefused
from tests.conftest import only_folder, rewrite_sidecar
from pathlib import Path
root = Path(sys.argv[1])
with tdinspect.capture_ops(root, inputs=True) as dump:
    torch.ones([2, 2]) + 1
    dump.step()
sidecar = only_folder(root) / "pass00000.json"
doc = json.loads(sidecar.read_text())
i = doc["entries"]["key"].index("model/aten.ones.default[out0]")
doc["entries"]["call_args"][i]["leaves"][0:2] = [2**16, 2**17]  # 2**33 float32: 32 GiB
rewrite_sidecar(sidecar, doc)
resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))  # never more than 4 GiB here
try:
    tdinspect.replay(root, "model/aten.ones.default")
except ReplayRefused as exc:
    print("refused:", exc)
except Exception as exc:
    print("failed:", type(exc).__name__, str(exc)[:200])
"""


def test_a_replayed_factory_with_a_forged_size_is_refused_before_allocating(tmp_path):
    """Case 13: replay of a forged ``aten.ones([2**33])`` allocated 34 GB: the run on meta
    tensors that bounds a replay kept the factory's ``device="cpu"``, so it tried to make the
    tensor for real, failed, and the real run went on. Now the factory runs on meta too and
    the replay is refused from the size alone (in a subprocess held to 4 GiB)."""
    import subprocess
    import sys

    from .conftest import ROOT

    done = subprocess.run(
        [sys.executable, "-c", _FORGED_ONES, str(tmp_path / "ones")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert "refused:" in done.stdout and "would make 34359738368 bytes" in done.stdout, (
        done.stdout + done.stderr
    )


def test_a_mapping_template_that_amplifies_is_refused_before_it_expands(tmp_path):
    """Case 13: a 1.5 MB mapping template of group references (``\\1`` x 750,000) peaked at
    1.6 GB expanding one A name. A template is one entry's name: at most 4,096 characters, and
    what it would expand to is measured from its references and the match before it is built."""
    import tracemalloc

    from tdinspect.align.mapping import Mapping
    from tdinspect.errors import MappingError

    path = tmp_path / "map.json"
    path.write_text(json.dumps({r"model\.(\w+)": "x" + "\\1" * 750_000}))
    with pytest.raises(MappingError, match=r"a B template of 1500001 characters \(at most 4096"):
        Mapping.from_file(path)
    mapping = Mapping({r"model\.(\w+)": "x" + "\\1" * 2000})  # 4,001 characters: allowed
    assert mapping.partner("model.fc")[0] == "x" + "fc" * 2000
    tracemalloc.start()
    try:
        with pytest.raises(
            MappingError, match=r"2000 group references\) would name a B entry of up to 6000001"
        ):
            mapping.partner("model." + "a" * 3000)
        assert tracemalloc.get_traced_memory()[1] < 2 << 20  # nothing near the 6 MB name was built
    finally:
        tracemalloc.stop()
    assert Mapping({r"(model)\.(\w+)": r"\g<2>.\g<1>"}).partner("model.fc")[0] == "fc.model"
