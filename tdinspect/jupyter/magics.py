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

Re-running cells stays quiet and bounded: each cell prints one short line at
most (which run it wrote or opened), never a warning quoting tdinspect's own
source, and a capture cell keeps the newest ``keep_runs`` runs of its folder
(3; ``%config TdinspectMagics.keep_runs = 5``, or ``$TDINSPECT_KEEP_RUNS``;
``--keep-runs N`` for one cell), removing older finished runs capture cells made
(a script's runs in that folder are kept); a ``--compare-to`` cell keeps the rows and
evidence of its newest ``keep_runs`` re-runs in this kernel the same way.

A mistake (an unknown variable, a missing folder, a damaged dump, a bad flag)
raises ``UsageError`` with one line saying what was looked up, so "Run All"
stops at the failing cell. Loading the extension also completes entry names
inside ``ds.tensor('...``.
"""

from __future__ import annotations

import os
import re
import sys
import warnings
from pathlib import Path

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring
from IPython.display import display
from traitlets import Integer

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


def _default_keep_runs() -> int:
    value = os.environ.get("TDINSPECT_KEEP_RUNS", "").strip()
    return int(value) if value.isdigit() and int(value) > 0 else 3


_OWN = tuple(
    os.path.dirname(os.path.abspath(m.__file__)) + os.sep
    for m in (sys.modules["tdinspect"], sys.modules["IPython"], sys.modules["traitlets"])
)


def _user_stacklevel() -> int:
    """``stacklevel`` for ``warnings.warn`` called here that names the user's cell (the first
    frame outside tdinspect, IPython and traitlets), never tdinspect's own source line."""
    frame, level = sys._getframe(1), 1  # level 1: the frame calling warnings.warn
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_OWN):
        frame, level = frame.f_back, level + 1
    return level


class _Quiet:
    """Warnings raised inside a magic, held: the routine notes about earlier runs
    (:class:`~tdinspect.errors.RunsNote`) become part of the cell's one line; tdinspect's others
    are warned again attributed to the user's cell; the user's own code's, as they were."""

    def __enter__(self):
        self._catch = warnings.catch_warnings(record=True)
        self.caught = self._catch.__enter__()
        warnings.simplefilter("always")
        return self

    def __exit__(self, *exc) -> None:
        self._catch.__exit__(*exc)
        from tdinspect.errors import RunsNote

        for w in self.caught:
            if issubclass(w.category, RunsNote):
                continue
            if os.path.abspath(w.filename).startswith(_OWN):
                warnings.warn(str(w.message), w.category, stacklevel=_user_stacklevel())
            else:  # the user's own code warned: as it would have
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)


@magics_class
class TdinspectMagics(Magics):
    """The ``%tdi_*`` magics."""

    keep_runs = Integer(
        _default_keep_runs(),
        min=1,
        config=True,
        help="runs a %%tdi_capture cell keeps in its folder (the newest; older finished runs "
        "tdinspect made are removed). Default 3, or $TDINSPECT_KEEP_RUNS.",
    ).tag(config=True)

    def _variable(self, name: str):
        value = self.shell.user_ns.get(name, _MISSING)
        if value is _MISSING:
            raise UsageError(f"no variable `{name}` in the notebook")
        return value

    def _open(self, path: str, notes: list[str] | None = None):
        """``DumpSet.open(path)``; when ``path`` holds several runs, a short note naming the one
        opened goes to ``notes`` (printed by the caller as one line), not a warning."""
        from tdinspect.dumpset import DumpSet
        from tdinspect.errors import DumpFormatError

        try:
            with _Quiet():
                ds = DumpSet.open(path)
        except (DumpFormatError, OSError, ValueError) as exc:
            raise _usage(exc) from exc
        runs = len(DumpSet.runs(path)) if ds.run is not None and Path(path).is_dir() else 1
        if runs > 1 and notes is not None:
            notes.append(f"{path} holds {runs} runs; opened the newest, {ds.run.name}")
        return ds

    def _dumpset(self, ref: str, notes: list[str] | None = None):
        """A DumpSet variable, else a dump folder; a clear error when it is neither."""
        from tdinspect.dumpset import DumpSet

        value = self.shell.user_ns.get(ref, _MISSING)
        if isinstance(value, DumpSet):
            return value
        if Path(ref).exists():
            return self._open(ref, notes)
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
        notes: list[str] = []
        ds = self._open(args.path, notes)
        self.shell.user_ns[args.name] = ds
        if notes:
            print(visible(f"tdinspect: {notes[0]}"))
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
        notes: list[str] = []
        a, b = self._dumpset(args.a, notes), self._dumpset(args.b, notes)
        if notes:
            print(visible(f"tdinspect: {'; '.join(notes)}"))
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
        "--keep-runs",
        dest="keep_runs",
        type=int,
        default=None,
        help="runs to keep in DIR, the newest (default: TdinspectMagics.keep_runs, 3)",
    )
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
        keep = self.keep_runs if args.keep_runs is None else args.keep_runs
        if keep < 1:
            raise UsageError(f"--keep-runs {keep}: keep 1 run or more")
        before = _run_folders(args.dir)
        try:
            with _Quiet():
                if args.ops:
                    cap = tdinspect.capture_ops(
                        args.dir, model=model, filter=args.filter, overwrite=args.overwrite, **live
                    )
                else:
                    if model is None:
                        raise UsageError("module-level capture needs --model VAR (or use --ops)")
                    cap = tdinspect.capture(
                        model, args.dir, filter=args.filter, overwrite=args.overwrite, **live
                    )
        except (ValueError, TypeError, OSError) as exc:
            raise _usage(exc) from exc
        error = None
        with _Quiet(), cap:
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
            if args.dir is not None:
                note = _prune_live(args.dir, keep, cap.live.made)
                if note:
                    print(visible(note))
        else:
            note = _prune(args.dir, keep, before)
            if failed is None:
                print(visible(f"tdinspect: wrote {path}{note}"))
            else:
                print(
                    visible(
                        f"tdinspect: the cell raised {type(error).__name__}; wrote what ran before "
                        f"the error to {path}, marked failed in its sidecar{note}"
                    )
                )
        if error is not None:
            raise error  # the cell fails: Run All stops here


def _run_folders(folder: str | None) -> set[str]:
    """The names of the ``rank*_pid*`` folders directly in ``folder`` (links not followed)."""
    from tdinspect.store.format import RANK_DIR_RE

    try:
        return {e.name for e in os.scandir(folder) if RANK_DIR_RE.match(e.name)} if folder else set()
    except OSError:
        return set()


CELL = "%%tdi_capture"  # what a capture cell's runs say made them (run.json "made_by")


def _prune(folder: str, keep: int, before: set[str]) -> str:
    """Keep the newest ``keep`` runs of ``folder`` that capture cells made; what to add to the
    cell's one line (how many runs it holds, how many this cell removed: ``--overwrite`` or
    beyond ``keep``). Runs a script made there are never removed by a cell."""
    from tdinspect.store.runs import list_runs, mark_run, prune_runs, read_manifest

    for name in _run_folders(folder) - before:  # this cell's run (of this process)
        path = Path(folder) / name
        if not path.is_symlink() and (read_manifest(path) or {}).get("pid") == os.getpid():
            mark_run(path, CELL)
    prune_runs(folder, keep, made_by=CELL)
    removed = len(before - _run_folders(folder))
    runs = len(list_runs(folder))
    if runs <= 1 and not removed:
        return ""
    return f" ({runs} run{'s' if runs > 1 else ''} kept" + (f", {removed} older removed)" if removed else ")")


# per dump directory, the folders each live capture cell of this process made there, oldest first
_LIVE_MADE: dict[str, list[list[Path]]] = {}


def _prune_live(folder: str, keep: int, made: list[Path]) -> str:
    """Keep the folders of the newest ``keep`` live capture cells of this process into
    ``folder`` (their rows and evidence: ``live_run2``, ``evidence/run/rank0_pid7_run2``...);
    what to print when older ones went. Folders a script, another process or an earlier
    kernel made are never removed."""
    from tdinspect.store.runs import remove_made_folders

    runs = _LIVE_MADE.setdefault(os.path.realpath(folder), [])
    if made:
        runs.append(list(made))
    removed = 0
    while len(runs) > keep:
        removed += len(remove_made_folders(runs.pop(0)))
    if not removed:
        return ""
    return f"tdinspect: removed {removed} folder(s) older live cells made in {folder} (keeping {keep} runs)"


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
