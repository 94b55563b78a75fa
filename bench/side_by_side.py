"""One bench of two checkouts side by side: their processes alternate, round after round.

Run: ``python bench/side_by_side.py A_CHECKOUT B_CHECKOUT ROUNDS BENCH [BENCH ARGS...]``, e.g.
``python bench/side_by_side.py ../main . 4 tokens.py --decode 16 --clock cpu``. Each round
runs ``BENCH`` of each checkout once (that checkout first on ``PYTHONPATH``; A first in even
rounds, B first in odd ones) and prints its last lines; for ``tokens.py``, the medians of
every timed round of each checkout's processes and their ratios (B over A) close the output.
Processes, not threads: two versions of one package cannot share an interpreter.
"""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys
from pathlib import Path


def main() -> None:
    if len(sys.argv) < 5:
        sys.exit(__doc__)
    trees = {"A": Path(sys.argv[1]).resolve(), "B": Path(sys.argv[2]).resolve()}
    rounds, bench, args = int(sys.argv[3]), sys.argv[4], sys.argv[5:]
    timed: dict[str, dict[str, list[float]]] = {k: {"plain": [], "tokens": []} for k in trees}
    for r in range(rounds):
        order = list(trees.items()) if r % 2 == 0 else list(trees.items())[::-1]
        for name, tree in order:
            env = dict(os.environ, PYTHONPATH=str(tree))
            done = subprocess.run(
                [sys.executable, str(tree / "bench" / bench), *args],
                cwd=tree,
                env=env,
                capture_output=True,
                text=True,
                check=False,
            )
            text = done.stdout + done.stderr
            print(f"--- round {r} {name} ({tree}):", *text.strip().splitlines()[-6:], sep="\n", flush=True)
            found = re.search(r"rounds plain \[([^\]]*)\], tokens \[([^\]]*)\]", text)
            if found:
                timed[name]["plain"] += [float(v) for v in found.group(1).split(",")]
                timed[name]["tokens"] += [float(v) for v in found.group(2).split(",")]
    if all(timed[k]["tokens"] for k in trees):
        med = {k: {w: statistics.median(v) for w, v in timed[k].items()} for k in trees}
        for k in trees:
            print(f"{k}: plain {med[k]['plain']:.4f} s, tokens=True {med[k]['tokens']:.4f} s")
        print(
            f"B / A: tokens=True {med['B']['tokens'] / med['A']['tokens']:.3f}, "
            f"plain {med['B']['plain'] / med['A']['plain']:.3f}"
        )


if __name__ == "__main__":
    main()
