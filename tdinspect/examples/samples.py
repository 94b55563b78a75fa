"""The sample dumps: made from the bundled model, regenerated on demand.

Regenerating on the same machine gives the same bytes. On another CPU, matmul and
reduction kernels may sum in another order: names, order, shapes, dtypes and every
non-numeric sidecar field are still identical, tensor values and statistics agree
within a few float32 ulps (docs/reliability.md, "Numbers", states the tolerance that
``tests/test_packaging.py`` checks).

``python -m tdinspect.examples.samples sample_dumps`` writes:

==================  ================================================================
``float32/``        TinyTransformer, float32, 2 steps (module level)
``bfloat16/``       the same weights and tokens in bfloat16
``wrong_layer/``    float32 with ``layers.2.mlp.down`` weights scaled by 1.2
``ops_layernorm/``  op level, the LayerNorm example (forward and backward, bf16),
                    with inputs, so ops can be replayed
``ops_layernorm_f32/``  the same in float32
==================  ================================================================

Folders are named ``rank0_pid0`` and sidecars carry ``pid: 0`` so that the
files do not depend on the process that made them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from tdinspect.dumper.modules import capture
from tdinspect.dumper.ops import capture_ops
from tdinspect.examples.models import layernorm_test, make_model, make_tokens
from tdinspect.store.format import SIDECAR_RE, atomic_write
from tdinspect.store.runs import RUN_FILENAME, clear_runs
from tdinspect.store.sidecars import seal

STEPS = 2
PERTURB_SCALE = 1.2  # a 20% error in one weight: rel_diff of that layer near 1e-2


def _normalise(run_dir: Path) -> None:
    """Rename ``rank0_pid<P>`` to ``rank0_pid0``, zero the pid in sidecars, and give the run
    manifest a fixed identity (id ``sample``, started at time 0, no host)."""
    (folder,) = [p for p in run_dir.iterdir() if p.is_dir()]
    fixed = run_dir / "rank0_pid0"
    folder.rename(fixed)
    run = json.loads((fixed / RUN_FILENAME).read_bytes())
    run.update(
        run_id="sample",
        started=0,
        started_iso="1970-01-01T00:00:00+0000",
        pid=0,
        host="",
        world_size=1,
        group=None,
    )
    data = json.dumps(run, indent=1).encode()
    atomic_write(fixed / RUN_FILENAME, lambda fh: fh.write(data))
    for f in fixed.iterdir():
        if SIDECAR_RE.match(f.name):
            doc = json.loads(f.read_bytes())
            doc["pid"] = 0
            doc.pop("binding", None)
            pass_file = f.with_suffix(".pt")
            data = seal(
                json.dumps(doc, separators=(",", ":")).encode(), pass_file if pass_file.exists() else None
            )  # bound again, as written
            atomic_write(f, lambda fh, data=data: fh.write(data))


def capture_model_run(
    out: Path,
    *,
    dtype=torch.float32,
    perturb: str | None = None,
    steps: int = STEPS,
    stats_only: bool = False,
) -> Path:
    """Capture ``steps`` forwards of the bundled model into ``out``."""
    model = make_model(seed=0, dtype=dtype)
    if perturb:
        with torch.no_grad():
            model.get_parameter(perturb).mul_(PERTURB_SCALE)
    with torch.no_grad(), capture(model, out, stats_only=stats_only, environ={}) as dump:
        for step in range(steps):
            model(make_tokens(seed=step))
            dump.step()
    return out


def capture_layernorm(out: Path, dtype=torch.bfloat16) -> Path:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        with capture_ops(out, inputs=True, environ={}) as dump:
            layernorm_test(dtype)
            dump.step()
    return out


def generate(root: str | Path) -> Path:
    """(Re)write every sample dump under ``root``: the runs tdinspect wrote there are replaced;
    a sample folder holding anything else is a ``ConfigError`` naming it, nothing removed."""
    root = Path(root)
    runs = {
        "float32": lambda p: capture_model_run(p),
        "bfloat16": lambda p: capture_model_run(p, dtype=torch.bfloat16),
        "wrong_layer": lambda p: capture_model_run(p, perturb="layers.2.mlp.down.weight"),
        "ops_layernorm": lambda p: capture_layernorm(p),
        "ops_layernorm_f32": lambda p: capture_layernorm(p, torch.float32),
    }
    clear_runs(*(root / name for name in runs))  # only the runs it wrote: anything else refused
    for name, make in runs.items():
        target = root / name
        make(target)
        _normalise(target)
    return root


if __name__ == "__main__":  # pragma: no cover
    print(generate(sys.argv[1] if len(sys.argv) > 1 else "sample_dumps"))
