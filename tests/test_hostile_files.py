"""Hostile dump folders and files changing under the reader: a FIFO, a device or a folder
where a file should be, a manifest with impossible values, a pickle claiming more elements
than int64 counts, a pass file rewritten after it was opened. Each gives a clear error naming
the file (or, for a manifest, is ignored); none hangs, fills memory or kills the process."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import textwrap
import threading
import warnings
import zipfile
from pathlib import Path

import pytest
import torch

from tdinspect import DumpFormatError, DumpSet, list_runs
from tdinspect.cli import main
from tdinspect.examples.samples import capture_model_run

from .conftest import ROOT, only_folder


def _within(seconds: float, fn):
    """``fn()``'s result or exception, failing the test if it has not returned in time (a
    reader blocked on a FIFO never returns: it is left behind in a daemon thread)."""
    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still blocked after {seconds} s"
    if "error" in out:
        raise out["error"]
    return out["value"]


def _two_passes(root: Path) -> Path:
    folder = root / "rank0_pid1"
    folder.mkdir(parents=True)
    torch.save({"a": torch.arange(3.0)}, folder / "pass00000.pt")
    torch.save({"a": torch.arange(3.0) + 1}, folder / "pass00001.pt")
    return folder


def _make(kind: str, path: Path) -> None:
    path.unlink(missing_ok=True)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "folder":
        path.mkdir()
    elif kind == "device":
        os.symlink("/dev/zero", path)  # read to its end, it never ends
    elif kind == "dangling link":
        os.symlink(path.parent / "nowhere", path)
    elif kind == "link loop":
        os.symlink(path, path)


KINDS = ["fifo", "folder", "device", "dangling link", "link loop"]


@pytest.mark.parametrize("which", ["pass00001.pt", "pass00001.json"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_dump_file_that_is_not_a_regular_file_is_refused_naming_it(tmp_path, capsys, kind, which):
    folder = _two_passes(tmp_path)
    _make(kind, folder / which)
    with pytest.raises(DumpFormatError, match=which.replace(".", r"\.")):
        _within(30, lambda: DumpSet.open(tmp_path))
    with pytest.warns(RuntimeWarning, match="skipping unreadable pass"):
        ds = _within(30, lambda: DumpSet.open(tmp_path, on_error="warn"))
    assert ds.passes == [0] and torch.equal(ds.tensor("a"), torch.arange(3.0))
    capsys.readouterr()
    assert _within(30, lambda: main(["ls", str(tmp_path)])) == 2  # the CLI: its error,
    assert which in capsys.readouterr().err  # naming the file


@pytest.mark.parametrize("kind", ["fifo", "folder", "device", "dangling link"])
def test_a_manifest_that_is_not_a_regular_file_is_ignored(tmp_path, kind):
    folder = _two_passes(tmp_path)
    _make(kind, folder / "run.json")
    ds = _within(30, lambda: DumpSet.open(tmp_path))
    assert ds.passes == [0, 1]
    assert "rank0_pid1 (started" in _within(30, lambda: list_runs(tmp_path))[0].describe()


@pytest.mark.parametrize(
    "started", ["NaN", "Infinity", "1e300", "-1e300", "9" * 5000, "[" * 100_000 + "]" * 100_000]
)
def test_a_manifest_with_an_impossible_start_time_is_ignored(tmp_path, started):
    folder = _two_passes(tmp_path)
    (folder / "run.json").write_text(
        f'{{"format": "tdinspect.run", "version": 1, "run_id": "x", "started": {started}}}'
    )
    (run,) = list_runs(tmp_path)
    assert run.id == "legacy-rank0_pid1" and "rank0_pid1 (started" in run.describe()
    assert DumpSet.open(tmp_path).passes == [0, 1]


def _long1(value: int) -> bytes:
    data = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(data)]) + data


def _with_pickle(path: Path, tensors: dict, edit) -> None:
    """``torch.save(tensors)`` at ``path`` with its pickle passed through ``edit`` (bytes to
    bytes), written back by torch's own archive writer."""
    buf = io.BytesIO()
    torch.save(tensors, buf)
    archive = zipfile.ZipFile(buf)
    records = {i.filename.split("/", 1)[1]: archive.read(i) for i in archive.infolist()}
    records["data.pkl"] = edit(records["data.pkl"])
    writer = torch._C.PyTorchFileWriter(str(path))
    for name, data in records.items():
        if name not in (".data/serialization_id", ".data/version"):  # the writer adds its own
            writer.write_record(name, data, len(data))
    writer.write_end_of_file()


@pytest.mark.parametrize(
    "size",
    [
        _long1(2**62) + b"K\x04\x86",  # 2^64 elements: numel overflows int64
        _long1(2**70) + b"K\x04\x86",  # a size that is not an int64
        _long1(2**40) + _long1(2**40) + b"\x86",
    ],
)
def test_a_pickle_claiming_more_elements_than_int64_counts_is_a_dump_format_error(tmp_path, size):
    folder = tmp_path / "rank0_pid1"
    folder.mkdir()
    expanded = {"a": torch.arange(4.0).expand(3, 4)}  # sizes (3, 4), strides (0, 1)
    _with_pickle(folder / "pass00000.pt", expanded, lambda p: p.replace(b"K\x03K\x04\x86", size, 1))
    _with_pickle(folder / "pass00001.pt", expanded, lambda p: p)  # the same, untouched
    with pytest.raises(DumpFormatError, match=r"pass00000\.pt"):
        DumpSet.open(tmp_path)
    with pytest.warns(RuntimeWarning, match="skipping unreadable pass"):
        ds = DumpSet.open(tmp_path, on_error="warn")
    assert ds.passes == [1] and torch.equal(ds.tensor("a", pass_=1), expanded["a"])


_CHANGE_AFTER_OPEN = textwrap.dedent("""
    import os, sys, warnings, torch
    from tdinspect import DumpFormatError, DumpSet
    root, ref, how = sys.argv[1], sys.argv[2], sys.argv[3]
    victim = os.path.join(root, "rank0_pid1", "pass00001.pt")
    ds = DumpSet.open(root)
    if how == "truncate":
        os.truncate(victim, os.path.getsize(victim) // 4)
    else:  # torch.save over it in place, as another tool's rerun would
        torch.save({"b": torch.ones(2)}, victim)
    warnings.simplefilter("ignore")
    try:
        ds.diff(ref).first_divergence()  # reads the victim's tensors
    except DumpFormatError as exc:
        print("DumpFormatError:", exc)
""")


@pytest.mark.parametrize("how", ["truncate", "rewrite"])
def test_a_pass_file_rewritten_in_place_after_open_is_an_error_not_a_crash(tmp_path, how):
    """Reading tensors kept from the open, which map the file as it was, was a SIGBUS that
    killed the process (a notebook's kernel); now the file is read again and named."""
    for run in ("run", "ref"):
        folder = tmp_path / run / "rank0_pid1"
        folder.mkdir(parents=True)
        for i in range(2):
            torch.manual_seed(i)
            torch.save({f"m{j}": torch.randn(256, 64) for j in range(4)}, folder / f"pass{i:05d}.pt")
    done = subprocess.run(
        [sys.executable, "-c", _CHANGE_AFTER_OPEN, str(tmp_path / "run"), str(tmp_path / "ref"), how],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "DumpFormatError:" in done.stdout and "pass00001.pt" in done.stdout


def test_a_pass_file_replaced_after_open_is_not_read_as_the_old_one(tmp_path):
    folder = _two_passes(tmp_path)
    ds = DumpSet.open(tmp_path)
    fresh = folder / "fresh.pt"
    torch.save({"b": torch.ones(2)}, fresh)
    os.replace(fresh, folder / "pass00001.pt")  # atomically, another inode
    with pytest.raises(
        DumpFormatError,
        match=r"pass00001\.pt: file when opened and pass file "
        r"disagree.*rewritten since it was opened",
    ):
        ds.tensor("a", pass_=1)


def test_a_sidecar_dump_rewritten_after_open_is_an_error_naming_the_file(tmp_path):
    run = capture_model_run(tmp_path / "run", steps=2)
    victim = only_folder(run) / "pass00001.pt"
    ds = DumpSet.open(run)
    os.truncate(victim, victim.stat().st_size // 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(DumpFormatError, match=r"pass00001\.pt"):
            ds.diff(run).first_divergence()


def _deflated(path: Path, tensors: dict, padding: int) -> None:
    """``torch.save(tensors)`` re-zipped with ``data.pkl`` deflated and ``padding`` zero bytes
    after its STOP (unpickling ignores them; decompressing does not)."""
    buf = io.BytesIO()
    torch.save(tensors, buf)
    archive = zipfile.ZipFile(buf)
    with zipfile.ZipFile(path, "w") as out:
        for info in archive.infolist():
            data = archive.read(info)
            if info.filename.endswith("/data.pkl"):
                out.writestr(info.filename, data + bytes(padding), zipfile.ZIP_DEFLATED)
            else:
                out.writestr(info.filename, data)


def test_a_zip_bomb_is_refused_before_it_is_decompressed(tmp_path):
    folder = tmp_path / "rank0_pid1"
    folder.mkdir()
    _deflated(folder / "pass00000.pt", {"a": torch.ones(3)}, 0)  # compressed, honestly
    _deflated(folder / "pass00001.pt", {"a": torch.ones(3)}, 200 << 20)  # 200 MB in 200 KB
    assert (folder / "pass00001.pt").stat().st_size < 1 << 20
    with pytest.raises(
        DumpFormatError,
        match=r"pass00001\.pt: compressed records would expand "
        r"to 209715\d+ bytes from a \d+-byte file",
    ):
        DumpSet.open(tmp_path)
    with pytest.warns(RuntimeWarning, match="skipping unreadable pass"):
        ds = DumpSet.open(tmp_path, on_error="warn")
    assert ds.passes == [0] and torch.equal(ds.tensor("a"), torch.ones(3))


def test_a_bound_sidecar_shape_beyond_int64_is_a_dump_format_error(tmp_path, capsys):
    from .conftest import rewrite_sidecar

    run = capture_model_run(tmp_path / "run", steps=1)
    sidecar = only_folder(run) / "pass00000.json"
    doc = json.loads(sidecar.read_text())
    for shape in ([2**63], [2**40, 2**40], [10**30, 10**30], [10**30, 0]):
        doc["entries"]["shape"][0] = shape
        rewrite_sidecar(sidecar, doc)  # bound again, as a careful forger would
        with pytest.raises(DumpFormatError, match=r"pass00000\.json: sidecar column 'shape'"):
            DumpSet.open(run)
        assert main(["ls", str(run)]) == 2  # was numpy's OverflowError, naming nothing
        assert "pass00000.json: sidecar column 'shape'" in capsys.readouterr().err
    doc["entries"]["shape"][0] = [10**6, 10**6, 10**6]  # 10^18 elements: torch can expand so
    rewrite_sidecar(sidecar, doc)
    assert DumpSet.open(run).passes == [0]


HOSTILE_KEYS = {
    "model.title\x1b]0;pwned\x07": torch.ones(3),  # sets the terminal's title
    "model.clear\x1b[2J": torch.ones(2),  # clears the screen
    "model.x\nno divergence": torch.zeros(2),  # forges a line of output
    "model.\u202eevil": torch.ones(1),  # shows the rest of the line reversed
    "model.\udcff": torch.ones(1),  # an undecodable byte of a name
}


def _hostile_runs(root: Path) -> tuple[str, str]:
    for run, scale in (("a", 1.0), ("b", 2.0)):
        (root / run / "rank0_pid1").mkdir(parents=True)
        torch.save(
            {k: t * scale for k, t in HOSTILE_KEYS.items()}, root / run / "rank0_pid1" / "pass00000.pt"
        )
    return str(root / "a"), str(root / "b")


def test_names_from_a_dump_reach_the_terminal_escaped(tmp_path, capsys):
    a, b = _hostile_runs(tmp_path)
    for argv in (
        ["ls", a],
        ["stats", a],
        ["diff", a, b],
        ["first-divergence", a, b],
        ["ls", str(tmp_path / "a" / "rank0_pid1" / "pass00000.pt\x1b[2J")],
    ):
        main(argv)
        shown = capsys.readouterr()
        for text in (shown.out, shown.err):
            assert not any(c in text for c in "\x1b\x07\u202e\udcff"), (argv, text)
            assert not any(line.startswith("no divergence") for line in text.splitlines()), argv
        assert "\\x1b" in shown.out + shown.err, argv
    shown = repr(DumpSet.open(a).diff(b).first_divergence())  # as a REPL prints it
    assert "\\x1b" in shown and "\x1b" not in shown
    main(["ls", a])
    out = capsys.readouterr().out
    assert "model.title\\x1b]0;pwned\\x07" in out and "model.x\\nno divergence" in out
    assert "model.\\u202eevil" in out and "model.\\udcff" in out


def test_explorers_and_plots_draw_undecodable_and_control_names(tmp_path):
    """matplotlib cannot draw a lone surrogate (a name's undecodable byte): building the
    diff explorer raised TypeError from FT2Font.set_text."""
    import tdinspect

    a, b = _hostile_runs(tmp_path)
    diff = DumpSet.open(a).diff(b)

    def drawn(fig):
        fig.savefig(io.BytesIO(), format="png")

    ex = tdinspect.explore(diff, threshold=1e-6)
    drawn(ex.fig)
    for key in HOSTILE_KEYS:
        ex.show_entry(key)
        drawn(ex.view_fig)
    for plot in ("divergence", "rank_pass"):
        drawn(getattr(tdinspect.plot, plot)(diff, threshold=1e-6))
    drawn(tdinspect.plot.heatmap(diff))
    drawn(tdinspect.explore(DumpSet.open(a)).fig)


_TRUNCATE_IN_USE = textwrap.dedent("""
    import os, sys, torch
    from tdinspect import DumpSet
    root = sys.argv[1]
    ds = DumpSet.open(root)
    pi = ds.pass_indexes()[0]
    tensors = {k: ds.tensor(k) for k in ds.ops}  # in use, as a notebook holds them
    truth = {k: t.clone() for k, t in tensors.items()}
    os.truncate(pi.files.tensors, 100)  # another program rewrites the file in place
    assert all(torch.equal(tensors[k], truth[k]) for k in truth)
    print("intact")
""")


@pytest.mark.parametrize("sidecars", [True, False])
def test_with_tdinspect_mmap_0_a_file_truncated_while_in_use_does_not_reach_its_tensors(tmp_path, sidecars):
    """Mapped (the default), these tensors read after the truncation are a SIGBUS or show the
    new bytes (the same script fails); read into memory (TDINSPECT_MMAP=0), they are intact."""
    if sidecars:
        root = capture_model_run(tmp_path / "run", steps=1)
    else:
        root = tmp_path / "run"
        (root / "rank0_pid1").mkdir(parents=True)
        torch.save({f"m{j}": torch.randn(64, 64) for j in range(4)}, root / "rank0_pid1" / "pass00000.pt")
    done = subprocess.run(
        [sys.executable, "-c", _TRUNCATE_IN_USE, str(root)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "TDINSPECT_MMAP": "0"},
    )
    assert done.returncode == 0 and "intact" in done.stdout, done.stderr[-2000:]


def test_with_tdinspect_mmap_0_dumps_read_the_same(tmp_path, monkeypatch):
    run = capture_model_run(tmp_path / "run", steps=2)
    plain = tmp_path / "plain"
    (plain / "rank0_pid1").mkdir(parents=True)
    torch.save(
        {"a": torch.arange(6.0).reshape(2, 3).t(), "b": torch.ones(2, dtype=torch.bfloat16)},
        plain / "rank0_pid1" / "pass00000.pt",
    )
    mapped = {r: DumpSet.open(r) for r in (run, plain)}
    monkeypatch.setenv("TDINSPECT_MMAP", "0")
    for root, ds in mapped.items():
        read = DumpSet.open(root)
        for op in ds.ops:
            a, b = ds.tensor(op), read.tensor(op)
            assert torch.equal(a, b) and a.stride() == b.stride() and a.dtype == b.dtype, op
            b.add_(1)  # its own memory: writable, and the file is untouched
        assert DumpSet.open(root).diff(ds).first_divergence() is None


def test_names_cannot_write_rules_into_a_suggested_mapping_file(tmp_path):
    """The mapping file lists unmatched entries as comments: a name holding a newline ended
    its comment, and the next line of the name became a rule of the file."""
    import yaml

    from tdinspect.suggest import suggest_mapping

    t = torch.randn(4, 4)
    injected = "model.zzz\nmodel\\.layers\\.0\\.mlp: model.other"
    for run, tensors in (
        ("a", {"model.layers.0.mlp": t, "model.layers.1.mlp": t + 1, injected: torch.ones(3)}),
        ("b", {"model.blocks.0.mlp": t, "model.blocks.1.mlp": t + 1, "model.other": t * 0}),
    ):
        (tmp_path / run / "rank0_pid1").mkdir(parents=True)
        torch.save(tensors, tmp_path / run / "rank0_pid1" / "pass00000.pt")
    suggested = suggest_mapping(tmp_path / "a", tmp_path / "b")
    assert suggested.rules  # a block mapping, which an injected line would extend
    path = suggested.save(tmp_path / "mapping.yaml")
    assert yaml.safe_load(path.read_text()) == suggested.rules
    assert "# only in A: model.zzz\\nmodel" in path.read_text()


_SAVE_TOO_BIG = textwrap.dedent("""
    import resource, signal, sys, torch
    from tdinspect.suggest import suggest_mapping
    a, b, out = sys.argv[1:4]
    suggested = suggest_mapping(a, b)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit: EFBIG, not a kill
    resource.setrlimit(resource.RLIMIT_FSIZE, (64, 64))  # a full disk, for this process
    try:
        suggested.save(out)
    except OSError as exc:
        print("refused:", exc.errno)
""")


def test_a_failed_save_of_a_suggested_mapping_keeps_the_earlier_file(tmp_path):
    t = torch.randn(4, 4)
    for run, prefix in (("a", "layers"), ("b", "blocks")):
        (tmp_path / run / "rank0_pid1").mkdir(parents=True)
        torch.save(
            {f"model.{prefix}.{i}.mlp": t + i for i in range(3)},
            tmp_path / run / "rank0_pid1" / "pass00000.pt",
        )
    out = tmp_path / "mapping.yaml"
    out.write_text("# my hand-written mapping\nmodel\\.a: model.b\n")
    done = subprocess.run(
        [sys.executable, "-c", _SAVE_TOO_BIG, str(tmp_path / "a"), str(tmp_path / "b"), str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert "refused: 27" in done.stdout, done.stderr[-2000:]  # EFBIG
    assert out.read_text() == "# my hand-written mapping\nmodel\\.a: model.b\n"
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


@pytest.mark.parametrize("dtype", [torch.uint16, torch.uint32, torch.uint64])
def test_wide_unsigned_integers_capture_open_and_diff(tmp_path, dtype):
    """torch has no min, max or abs for uint16/32/64 on CPU: their statistics raised
    NotImplementedError, in capture (inside the model's forward) and in DumpSet.to_xarray."""
    import tdinspect

    class Cast(torch.nn.Module):
        def forward(self, x):
            return (x * 10).to(torch.int64).to(dtype)

    model = torch.nn.Sequential(Cast())
    for run, x in (("a", torch.arange(4.0)), ("b", torch.arange(4.0) + (torch.arange(4) == 3))):
        with tdinspect.capture(model, tmp_path / run) as dump:
            model(x)
            dump.step()
    a = DumpSet.open(tmp_path / "a")
    cube = a.to_xarray(progress=False)
    assert float(cube["max"].max()) == 30 and float(cube["min"].min()) == 0
    assert a.tensor("model.0").dtype == dtype
    div = a.diff(tmp_path / "b").first_divergence()
    assert div is not None and div.key == "model.0"
    big = tmp_path / "big" / "rank0_pid1"  # beyond int64, for uint64: statistics in float64
    big.mkdir(parents=True)
    torch.save({"u": torch.tensor([0, 2**62, 5]).to(dtype)}, big / "pass00000.pt")
    assert float(DumpSet.open(big).to_xarray(progress=False)["absmax"].max()) == float(
        torch.tensor([0, 2**62, 5]).to(dtype).double().max()
    )


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex128, torch.float32, torch.bfloat16])
def test_records_at_any_byte_offset_read_as_torch_load_reads_them(tmp_path, dtype):
    """torch.save aligns each record to 64 bytes; another zip writer need not, and the record
    reader then views tensors at any address (x86 loads them unaligned: no crash, the same
    values and the same diff as torch.load's copy)."""
    from tdinspect.store.rawpass import read_plain

    torch.manual_seed(0)
    t = torch.randn(300, 67).to(dtype)
    tensors = {"model.a": t, "model.b": t[3:, 1:]}
    buf = io.BytesIO()
    torch.save(tensors, buf)
    archive = zipfile.ZipFile(buf)
    for pad in (1, 2, 3, 5):
        folder = tmp_path / f"pad{pad}" / "rank0_pid1"
        folder.mkdir(parents=True)
        with zipfile.ZipFile(folder / "pass00000.pt", "w") as out:
            for info in archive.infolist():
                if "/data/" in info.filename:
                    out.writestr("archive/" + "x" * pad, b"")  # shifts the records after it
                out.writestr(info.filename, archive.read(info))
        keys, _, read = read_plain(folder / "pass00000.pt")
        truth = torch.load(folder / "pass00000.pt", weights_only=True)
        assert keys == list(tensors) and all(torch.equal(read[k], truth[k]) for k in keys)
        ds = DumpSet.open(folder.parent)
        assert torch.equal(ds.tensor("model.b"), tensors["model.b"])
        assert ds.diff(folder.parent).first_divergence() is None
    assert {
        read_plain(tmp_path / f"pad{p}" / "rank0_pid1" / "pass00000.pt")[2]["model.a"].data_ptr()
        % dtype.itemsize
        for p in (1, 2, 3, 5)
    } != {0}  # some are misaligned


def test_warnings_show_names_from_the_dump_as_escapes(tmp_path):
    """A warning's text reaches a notebook's stderr raw (the CLI escapes its own streams):
    a folder name with ESC must not clear the screen through 'skipping unreadable pass'."""
    import warnings

    from tdinspect.dumper.recorder import Recorder

    root = tmp_path / "run\x1b[2J\x07"
    rec = Recorder(root, level="module")
    for p in range(2):
        rec.record("m.x", torch.ones(3) * p, module_type="Linear")
        rec.step()
    rec.close()
    broken = sorted(root.rglob("pass00001.pt"))[0]
    broken.write_bytes(b"not a zip archive")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        DumpSet.open(root, on_error="warn")
    texts = [str(w.message) for w in caught if "skipping unreadable pass" in str(w.message)]
    assert texts, [str(w.message) for w in caught]
    assert all("\x1b" not in t and "\x07" not in t for t in texts)
    assert "\\x1b[2J" in texts[0] or "\\x1b" in texts[0], texts[0]
    # the warning still points at the caller's line, not at tdinspect's helper
    assert {w.filename for w in caught if "skipping" in str(w.message)} == {__file__}


@pytest.mark.parametrize("shift", [1, 10, 40_000])
def test_a_rebound_sidecar_never_reads_past_its_record(tmp_path, shift):
    """A forged layout bound anew (the binding is no signature) that runs an entry past the
    end of its zip record: the diff refuses it or reads as ``torch.load`` does, never the
    bytes after the record (docs/reliability.md, below its table of hostile inputs)."""
    from tdinspect.numerics.metrics import TENSOR_METRICS, compare_tensors

    from .conftest import rewrite_sidecar
    from .recorded import record_dump

    files = []
    for seed, side in ((0, "a"), (1, "b")):
        g = torch.Generator().manual_seed(seed)
        root = record_dump(tmp_path / side, [{"m.x": torch.randn(40_001, generator=g)}])
        sidecar = next(root.rglob("pass00000.json"))
        doc = json.loads(sidecar.read_text())
        doc["entries"]["raw"][0][1] = shift  # the storage offset, in elements
        rewrite_sidecar(sidecar, doc)
        files.append(next(root.rglob("pass00000.pt")))
    truth = [torch.load(f, weights_only=True)["m.x"] for f in files]
    want = compare_tensors(truth[1], truth[0])
    try:
        row = DumpSet.open(tmp_path / "a").diff(tmp_path / "b").table(progress=False).iloc[0]
    except DumpFormatError as exc:
        assert "pass00000" in str(exc)
        return
    assert [row[k] for k in TENSOR_METRICS] == [want[k] for k in TENSOR_METRICS]
