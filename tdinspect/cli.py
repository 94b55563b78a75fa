"""Command line: ``tdinspect ls|stats|diff|first-divergence|report|first-nonfinite|suggest-mapping|demo``.

Exit status: 0 when nothing diverges, 1 when something does, 2 on any error
(one line on stderr naming the file or argument; ``--debug`` adds the
traceback), so ``tdinspect first-divergence ref/ new/`` can gate a CI pipeline;
``first-divergence`` and ``diff`` exit 3 when the comparison is incomplete (nothing
diverged among the entries compared, but others were set aside or never compared, or
nothing was compared; ``--allow-uncompared REGEX`` names those that may be);
141, silently, when the reader of the output left (``| head``), as for any
command ended by SIGPIPE. Every command
maps onto the Python API (DumpSet.open, Diff.first_divergence, ...); ``--json``
prints machine-readable output.

Examples
--------
::

    tdinspect ls dumps/run_a
    tdinspect stats dumps/run_a --op 'layers\\.0\\.'
    tdinspect diff dumps/run_a dumps/run_b --metric rel_diff --threshold 1e-3
    tdinspect first-divergence dumps/run_a dumps/run_b --threshold 'attn=1e-2' --json
    tdinspect report dumps/run_a dumps/run_b -o report.html
    tdinspect first-nonfinite dumps/run_a

``--threshold auto`` (the default) derives each entry's threshold from its
two dtypes (``rel_diff``: ``u/4``, ``u`` the unit roundoff of the coarser:
float32 1.5e-8, bfloat16 9.8e-4; see :mod:`tdinspect.numerics.metrics`); a number
keeps one threshold for every entry.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import traceback
import warnings
from typing import Any

from tdinspect.numerics.metrics import METRICS
from tdinspect.report import text_table
from tdinspect.util.arguments import add_spec_arguments, nonempty
from tdinspect.util.terminal import visible, visible_streams


class _Fail(Exception):
    pass


def _json_default(o: Any):
    if isinstance(o, float) and (math.isnan(o) or math.isinf(o)):
        return None
    return str(o)


def _dump(obj: Any) -> str:
    def clean(v):
        if isinstance(v, float) and not math.isfinite(v):
            return None if math.isnan(v) else ("inf" if v > 0 else "-inf")
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [clean(x) for x in v]
        if hasattr(v, "item"):
            return clean(v.item())
        return v

    return json.dumps(clean(obj), indent=2, default=_json_default)


def _run_arg(value: str | None) -> int | str | None:
    """``--run -2`` is an index, anything else a run id or folder name."""
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        return value


def cmd_ls(args) -> int:
    from tdinspect.dumpset import DumpSet

    ds = DumpSet.open(args.path, run=_run_arg(args.run), on_error=args.on_error)
    s = ds.summary()
    runs = DumpSet.runs(args.path)
    if args.json:
        print(
            _dump(
                {
                    **s,
                    "passes": ds.passes,
                    "ops": ds.ops,
                    "runs": [
                        {
                            "id": r.id,
                            "folders": [f.path.name for f in r.folders],
                            "started": r.started,
                            "opened": r.id == ds.run.id,
                        }
                        for r in runs
                    ],
                }
            )
        )
        return 0
    if len(runs) > 1:
        print(f"{len(runs)} runs (oldest first; --run N or a folder name picks one):")
        for i, r in enumerate(runs):
            print(f"  {'*' if r.id == ds.run.id else ' '} [{i - len(runs)}] {r.describe()}")
    print(repr(ds))
    first = ds.pass_indexes()[0]
    calls: dict[str, int] = {}
    from tdinspect.naming import split_call

    for k in first.keys:
        base, call = split_call(k)
        calls[base] = max(calls.get(base, 0), call + 1)
    shapes = _shapes_per_call(ds)
    rows = [
        [k, calls.get(k, 0), first.dtype[first.position[k]] if k in first.position else "", shapes.get(k, "")]
        for k in ds.ops
    ]
    print(text_table(["op", f"calls in pass {first.index}", "dtype", "shape"], rows))
    return 0


def _shapes_per_call(ds) -> dict[str, str]:
    """Each op's shape, or, when its calls differ (prefill ``[2, 16, 64]`` then decode
    ``[2, 1, 64]``), every distinct shape with where it first appears and how often."""
    from tdinspect.naming import split_call

    seen: dict[str, dict[str, list]] = {}
    for pi in ds.pass_indexes():
        for key, shape in zip(pi.keys, pi.shape):
            base, call = split_call(key)
            where = seen.setdefault(base, {}).setdefault(str(shape), [pi.index, call, 0])
            where[2] += 1
    out = {}
    for base, by_shape in seen.items():
        if len(by_shape) == 1:
            out[base] = next(iter(by_shape))
        else:
            out[base] = "; ".join(
                f"{shape} (pass {p} call {c}{f', x{n}' if n > 1 else ''})"
                for shape, (p, c, n) in by_shape.items()
            )
    return out


def cmd_stats(args) -> int:
    from tdinspect.dumpset import DumpSet

    ds = DumpSet.open(args.path, run=_run_arg(args.run), on_error=args.on_error)
    if args.op:
        try:
            ds = ds.filter(args.op)
        except ValueError as exc:
            raise _Fail(f"--op: {exc}") from None
    if args.pass_ is not None and args.pass_ not in ds.passes:
        shown = ", ".join(map(str, ds.passes[:8])) + (", ..." if len(ds.passes) > 8 else "")
        raise _Fail(f"--pass {args.pass_}: {args.path} has no such pass (passes: {shown})")
    df = ds.entries(progress=False)
    if args.pass_ is not None:
        df = df[df["pass"] == args.pass_]
    cols = ["rank", "pass", "key", "dtype", "shape", "min", "max", "mean", "std", "absmax", "nan", "inf"]
    if args.json:
        print(_dump(df[cols].to_dict("records")))
    else:
        print(text_table(cols, df[cols].values.tolist()))
    return 0


def _spec(args):
    """The comparison spec of the command's flags (a bad value: exit 2, naming the flag)."""
    from tdinspect.compare.spec import CompareSpec

    if getattr(args, "baseline_factor", None) is not None and getattr(args, "baseline", None) is None:
        raise _Fail("--baseline-factor K: give the baseline run too (--baseline DIR)")
    try:
        return CompareSpec.from_args(args)
    except ValueError as exc:
        raise _Fail(str(exc)) from None


def _diff(args):
    from tdinspect.dumpset import DumpSet
    from tdinspect.errors import DumpFormatError

    spec = _spec(args)
    a = DumpSet.open(args.a, on_error=args.on_error)
    if spec.baseline is not None:  # opened here, so that its errors follow --on-error
        try:
            spec = spec.replace(baseline=DumpSet.open(spec.baseline, on_error=args.on_error))
        except DumpFormatError as exc:  # which of the three dumps: say so
            raise _Fail(f"--baseline {exc}") from None
    return a.diff(DumpSet.open(args.b, on_error=args.on_error), spec=spec)


# the exit status of each outcome of first-divergence and diff (2: an error)
EXIT = {"matches": 0, "diverges": 1, "incomplete": 3}


def cmd_first_divergence(args) -> int:
    diff = _diff(args)
    summary = diff.summary()  # the spec's metric, threshold, structural mode, allowed entries
    div = summary["first_divergence"]
    status = EXIT[summary["outcome"]]
    if args.json:
        print(_dump(summary))
        return status
    if div is None:
        head = "no divergence" if summary["outcome"] == "matches" else "incomplete"
        print(
            f"{head} ({summary['metric']}, {diff.mode} mode): {diff.a.path} vs {diff.b.path}"
            f"\n  threshold: {summary['threshold']}"
        )
        print(f"  {visible(summary['verdict'])}")  # what %%tdi_capture --compare-to prints too
        if summary["nearest"]:
            print(f"  nearest: {visible(summary['nearest']['text'])}")
    else:
        where = f"pass {div['pass']}" + (f", rank {div['rank']}" if div["rank"] else "")
        if "request" in div:  # --tokens: the pass is the request
            where = f"request {div['request']}" + (
                f", position {div['position']}" if div["position"] >= 0 else ""
            )
        print(
            f"first divergence: {visible(div['key'])} ({where}, call {div['call']})\n"
            f"  {visible(div['reason'])}"
            f"\n  threshold: {summary['threshold']}"
        )
    if diff.spec.describe():
        print(f"  compared with: {visible(diff.spec.describe())}")
    listed = summary.get("structural_entries")
    if listed:
        print(f"{len(listed)} structural entries set aside (--structural report):")
        print(
            text_table(
                ["pass", "rank", "key", "key_b", "reason"],
                [[r["pass"], r["rank"], r["key"], r["key_b"], r["reason"]] for r in listed],
            )
        )
    return status


def cmd_diff(args) -> int:
    diff = _diff(args)
    metric, thr = diff.default_metric, diff.spec.threshold
    df = diff.divergences(progress=False)
    summary = diff.summary()
    status = EXIT[summary["outcome"]]
    if args.json:
        summary["divergences"] = (
            df[["rank", "pass", "key", "reason", metric, "why"]].head(args.limit).to_dict("records")
        )
        summary["n_divergences"] = int(len(df))
        print(_dump(summary))
        return status
    print(diff.headline(metric, thr))  # the rule of the metric asked for, when it is auto
    print(f"threshold: {summary['threshold']}")
    if df.empty:
        if summary["outcome"] == "incomplete":
            print(visible(summary["verdict"]))
        else:
            print(f"no divergence ({metric})")
        if summary["nearest"]:
            print(f"nearest: {visible(summary['nearest']['text'])}")
        return status
    cols = ["pass", "rank", "key", metric, "why"]
    print(f"{len(df)} divergent entries ({metric}); first {min(len(df), args.limit)}:")
    rows = df[cols].head(args.limit).values.tolist()
    for row, thr in zip(rows, df["threshold"]):  # a divergent cosine of 0.99999773 is not "1"
        row[3] = _value_text(row[3], thr)
    print(text_table(cols, rows))
    div = summary["first_divergence"]
    print(f"first divergence: {visible(div['key'])} (pass {div['pass']}): {visible(div['reason'])}")
    return status


def cmd_report(args) -> int:
    from tdinspect.report import DiffSummary, report_page

    diff = _diff(args)  # every part of the page answers by the diff's own spec
    summary = DiffSummary(diff)
    page = report_page(
        summary._repr_html_(),
        diff.tree(progress=False),
        diff.health(progress=False),
        f"tdinspect report: {diff.a.path} vs {diff.b.path}",
    )
    if args.output in (None, "-"):
        sys.stdout.write(page + "\n")
    else:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(page)
        print(visible(f"wrote {args.output}: {summary.verdict.text}"))
    return EXIT[summary.verdict.outcome]


def _value_text(value, thr):
    """A divergent metric value with the digits its reason shows (0.99999773, not 1)."""
    from tdinspect.compare.thresholds import digits_apart

    if not isinstance(value, float) or not math.isfinite(value) or not math.isfinite(thr):
        return value
    return f"{value:.{digits_apart(value, thr)}g}"


def cmd_first_nonfinite(args) -> int:
    from tdinspect.dumpset import DumpSet

    found = DumpSet.open(args.path, on_error=args.on_error).first_nonfinite()
    if args.json:
        print(
            _dump(
                None
                if found is None
                else {
                    "key": found.key,
                    "op": found.op,
                    "call": found.call,
                    "pass": found.pass_,
                    "rank": found.rank,
                    "nan": found.nan,
                    "inf": found.inf,
                    "numel": found.numel,
                    "inherited": found.inherited,
                    "order": found.order,
                }
            )
        )
    elif found is None:
        print(f"no NaN/Inf in {args.path}")
    else:
        print(f"first non-finite output: {found.describe()}")
    return 0 if found is None else 1


def cmd_suggest_mapping(args) -> int:
    from tdinspect.dumpset import DumpSet
    from tdinspect.suggest import suggest_mapping

    s = suggest_mapping(
        DumpSet.open(args.a, on_error=args.on_error),
        DumpSet.open(args.b, on_error=args.on_error),
        pass_=args.pass_,
        rank=args.rank,
        tol=args.tol,
        min_confidence=args.min_confidence,
    )
    if args.json:
        print(
            _dump(
                {
                    "rules": s.rules,
                    "pairs": s.pairs.to_dict("records"),
                    "unmatched_a": s.unmatched_a,
                    "unmatched_b": s.unmatched_b,
                }
            )
        )
    else:
        print(s.to_yaml(), end="")
    return 0


def cmd_dashboard(args) -> int:
    from tdinspect.jupyter.dashboard import serve

    return serve(args.a, args.b, port=args.port, spec=_spec(args), open_browser=not args.no_browser)


def cmd_demo(args) -> int:
    from tdinspect.examples.demo import run_demo

    return run_demo(args.out)


def _port(text: str) -> int:
    """A TCP port, 0-65535 (argparse's error, exit 2, otherwise: -1 was a traceback, 70000
    served on 4464 while saying 70000)."""
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{visible(text)!r} is not a port (0 to 65535; 0: any free port)")
    return value


EXIT_STATUS = """exit status:
  0  matches: every entry of both sides compared (at least one), none past its threshold
  1  diverges: the first divergence is printed
  2  error (one line on stderr)
  3  incomplete: nothing diverged among the entries compared, but entries were
     set aside (--structural report) or never compared, or none was; the output says
     which and where the comparison stopped (--allow-uncompared REGEX names those that
     may be)"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tdinspect", description="Inspect and compare tensor dumps.")
    parser.add_argument("--debug", action="store_true", help="on an error, print the traceback too")
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p, two=False, json=True):
        if two:
            p.add_argument("a", type=nonempty, help="reference dump (folder, rank folder or pass file)")
            p.add_argument("b", type=nonempty, help="compared dump")
            add_spec_arguments(p, METRICS)
        else:
            p.add_argument("path", type=nonempty, help="dump folder, rank folder or pass file")
            p.add_argument(
                "--run",
                type=nonempty,
                default=None,
                help="which run of a folder holding several: "
                "-1 the newest (default), -2 the one before, 0 the oldest, or a "
                "run id or rank folder name",
            )
        if json:  # report writes HTML only: a --json it ignored gave a page to a JSON reader
            p.add_argument("--json", action="store_true", help="machine-readable output")
        p.add_argument(
            "--on-error",
            choices=["raise", "warn"],
            default="raise",
            help="on an unreadable pass: stop (default) or skip it with a warning",
        )
        p.add_argument(
            "--debug",
            action="store_true",
            default=argparse.SUPPRESS,
            help="on an error, print the traceback too",
        )

    common(sub.add_parser("ls", help="what a dump holds"))
    p = sub.add_parser("stats", help="per-entry statistics")
    common(p)
    p.add_argument("--op", help="regex on entry names")
    p.add_argument("--pass", dest="pass_", type=int, help="one pass only")
    p = sub.add_parser(
        "diff",
        help="all divergences between two dumps",
        description="All divergences between two dumps.",
        epilog=EXIT_STATUS,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    common(p, two=True)
    p.add_argument("--limit", type=int, default=20, help="rows shown")
    p = sub.add_parser(
        "first-divergence",
        help="the first divergent entry",
        description="The first divergent entry, in the reference's execution order.",
        epilog=EXIT_STATUS,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    common(p, two=True)
    p = sub.add_parser(
        "report",
        help="an HTML page of a diff: its verdict, module tree and health table (a CI artifact)",
        description="An HTML page of a diff (its verdict, module tree and health table); it needs no "
        "kernel or script to read.",
        epilog=EXIT_STATUS,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    common(p, two=True, json=False)
    p.add_argument(
        "-o", "--output", type=nonempty, metavar="FILE", default=None, help="the HTML file (default: stdout)"
    )
    common(sub.add_parser("first-nonfinite", help="the first output holding NaN or Inf"))
    p = sub.add_parser(
        "suggest-mapping",
        help="propose mapping rules (YAML on stdout) pairing differently named entries of A and B",
    )
    p.add_argument("a", type=nonempty, help="reference dump")
    p.add_argument("b", type=nonempty, help="compared dump (a port, another engine)")
    p.add_argument("--pass", dest="pass_", type=int, default=None, help="pass to learn from")
    p.add_argument("--rank", type=int, default=None, help="rank to learn from")
    p.add_argument("--tol", type=float, default=1e-6, help="rel_diff at which values count as equal")
    p.add_argument(
        "--min-confidence", type=float, default=0.6, help="pairs below it are listed as comments, not used"
    )
    p.add_argument("--json", action="store_true", help="rules, pairs and unmatched entries as JSON")
    p.add_argument("--on-error", choices=["raise", "warn"], default="raise")
    p.add_argument(
        "--debug", action="store_true", default=argparse.SUPPRESS, help="on an error, print the traceback too"
    )
    p = sub.add_parser(
        "dashboard",
        help="serve a dashboard of two dumps in the browser (Voila: pip install 'tdinspect[dashboard]')",
    )
    p.add_argument("a", type=nonempty, help="reference dump")
    p.add_argument("b", type=nonempty, help="compared dump")
    add_spec_arguments(p, METRICS)
    p.add_argument("--port", type=_port, default=8866, help="0 to 65535 (default 8866; 0: any free port)")
    p.add_argument("--no-browser", action="store_true", help="do not open a browser")
    p.add_argument(
        "--debug", action="store_true", default=argparse.SUPPRESS, help="on an error, print the traceback too"
    )
    p = sub.add_parser("demo", help="capture two runs of the bundled model, diff them, plot")
    p.add_argument(
        "--out", type=nonempty, default=None, help="folder for the dumps and the PNG (default: temporary)"
    )
    p.add_argument(
        "--debug", action="store_true", default=argparse.SUPPRESS, help="on an error, print the traceback too"
    )
    return parser


COMMANDS = {
    "ls": cmd_ls,
    "stats": cmd_stats,
    "diff": cmd_diff,
    "first-divergence": cmd_first_divergence,
    "first-nonfinite": cmd_first_nonfinite,
    "report": cmd_report,
    "suggest-mapping": cmd_suggest_mapping,
    "dashboard": cmd_dashboard,
    "demo": cmd_demo,
}


_SIGPIPE_STATUS = 141  # 128 + SIGPIPE: what a shell reports for a command whose reader left


def _reader_gone() -> bool:
    """Whether stdout's reader closed the pipe (``tdinspect diff a b | head``). If so,
    stdout is pointed at /dev/null so that the exit does not fail on the unwritten rest."""
    import select

    try:
        fd = sys.stdout.fileno()
        events = select.poll()
        events.register(fd, select.POLLOUT)
        gone = any(ev & (select.POLLERR | select.POLLHUP) for _, ev in events.poll(0))
    except (AttributeError, OSError, ValueError):  # no file descriptor, or no poll()
        return False
    if gone:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, fd)
        os.close(devnull)
    return gone


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``tdinspect`` command; returns the exit status.

    Any failure is exit status 2 with one line on stderr (1 means "divergence
    found", 3 "incomplete": see :data:`EXIT`); ``--debug`` prints the traceback as well. When the reader of
    stdout leaves (``| head``), the command stops quietly with 141, as a
    command ended by SIGPIPE does. Everything it prints goes through
    :func:`tdinspect.util.terminal.visible`.
    """
    args = build_parser().parse_args(argv)
    shown = warnings.formatwarning
    warnings.formatwarning = _format_warning  # how a warning is printed (recording is untouched)
    try:
        with visible_streams():  # names from files never reach the terminal as control characters
            return _run(args)
    finally:
        warnings.formatwarning = shown


def _format_warning(message, category, filename, lineno, line=None) -> str:
    """A warning as one line of the command's own (``tdinspect: ...``), never the source line of
    tdinspect that raised it (``.../cli.py:107: RunWarning:`` meant nothing to a user)."""
    text = str(message)
    text = text if text.startswith("tdinspect") else f"tdinspect: {text}"
    return f"{text} [{category.__name__}]\n"


def _arguments_escaped(msg: str, args) -> str:
    """``msg`` with each argument that holds a line break or another control character (a
    path named ``a\\nb``) written as its escapes, so that the one line shown holds it whole
    (it was cut at the newline)."""
    values = []
    for value in vars(args).values():
        values.extend(value if isinstance(value, (list, tuple)) else [value])
    for value in sorted({v for v in values if isinstance(v, str)}, key=len, reverse=True):
        shown = visible(value)
        if shown != value:
            for form in {value, os.path.normpath(value), os.path.abspath(value)}:
                msg = msg.replace(form, visible(form))
    return msg


def _run(args) -> int:
    from tdinspect.errors import ConfigError, DumpFormatError

    try:
        return COMMANDS[args.command](args)
    except KeyboardInterrupt:
        print(f"tdinspect {args.command}: interrupted", file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 - the CLI's contract: exit 2, one clear line
        if isinstance(exc, BrokenPipeError) and _reader_gone():
            return _SIGPIPE_STATUS
        if args.debug:
            traceback.print_exc()
        if isinstance(exc, (_Fail, DumpFormatError, ConfigError, OSError)):
            msg = str(exc)
        elif isinstance(exc, KeyError) and exc.args:
            msg = str(exc.args[0])
        else:
            msg = f"{type(exc).__name__}: {exc}"
        first = (_arguments_escaped(msg, args).strip().splitlines() or [type(exc).__name__])[0]
        hint = "" if args.debug else " (--debug shows the traceback)"
        if isinstance(exc, (_Fail, DumpFormatError, ConfigError, OSError, ValueError, KeyError)):
            hint = ""
        print(f"tdinspect {args.command}: error: {first}{hint}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
