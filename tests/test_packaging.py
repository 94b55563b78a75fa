"""Project files stay consistent: pyproject and environment.yml list the same stack; README commands."""

from __future__ import annotations

import re
import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

from .conftest import ROOT

CONDA_NAMES = {"torch": "pytorch", "dask[distributed]": "dask"}


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


def test_sample_dumps_regenerate_bit_for_bit(tmp_path):
    from tdinspect.samples import generate

    generate(tmp_path)
    committed = sorted(p.relative_to(ROOT / "sample_dumps") for p in (ROOT / "sample_dumps").rglob("*")
                       if p.is_file())
    fresh = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    assert committed == fresh and committed
    for rel in committed:
        assert (ROOT / "sample_dumps" / rel).read_bytes() == (tmp_path / rel).read_bytes(), rel


def test_committed_notebooks_show_their_output():
    """Every code cell ran, without error, and the file says so (a reader on GitHub sees results)."""
    nbformat = pytest.importorskip("nbformat")
    notebooks = sorted((ROOT / "notebooks").glob("*.ipynb"))
    assert len(notebooks) == 3
    for path in notebooks:
        nb = nbformat.read(path, as_version=4)
        code = [c for c in nb.cells if c.cell_type == "code"]
        assert code and all(c.execution_count for c in code), f"{path.name} was saved unexecuted"
        assert sum(len(c.outputs) for c in code) >= len(code) - 1, path.name
        errors = [o for c in code for o in c.outputs if o.output_type == "error"]
        assert not errors, f"{path.name}: {errors[0].ename}"
