"""Project files stay consistent: pyproject and environment.yml list the same stack; README commands."""

from __future__ import annotations

import json
import re

import pytest

from .conftest import ROOT

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

CONDA_NAMES = {"torch": "pytorch", "dask[distributed]": "dask", "isal": "python-isal"}


def _pyproject_names():
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    deps = list(data["project"]["dependencies"])
    for items in data["project"]["optional-dependencies"].values():
        deps += [d for d in items if not d.startswith("tdinspect")]
    names = set()
    for d in deps:
        name = re.match(r"[A-Za-z0-9_.\-\[\]]+", d).group(0).lower()
        names.add(CONDA_NAMES.get(name, name))
    return names


def _environment_names():
    names = set()
    text = (ROOT / "environment.yml").read_text()
    deps = text.split("dependencies:", 1)[1]
    for line in deps.splitlines():
        m = re.match(r"\s+-\s+([A-Za-z0-9_.\-]+)\s*(>=|==|$)", line)
        if m and m.group(1) not in ("python", "pip", "distributed"):
            names.add(m.group(1).lower())
    return names


def test_environment_yml_matches_pyproject():
    assert _pyproject_names() == _environment_names()


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    commands = re.findall(r"```(?:bash|sh)\n(.*?)\n```", readme, re.S)
    assert len(commands) >= 2
    assert "tdinspect demo" in commands[0]
    ci = (ROOT / ".ci" / "run").read_text()
    assert commands[1].strip() in ci
    assert "torch==2.13.0" in commands[0] and "torch==2.13.0" in commands[1]


STAT_COLUMNS = ("min", "max", "mean", "std", "absmax", "l2", "nan", "inf", "numel")


def _tolerance(dtype: str) -> float:
    """Relative tolerance for a regenerated value of ``dtype`` (see docs/reliability.md, "Numbers").

    Matmul and reduction kernels sum in an order that depends on the CPU's vector width, so
    floating-point outputs agree across machines only to a few float32 ulps per op (after the
    bundled model's layers: measured 4 ulps of the tensor's absmax, AMD EPYC vs the committing
    machine), plus one rounding step of the stored dtype for 16-bit formats.
    """
    import torch

    eps = torch.finfo(getattr(torch, dtype.removeprefix("torch."))).eps
    return max(32 * torch.finfo(torch.float32).eps, 2 * eps)


def _sidecar_close(old: dict, new: dict, where) -> None:
    """Everything but statistics identical; statistics within the dtype's tolerance."""
    old_stats, new_stats = old["entries"].pop("stats"), new["entries"].pop("stats")
    # the binding digests the pass file's bytes and the sidecar's: it follows the values
    old.pop("binding", None), new.pop("binding", None)
    assert old == new, where
    for key, dtype, a, b in zip(old["entries"]["key"], old["entries"]["dtype"], old_stats, new_stats):
        if a is None or b is None:  # an entry without statistics (an op-level reference)
            assert a == b, (where, key)
            continue
        a, b = dict(zip(STAT_COLUMNS, a)), dict(zip(STAT_COLUMNS, b))
        for col in ("nan", "inf", "numel"):
            assert a[col] == b[col], (where, key, col)
        tol = _tolerance(dtype)
        for col in ("min", "max", "mean", "std", "absmax", "l2"):
            scale = a["l2"] if col == "l2" else a["absmax"]
            assert abs(a[col] - b[col]) <= tol * scale, (where, key, col, a[col], b[col])


def _pass_close(old: dict, new: dict, where) -> None:
    """Same keys in the same order, dtypes and shapes; values within the dtype's tolerance."""
    import torch

    assert list(old) == list(new), where
    for key, a in old.items():
        b = new[key]
        assert (a.dtype, a.shape) == (b.dtype, b.shape), (where, key)
        if not a.is_floating_point():
            assert torch.equal(a, b), (where, key)
            continue
        scale = a.double().abs().max().item() if a.numel() else 0.0
        torch.testing.assert_close(
            b.double(),
            a.double(),
            rtol=0,
            atol=_tolerance(str(a.dtype)) * scale,
            equal_nan=True,
            msg=lambda m, key=key: f"{where} {key}: {m}",
        )


def test_sample_dumps_regenerate_on_any_cpu(tmp_path):
    """Regenerating the samples gives the committed files: structure and every non-numeric
    byte exactly, tensor values and statistics within the documented cross-CPU tolerance."""
    import torch

    from tdinspect.examples.samples import generate

    generate(tmp_path)
    committed = sorted(
        p.relative_to(ROOT / "sample_dumps") for p in (ROOT / "sample_dumps").rglob("*") if p.is_file()
    )
    fresh = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    assert committed == fresh and committed
    for rel in committed:
        old, new = ROOT / "sample_dumps" / rel, tmp_path / rel
        if old.read_bytes() == new.read_bytes():
            continue
        if rel.suffix == ".json":
            _sidecar_close(json.loads(old.read_bytes()), json.loads(new.read_bytes()), rel)
        elif rel.suffix == ".pt":
            _pass_close(torch.load(old, weights_only=True), torch.load(new, weights_only=True), rel)
        else:
            raise AssertionError(f"{rel} differs")


def test_sample_tolerance_still_tells_runs_apart():
    """The tolerance is far below what the samples exist to show (wrong_layer vs float32)."""
    import torch

    root = ROOT / "sample_dumps"
    ref = torch.load(root / "float32/rank0_pid0/pass00000.pt", weights_only=True)
    bad = torch.load(root / "wrong_layer/rank0_pid0/pass00000.pt", weights_only=True)
    with pytest.raises(AssertionError):
        _pass_close(ref, bad, "wrong_layer")
    perturbed = {
        k: v * (1 + 10 * _tolerance(str(v.dtype))) if v.is_floating_point() else v for k, v in ref.items()
    }
    with pytest.raises(AssertionError):
        _pass_close(ref, perturbed, "10x the tolerance")


def test_committed_notebooks_show_their_output():
    """Every code cell ran, without error, and the file says so (a reader on GitHub sees results)."""
    nbformat = pytest.importorskip("nbformat")
    notebooks = sorted((ROOT / "notebooks").glob("*.ipynb"))
    assert len(notebooks) == 9
    for path in notebooks:
        nb = nbformat.read(path, as_version=4)
        code = [c for c in nb.cells if c.cell_type == "code"]
        assert code and all(c.execution_count for c in code), f"{path.name} was saved unexecuted"
        assert sum(len(c.outputs) for c in code) >= len(code) - 1, path.name
        errors = [o for c in code for o in c.outputs if o.output_type == "error"]
        assert not errors, f"{path.name}: {errors[0].ename}"


def test_public_api_is_curated_and_resolves():
    """``tdinspect`` names a short list of public things (capture, read, compare, look, errors);
    each resolves, completion lists those alone, and the rest stay in their modules."""
    import tdinspect

    assert 15 <= len(tdinspect.__all__) <= 28 and len(set(tdinspect.__all__)) == len(tdinspect.__all__)
    for name in tdinspect.__all__:
        assert getattr(tdinspect, name) is not None, name
    assert dir(tdinspect) == sorted([*tdinspect.__all__, "__version__"])
    assert not hasattr(tdinspect, "ModuleCapture")  # reachable from tdinspect.dumper.modules
    from tdinspect.dumper.modules import ModuleCapture
    from tdinspect.errors import NonFinite

    assert ModuleCapture and NonFinite
