"""Runs: every capture has an identity, and a new run never merges into an old one.

Each capture creates its own rank folder and writes a manifest, ``run.json``,
beside the passes before the first of them::

    <dump_dir>/rank0_pid1/run.json          {"format": "tdinspect.run", "run_id", "started", ...}
              rank0_pid1/pass00000.pt       (layout unchanged: plain torch.load still reads it)
              rank0_pid1_run2/run.json      the same pid again (PID 1 in a container, a re-run
              rank0_pid1_run2/pass00000.pt  cell in one kernel): a new folder, numbered from 0

Rank folders are grouped into runs: the folders of one launch (one per rank)
share a group (``$TDINSPECT_RUN_ID``, or torchrun's master address, port, run id
and restart count) or, without one, started within :data:`SAME_RUN_SECONDS` of
each other; a rank seen twice always starts a new run. Folders written before
manifests existed are grouped the same way by the time of their first file.

:func:`list_runs` lists the runs of a dump folder, oldest first;
``DumpSet.open(path)`` opens the newest and says so when there are several;
``DumpSet.open(path, run=-2)`` opens the one before.

Examples
--------
>>> [r.describe() for r in list_runs("dumps/run_a")]       # doctest: +SKIP
['rank0_pid1 (started 2026-11-30 17:31:02, 2 passes)', 'rank0_pid1_run2 (started ..., 2 passes)']
"""

from __future__ import annotations

import errno
import json
import os
import re
import secrets
import shutil
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from tdinspect.errors import (
    DumpFormatError,
    RunsNote,
    RunWarning,
)
from tdinspect.store import runlock
from tdinspect.store.format import (
    PASS_RE,
    RANK_DIR_RE,
    SIDECAR_RE,
    RankFolder,
    atomic_write,
    pass_number,
    scan_rank_folder,
    vanished,
)
from tdinspect.util.regularfile import open_regular
from tdinspect.util.terminal import visible, warn

RUN_FILENAME = "run.json"
_MANIFEST_BYTES = 1 << 16  # a manifest is ~300 bytes; a longer run.json is not one
RUN_FORMAT = "tdinspect.run"
RUN_VERSION = 1
SAME_RUN_SECONDS = 300.0  # ranks of one launch without a shared group start within this


@dataclass
class Run:
    """One run: its identity and its rank folders (one per rank)."""

    id: str
    started: float
    folders: list[RankFolder]

    @property
    def name(self) -> str:
        """The first rank folder's name (``rank0_pid1_run2``)."""
        return self.folders[0].path.name

    @property
    def ranks(self) -> list[int]:
        return sorted(f.rank for f in self.folders)

    @property
    def n_passes(self) -> int:
        return len({i for f in self.folders for i in f.passes})

    def describe(self) -> str:
        """One line: folders, start time, passes."""
        names = ", ".join(f.path.name for f in self.folders)
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        return f"{names} (started {when}, {self.n_passes} passes)"


def _group_and_world(grid: int | None = None) -> tuple[str | None, int | None]:
    """What the processes of one launch share, and how many there are (``grid``: the
    size of the capture's parallel grid, the count when nothing else gives one)."""
    env = os.environ
    group = env.get("TDINSPECT_RUN_ID") or None
    if group is None and env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
        group = "/".join(
            env.get(k, "")
            for k in ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT")
        )
    world = None
    import torch

    dist = getattr(torch, "distributed", None)
    if dist is not None and dist.is_available() and dist.is_initialized():
        world = dist.get_world_size()
    elif env.get("WORLD_SIZE", "").isdigit():
        world = int(env["WORLD_SIZE"])
    elif "RANK" not in env:
        world = grid or 1  # no sign of other processes: one process, or one emulating ranks
    return group, world


def new_run_folder(
    dump_dir: str | os.PathLike, rank: int, *, overwrite: bool = False, world: int | None = None
) -> tuple[Path, dict]:
    """Create this capture's own rank folder and its manifest; say what else is there.

    The folder is ``rank<R>_pid<P>``, or ``rank<R>_pid<P>_run<N>`` when that
    name is taken (created with ``mkdir``, which fails if it exists, so two
    processes never share one). Earlier runs of this rank are kept, and a
    :class:`RunWarning` says so; ``overwrite=True`` removes them (and, from
    rank 0, folders of ranks this run does not have) and says which, but keeps, and
    says so, those whose manifest names another process of this host still running. ``world``: the
    size of the capture's parallel grid, the run's rank count when neither
    ``torch.distributed`` nor ``$WORLD_SIZE`` / ``$RANK`` give one.
    """
    dump_dir = Path(dump_dir)
    pid = os.getpid()
    group, world = _group_and_world(world)
    started = time.time()
    manifest = {
        "format": RUN_FORMAT,
        "version": RUN_VERSION,
        "run_id": secrets.token_hex(8),
        "started": started,
        "started_iso": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "rank": rank,
        "pid": pid,
        "host": socket.gethostname(),
        "world_size": world,
        "group": group,
    }
    data = json.dumps(manifest, indent=1).encode()
    folder, lock = _new_folder_with_manifest(dump_dir, f"rank{rank}_pid{pid}", data)
    with _open_lock:
        _OPEN[_key(folder)] = _OPEN.get(_key(folder), 0) + 1
        _LOCKS.setdefault(_key(folder), []).append((lock, os.getpid()))
    try:
        _older_runs(dump_dir, folder, rank, world, overwrite)
    except BaseException:  # refused: this capture leaves nothing behind
        release_run_folder(folder)
        remove_run_folder(folder)
        raise
    return folder, manifest


# Run folders of the captures open in this process: overwrite=True never removes them (it
# removed a capture still running in this process: its next step failed, its pass 0 gone).
_OPEN: dict[str, int] = {}
# the run locks (:mod:`tdinspect.store.runlock`) those captures hold, released with the last,
# with the process that took each
_LOCKS: dict[str, list[tuple[int | None, int]]] = {}
_open_lock = threading.Lock()


def _key(folder: str | os.PathLike) -> str:
    """One name per folder however the dump folder was spelt (relative, ``a/../a``, a link)."""
    return os.path.realpath(folder)


def release_run_folder(folder: str | os.PathLike | None) -> None:
    """The capture writing into ``folder`` has closed: an ``overwrite=True`` may remove it."""
    if folder is None:
        return
    with _open_lock:
        key = _key(folder)
        left = _OPEN.get(key, 0) - 1
        if left > 0:
            _OPEN[key] = left
        else:
            _OPEN.pop(key, None)
            for lock, owner in _LOCKS.pop(key, ()):  # a forked child never removes its parent's
                runlock.release(lock, Path(folder) if owner == os.getpid() else None)


def _new_folder_with_manifest(parent: Path, name: str, manifest: bytes) -> tuple[Path, int | None]:
    """``parent/name`` (or ``name_run2``...), created holding its manifest: made under a
    temporary name with ``run.json`` inside, then renamed into place, so that no run folder is
    ever seen without its manifest (``overwrite=True`` in another process took such a young
    folder for an old one and removed it). A rename never replaces a folder holding anything.
    Returns the folder and its run lock (:func:`tdinspect.store.runlock.take`), taken before
    the rename: no run folder is ever seen unlocked while its capture is open.

    Raises
    ------
    ConfigError
        When ``parent``, or a folder above it, is a file.
    CaptureWriteError
        When the folder or its manifest cannot be written (a full disk, no permission);
        nothing is left behind.
    """
    from tdinspect.errors import CaptureWriteError

    made = [] if parent.exists() else [p for p in (parent, *parent.parents) if not p.exists()]
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        from tdinspect.errors import ConfigError

        raise ConfigError(f"dump_dir {parent}: not a folder (it, or a folder above it, is a file)") from None
    except OSError as exc:
        raise CaptureWriteError(f"creating the dump folder {parent} failed: {_reason(exc)}") from exc
    tmp = parent / f".{name}.{secrets.token_hex(6)}.new"  # not a rank folder: no reader sees it
    lock = None
    try:
        tmp.mkdir()
        lock = runlock.take(tmp)
        atomic_write(tmp / RUN_FILENAME, lambda f: f.write(manifest))
        n = _next_run_number(parent, name)
        while True:
            folder = parent / (name + (f"_run{n}" if n > 1 else ""))
            n += 1
            if os.path.lexists(folder):
                continue
            try:
                os.rename(tmp, folder)  # fails when it exists and holds anything
                return folder, lock
            except OSError as exc:
                if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR):
                    raise
    except BaseException as exc:
        runlock.release(lock)
        shutil.rmtree(tmp, ignore_errors=True)  # only what this call made
        for p in made:  # the dump folder (and those above it) if this call made them
            try:
                p.rmdir()
            except OSError:
                break
        if isinstance(exc, OSError):
            raise CaptureWriteError(
                f"creating the run folder {parent / name} (its manifest {RUN_FILENAME}) failed: "
                f"{_reason(exc)}; nothing was written"
            ) from exc
        raise


def _next_run_number(parent: Path, name: str) -> int:
    """1 + the highest ``N`` of ``name`` / ``name_runN`` in ``parent``: names keep counting up
    after older runs are removed (``prune_runs``), so the newest run has the highest number."""
    pattern = re.compile(re.escape(name) + r"(?:_run(\d+))?\Z")
    numbers = [0]
    try:
        for entry in os.listdir(parent):
            m = pattern.match(entry)
            if m:
                numbers.append(int(m.group(1) or 1))
    except OSError:
        pass
    return max(numbers) + 1 if max(numbers) else 1


def _reason(exc: OSError) -> str:
    return f"{os.strerror(exc.errno)} ({exc})" if exc.errno else str(exc)


def new_folder(parent: Path, name: str) -> Path:
    """``parent/name``, or ``name_run2``, ``name_run3``... when taken: a folder this call
    created (``mkdir`` fails if it exists), so no two writers, nor a re-run in the same
    process (a notebook cell: same pid), ever write into one.

    Raises
    ------
    ConfigError
        When ``parent``, or a folder above it, is a file.
    """
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        from tdinspect.errors import ConfigError

        raise ConfigError(f"dump_dir {parent}: not a folder (it, or a folder above it, is a file)") from None
    n = 1
    while True:
        folder = parent / (name + (f"_run{n}" if n > 1 else ""))
        try:
            folder.mkdir()
            return folder
        except FileExistsError:
            n += 1


def _older_runs(dump_dir: Path, folder: Path, rank: int, world: int | None, overwrite: bool) -> None:
    others = []
    for p in sorted(dump_dir.iterdir()):
        m = RANK_DIR_RE.match(p.name)
        if p == folder or not m or not p.is_dir():
            continue
        other_rank = int(m.group(1))
        if other_rank == rank or (overwrite and rank == 0 and world is not None and other_rank >= world):
            others.append(p)
    if overwrite:
        with _open_lock:
            mine = [p for p in others if _key(p) in _OPEN]
        if mine:
            warn(
                f"tdinspect: overwrite=True kept {len(mine)} run folder(s) in {dump_dir} of a "
                f"capture still open in this process: {', '.join(p.name for p in mine)} "
                "(close it first to replace its run)",
                RunWarning,
                stacklevel=6,
            )
        locked = [p for p in others if p not in mine and runlock.held(p)]
        if locked:  # written by an open capture, whatever its PID (PID 1 in two containers)
            warn(
                f"tdinspect: overwrite=True kept {len(locked)} run folder(s) in {dump_dir} whose "
                f"capture is still running, being written by another open capture (its lock "
                f"{runlock.LOCK_FILENAME} is held, whatever its PID): "
                f"{', '.join(p.name for p in locked)} (close that capture to replace its run)",
                RunWarning,
                stacklevel=6,
            )
        live = [p for p in others if p not in mine and p not in locked and _running_elsewhere(p)]
        if live:
            warn(
                f"tdinspect: overwrite=True kept {len(live)} run folder(s) in {dump_dir} whose "
                f"process is still running on this host: {', '.join(p.name for p in live)} "
                "(removing them lost what that capture had written, and its next pass)",
                RunWarning,
                stacklevel=6,
            )
        young = [p for p in others if p not in mine + locked + live and not _is_old_run(p)]
        if young:
            warn(
                f"tdinspect: overwrite=True kept {len(young)} folder(s) in {dump_dir} holding "
                f"neither a run manifest nor a pass: {', '.join(p.name for p in young)} "
                "(being created by another capture, or not tdinspect's)",
                RunWarning,
                stacklevel=6,
            )
        others = [p for p in others if p not in mine + locked + live + young]
    if not others:
        return
    names = ", ".join(p.name for p in others)
    if overwrite:
        foreign = {p: remove_run_folder(p) for p in others}
        left = [p for p in others if os.path.lexists(p)]
        gone = [p.name for p in others if p not in left]
        if gone:
            warn(
                f"tdinspect: overwrite=True removed {len(gone)} earlier run folder(s) from "
                f"{dump_dir}: {', '.join(gone)}",
                RunsNote,
                stacklevel=6,
            )
        if left:
            kept = "; ".join(
                p.name + (f" (holds {', '.join(foreign[p][:5])}, not tdinspect's)" if foreign[p] else "")
                for p in left
            )
            warn(
                f"tdinspect: overwrite=True removed the runs' files but kept {len(left)} folder(s) "
                f"in {dump_dir}: {kept} (what tdinspect did not write is never removed)",
                RunWarning,
                stacklevel=6,
            )
    else:
        warn(
            f"tdinspect: {dump_dir} already holds {len(others)} earlier run(s) of rank "
            f"{rank} ({names}); this capture is a new run in {folder.name}, kept apart "
            "(DumpSet.open opens the newest run, run=-2 the one before; overwrite=True "
            "replaces earlier runs)",
            RunsNote,
            stacklevel=6,
        )


_TEMPORARY_RE = re.compile(r"^\.(?:run\.json|pass\d{5,}\.(?:pt|json))\.[0-9a-f]+\.tmp\Z")


def _ours(name: str) -> bool:
    """Whether a file of a rank folder is one tdinspect writes there: its manifest, pass files,
    sidecars and their temporary files (``format.atomic_write``)."""
    return (
        name in (RUN_FILENAME, runlock.LOCK_FILENAME)
        or bool(PASS_RE.match(name) or SIDECAR_RE.match(name) or _TEMPORARY_RE.match(name))
        and "\n" not in name
    )


def _is_old_run(folder: Path) -> bool:
    """Whether ``folder`` holds a run that is not being made now: a manifest (written with the
    folder, see :func:`_new_folder_with_manifest`), or, in a dump from before manifests, a pass.
    An empty folder, or one of temporary files only, may be a capture of an older tdinspect
    starting (it made the folder, then the manifest): never removed."""
    if folder.is_symlink():
        return True  # only the link goes
    if read_manifest(folder) is not None:
        return True
    try:
        return any(PASS_RE.match(n) or SIDECAR_RE.match(n) for n in os.listdir(folder))
    except OSError:
        return False


# the per-pass rows a live comparison records (compare_to with on_divergence="record")
_LIVE_ROWS_RE = re.compile(r"^\.?pass\d{5,}\.csv(?:\.[0-9a-f]+\.tmp)?\Z")


def remove_made_folders(folders: list[Path]) -> list[Path]:
    """Remove folders a live comparison of this process made (``Live.made``: its rows' folder,
    its evidence's two dumps): the files tdinspect writes there, then each folder left empty;
    returns those removed. A folder that is now a link, or holds anything else, is kept."""
    removed = []
    for folder in folders:
        if folder.is_symlink() or not folder.is_dir():
            continue
        if not remove_run_folder(folder, lambda n: _ours(n) or bool(_LIVE_ROWS_RE.match(n))):
            removed.append(folder)
    return removed


def remove_run_folder(folder: Path, ours=_ours) -> list[str]:
    """Remove what tdinspect wrote in the run folder ``folder`` (the names ``ours`` accepts),
    then the folder when that leaves it empty; returns the names of what else it holds (kept,
    and the folder with them). A link is removed as a link, never what it points to."""
    if folder.is_symlink():
        folder.unlink()
        return []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return []
    foreign = []
    for e in entries:
        if e.is_file(follow_symlinks=False) and ours(e.name):
            try:
                os.unlink(e.path)
            except FileNotFoundError:
                pass
            except OSError:
                foreign.append(e.name)
        else:
            foreign.append(e.name)
    if not foreign:
        try:
            folder.rmdir()
        except OSError as exc:
            if exc.errno == errno.ENOTEMPTY:  # written to meanwhile
                foreign = sorted(n for n in os.listdir(folder) if not ours(n)) or os.listdir(folder)
    return sorted(foreign)


def clear_runs(*folders: str | os.PathLike) -> None:
    """Make each of ``folders`` ready for new runs of a command that writes there (``tdinspect
    demo --out``, the sample dumps): remove the runs tdinspect wrote in it, and nothing else.

    Each folder is checked before anything is removed: a folder holding anything but
    ``rank*_pid*`` run folders of tdinspect's files (a manifest or passes) is refused.

    Raises
    ------
    ConfigError
        Naming the folder and what in it tdinspect did not write; nothing removed.
    """
    from tdinspect.errors import ConfigError

    runs = []
    for root in map(Path, folders):
        if not os.path.lexists(root):
            continue
        if root.is_symlink() or not root.is_dir():
            raise ConfigError(f"{root}: not a folder tdinspect wrote (a file or a link); nothing removed")
        foreign = []
        for p in sorted(root.iterdir()):
            if not (RANK_DIR_RE.match(p.name) and not p.is_symlink() and p.is_dir() and _is_old_run(p)):
                foreign.append(p.name)
                continue
            theirs = sorted(n for n in os.listdir(p) if not _ours(n))
            foreign.extend(f"{p.name}/{n}" for n in theirs)
            if not theirs:
                runs.append(p)
        if foreign:
            shown = ", ".join(visible(n) for n in foreign[:5]) + (" ..." if len(foreign) > 5 else "")
            raise ConfigError(
                f"{root} holds what tdinspect did not write ({shown}): refusing to replace it, "
                "nothing removed; move it away or choose another folder"
            )
    for p in runs:
        remove_run_folder(p)


def mark_run(folder: str | os.PathLike, made_by: str) -> None:
    """Record in the manifest of the run folder ``folder`` what made the run (``made_by``,
    e.g. ``"%%tdi_capture"``), so that :func:`prune_runs` can remove only such runs."""
    folder = Path(folder)
    doc = read_manifest(folder)
    if doc is None or folder.is_symlink():
        return
    doc["made_by"] = made_by
    data = json.dumps(doc, indent=1).encode()
    atomic_write(folder / RUN_FILENAME, lambda f: f.write(data))


def prune_runs(dump_dir: str | os.PathLike, keep: int, made_by: str | None = None) -> list[str]:
    """Remove the oldest runs of ``dump_dir`` beyond the newest ``keep``; returns the names of the
    rank folders removed.

    Only finished runs that tdinspect made are removed: every folder of the run holds a manifest
    and only files tdinspect writes, none is a link, none belongs to a capture still open in
    this process or to a live process of this host (:func:`_running_elsewhere`). With
    ``made_by``, only runs whose manifests say so (:func:`mark_run`): a capture cell pointed at
    a folder of runs a script made keeps them. A run that cannot be removed is kept and still
    counts among the runs.

    Examples
    --------
    >>> prune_runs("dumps/cell", keep=3)            # doctest: +SKIP
    ['rank0_pid41', 'rank0_pid41_run2']
    """
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        from tdinspect.errors import ConfigError

        raise ConfigError(f"keep_runs={keep!r}: expected a whole number of runs, 1 or more")
    root = Path(dump_dir)
    if root.is_symlink() or not root.is_dir():
        return []
    try:
        runs = list_runs(root)
    except DumpFormatError:
        return []
    removed = []
    for run in runs[: max(len(runs) - keep, 0)]:
        folders = [f.path for f in run.folders]
        with _open_lock:
            open_here = any(_key(p) in _OPEN for p in folders)
        if open_here or any(
            p.parent != root
            or p.is_symlink()
            or not _made_by(p, made_by)
            or _running_elsewhere(p)
            or not all(_ours(n) for n in os.listdir(p))
            for p in folders
        ):
            continue
        for p in folders:
            remove_run_folder(p)
            if not os.path.lexists(p):
                removed.append(p.name)
    return removed


def _made_by(folder: Path, made_by: str | None) -> bool:
    """Whether ``folder`` holds a run manifest (saying ``made_by``, when given)."""
    doc = read_manifest(folder)
    return doc is not None and (made_by is None or doc.get("made_by") == made_by)


def _running_elsewhere(folder: Path) -> bool:
    """Whether ``folder``'s manifest names another process of this host that is still alive
    (a capture that may be writing there). A pid reused since reads as alive: the folder is
    then kept, the safe side."""
    lock = runlock.held(folder)
    if lock is not None:  # the lock says it, whatever the PID: a free one, the capture closed
        return lock
    doc = read_manifest(folder)
    pid = doc.get("pid") if doc else None
    if type(pid) is not int or pid <= 0 or pid == os.getpid() or doc.get("host") != socket.gethostname():
        return False
    try:
        os.kill(pid, 0)
    except PermissionError:
        return True  # alive, another user's
    except (ProcessLookupError, OverflowError, OSError):
        return False
    return True


def read_manifest(folder: Path) -> dict | None:
    """The folder's ``run.json``, or ``None`` (a dump written before manifests, or damaged)."""
    try:
        with open_regular(folder / RUN_FILENAME) as f:
            doc = json.loads(f.read(_MANIFEST_BYTES))
    except (OSError, ValueError, RecursionError):
        return None  # unreadable, not JSON, cut at _MANIFEST_BYTES, nested past the stack
    if not isinstance(doc, dict) or doc.get("format") != RUN_FORMAT:
        return None
    started = doc.get("started")
    if type(started) not in (int, float) or not isinstance(doc.get("run_id"), str):
        return None
    try:  # a time the runs can be ordered by and shown with (not NaN, not 1e300)
        time.localtime(started)
    except (OverflowError, OSError, ValueError):
        return None
    return doc


def _first_write(folder: RankFolder) -> float:
    times = [_mtime(p) for pf in folder.passes.values() for p in (pf.tensors, pf.sidecar) if p is not None]
    return min((t for t in times if t is not None), default=folder.path.stat().st_mtime)


def _mtime(path: Path) -> float | None:
    """When ``path`` was written; ``None`` for a dangling link or a file gone since the folder
    was listed (its pass then fails to open, naming it)."""
    try:
        return path.stat().st_mtime
    except OSError:
        return None


def group_runs(folders: list[RankFolder]) -> list[Run]:
    """Split rank folders into runs, oldest first (rules in the module docstring)."""
    items = []
    for f in folders:
        doc = read_manifest(f.path)
        items.append((float(doc["started"]) if doc else _first_write(f), f.path.name, f, doc))
    items.sort(key=lambda it: (it[0], it[1]))
    runs: list[tuple[Run, dict | None]] = []
    for started, _, folder, doc in items:
        if runs and _joins(runs[-1], started, folder, doc):
            runs[-1][0].folders.append(folder)
            continue
        run_id = doc["run_id"] if doc else f"legacy-{folder.path.name}"
        runs.append((Run(run_id, started, [folder]), doc))
    for run, _ in runs:
        run.folders.sort(key=lambda f: f.rank)
    return [run for run, _ in runs]


def _joins(current: tuple[Run, dict | None], started: float, folder: RankFolder, doc: dict | None) -> bool:
    run, first = current
    if folder.rank in run.ranks or (first is None) != (doc is None):
        return False
    if first is None:  # folders without manifests: one run per rank, as before manifests
        return True
    world = first.get("world_size")
    if isinstance(world, int) and len(run.folders) >= world:
        return False
    if first.get("group") or doc.get("group"):
        return first.get("group") == doc.get("group")
    return started - run.started <= SAME_RUN_SECONDS


def rank_folders(path: Path) -> list[RankFolder] | None:
    """The ``rank*_pid*`` folders directly under ``path`` (``None`` when it has none)."""
    try:
        dirs = sorted(
            (p for p in path.iterdir() if p.is_dir() and RANK_DIR_RE.match(p.name)), key=lambda p: p.name
        )
    except FileNotFoundError:
        raise DumpFormatError(vanished(path)) from None
    if not dirs:
        return None
    out = []
    for p in dirs:
        m = RANK_DIR_RE.match(p.name)
        folder = scan_rank_folder(p, int(m.group(1)), int(m.group(2)))
        if folder.passes:
            out.append(folder)
    return out


def list_runs(path: str | os.PathLike) -> list[Run]:
    """The runs in a dump folder, oldest first (one run for a rank folder or a pass file).

    Examples
    --------
    >>> runs = list_runs("dumps/run_a")                 # doctest: +SKIP
    >>> runs[-1].describe()                             # doctest: +SKIP
    'rank0_pid1_run2 (started 2026-11-30 17:40:01, 1 passes)'
    """
    path = Path(nonempty_path(path))
    try:
        folders = discover_folders(path)
        if path.is_dir() and any(RANK_DIR_RE.match(f.path.name) and f.path.parent == path for f in folders):
            return group_runs(folders)
        doc = read_manifest(folders[0].path)
        run_id = doc["run_id"] if doc else f"legacy-{folders[0].path.name}"
        started = float(doc["started"]) if doc else _first_write(folders[0])
    except FileNotFoundError as exc:  # a folder or file removed between listing and reading it
        raise DumpFormatError(vanished(exc.filename or path)) from None
    return [Run(run_id, started, folders)]


def select_run(path: str | os.PathLike, run: int | str | None = None) -> tuple[Run, list[Run]]:
    """``(chosen run, all runs)``: the newest by default, else ``runs[run]`` (``-2``: the one
    before the newest) or the run with that id or folder name."""
    runs = list_runs(path)
    if run is None:
        return runs[-1], runs
    if isinstance(run, int) and not isinstance(run, bool):
        try:
            return runs[run], runs
        except IndexError:
            raise DumpFormatError(
                f"{path}: run={run}, but it holds {len(runs)} run(s): "
                + "; ".join(r.describe() for r in runs)
            ) from None
    for r in runs:
        if run == r.id or run in (f.path.name for f in r.folders):
            return r, runs
    raise DumpFormatError(
        f"{path}: no run {run!r}; runs: " + "; ".join(f"{r.id} = {r.describe()}" for r in runs)
    )


def discover(path: str | os.PathLike, run: int | str | None = None) -> list[RankFolder]:
    """The rank folders and passes of one run under ``path`` (the newest by default).

    ``path`` may be a dump folder (holding ``rank*_pid*`` folders), one rank
    folder (or any folder of pass files), or one pass file. A dump folder
    holding several runs gives the newest, or ``run`` (see
    :func:`tdinspect.store.runs.select_run`).

    Raises
    ------
    DumpFormatError
        If ``path`` does not exist or holds no pass.
    """
    return select_run(path, run)[0].folders


def nonempty_path(path: str | os.PathLike) -> str | os.PathLike:
    """``path``, unless it is empty (``DumpFormatError``): ``Path("")`` is the working folder,
    so ``tdinspect first-divergence "" ""`` (two unset shell variables) compared the working
    folder with itself and answered "matches"."""
    if isinstance(path, (str, bytes)) and not path.strip():
        raise DumpFormatError(f"{path!r}: an empty path names no dump (give '.' for the working folder)")
    return path


def discover_folders(path: str | os.PathLike) -> list[RankFolder]:
    """Every rank folder with passes under ``path``, whatever run wrote it."""
    path = Path(nonempty_path(path))
    if not path.exists():
        raise DumpFormatError(f"{path}: no such file or folder")
    if path.is_file():
        index = pass_number(path.name)
        if index is None:
            raise DumpFormatError(f"{path}: not a pass file (expected passNNNNN.pt)")
        rm = RANK_DIR_RE.match(path.parent.name)
        folder = RankFolder(path.parent, int(rm.group(1)) if rm else 0, int(rm.group(2)) if rm else None)
        full = scan_rank_folder(path.parent, folder.rank, folder.pid)
        folder.passes = {index: full.passes[index]}
        return [folder]
    folders = rank_folders(path)
    if folders is None:
        folder = scan_rank_folder(path, 0, None)
        rm = RANK_DIR_RE.match(path.name)
        if rm:
            folder.rank, folder.pid = int(rm.group(1)), int(rm.group(2))
        if not folder.passes:
            raise DumpFormatError(f"{path}: no rank*_pid* folders and no pass files: not a dump")
        return [folder]
    if not folders:
        raise DumpFormatError(f"{path}: rank folders hold no pass files")
    return folders
