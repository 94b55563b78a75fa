"""Capture configuration, the environment overlay, and filter resolution.

Dumping is off unless a dump directory is given, in code or in the environment.
Environment variables always overlay what the code passed, so a program with a
hard-coded config can be switched to dumping for one run:

=================================  ==============================  =========================================
documented engine name             tdinspect name                  meaning
=================================  ==============================  =========================================
``PHYAI_DEBUG_TENSOR_DUMP_DIR``    ``TDINSPECT_DUMP_DIR``          output directory; setting it enables dumping
``PHYAI_DEBUG_TENSOR_DUMP_FILTER``  ``TDINSPECT_DUMP_FILTER``      JSON array of regexes, or one bare pattern
``PHYAI_DEBUG_TENSOR_DUMP_FILTER_FN`` ``TDINSPECT_DUMP_FILTER_FN``  ``"pkg.module:func"`` or ``"/path/file.py:func"``
``PHYAI_DEBUG_TENSOR_DUMP_RECORD``  ``TDINSPECT_DUMP_RECORD``      what to record per module, a comma list of
                                                                   ``inputs,outputs,params,grads``
=================================  ==============================  =========================================

Setting a FILTER and a FILTER_FN together is an error, and so is setting the
same switch in both families to different values.

Examples
--------
>>> cfg = DumpConfig(dump_dir="/tmp/run_a", filter=[r"layers\\.0\\."])
>>> cfg.with_env({"TDINSPECT_DUMP_DIR": "/tmp/run_b"}).dump_dir
'/tmp/run_b'
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import json
import operator
import os
import re
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Union

from tdinspect.errors import ConfigError

FilterSpec = Union[None, str, "re.Pattern[str]", Sequence[str], Callable[[str, Any], bool]]
Predicate = Callable[[str, Any], bool]

_FAMILIES = ("PHYAI_DEBUG_TENSOR_DUMP_", "TDINSPECT_DUMP_")
RECORD_KINDS = ("inputs", "outputs", "params", "grads")


def _env(environ: Mapping[str, str], suffix: str) -> tuple[str, str] | None:
    """The value of one switch across both families, as ``(variable, value)``."""
    found = [
        (fam + suffix, environ[fam + suffix]) for fam in _FAMILIES if environ.get(fam + suffix, "") != ""
    ]
    if len(found) == 2 and found[0][1] != found[1][1]:
        raise ConfigError(
            f"{found[0][0]}={found[0][1]!r} and {found[1][0]}={found[1][1]!r} disagree; set one of them"
        )
    return found[-1] if found else None


DEFAULT_MEMORY_LIMIT = 2 << 30  # what ``capture(..., memory=True)`` may hold: 2 GB
_UNITS = {"": 1, "B": 1, "KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30, "TB": 1 << 40}


MAX_MEMORY_LIMIT = 2**63 - 1  # bytes: what a byte count of the process can be


def parse_memory(value) -> int | None:
    """The byte limit of a capture to memory: ``None`` (off) for ``None``/``False``,
    :data:`DEFAULT_MEMORY_LIMIT` for ``True``, else a byte count or a size such as ``"2GB"``,
    ``"512 MB"`` or ``"1.5GiB"`` (powers of 1024, as tdinspect prints sizes).

    Examples
    --------
    >>> parse_memory(True) == DEFAULT_MEMORY_LIMIT, parse_memory("512MB"), parse_memory(4096)
    (True, 536870912, 4096)
    """
    if value is None or value is False:
        return None
    if value is True:
        return DEFAULT_MEMORY_LIMIT
    count = None
    if not isinstance(value, (str, float)):
        try:
            count = operator.index(value)  # int, numpy.int64, torch's: an exact whole number
        except TypeError:
            pass
    if isinstance(value, str):
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(I?B)?\s*", value.upper())
        if m and float(m.group(1)) > 0:
            unit = (m.group(2) + "B") if m.group(2) else ""
            size = float(m.group(1)) * _UNITS[unit]  # inf for 400 digits: refused below
            count = max(int(size), 1) if size <= MAX_MEMORY_LIMIT else MAX_MEMORY_LIMIT + 1
    if count is not None and 0 < count <= MAX_MEMORY_LIMIT:
        return count
    if count is not None and count > MAX_MEMORY_LIMIT:  # 10**400 raised OverflowError later
        raise ConfigError(f"memory={str(value)[:40]}: more than {MAX_MEMORY_LIMIT} bytes (8 EiB)")
    raise ConfigError(
        f"memory={value!r}: expected True (a {DEFAULT_MEMORY_LIMIT >> 30} GB limit), a byte count "
        "or a size such as '2GB' or '512MB'"
    )


def parse_filter_env(value: str, variable: str = "TDINSPECT_DUMP_FILTER") -> list[str]:
    """Patterns from a FILTER variable: a JSON array of regexes, or one bare pattern."""
    text = value.strip()
    if text.startswith("["):
        try:
            patterns = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{variable}: not a valid JSON array of regexes ({exc}): {value!r}") from None
        if not isinstance(patterns, list) or not all(isinstance(p, str) for p in patterns):
            raise ConfigError(f"{variable}: expected a JSON array of strings, got {value!r}")
        return patterns
    return [value]


def parse_record(value, source: str = "record") -> tuple[str, ...]:
    """What module-level capture records: a tuple drawn from :data:`RECORD_KINDS`.

    ``value`` is a string (one kind, or a comma list as in ``..._RECORD``) or
    a sequence of kinds; order and repeats do not matter.

    Examples
    --------
    >>> parse_record("outputs, params")
    ('outputs', 'params')
    """
    items = value.split(",") if isinstance(value, str) else list(value)
    kinds = {str(k).strip() for k in items} - {""}
    unknown = sorted(kinds - set(RECORD_KINDS))
    if unknown or not kinds:
        raise ConfigError(
            f"{source}={value!r}: expected one or more of {', '.join(RECORD_KINDS)}"
            + (f" (unknown: {', '.join(unknown)})" if unknown else "")
        )
    return tuple(k for k in RECORD_KINDS if k in kinds)


@dataclasses.dataclass(frozen=True)
class DumpConfig:
    """Where and what to dump; an engine can keep one in its runtime config.

    Parameters
    ----------
    dump_dir : str or Path, optional
        Output directory. ``None`` means dumping is off.
    filter : str, regex, list of str, or callable, optional
        ``None`` keeps every selected module; regexes keep names that any of
        them ``re.search``-matches; a callable ``(name, module) -> bool`` decides.
    filter_fn : str, optional
        A predicate named as ``"pkg.module:func"`` or ``"/path/file.py:func"``.
        Exclusive with ``filter``.
    record : tuple of str
        What module-level capture records for each selected module, any of
        ``"inputs"`` (``name[in]...``), ``"outputs"`` (``name...``),
        ``"params"`` (parameters and buffers, ``name.weight``) and ``"grads"``
        (parameter gradients after backward, ``name.weight.grad``).

    Examples
    --------
    >>> DumpConfig().enabled
    False
    >>> DumpConfig("/tmp/d", filter=r"o_proj$").predicate()("model.layers.0.o_proj", None)
    True
    """

    dump_dir: str | os.PathLike | None = None
    filter: FilterSpec = None
    filter_fn: str | None = None
    record: tuple[str, ...] = ("outputs",)

    def __post_init__(self) -> None:
        if self.filter is not None and self.filter_fn is not None:
            raise ConfigError("filter and filter_fn are exclusive: pass one of them")
        object.__setattr__(self, "record", parse_record(self.record))

    @property
    def enabled(self) -> bool:
        """Whether dumping is on (a dump directory is set)."""
        return self.dump_dir is not None and str(self.dump_dir) != ""

    def with_env(self, environ: Mapping[str, str] | None = None) -> DumpConfig:
        """This config overlaid by the environment (``os.environ`` by default)."""
        environ = os.environ if environ is None else environ
        directory = _env(environ, "DIR")
        flt = _env(environ, "FILTER")
        fn = _env(environ, "FILTER_FN")
        record = _env(environ, "RECORD")
        if flt and fn:
            raise ConfigError(f"{flt[0]} and {fn[0]} are exclusive: set one of them")
        changes: dict[str, Any] = {}
        if directory:
            changes["dump_dir"] = directory[1]
        if flt:
            changes.update(filter=parse_filter_env(flt[1], flt[0]), filter_fn=None)
        if fn:
            changes.update(filter=None, filter_fn=fn[1])
        if record:
            changes["record"] = parse_record(record[1], record[0])
        return dataclasses.replace(self, **changes) if changes else self

    def use_cuda_graph(self, requested: bool) -> bool:
        """Whether an engine may use CUDA graphs: forced off (with a warning) while dumping.

        Hooks do not run when a captured CUDA graph is replayed, so a dump taken
        under graphs would silently miss every op.
        """
        if requested and self.enabled:
            warnings.warn(
                "tensor dump is enabled: forcing use_cuda_graph=False so that hooks run "
                "(CUDA-graph replay never re-enters Python)",
                stacklevel=2,
            )
            return False
        return requested

    def predicate(self) -> Predicate:
        """The resolved filter as a ``(name, module) -> bool`` callable.

        Raises
        ------
        ConfigError
            For an invalid regex or a predicate that cannot be loaded.
        """
        if self.filter_fn is not None:
            return load_predicate(self.filter_fn)
        return resolve_filter(self.filter)


def resolve_filter(spec: FilterSpec) -> Predicate:
    """Turn ``None``, a regex, a list of regexes or a callable into a predicate."""
    if spec is None:
        return lambda name, module: True
    if callable(spec) and not isinstance(spec, (str, re.Pattern)):
        return spec
    patterns = [spec] if isinstance(spec, (str, re.Pattern)) else list(spec)
    if not patterns:
        raise ConfigError("filter is an empty list: it would capture nothing; pass None to keep all")
    compiled = []
    for p in patterns:
        if isinstance(p, re.Pattern):
            compiled.append(p)
            continue
        if not isinstance(p, str):
            raise ConfigError(f"filter entries must be regex strings, got {p!r}")
        try:
            compiled.append(re.compile(p))
        except re.error as exc:
            raise ConfigError(f"invalid filter regex {p!r}: {exc}") from None
    return lambda name, module: any(c.search(name) for c in compiled)


def load_predicate(ref: str) -> Predicate:
    """Load a predicate named ``"pkg.module:func"`` or ``"/path/file.py:func"``.

    Only the named module or file is imported. It runs as code of this
    process: a ``filter_fn`` (or ``TDINSPECT_DUMP_FILTER_FN``) is trusted
    input, like ``PYTHONSTARTUP``; never take it from a file or a user you do
    not trust. A module that exits (``SystemExit``) while it is imported is a
    ``ConfigError``, not the end of the process.
    """
    if not isinstance(ref, str) or ":" not in ref:
        raise ConfigError(f"filter_fn {ref!r}: expected 'pkg.module:func' or '/path/file.py:func'")
    target, _, attr = ref.rpartition(":")
    try:
        if target.endswith(".py") or os.sep in target or "/" in target:
            path = Path(target)
            if not path.is_file():
                raise ConfigError(f"filter_fn {ref!r}: no such file {str(path)!r}")
            spec = importlib.util.spec_from_file_location(f"_tdinspect_filter_{path.stem}", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(target)
    except ConfigError:
        raise
    except (Exception, SystemExit) as exc:
        raise ConfigError(
            f"filter_fn {ref!r}: importing {target!r} failed: {type(exc).__name__}: {exc}"
        ) from exc
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(f"filter_fn {ref!r}: {target!r} has no callable {attr!r}")
    return fn
