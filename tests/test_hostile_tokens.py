"""Token layouts checked at write by the reader's own check, and token work bounded by what the
files hold (issue 36, cases 3, 5, 6, 7): a layout capture accepts is one every reader opens; a
bad one is a ``TokenLayoutError`` naming the field, its pass still open; sizes a file or an
argument claims are refused before anything of that size is made."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tdinspect
from tdinspect import DumpSet
from tdinspect.errors import DumpFormatError, TokenLayoutError
from tdinspect.store.tokenlayout import MAX_ROWS, TokenLayout

from .conftest import ROOT, only_folder, rewrite_sidecar


def _limited(code: str, limit: int, *args: str) -> subprocess.CompletedProcess:
    """``code`` in a child process limited to ``limit`` bytes of address space: a run-away
    allocation there is a ``MemoryError``, never this machine's memory."""
    head = f"import resource\nresource.setrlimit(resource.RLIMIT_AS, ({limit}, {limit}))\n"
    return subprocess.run(
        [sys.executable, "-c", head + textwrap.dedent(code), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"},
    )


class _Rows(torch.nn.Module):
    """``[T, 3]`` rows: token-major, the row of token ``t`` is ``t`` (plus ``bump`` at row 2)."""

    def __init__(self, bump=0.0):
        super().__init__()
        self.bump = bump

    def forward(self, n):
        out = torch.arange(float(n)).repeat_interleave(3).reshape(n, 3)
        if n > 2:
            out[2] += self.bump
        return out


def _dump(path, bump=0.0, n=4):
    model = _Rows(bump)
    with tdinspect.capture(model, path) as dump:
        model(n)
        dump.step(tokens=tdinspect.tokens(seq_lens=[n]))
    return only_folder(path)


# -- case 5: what capture accepts, every reader opens ---------------------------------------

BAD = {
    "shape ()": ((), ((0, 0, 1),), r"shape=\(\)"),
    "segments not covering the rows": ((4,), ((0, 0, 3),), r"segments cover 3 rows, shape \[4\] has 4"),
    "overlapping segments": ((4,), ((0, 0, 2), (0, 1, 2)), r"request 0 position 1 is in rows 1 and 2"),
    "a negative request id": ((4,), ((-1, 0, 4),), r"segments\[0\] = \(-1, 0, 4\)"),
    "a string request id": ((4,), (("a", 0, 4),), r"segments\[0\] = \('a', 0, 4\)"),
    "a NaN position": ((4,), ((0, float("nan"), 4),), r"segments\[0\] = \(0, nan, 4\)"),
    "a position past int64": ((4,), ((0, 2**63, 4),), r"segments\[0\].*positions up to 2\^63-1"),
    "a run past int64": ((4,), ((0, 2**63 - 2, 4),), r"segments\[0\].*positions up to 2\^63-1"),
    "a float length": ((4,), ((0, 0, 4.0),), r"segments\[0\] = \(0, 0, 4.0\)"),
    "rows past the limit": ((2**27,), ((0, 0, 2**27),), r"holds 134217728 token rows, more than a pass may"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_layout_the_reader_refuses_is_refused_at_capture_and_the_pass_kept(tmp_path, case):
    """Layouts capture accepted but every reader refused (the whole dump unopenable), or whose
    write failed (a NaN position: the pass lost): now ``TokenLayoutError`` naming the field, from
    the reader's own check, before the pass is written; it stays open, and ``step`` with a good
    layout writes it. The dump opens, every pass in it."""
    shape, segments, words = BAD[case]
    model = _Rows()
    with tdinspect.capture(model, tmp_path) as dump:
        model(4)
        dump.step(tokens=tdinspect.tokens(seq_lens=[4]))
        model(4)
        with pytest.raises(TokenLayoutError, match=words):
            dump.step(tokens=TokenLayout(shape, segments))
        dump.step(tokens=tdinspect.tokens(request_ids=[1], seq_lens=[4]))  # the pass stayed open
    ds = DumpSet.open(tmp_path)
    assert len(ds.passes) == 2 and ds.get_pass(1).tokens.segments == ((1, 0, 4),)
    assert torch.equal(ds.tensor("model", pass_=1), _Rows()(4))


def test_tokens_refuses_an_empty_shape_naming_it():
    """``tokens(seq_lens=[1], shape=())`` was accepted (one row in a 0-d shape) and its dump
    then refused by every reader."""
    with pytest.raises(TokenLayoutError, match=r"shape=\(\)"):
        tdinspect.tokens(seq_lens=[1], shape=())


_IDS = st.one_of(
    st.none(),
    st.integers(-3, 12),
    st.sampled_from([2**63 - 1, 2**63, 2**64, True, 1.0, float("nan"), "0", [0]]),
)
_SEGMENT = st.one_of(
    st.tuples(_IDS, st.one_of(st.integers(0, 12), _IDS), st.one_of(st.integers(1, 5), _IDS)),
    st.lists(st.integers(0, 4), max_size=4).map(tuple),
)
_SHAPE = st.one_of(
    st.lists(st.integers(0, 6), max_size=3).map(tuple),
    st.sampled_from([(2**26 + 1,), (2**13, 2**13 + 1), (-1,), (True,), (2.0,), ("4",)]),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shape=_SHAPE, segments=st.lists(_SEGMENT, max_size=5).map(tuple))
def test_capture_and_reader_accept_exactly_the_same_layouts(shape, segments):
    """Token layouts of every shape (empty, 0-d, 3-d, past the row limit) and segments of every
    kind (negative, huge, bool, float, NaN, string ids and positions; short and long tuples):
    a layout is made (as capture writes it) exactly when the reader opens its JSON, and what is
    read is what was made."""
    try:
        made = TokenLayout(shape, segments)
    except TokenLayoutError:
        made = None
    doc = {
        "shape": list(shape) if isinstance(shape, tuple) else shape,
        "segments": [list(s) for s in segments],
    }
    try:
        read = TokenLayout.from_json(json.loads(json.dumps(doc)), "pass00000.json")
    except DumpFormatError as exc:
        assert "pass00000.json: malformed 'tokens' field" in str(exc)
        read = None
    assert (made is None) == (read is None), (shape, segments, made, read)
    if made is not None:
        assert read == made and TokenLayout.from_json(made.to_json(), "x") == made
        assert made.rows == math.prod(made.shape) == sum(n for _, _, n in made.segments) <= MAX_ROWS


# -- case 6: the row limit holds with shape= ------------------------------------------------


def test_the_row_limit_of_tokens_holds_when_shape_is_given():
    """``tokens(seq_lens=[10**8], shape=(10**8,))`` skipped the 2^26-row limit (it was only
    checked without ``shape``) and made 10^8 positions: MemoryError at 2.4 GB. Now refused
    naming the argument before any list is made (under a 3 GB address-space limit)."""
    out = _limited(
        """
        import tdinspect
        from tdinspect.errors import TokenLayoutError
        try:
            tdinspect.tokens(seq_lens=[10**8], shape=(10**8,))
        except TokenLayoutError as exc:
            print("refused:", exc)
        """,
        3 << 30,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "refused: seq_lens give 100000000 tokens, but a pass holds 67108864 at most" in out.stdout, (
        out.stdout
    )


# -- case 7: positions past int64 -----------------------------------------------------------


def test_positions_past_int64_are_refused_at_capture_and_on_read(tmp_path):
    """Positions >= 2^63 were accepted, then every diff that diverged ended in
    ``OverflowError`` (exit 2 with a traceback's last line). Now ``tokens()`` refuses them
    naming the argument, and a sealed sidecar holding one is a ``DumpFormatError`` naming it;
    the CLI exits 2 with that message."""
    with pytest.raises(TokenLayoutError, match=r"positions\[1\] = 9223372036854775808: .*up to 2\^63-1"):
        tdinspect.tokens(request_ids=[0, 0], positions=[0, 2**63])
    with pytest.raises(TokenLayoutError, match=r"request_ids\[0\] = 18446744073709551616"):
        tdinspect.tokens(request_ids=[2**64], seq_lens=[2])
    a, b = _dump(tmp_path / "a"), _dump(tmp_path / "b", bump=1.0)  # B differs at row 2
    for side in (a, b):  # as such a capture wrote them (sealed): rows 2-3 at positions 2^63...
        sidecar = side / "pass00000.json"
        doc = json.loads(sidecar.read_text())
        doc["tokens"]["segments"] = [[0, 0, 2], [0, 2**63, 2]]
        rewrite_sidecar(sidecar, doc)
    with pytest.raises(DumpFormatError, match=r"pass00000\.json: malformed 'tokens' field \(segments\[1\]"):
        DumpSet.open(a).diff(DumpSet.open(b), tokens=True).first_divergence()
    out = subprocess.run(
        [sys.executable, "-m", "tdinspect", "first-divergence", str(a), str(b), "--tokens"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 2 and "pass00000.json" in out.stderr and "segments[1]" in out.stderr, out.stderr
    assert "OverflowError" not in out.stderr


# -- case 3: token work bounded by what the files hold --------------------------------------


def test_a_layout_claiming_more_rows_than_its_file_holds_is_refused_before_allocation(tmp_path):
    """A 2.7 KB dump (an expanded entry of N rows and a layout of N tokens, sealed) made
    ``diff(tokens=True)`` list N positions: 3.3 GB in 12 s. Now a layout claiming more token
    rows than its pass file holds bytes is an ``AlignError`` naming the pass, before any
    position is listed (under a 2 GB address-space limit)."""
    a = _dump(tmp_path / "a")

    class Expand(torch.nn.Module):
        def forward(self, x):
            return x.reshape(1, 1).expand(4, 3)

    m = Expand()
    with tdinspect.capture(m, tmp_path / "b") as dump:
        m(torch.tensor(1.0))
        dump.step(tokens=tdinspect.tokens(seq_lens=[4]))
    b = only_folder(tmp_path / "b")
    n = MAX_ROWS - 1  # past any bound by rows alone: one pass may hold this many
    sidecar = b / "pass00000.json"
    doc = json.loads(sidecar.read_text())
    doc["tokens"] = {"shape": [n], "segments": [[0, 0, n]]}
    doc["entries"]["shape"] = [[n, 3]]
    doc["entries"]["storage"][0]["expand"]["view"][0] = [n, 3]
    rewrite_sidecar(sidecar, doc)
    assert sum(f.stat().st_size for f in b.iterdir()) < 4096
    out = _limited(
        """
        import sys
        from tdinspect import DumpSet
        from tdinspect.errors import AlignError
        try:
            DumpSet.open(sys.argv[1]).diff(DumpSet.open(sys.argv[2]), tokens=True).first_divergence()
        except AlignError as exc:
            print("refused:", exc)
        """,
        2 << 30,
        str(a),
        str(b),
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "refused:" in out.stdout and "pass 0" in out.stdout, out.stdout
    assert f"claims {n} token rows, but its pass file holds" in out.stdout, out.stdout


def test_an_honest_token_diff_is_within_the_bound(tmp_path):
    """The bound refuses nothing a capture writes: an honest token diff still finds the bump
    at its position."""
    a, b = _dump(tmp_path / "a", n=6), _dump(tmp_path / "b", bump=1.0, n=6)
    d = DumpSet.open(a).diff(DumpSet.open(b), tokens=True)
    div = d.first_divergence()
    assert div is not None and div.request == 0 and div.position == 2, div
