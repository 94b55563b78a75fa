r"""Mapping: which B entry an A entry meets when the two runs name things differently.

Rules are ``{a_regex: b_template}`` or ``{a_regex: [b_template, transform]}``.
An A entry whose name (without ``::callN``) fully matches ``a_regex`` (the
first matching rule wins) meets the B entry named by ``match.expand(b_template)``,
same call and pass, after ``transform`` is applied to the B tensor. Entries no
rule covers pair by identical name. Several A entries may take slices of one B
entry (``q``, ``k``, ``v`` from a fused ``qkv``).

Examples
--------
>>> m = Mapping({r"model\.layers\.(\d+)\.self_attn\.q_proj": [r"model.blocks.\1.attn.qkv", "chunk(3, -1)[0]"]})
>>> b, t = m.partner("model.layers.4.self_attn.q_proj")
>>> b, str(t)
('model.blocks.4.attn.qkv', 'chunk(3, -1)[0]')
>>> m.partner("model.norm")
('model.norm', None)
"""

from __future__ import annotations

import functools
import os
import re
import reprlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import regex  # rules come from files: matched with a time limit (no catastrophic backtracking)

from tdinspect.align.transforms import Transform, as_transform
from tdinspect.errors import (
    MappingError,
    TransformError,
)
from tdinspect.naming import make_key, split_call
from tdinspect.util.regularfile import open_regular

MAX_NAME_CHARS = 4096  # a B template, and the name it expands to: entry names are far shorter
_GROUP_REF = re.compile(r"\\(?:\d+|g<[^>]*>)")  # \1, \g<1>, \g<name> in a template
MAX_FILE_BYTES = 16 << 20  # a mapping file is rules: kilobytes (a FIFO or /dev/zero: refused)
_SHOWN = reprlib.Repr()  # values quoted in messages, cut short (Python 3.11 takes no arguments)
_SHOWN.maxstring = _SHOWN.maxother = 80
_SHOWN.maxlist = _SHOWN.maxdict = 4
_SHOWN.maxlevel = 2
MATCH_SECONDS = 1.0  # one rule against one name: microseconds, unless the pattern backtracks without end


def quoted_rule(pattern: str) -> str:
    """A rule's pattern as messages quote it: cut short (a file may hold megabytes of one)."""
    return pattern if len(pattern) <= 120 else f"{pattern[:80]}...{pattern[-20:]} ({len(pattern)} characters)"


@functools.cache
def _loader() -> type:
    """``yaml.safe_load``'s loader, refusing aliases (``*name``): nested ones make a few
    bytes stand for millions of values (rules never need them). Made on first use: yaml is
    imported only to read a file."""
    import yaml

    class Loader(yaml.SafeLoader):
        def compose_node(self, parent, index):
            if self.check_event(yaml.AliasEvent):
                raise yaml.composer.ComposerError(
                    None,
                    None,
                    "aliases (*name) are not allowed in a mapping file",
                    self.peek_event().start_mark,
                )
            return super().compose_node(parent, index)

    return Loader


def _bound_expansion(rule, m, a_base: str) -> None:
    """``MappingError`` when ``rule``'s template would expand to more than
    :data:`MAX_NAME_CHARS` for this match: measured from its group references and the longest
    group before anything is built (each reference is one group's text)."""
    refs = len(_GROUP_REF.findall(rule.template))
    if not refs:
        return
    longest = max((len(g) for g in m.groups() if g), default=len(m.group(0)))
    longest = max(longest, len(m.group(0)) if "g<0>" in rule.template else 0)
    most = len(_GROUP_REF.sub("", rule.template)) + refs * longest
    if most > MAX_NAME_CHARS:
        raise MappingError(
            f"rule '{quoted_rule(rule.source)}': its template ({refs} group references) would name a "
            f"B entry of up to {most} characters for {_SHOWN.repr(a_base)} (at most {MAX_NAME_CHARS})"
        )


@dataclass(frozen=True)
class Rule:
    """One compiled rule: A pattern, B template, optional transform."""

    pattern: regex.Pattern
    template: str
    transform: Transform | None

    @property
    def source(self) -> str:
        return self.pattern.pattern


class Mapping:
    """Compiled mapping rules (see the module docstring); picklable when its
    transforms are parsed specs.

    Parameters
    ----------
    rules : dict
        ``{a_regex: b_template}`` or ``{a_regex: [b_template, transform]}``,
        in priority order; ``transform`` is a spec string or a callable.
    """

    def __init__(self, rules: dict[str, Any] | None = None):
        self.rules: list[Rule] = []
        for pattern, target in (rules or {}).items():
            self.rules.append(_rule(pattern, target))
        self._cache: dict[str, tuple[str, Transform | None, int]] = {}

    @classmethod
    def coerce(cls, value: Mapping | dict | str | os.PathLike | None) -> Mapping | None:
        """A Mapping from a Mapping, a dict of rules, or a YAML/JSON file path."""
        if value is None or isinstance(value, Mapping):
            return value
        if isinstance(value, dict):
            return cls(value)
        if isinstance(value, (str, os.PathLike)):
            return cls.from_file(value)
        rules = getattr(value, "rules", None)  # a suggestion object
        if isinstance(rules, dict):
            return cls(rules)
        raise MappingError(
            f"mapping must be a dict of rules, a file path or a Mapping, not {type(value).__name__}"
        )

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> Mapping:
        """Read rules from a YAML or JSON file (``yaml.safe_load``: data only).

        The file must be a regular file of at most :data:`MAX_FILE_BYTES`, UTF-8,
        without YAML aliases (``*name``): a 310-byte file of nested aliases stood
        for 43 million strings, and its error message alone took 14 s and 1.9 GB.

        Raises
        ------
        MappingError
            Naming the file, for anything it cannot be read as.
        """
        import yaml

        path = Path(path)
        try:
            with open_regular(path, links=True) as f:  # the user's own file
                data = f.read(MAX_FILE_BYTES + 1)
        except OSError as exc:
            raise MappingError(f"{path}: cannot read the mapping file ({exc.strerror})") from None
        if len(data) > MAX_FILE_BYTES:
            raise MappingError(f"{path}: larger than {MAX_FILE_BYTES >> 20} MiB, not a mapping file")
        try:
            doc = yaml.load(data.decode("utf-8"), Loader=_loader())  # noqa: S506 - safe, no aliases
        except UnicodeDecodeError as exc:
            raise MappingError(f"{path}: not a text file (not UTF-8 at byte {exc.start})") from None
        except yaml.YAMLError as exc:
            raise MappingError(f"{path}: not valid YAML or JSON ({str(exc).splitlines()[0]})") from None
        except RecursionError:
            raise MappingError(f"{path}: nested too deeply to be a mapping file") from None
        if doc is None:
            doc = {}
        if isinstance(doc, dict) and set(doc) == {"rules"} and isinstance(doc["rules"], dict):
            doc = doc["rules"]
        if not isinstance(doc, dict):
            raise MappingError(
                f"{path}: expected a mapping of a_regex: b_template rules, found {type(doc).__name__}"
            )
        if not doc:  # a mapping given must pair something: else the diff pairs by name, unasked
            raise MappingError(
                f"{path}: no rules (an empty mapping file); expected a_regex: b_template lines"
            )
        try:
            return cls(doc)
        except MappingError as exc:
            raise MappingError(f"{path}: {exc}") from None

    def partner(self, a_base: str) -> tuple[str, Transform | None]:
        """``(b_base, transform)`` for an A entry name without ``::callN``."""
        hit = self._cache.get(a_base)
        if hit is None:
            hit = (a_base, None, -1)
            for n, rule in enumerate(self.rules):
                try:
                    m = rule.pattern.fullmatch(a_base, timeout=MATCH_SECONDS)
                except TimeoutError:
                    raise MappingError(
                        f"rule '{quoted_rule(rule.source)}': matching {_SHOWN.repr(a_base)} took more "
                        f"than {MATCH_SECONDS} s (a pattern that backtracks without end): write it without "
                        "nested repeats"
                    ) from None
                if m is not None:
                    _bound_expansion(rule, m, a_base)
                    try:
                        hit = (m.expand(rule.template), rule.transform, n)
                    except (regex.error, IndexError) as exc:
                        raise MappingError(
                            f"rule '{quoted_rule(rule.source)}': template {_SHOWN.repr(rule.template)} "
                            f"cannot be expanded for {_SHOWN.repr(a_base)} ({exc})"
                        ) from None
                    break
            self._cache[a_base] = hit
        return hit[0], hit[1]

    def rule_of(self, a_base: str) -> str:
        """The pattern of the rule that covers ``a_base`` (``""`` when none does)."""
        self.partner(a_base)
        n = self._cache[a_base][2]
        return self.rules[n].source if n >= 0 else ""

    def to_dict(self) -> dict[str, Any]:
        """The rules as written in a mapping file (callable transforms by name)."""
        return {r.source: ([r.template, r.transform.spec] if r.transform else r.template) for r in self.rules}

    def __getstate__(self):
        return {"rules": self.rules, "_cache": {}}

    def __len__(self) -> int:
        return len(self.rules)

    def __repr__(self) -> str:
        return f"Mapping({len(self.rules)} rules)"


def mapped_key(mapping: Mapping, a_key: str) -> str:
    r"""The B key an A key (with ``::callN``) meets under ``mapping``: its partner's name,
    same call (the A key itself where no rule covers it).

    Examples
    --------
    >>> mapped_key(Mapping({r"a\.(\d+)": r"b.\1"}), "a.3::call2")
    'b.3::call2'
    """
    base, call = split_call(a_key)
    return make_key(mapping.partner(base)[0], call)


def _rule(pattern: Any, target: Any) -> Rule:
    if not isinstance(pattern, str):
        raise MappingError(f"rule {_SHOWN.repr(pattern)}: the A pattern must be a string")
    try:
        compiled = regex.compile(pattern)
    except (regex.error, TypeError, ValueError, OverflowError) as exc:
        raise MappingError(f"rule '{quoted_rule(pattern)}': invalid regex ({exc})") from None
    transform = None
    if isinstance(target, (list, tuple)):
        if len(target) != 2 or not isinstance(target[0], str):
            raise MappingError(
                f"rule '{quoted_rule(pattern)}': expected b_template or [b_template, transform], got {_SHOWN.repr(target)}"
            )
        target, spec = target
        try:
            transform = as_transform(spec)
        except TransformError as exc:
            raise MappingError(f"rule '{quoted_rule(pattern)}': {exc}") from None
    if not isinstance(target, str) or not target:
        raise MappingError(
            f"rule '{quoted_rule(pattern)}': the B template must be a non-empty string, got {_SHOWN.repr(target)}"
        )
    if len(target) > MAX_NAME_CHARS:  # a 1.5 MB template of group references peaked at 1.6 GB
        raise MappingError(
            f"rule '{quoted_rule(pattern)}': a B template of {len(target)} characters (at most "
            f"{MAX_NAME_CHARS}: it names one entry)"
        )
    try:
        plain = re.compile(pattern)  # group references are checked as re checks them (regex: on a match)
    except re.error:
        plain = None  # syntax of regex's own: its template is checked when it first expands
    if plain is not None:
        try:
            plain.sub(target, "")
        except (re.error, IndexError) as exc:
            raise MappingError(
                f"rule '{quoted_rule(pattern)}': bad template {_SHOWN.repr(target)} ({exc})"
            ) from None
    return Rule(compiled, target, transform)
