"""The docs name only tests and Python paths that exist (a guide that cites a removed test or
a module path that moved sends a reader nowhere)."""

from __future__ import annotations

import importlib
import re

import pytest

from .conftest import ROOT

DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])


def _test_names() -> set[str]:
    names = set()
    for path in (ROOT / "tests").rglob("*.py"):  # tests/scenarios/ too
        names |= set(re.findall(r"^def (test_\w+)", path.read_text(), re.M))
    return names


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_test_a_doc_cites_exists(doc):
    known = _test_names()
    cited = set(re.findall(r"\b(test_\w+)\b", doc.read_text()))
    cited -= {n for n in cited if n.startswith("test_") and n.endswith("_")}  # prefixes ("test_safety_*")
    missing = sorted(n for n in cited if n not in known and not any((ROOT / "tests").rglob(f"{n}.py")))
    assert not missing, f"{doc.name} cites tests that do not exist: {missing}"


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_python_path_a_doc_names_resolves(doc):
    names = set(re.findall(r"`(tdinspect(?:\.[A-Za-z_]\w*)+)", doc.read_text()))
    missing = sorted(n for n in names if not _resolves(n))
    assert not missing, f"{doc.name} names paths that do not resolve: {missing}"
