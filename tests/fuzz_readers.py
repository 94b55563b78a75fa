"""Random tensors forged into pass files, read back by every reader (run by
tests/test_hostile_tensors.py in a process of its own, under a memory limit).

Each example writes one pass file holding one forged tensor (sparse indices anywhere, sizes
that do not fit, strides and offsets against the record), then reads it as a user would:
``load_pass``, ``DumpSet.open(...).tensor``, statistics. Every read must either give a
tensor equal to what the public constructors (which check everything) make of the same
parts, or raise ``DumpFormatError``; nothing may crash, write out of bounds, or allocate
more than a small multiple of what the file holds.
"""

from __future__ import annotations

import collections
import os
import resource
import sys
import tempfile
import warnings

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tdinspect import DumpFormatError, DumpSet, load_pass

warnings.simplefilter("ignore")
BIG = st.one_of(
    st.integers(-4, 8), st.sampled_from([2**20, 2**31, 2**40, 2**62, 2**63 - 1, -(2**63), -(2**31)])
)


class _Forged:
    """Pickles as torch.save pickles a strided tensor, with any offset, sizes and strides."""

    def __init__(self, storage, offset, size, stride):
        self.args = (storage, offset, tuple(size), tuple(stride))

    def __reduce__(self):
        return (torch._utils._rebuild_tensor_v2, (*self.args, False, collections.OrderedDict()))


def _read_all(folder: str) -> None:
    """Every way a user reads the entry; each succeeds or raises DumpFormatError."""
    path = os.path.join(folder, "pass00000.pt")
    for read in (
        lambda: load_pass(path),
        lambda: DumpSet.open(folder).tensor("model.a"),
        lambda: DumpSet.open(folder).to_xarray(progress=False),
    ):
        try:
            read()
        except DumpFormatError:
            pass


def _expected_sparse(indices, values, size):
    try:
        return torch.sparse_coo_tensor(indices, values, size, check_invariants=True).to_dense()
    except (RuntimeError, ValueError):
        return None


@settings(
    max_examples=int(os.environ.get("FUZZ_EXAMPLES", "60")),
    deadline=None,
    suppress_health_check=list(HealthCheck),
)
@given(
    nnz=st.integers(0, 3),
    size=st.lists(
        st.one_of(st.integers(0, 6), st.sampled_from([2**15, 2**20, 2**40])), min_size=1, max_size=3
    ),
    index=st.lists(BIG, min_size=9, max_size=9),
)
def fuzz_sparse_coo(nnz, size, index):
    indices = torch.tensor(index[: len(size) * nnz], dtype=torch.int64).reshape(len(size), nnz)
    values = torch.arange(1.0, nnz + 1.0)
    try:
        forged = torch.sparse_coo_tensor(indices, values, size, check_invariants=False)
    except (RuntimeError, ValueError):
        return  # torch will not even build it: nothing to save
    with tempfile.TemporaryDirectory() as folder:
        torch.save({"model.a": forged}, os.path.join(folder, "pass00000.pt"))
        _read_all(folder)
        # the dense reference wherever the reader's 64 MB budget lets it read the entry
        want = _expected_sparse(indices, values, size) if torch.Size(size).numel() * 4 <= 64 << 20 else None
        try:
            got = DumpSet.open(folder).tensor("model.a")
        except DumpFormatError:
            assert want is None or torch.Size(size).numel() * 4 > 64 << 20
            return
        assert want is not None and torch.equal(got, want)


@settings(
    max_examples=int(os.environ.get("FUZZ_EXAMPLES", "60")),
    deadline=None,
    suppress_health_check=list(HealthCheck),
)
@given(
    n=st.integers(0, 16),
    offset=BIG,
    size=st.lists(BIG, min_size=1, max_size=3),
    stride=st.lists(BIG, min_size=3, max_size=3),
)
def fuzz_strided(n, offset, size, stride):
    storage = torch.arange(float(n)).untyped_storage()
    typed = torch.storage.TypedStorage(wrap_storage=storage, dtype=torch.float32, _internal=True)
    with tempfile.TemporaryDirectory() as folder:
        torch.save(
            {"model.a": _Forged(typed, offset, size, stride[: len(size)])},
            os.path.join(folder, "pass00000.pt"),
        )
        _read_all(folder)


if __name__ == "__main__":
    limit = int(sys.argv[1]) if len(sys.argv) > 1 else 6 << 30
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    fuzz_sparse_coo()
    fuzz_strided()
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"ok peak {peak_mb:.0f} MB")
