"""Shared fixtures: the bundled transformer and real dumps captured from it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from tdinspect.examples.models import make_model, make_tokens
from tdinspect.examples.samples import capture_model_run

ROOT = Path(__file__).resolve().parent.parent

os.environ.setdefault("MPLBACKEND", "Agg")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    """No capture switch from the outer environment leaks into a test."""
    for fam in ("PHYAI_DEBUG_TENSOR_DUMP_", "TDINSPECT_DUMP_"):
        for suffix in ("DIR", "FILTER", "FILTER_FN", "RECORD"):
            monkeypatch.delenv(fam + suffix, raising=False)


@pytest.fixture
def model():
    return make_model(seed=0)


@pytest.fixture
def tokens():
    return make_tokens(seed=0)


@pytest.fixture(scope="session")
def runs(tmp_path_factory):
    """Real dumps: float32 reference, one wrong layer, bfloat16 (3 passes each)."""
    root = tmp_path_factory.mktemp("runs")
    return {
        "ref": capture_model_run(root / "ref", steps=3),
        "ref2": capture_model_run(root / "ref2", steps=3),
        "wrong": capture_model_run(root / "wrong", steps=3, perturb="layers.2.mlp.down.weight"),
        "bf16": capture_model_run(root / "bf16", steps=3, dtype=torch.bfloat16),
        "stats": capture_model_run(root / "stats", steps=3, stats_only=True),
        "stats_wrong": capture_model_run(
            root / "stats_wrong", steps=3, stats_only=True, perturb="layers.2.mlp.down.weight"
        ),
    }


def only_folder(run: Path) -> Path:
    (folder,) = [p for p in Path(run).iterdir() if p.is_dir()]
    return folder


def rewrite_sidecar(sidecar: Path, doc: dict, bind: bool = True) -> None:
    """Write ``doc`` as ``sidecar``: bound to its pass file as the writer does (a careful
    attacker), or (``bind=False``) as an editor would, keeping whatever binding it holds."""
    from tdinspect.store.sidecars import seal

    if not bind:
        sidecar.write_text(json.dumps(doc, separators=(",", ":")))
        return
    data = json.dumps({k: v for k, v in doc.items() if k != "binding"}, separators=(",", ":")).encode()
    pass_file = sidecar.with_suffix(".pt")
    sidecar.write_bytes(seal(data, pass_file if pass_file.exists() else None))
