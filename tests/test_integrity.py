"""No capture is silently lost: full disk, Ctrl-C, file modes, load_pass without a mapping."""

from __future__ import annotations

import errno
import json
import os
import subprocess

import pytest
import torch

import tdinspect
from tdinspect import DumpSet, load_pass
from tdinspect.store.format import atomic_write

from .conftest import only_folder


@pytest.fixture
def tiny_disk(tmp_path):
    """A real 20 MB tmpfs (needs root; skipped elsewhere)."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=20m", "tmpfs", str(mnt)], capture_output=True)
    if done.returncode != 0:
        pytest.skip("mounting a tmpfs needs root")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _big_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 1 << 16), torch.nn.ReLU())  # 4 MB per output


@pytest.mark.parametrize("background", [False, True])
def test_real_full_disk_says_no_space_left(tiny_disk, background):
    model, x = _big_model(), torch.randn(16, 64)
    with pytest.raises(tdinspect.CaptureWriteError, match="No space left on device") as info:
        with tdinspect.capture(model, tiny_disk / "d", background_write=background) as dump:
            for _ in range(10):  # 8 MB a pass: the third cannot fit
                model(x)
                dump.step()
                dump.recorder.writer.flush()
    assert "unexpected pos" not in str(info.value).split("(")[0]
    folder = only_folder(tiny_disk / "d")
    finals = sorted(p.name for p in folder.iterdir() if p.name.startswith("pass"))
    assert finals[:4] == ["pass00000.json", "pass00000.pt", "pass00001.json", "pass00001.pt"]
    assert not [p for p in folder.iterdir() if p.name.endswith(".tmp")]
    for name in finals:
        if name.endswith(".pt"):
            assert len(load_pass(folder / name)) == 2
    assert DumpSet.open(tiny_disk / "d").passes == [0, 1]


def test_full_disk_inside_torch_save_names_the_cause(tmp_path, monkeypatch):
    """Without root: torch's zip writer hits ENOSPC and reports 'unexpected pos'; the message
    still says No space left on device."""
    from tdinspect.store import format as fmt

    real_fdopen = os.fdopen

    class Full:
        def __init__(self, f, limit):
            self.f, self.left = f, limit

        def write(self, data):
            if len(data) > self.left:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            self.left -= len(data)
            return self.f.write(data)

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    real_create = fmt._create_temporary
    created = {}

    def create(path):
        fd, tmp = real_create(path)
        created[fd] = path.name
        return fd, tmp

    def fdopen(fd, mode="r", *args, **kwargs):
        f = real_fdopen(fd, mode, *args, **kwargs)
        return Full(f, 1000) if created.get(fd) == "pass00001.pt" else f

    monkeypatch.setattr(fmt, "_create_temporary", create)
    monkeypatch.setattr(fmt.os, "fdopen", fdopen)
    model, x = _big_model(), torch.randn(2, 64)
    with pytest.raises(tdinspect.CaptureWriteError, match=r"pass 1 .*No space left on device"):
        with tdinspect.capture(model, tmp_path, background_write=False) as dump:
            for _ in range(3):
                model(x)
                dump.step()
    folder = only_folder(tmp_path)
    assert sorted(p.name for p in folder.iterdir()) == ["pass00000.json", "pass00000.pt", "run.json"]


def test_ctrl_c_during_inline_write_is_a_keyboard_interrupt(tmp_path, monkeypatch):
    from tdinspect.dumper import writer

    real = writer.save_pass
    calls = {"n": 0}

    def interrupted(path, tensors, fsync=False, **kw):
        calls["n"] += 1
        if calls["n"] == 2:

            def write(f):
                f.write(b"PK\x03\x04 half a pass")
                raise KeyboardInterrupt

            atomic_write(path, write)
        return real(path, tensors, fsync=fsync, **kw)

    monkeypatch.setattr(writer, "save_pass", interrupted)
    model, x = _big_model(), torch.randn(2, 64)
    with pytest.raises(KeyboardInterrupt):
        with tdinspect.capture(model, tmp_path, background_write=False) as dump:
            for _ in range(3):
                model(x)
                dump.step()
    assert all(not m._forward_hooks for m in model.modules())
    folder = only_folder(tmp_path)
    assert sorted(p.name for p in folder.iterdir() if p.name.startswith(("pass", "."))) == [
        "pass00000.json",
        "pass00000.pt",
    ]
    assert len(load_pass(folder / "pass00000.pt")) == 2


@pytest.mark.parametrize("umask", [0o022, 0o002, 0o077])
def test_files_respect_the_umask(tmp_path, umask):
    model, x = _big_model(), torch.randn(2, 64)
    old = os.umask(umask)
    try:
        with tdinspect.capture(model, tmp_path / "d", background_write=False) as dump:
            model(x)
            dump.step()
        torch.save({}, tmp_path / "reference.pt")
    finally:
        os.umask(old)
    expected = (tmp_path / "reference.pt").stat().st_mode & 0o777
    assert expected == 0o666 & ~umask
    files = [p for p in only_folder(tmp_path / "d").iterdir() if p.is_file()]
    assert files and {p.stat().st_mode & 0o777 for p in files} == {expected}


def test_load_pass_result_can_be_modified_and_saved_over_its_file(tmp_path):
    model, x = _big_model(), torch.randn(2, 64)
    with tdinspect.capture(model, tmp_path, background_write=False) as dump:
        model(x)
        dump.step()
    p = only_folder(tmp_path) / "pass00000.pt"
    before = load_pass(p)
    k = "model.0"
    # the exact sequence of the report, in a child: on failure it dies of SIGBUS
    code = (
        "import sys, torch; from tdinspect import load_pass; p = sys.argv[1]; "
        "t = load_pass(p); t['model.0'] *= 2; torch.save(t, p)"
    )
    done = subprocess.run(
        [os.sys.executable, "-c", code, str(p)],
        capture_output=True,
        text=True,
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join(
                [str(tdinspect.__path__[0].rsplit(os.sep, 1)[0]), os.environ.get("PYTHONPATH", "")]
            ),
        },
    )
    assert done.returncode == 0, done.stderr[-500:]
    after = load_pass(p)
    assert torch.equal(after[k], before[k] * 2)
    assert torch.equal(after["model.1"], before["model.1"])
    mapped = load_pass(p, mmap=True)  # the opt-in still maps
    assert torch.equal(mapped[k], after[k])


# -- names: the mapping from outputs and modules to keys is injective ---------------------------


class _DictOut(torch.nn.Module):
    def forward(self, x):
        return {"a/b": x + 1, "a_b": x + 2, "a:b": x + 3, "a::call1": x + 4, "[x]": x + 5}


class _Tuple(torch.nn.Module):
    def forward(self, x):
        return x + 1, x + 2


class _Plus(torch.nn.Module):
    def __init__(self, k):
        super().__init__()
        self.k = k

    def forward(self, x):
        return x + self.k


class _Odd(torch.nn.Module):
    """A module ``a`` called twice next to a module literally named ``a::call1``, and a tuple
    output of ``x`` next to a module literally named ``x[0]``."""

    def __init__(self):
        super().__init__()
        self.add_module("a", _Plus(1))
        self.add_module("a::call1", _Plus(10))
        self.add_module("x", _Tuple())
        self.add_module("x[0]", _Plus(100))
        self.d = _DictOut()

    def forward(self, t):
        t = self.a(self.a(t))
        t = getattr(self, "a::call1")(t)
        t = self.x(t)[0] + getattr(self, "x[0]")(t)
        return self.d(t)


def _capture_odd(folder):
    model, x = _Odd(), torch.ones(2)
    with tdinspect.capture(model, folder, modules="all") as dump:
        out = model(x)
        dump.step()
    return dump.folder, out


@pytest.mark.parametrize("level", ["module", "op"])
def test_names_never_collide(tmp_path, level):
    if level == "module":
        folder, out = _capture_odd(tmp_path / "m")
        tensors = load_pass(folder / "pass00000.pt")
        side = json.loads((folder / "pass00000.json").read_text())
        assert len(side["entries"]["key"]) == len(set(side["entries"]["key"])) == len(tensors)
        assert torch.equal(tensors["model.d[a%2Fb]"], out["a/b"])
        assert torch.equal(tensors["model.d[a_b]"], out["a_b"])
        assert torch.equal(tensors["model.d[a%3Ab]"], out["a:b"])
        assert torch.equal(tensors["model.d[a%3A%3Acall1]"], out["a::call1"])
        assert torch.equal(tensors["model.d[%5Bx%5D]"], out["[x]"])
        assert torch.equal(tensors["model.a"], torch.full((2,), 2.0))
        assert torch.equal(tensors["model.a::call1"], torch.full((2,), 3.0))  # second call of a
        assert torch.equal(tensors["model.a%3A%3Acall1"], torch.full((2,), 13.0))  # the module
        assert torch.equal(tensors["model.x[0]"], torch.full((2,), 14.0))  # the tuple's element
        assert torch.equal(tensors["model.x%5B0%5D"], torch.full((2,), 113.0))  # the module
        assert tdinspect.parse_key("model.d[a%2Fb]").labels == ("a%2Fb",)
    else:
        model, x = _Odd(), torch.ones(2)
        with tdinspect.capture_ops(tmp_path / "o", model=model) as dump:
            model(x)
            dump.step()
        tensors = load_pass(dump.folder / "pass00000.pt")
        keys = json.loads((dump.folder / "pass00000.json").read_text())["entries"]["key"]
        assert len(keys) == len(set(keys))
        assert any(k.startswith("model.a%3A%3Acall1/aten.add") for k in tensors)
        assert any(k.startswith("model.x%5B0%5D/aten.add") for k in tensors)


def test_two_identical_runs_never_diverge(tmp_path):
    _capture_odd(tmp_path / "a")
    _capture_odd(tmp_path / "b")
    diff = DumpSet.open(tmp_path / "a").diff(DumpSet.open(tmp_path / "b"))
    assert diff.first_divergence(metric="equal") is None
    assert DumpSet.open(tmp_path / "a").n_entries() == 16  # 2 calls of a, 3 modules, 2 dicts of 5


# -- threads and fork ---------------------------------------------------------------------------


@pytest.mark.parametrize("background", [False, True])
def test_threads_lose_nothing(tmp_path, background):
    """Four threads calling the model under one capture, switching threads as often as
    Python can: every call is stored under its own name, shapes match the tensors, and each
    stored tensor is one of the outputs the threads computed."""
    import sys
    import threading

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.ReLU(), torch.nn.Linear(5, 2))
    inputs = {t: torch.full((t + 1, 3), float(t)) for t in range(4)}  # a shape per thread
    expected = {}
    with torch.no_grad():
        for t, x in inputs.items():
            h = model[0](x)
            expected[t] = [h, torch.relu(h), model(x)]
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        with pytest.warns(RuntimeWarning, match="second thread"):
            with tdinspect.capture(model, tmp_path, background_write=background) as dump:

                def work(t):
                    with torch.no_grad():
                        for _ in range(25):
                            model(inputs[t])

                threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
                for th in threads:
                    th.start()
                for th in threads:
                    th.join()
                dump.step()
    finally:
        sys.setswitchinterval(old)
    tensors = load_pass(dump.folder / "pass00000.pt")
    side = json.loads((dump.folder / "pass00000.json").read_text())["entries"]
    assert len(tensors) == len(side["key"]) == 3 * 4 * 25
    for key, shape in zip(side["key"], side["shape"]):
        assert list(tensors[key].shape) == shape
        layer = {"model.0": 0, "model.1": 1, "model.2": 2}[key.split("::")[0]]
        t = shape[0] - 1
        assert torch.equal(tensors[key], expected[t][layer])
    assert set(side["thread"]) - {None} == {1, 2, 3}


FORK_CHILD = """
import os, sys, warnings
from tdinspect import load_pass
def child(dump, model, x):
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            model(x * 7)
            path = dump.step()
        said = [str(w.message) for w in seen]
        ok = path is None and any("forked from pid" in m and "captures nothing" in m for m in said)
        os._exit(0 if ok else 3)
    except BaseException:
        os._exit(4)
"""


@pytest.mark.parametrize("background", [False, True])
def test_fork_child_captures_nothing_and_says_so(tmp_path, background):
    namespace = {}
    exec(FORK_CHILD, namespace)
    torch.manual_seed(0)
    model, x = torch.nn.Sequential(torch.nn.Linear(3, 3)), torch.ones(2, 3)
    with tdinspect.capture(model, tmp_path, background_write=background) as dump:
        model(x)
        dump.step()
        dump.recorder.writer.flush()
        # run.lock: held while the capture is open, removed when it closes
        before = {p.name: p.read_bytes() for p in dump.folder.iterdir() if p.name != "run.lock"}
        pid = os.fork()
        if pid == 0:
            namespace["child"](dump, model, x)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        model(x * 2)
        dump.step()
    folder = dump.folder
    assert [p.name for p in tmp_path.iterdir()] == [folder.name]  # no folder of the child
    for name, data in before.items():
        assert (folder / name).read_bytes() == data  # pass 0 untouched
    p1 = load_pass(folder / "pass00001.pt")
    assert torch.equal(p1["model.0"], model(x * 2).detach())  # the parent's own pass 1
