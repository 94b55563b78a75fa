"""IPython magics: ``%load_ext tdinspect``.

``%tdi_open NAME PATH``
    open a DumpSet into the namespace as NAME and show its summary.
``%tdi_diff A B [--metric M] [--threshold T] [--as NAME]``
    diff two dumps (paths or DumpSet variables), show the first divergence.
``%%tdi_capture DIR [--model VAR] [--ops] [--filter REGEX ...]``
    capture what the cell runs, one pass per cell run (module level on the
    named model, or op level with ``--ops``).

Errors print one line, not a traceback from inside the toolkit.
"""

from __future__ import annotations

import sys

from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring
from IPython.display import display

_NAMES = ("tdi_open", "tdi_diff", "tdi_capture")


@magics_class
class TdinspectMagics(Magics):
    """The ``%tdi_*`` magics."""

    def _fail(self, exc: Exception) -> None:
        print(f"tdinspect: {type(exc).__name__}: {exc}", file=sys.stderr)

    def _resolve(self, ref: str):
        from ..dumpset import DumpSet

        value = self.shell.user_ns.get(ref)
        return value if isinstance(value, DumpSet) else DumpSet.open(ref)

    @magic_arguments()
    @argument("name", help="variable to bind the DumpSet to")
    @argument("path", help="dump folder, rank folder or pass file")
    @line_magic
    def tdi_open(self, line):
        """Open a dump into the namespace: ``%tdi_open ds dumps/run_a``."""
        try:
            args = parse_argstring(self.tdi_open, line)
            from ..dumpset import DumpSet

            ds = DumpSet.open(args.path)
        except (Exception, SystemExit) as exc:
            return self._fail(exc)
        self.shell.user_ns[args.name] = ds
        display(ds)

    @magic_arguments()
    @argument("a", help="reference: path or DumpSet variable")
    @argument("b", help="compared: path or DumpSet variable")
    @argument("--metric", default=None, help="rel_diff (default), max_abs, cosine, ...")
    @argument("--threshold", type=float, default=None, help="divergence threshold")
    @argument("--as", dest="as_", default=None, help="bind the Diff to this variable")
    @line_magic
    def tdi_diff(self, line):
        """Diff two dumps and show the first divergence: ``%tdi_diff a b --as d``."""
        try:
            args = parse_argstring(self.tdi_diff, line)
            diff = self._resolve(args.a).diff(self._resolve(args.b))
            div = diff.first_divergence(args.threshold, args.metric)
        except (Exception, SystemExit) as exc:
            return self._fail(exc)
        if args.as_:
            self.shell.user_ns[args.as_] = diff
        display(diff)
        return div

    @magic_arguments()
    @argument("dir", help="dump directory")
    @argument("--model", default=None, help="variable holding the nn.Module")
    @argument("--ops", action="store_true", help="op-level capture (TorchDispatchMode)")
    @argument("--filter", nargs="*", default=None, help="regexes on names")
    @cell_magic
    def tdi_capture(self, line, cell):
        """Capture what the cell runs, one pass per run of the cell."""
        import tdinspect

        try:
            args = parse_argstring(self.tdi_capture, line)
            model = self.shell.user_ns[args.model] if args.model else None
            if args.ops:
                cap = tdinspect.capture_ops(args.dir, model=model, filter=args.filter)
            else:
                if model is None:
                    raise ValueError("module-level capture needs --model VAR (or use --ops)")
                cap = tdinspect.capture(model, args.dir, filter=args.filter)
        except (Exception, SystemExit) as exc:
            return self._fail(exc)
        with cap:
            result = self.shell.run_cell(cell)
            path = cap.step()
        if result.error_in_exec is None:
            print(f"tdinspect: wrote {path}")


def load_ipython_extension(ipython) -> None:
    """Register the magics (idempotent: loading twice changes nothing)."""
    ipython.register_magics(TdinspectMagics)


def unload_ipython_extension(ipython) -> None:
    """Remove the magics that :func:`load_ipython_extension` added."""
    for kind in ("line", "cell"):
        table = ipython.magics_manager.magics[kind]
        for name in _NAMES:
            table.pop(name, None)
