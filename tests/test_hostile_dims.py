"""A dims spec is a sidecar's text (``dims`` column), of any length: it is parsed in one pass
and quoted short. A repeated name was looked up in a list: 8,000 dims took 1.04 s to parse
(quadratic: 80,000 would take ~100 s), now 0.11 s (800,000: 2.9 s); each error quoted the
whole spec."""

from __future__ import annotations

import pytest

from tdinspect.align.dims import parse_dims
from tdinspect.errors import DimsError


@pytest.mark.parametrize("tail", ["a", "x(qq)", "y(tp,partial,partial)", "%" * 10_000])
def test_errors_in_a_huge_dims_spec_are_quoted_short(tail):
    text = " ".join(f"d{i}" for i in range(20_000)) + " a " + tail
    with pytest.raises(DimsError) as caught:
        parse_dims(text)
    assert len(str(caught.value)) < 400


def test_a_huge_dims_spec_names_a_missing_dim_briefly():
    spec = parse_dims(" ".join(f"d{i}" for i in range(20_000)))
    assert len(spec.dims) == 20_000
    with pytest.raises(DimsError, match=r"has no dim 'nope' \(dims: d0, d1, .*, \.\.\.\)") as caught:
        spec.index("nope")
    assert len(str(caught.value)) < 400
