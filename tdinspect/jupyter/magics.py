"""IPython magics: ``%load_ext tdinspect``.

``%tdi_open NAME PATH``
    open a DumpSet into the namespace as NAME and show its summary.
``%tdi_diff A B [--mapping FILE] [--structural report] [--metric M] [--threshold T] ... [--as NAME]``
    diff two dumps (paths or DumpSet variables) and show one summary (the verdict);
    takes every flag of ``tdinspect first-divergence``; ``--as`` binds the Diff.
``%%tdi_capture DIR [--model VAR] [--ops] [--filter REGEX ...] [--overwrite]``
    capture what the cell runs into a new run (module level on the named
    model, or op level with ``--ops``). Re-running the cell makes a new run
    beside the old one, which ``%tdi_open`` / ``%tdi_diff`` then use (they
    open the newest run); ``--overwrite`` removes the earlier runs. A cell
    that raises still writes what ran before the error, marked ``failed``
    in the pass's sidecar, and says so. ``--compare-to REF`` compares each
    entry with the reference dump while the cell runs (DIR, then optional,
    holds only the evidence; ``--on-divergence raise|warn|record`` and the comparison
    flags of ``%tdi_diff``) and prints the verdict when the cell ends.

A mistake (an unknown variable, a missing folder, a damaged dump, a bad flag)
raises ``UsageError`` with one line saying what was looked up, so "Run All"
stops at the failing cell. Loading the extension also completes entry names
inside ``ds.tensor('...``.
"""

from __future__ import annotations

import re
from pathlib import Path

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring
from IPython.display import display

from tdinspect.numerics.metrics import METRICS
from tdinspect.util.arguments import spec_flags
from tdinspect.util.terminal import visible

_NAMES = ("tdi_open", "tdi_diff", "tdi_capture")
_MISSING = object()


def _usage(exc: Exception) -> UsageError:
    return UsageError(f"{type(exc).__name__}: {exc}")


def spec_arguments(func):
    """The comparison flags of ``tdinspect first-divergence`` (one definition,
    :data:`tdinspect.util.arguments.SPEC_FLAGS`) on a magic."""
    for flags, options in reversed(spec_flags(METRICS)):
        func = argument(*flags, **options)(func)
    return func


def _spec(args):
    """The comparison spec of a magic's flags (a bad one: ``UsageError`` naming it)."""
    from tdinspect.compare.spec import CompareSpec

    try:
        return CompareSpec.from_args(args)
    except (ValueError, TypeError, OSError) as exc:
        raise _usage(exc) from exc


@magics_class
class TdinspectMagics(Magics):
    """The ``%tdi_*`` magics."""

    def _variable(self, name: str):
        value = self.shell.user_ns.get(name, _MISSING)
        if value is _MISSING:
            raise UsageError(f"no variable `{name}` in the notebook")
        return value

    def _open(self, path: str):
        from tdinspect.dumpset import DumpSet
        from tdinspect.errors import DumpFormatError

        try:
            return DumpSet.open(path)
        except (DumpFormatError, OSError, ValueError) as exc:
            raise _usage(exc) from exc

    def _dumpset(self, ref: str):
        """A DumpSet variable, else a dump folder; a clear error when it is neither."""
        from tdinspect.dumpset import DumpSet

        value = self.shell.user_ns.get(ref, _MISSING)
        if isinstance(value, DumpSet):
            return value
        if Path(ref).exists():
            return self._open(ref)
        if value is not _MISSING:
            raise UsageError(
                f"`{ref}` is a {type(value).__name__}, not a DumpSet, and no folder `{ref}` exists"
            )
        raise UsageError(
            f"`{ref}` is neither a variable in the notebook nor a folder (looked in {Path.cwd()})"
        )

    @magic_arguments()
    @argument("name", help="variable to bind the DumpSet to")
    @argument("path", help="dump folder, rank folder or pass file")
    @line_magic
    def tdi_open(self, line):
        """Open a dump into the namespace: ``%tdi_open ds dumps/run_a``."""
        args = parse_argstring(self.tdi_open, line)
        if not args.name.isidentifier():
            raise UsageError(f"`{args.name}` is not a Python variable name")
        ds = self._open(args.path)
        self.shell.user_ns[args.name] = ds
        display(ds)

    @magic_arguments()
    @argument("a", help="reference: path or DumpSet variable")
    @argument("b", help="compared: path or DumpSet variable")
    @spec_arguments
    @argument("--as", dest="as_", default=None, help="bind the Diff to this variable")
    @line_magic
    def tdi_diff(self, line):
        """Diff two dumps and show one summary: ``%tdi_diff a b --metric cosine --as d``.

        Takes every flag ``tdinspect first-divergence`` takes (``--mapping``,
        ``--structural``, ``--allow-uncompared``...); the summary is the verdict of that
        spec, and ``--as d`` keeps the Diff with it (``d.verdict()``, ``explore(d)``).
        """
        from tdinspect.report import DiffSummary

        args = parse_argstring(self.tdi_diff, line)
        spec = _spec(args)
        a, b = self._dumpset(args.a), self._dumpset(args.b)
        try:
            diff = a.diff(b, spec=spec)
            summary = DiffSummary(diff)  # the diff's own spec
        except (ValueError, TypeError, OSError) as exc:  # a bad metric, mapping file, concat
            raise _usage(exc) from exc
        if args.as_:
            self.shell.user_ns[args.as_] = diff
        display(summary)

    @magic_arguments()
    @argument(
        "dir",
        nargs="?",
        default=None,
        help="dump directory (with --compare-to: where the evidence goes, optional)",
    )
    @argument("--model", default=None, help="variable holding the nn.Module")
    @argument("--ops", action="store_true", help="op-level capture (TorchDispatchMode)")
    @argument("--filter", nargs="*", default=None, help="regexes on names")
    @argument("--overwrite", action="store_true", help="remove earlier runs in DIR")
    @argument(
        "--compare-to",
        dest="compare_to",
        default=None,
        help="reference dump: compare every entry with it while the cell runs",
    )
    @argument(
        "--on-divergence",
        dest="on_divergence",
        default="raise",
        choices=["raise", "warn", "record"],
        help="with --compare-to (default raise)",
    )
    @spec_arguments
    @cell_magic
    def tdi_capture(self, line, cell):
        """Capture what the cell runs as a new run in DIR (one pass)."""
        import tdinspect

        args = parse_argstring(self.tdi_capture, line)
        model = self._variable(args.model) if args.model else None
        if args.dir is None and args.compare_to is None:
            raise UsageError("give a dump directory (or --compare-to REF)")
        live = {}
        if args.compare_to is not None:  # the comparison flags of %tdi_diff
            live = {"compare_to": args.compare_to, "on_divergence": args.on_divergence, "spec": _spec(args)}
        try:
            if args.ops:
                cap = tdinspect.capture_ops(
                    args.dir, model=model, filter=args.filter, overwrite=args.overwrite, **live
                )
            else:
                if model is None:
                    raise UsageError("module-level capture needs --model VAR (or use --ops)")
                cap = tdinspect.capture(model, args.dir, filter=args.filter, overwrite=args.overwrite, **live)
        except (ValueError, TypeError, OSError) as exc:
            raise _usage(exc) from exc
        error = None
        with cap:
            # in this cell, as %%timeit runs its body (run_cell ran a cell of its own: its error did
            # not fail this one, so Run All went on to diff a partial dump, and its traceback was
            # labelled with another cell's number)
            try:
                self.shell.ex(self.shell.transform_cell(cell))  # IPython syntax in the body too
            except Exception as exc:  # noqa: BLE001 - the pass is written marked failed, then it goes on
                error = exc
            failed = None if error is None else f"{type(error).__name__}: {error}"
            path = cap.step(failed=failed)
        if live:  # the verdict, in the words the CLI prints
            print(visible(f"tdinspect: against {args.compare_to}: {cap.live.verdict().text}"))
        elif failed is None:
            print(f"tdinspect: wrote {path}")
        else:
            print(
                f"tdinspect: the cell raised {type(error).__name__}; wrote what ran before the "
                f"error to {path}, marked failed in its sidecar"
            )
        if error is not None:
            raise error  # the cell fails: Run All stops here


_TENSOR_CALL = re.compile(r"([A-Za-z_]\w*)\.tensor\(\s*(?:op\s*=\s*)?(['\"])([^'\"]*)$")


def _entry_matcher(shell):
    """A completer (IPython matcher API v2) for entry names inside ``ds.tensor('...``."""
    from IPython.core.completer import SimpleCompletion, context_matcher

    @context_matcher()
    def tdinspect_entries(context):
        from tdinspect.dumpset import DumpSet

        found = _TENSOR_CALL.search(context.text_until_cursor)
        ds = shell.user_ns.get(found.group(1)) if found else None
        if not isinstance(ds, DumpSet):
            return {"completions": []}
        prefix = found.group(3)
        names = [o for o in ds.ops if o.startswith(prefix)]
        return {
            "completions": [SimpleCompletion(o, type="entry") for o in names],
            "matched_fragment": prefix,
            "suppress": bool(names),
            "ordered": True,
        }

    return tdinspect_entries


def load_ipython_extension(ipython) -> None:
    """Register the magics and the entry-name completer (loading twice changes nothing)."""
    ipython.register_magics(TdinspectMagics)
    completer = getattr(ipython, "Completer", None)
    if completer is not None and not any(
        getattr(m, "__qualname__", "").endswith("tdinspect_entries") for m in completer.custom_matchers
    ):
        completer.custom_matchers.append(_entry_matcher(ipython))


def unload_ipython_extension(ipython) -> None:
    """Remove the magics and the completer that :func:`load_ipython_extension` added."""
    for kind in ("line", "cell"):
        table = ipython.magics_manager.magics[kind]
        for name in _NAMES:
            table.pop(name, None)
    completer = getattr(ipython, "Completer", None)
    if completer is not None:
        completer.custom_matchers[:] = [
            m
            for m in completer.custom_matchers
            if not getattr(m, "__qualname__", "").endswith("tdinspect_entries")
        ]
