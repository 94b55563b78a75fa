"""Shared pieces of the benchmarks: the benchmark transformer, a side-by-side timer and
synthetic dumps for the analysis benchmarks."""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from tdinspect.dumper.recorder import Recorder
from tdinspect.examples.models import make_model, make_tokens

SIZES = dict(d_model=256, n_layers=6, n_heads=4, mlp_ratio=4, vocab=1000, euler_steps=0)
BATCH, SEQ = 8, 128
# what the step timings read: wall time, or (--clock cpu) this process's CPU time, which a
# machine shared with other jobs disturbs far less (the writer must then run inline)
CLOCK = {"wall": time.perf_counter, "cpu": time.process_time}
clock = CLOCK["wall"]

# torch's OpenMP workers spin on after a parallel region: 8.9 ms of this process's CPU in a
# 20 ms sleep after the floor's compare of 64 MB (2 threads, measured). A call timed right after
# the floor found one of the two cores taken (a diff of 2 passes of one 16 MB bfloat16 pair:
# 10.2 ms, against 6.8 ms after a 20 ms pause), while the floor, timed after our pool's threads
# (which sleep at once), paid nothing. Every side-by-side round pauses this long before each
# timed call, whichever side ran before it.
SETTLE_S = 0.05


def settle() -> None:
    """Wait until the threads of the call before (torch's spinning OpenMP workers) are idle."""
    time.sleep(SETTLE_S)


@contextmanager
def scratch_dir(name: str, under: str | None) -> Iterator[Path]:
    """A fresh folder for one benchmark's files, in ``under`` (its ``--dir``; default: the
    system's temporary folder), removed afterwards whatever happens."""
    with tempfile.TemporaryDirectory(
        prefix=f"tdinspect-bench-{name}-", dir=under, ignore_cleanup_errors=True
    ) as folder:
        yield Path(folder)


def bench_model():
    """The benchmark transformer (issue #2): d_model 256, 6 layers, 4 heads, MLP 4x, vocab 1000."""
    return make_model(seed=0, **SIZES), make_tokens(BATCH, SEQ, SIZES["vocab"], seed=0)


def median_step(fn, steps: int) -> tuple[float, list[float]]:
    times = []
    for _ in range(steps):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return statistics.median(times), times


def fmt_bytes(n: float) -> str:
    return f"{n / 1e6:.1f} MB"


def threads_note() -> str:
    return f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads"


def report_line(mode: str, r: dict, target: float, extra: str = "") -> str:
    """One line of a capture benchmark: median step, ratio to eager, ratio with the final flush."""
    return (
        f"  {mode:10s} median step {r['median_s'] * 1e3:7.1f} ms vs eager {r['eager_s'] * 1e3:6.1f} ms"
        f"  ratio {r['ratio']:.2f}x (target <= {target}x)  with final flush {r['total_ratio']:.2f}x"
        f"  {extra}{fmt_bytes(r['bytes_per_pass'])}/pass"
    )


def compare_modes(model, tokens, steps: int, out: Path, modes: dict, start) -> dict:
    """Median step time of each capture mode against eager steps measured just before and after.

    ``start(folder, **kwargs)`` opens a capture (``tdinspect.capture`` or ``capture_ops``);
    ``modes`` maps a name to its kwargs. Returns per mode: median and eager step times, their
    ratio, the ratio including the final flush, bytes of tensors per pass, entries per pass.
    """
    results = {}
    eager, _ = median_step(lambda: model(tokens), steps)
    for mode, kw in modes.items():
        target = out / mode
        t0 = clock()
        with start(target, **kw) as dump:

            def step():
                model(tokens)
                dump.step()

            med, _ = median_step(step, steps)
            entries = dump.recorder.total_entries / steps
        total = clock() - t0
        eager_again, _ = median_step(lambda: model(tokens), steps)
        base = (eager + eager_again) / 2
        size = sum(f.stat().st_size for f in target.rglob("pass*.pt")) / steps
        results[mode] = dict(
            median_s=med,
            eager_s=base,
            ratio=med / base,
            total_ratio=total / (base * steps),
            bytes_per_pass=size,
            entries=entries,
        )
        eager = eager_again
        shutil.rmtree(target)
    return results


def synthetic_run(
    root: Path,
    passes: int,
    entries: int,
    numel: int,
    *,
    seed: int,
    noise: float = 0.0,
    perturb: tuple[int, int] | None = None,
    sidecars: bool = True,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """A dump of ``passes`` x ``entries`` tensors (``dtype``, default float32) of ``numel`` elements, written by our
    recorder: the same values for every seed (rolled copies of one random vector), plus
    ``noise`` everywhere (a rerun on another backend) and a 10% error at ``perturb=(pass,
    entry)``. ``sidecars=False`` removes the sidecars (a dump written by another tool)."""
    base = torch.randn(numel, generator=torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(seed)
    rec = Recorder(root, level="module", max_pending_bytes=512 << 20)
    for p in range(passes):
        for e in range(entries):
            t = base.roll(p * 7 + e)
            if noise:
                t = t + noise * torch.randn(numel, generator=gen)
            if perturb == (p, e):
                t = t + 0.1 * torch.randn(numel, generator=gen)
            rec.record(f"model.layers.{e // 10}.op{e % 10}", t.to(dtype), module_type="Linear")
        rec.step()
    rec.close()
    if not sidecars:
        for f in root.rglob("*.json"):
            f.unlink()
    return root
