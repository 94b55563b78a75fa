"""Capture to memory (issue 28): ``capture(model, memory=True)`` gives a DumpSet that equals
what the same capture to a folder opens as; a limit with a clear error; ``save`` writes a
normal dump and never writes over, or removes, what it did not make."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
import torch
import xarray as xr

import tdinspect
from tdinspect import DumpSet
from tdinspect.errors import CaptureCheckError, CaptureMemoryError, ConfigError, DumpFormatError
from tdinspect.examples.port import make_hf_llama, port_tokens


@pytest.fixture(scope="module")
def llama():
    return make_hf_llama().eval(), port_tokens()


def _files(folder) -> list[str]:
    return sorted(os.listdir(folder))


def _same(mem: DumpSet, disk: DumpSet) -> None:
    """Two DumpSets hold the same entries, statistics and tensors."""
    assert (mem.ops, mem.passes, mem.ranks, mem.level) == (disk.ops, disk.passes, disk.ranks, disk.level)
    xr.testing.assert_equal(mem.to_xarray(), disk.to_xarray())
    for (key, pi_m), pi_d in zip(mem.pass_map.items(), disk.pass_map.values()):
        assert pi_m.keys == pi_d.keys and pi_m.dtype == pi_d.dtype and pi_m.shape == pi_d.shape
        if not pi_m.stats_only:
            for k in pi_m.keys:
                assert torch.equal(pi_m.tensor(k), pi_d.tensor(k)), (key, k)


def test_memory_capture_is_a_dumpset_and_saves_as_a_normal_dump(llama, tmp_path, monkeypatch):
    model, x = llama
    monkeypatch.chdir(tmp_path)
    with tdinspect.capture(model, memory=True) as cap:
        for _ in range(2):
            model(x)
            assert cap.step() is None  # no file
    assert os.listdir(tmp_path) == []  # capture to disk stays off unless a folder is given
    ds = cap.dumpset
    assert isinstance(ds, DumpSet) and ds.passes == [0, 1] and "model.lm_head" in ds.ops
    assert cap.dumpset is ds  # built once while no pass is added
    assert cap.nbytes == ds.nbytes > 0
    # the same capture to a folder: the same cube, the same tensors, bit for bit
    with tdinspect.capture(model, tmp_path / "disk") as dump:
        for _ in range(2):
            model(x)
            dump.step()
    disk = DumpSet.open(tmp_path / "disk")
    _same(ds, disk)
    assert ds.diff(disk).verdict().outcome == "matches"
    # saved: the files a capture to a folder writes, and it opens equal to the one in memory
    folder = cap.save(tmp_path / "saved")
    (disk_folder,) = (tmp_path / "disk").iterdir()
    assert folder.parent == tmp_path / "saved" and _files(folder) == _files(disk_folder)
    assert _files(folder) == ["pass00000.json", "pass00000.pt", "pass00001.json", "pass00001.pt", "run.json"]
    _same(ds, DumpSet.open(tmp_path / "saved"))
    assert tdinspect.load_pass(folder / "pass00001.pt").keys() == disk.get_pass(1).load().keys()
    # explore and the tree of a diff take it like any other
    explorer = tdinspect.explore(ds)
    assert explorer is not None
    assert "memory" in repr(cap) and "<memory>" in repr(ds)


def test_memory_limit_names_the_limit_and_the_entry_and_keeps_whole_passes(llama):
    model, x = llama
    with tdinspect.capture(model, memory=True) as probe:
        model(x)
        probe.step()
    one_pass = probe.nbytes
    cap = tdinspect.capture(model, memory=int(one_pass * 1.5))
    model(x)
    cap.step()
    with pytest.raises(CaptureMemoryError) as err:
        model(x)
    assert isinstance(err.value, CaptureCheckError)
    message = str(err.value)
    assert f"past memory={one_pass * 1.5 / 1024:.1f} KB" in message, message
    assert "of pass 1" in message and "passes 0..0 are kept" in message and "pass 1 was dropped" in message
    assert "'model.model." in message or "'model.lm_head'" in message  # the entry that crossed it
    # the capture stopped: hooks removed, the partial pass gone, pass 0 whole
    model(x)
    cap.step()
    cap.close()
    assert [p["pass"] for p in cap.passes] == [0] and cap.dumpset.passes == [0]
    assert len(cap.dumpset.ops) == len(probe.dumpset.ops)
    with pytest.raises(ConfigError, match="memory='lots'"):
        tdinspect.capture(model, memory="lots")
    assert (
        tdinspect.config.parse_memory("2GB") == 2 << 30
        and tdinspect.config.parse_memory("512 MiB") == 512 << 20
    )


def test_memory_and_a_folder_are_never_both_taken(llama, tmp_path):
    model, _ = llama
    with pytest.raises(ConfigError, match="memory=True and a dump folder"):
        tdinspect.capture(model, tmp_path / "a", memory=True)
    with pytest.raises(ConfigError, match="TDINSPECT_DUMP_DIR"):
        tdinspect.capture(model, memory=True, environ={"TDINSPECT_DUMP_DIR": str(tmp_path / "b")})
    with pytest.raises(ConfigError, match="compare_to"):
        tdinspect.capture_ops(memory=True, compare_to=tmp_path)
    assert not tdinspect.capture(model).enabled and not (tmp_path / "a").exists()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with tdinspect.capture(model, tmp_path / "c") as on_disk:
            with pytest.raises(ConfigError, match="memory=True"):
                on_disk.save(tmp_path / "d")  # a capture to a folder keeps nothing to save


def test_stats_only_ops_and_params_in_memory(llama, tmp_path):
    model, x = llama
    with tdinspect.capture(model, memory=True, stats_only=True, checksum=True) as cap:
        model(x)
        cap.step()
    ds = cap.dumpset
    assert ds.stats_only and cap.nbytes == 0
    with pytest.raises(DumpFormatError, match="statistics-only"):
        ds.tensor("model.lm_head")
    cap.save(tmp_path / "stats")
    _same(ds, DumpSet.open(tmp_path / "stats"))
    # parameters unchanged since pass 0 refer to it, in memory as on disk
    with tdinspect.capture(model, memory=True, record=("params", "outputs"), filter="lm_head") as cap:
        for _ in range(2):
            model(x)
            cap.step()
    assert torch.equal(cap.dumpset.tensor("model.lm_head.weight", pass_=1), model.lm_head.weight)
    cap.save(tmp_path / "params")
    _same(cap.dumpset, DumpSet.open(tmp_path / "params"))
    # op level, with inputs: the same as capture_ops into a folder
    with tdinspect.capture_ops(model=model, inputs=True, memory=True) as ops:
        model(x)
        ops.step()
    with tdinspect.capture_ops(tmp_path / "ops", model=model, inputs=True) as dump:
        model(x)
        dump.step()
    _same(ops.dumpset, DumpSet.open(tmp_path / "ops"))
    assert "memory" in repr(ops)


def test_ranks_in_memory_and_saved_as_one_run(llama, tmp_path):
    model, x = llama
    caps = []
    for rank in range(2):
        with tdinspect.capture(model, memory=True, parallel={"tp": (rank, 2)}, filter="lm_head") as cap:
            model(x)
            cap.step()
        caps.append(cap)
    both = DumpSet.from_memory(caps[0].passes + caps[1].passes)
    assert both.ranks == [0, 1] and both.get_pass(0, 1).parallel == {"tp": [1, 2]}
    caps[0].save(tmp_path / "tp")
    with pytest.raises(ConfigError, match="not empty"):
        caps[1].save(tmp_path / "tp")
    caps[1].save(tmp_path / "tp", if_exists="add")
    opened = DumpSet.open(tmp_path / "tp")
    assert opened.ranks == [0, 1] and len(DumpSet.runs(tmp_path / "tp")) == 1
    _same(both, opened)
    with pytest.raises(DumpFormatError, match="two passes of rank 0"):
        DumpSet.from_memory(caps[0].passes * 2)


def test_save_never_writes_over_or_removes_what_it_did_not_make(llama, tmp_path):
    model, x = llama
    with tdinspect.capture(model, memory=True, filter="lm_head") as cap:
        model(x)
        cap.step()
    target = tmp_path / "mine"
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="notes.txt") as err:
        cap.save(target)
    assert "nothing written" in str(err.value) and _files(target) == ["notes.txt"]
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="not a folder"):
        cap.save(tmp_path / "file", if_exists="overwrite")
    first = cap.save(target, if_exists="add")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        second = cap.save(target, if_exists="overwrite")
    assert not first.exists() and second.exists() and (target / "notes.txt").read_text() == "mine"
    with pytest.raises(ConfigError, match="if_exists='always'"):
        cap.save(target, if_exists="always")


def test_a_memory_capture_loads_no_analysis_library_until_its_dumpset(tmp_path):
    code = (
        "import sys, torch, tdinspect\n"
        "m = torch.nn.Sequential(torch.nn.Linear(4, 4))\n"
        "with tdinspect.capture(m, memory=True) as cap:\n"
        "    m(torch.ones(2, 4)); cap.step()\n"
        "heavy = ('tdinspect.dumpset', 'xarray', 'pandas', 'numba', 'dask', 'matplotlib', 'IPython')\n"
        "print([h for h in heavy if h in sys.modules])\n"
        "print(cap.dumpset.ops, 'tdinspect.dumpset' in sys.modules)\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root)
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["[]", "['model.0'] True"]
