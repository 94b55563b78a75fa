"""Text read from a dump, made safe to print on a terminal.

Entry names, folder names and messages quoting them come from files, and a
terminal obeys control characters: a key holding ``ESC ] 0 ; ... BEL`` set the
window title through ``tdinspect ls``, ``ESC [ 2 J`` cleared the screen, a
newline forged a line of output (``no divergence``), and Unicode direction
overrides (U+202E) reordered what a line shows. :func:`visible` writes every
such character as its Python escape (``\\x1b``, ``\\u202e``); the CLI passes
all it prints through it (:func:`visible_streams`), and table cells and entry
names also escape newlines and tabs.

Every HTML view (notebook reprs, widgets, magics) writes text from a dump
through :func:`html_text`: the same escapes, then HTML's, so a name renders as
inert text and the page always encodes as UTF-8 (a lone surrogate made
Jupyter fail to send it).

Examples
--------
>>> visible("model.a\\x1b[2J\\nno divergence")
'model.a\\\\x1b[2J\\\\nno divergence'
>>> visible("line one\\nline two", keep="\\n")
'line one\\nline two'
>>> html_text("<script>&\\udcff")
'&lt;script&gt;&amp;\\\\udcff'
"""

from __future__ import annotations

import contextlib
import functools
import html
import re
import sys

# C0 and C1 controls, DEL, lone surrogates (undecodable bytes of a name), and the Unicode
# marks that change the direction or order text is shown in
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069\ud800-\udfff]")


_NAMED = {"\n": "\\n", "\t": "\\t", "\r": "\\r"}


def _escape(match: re.Match) -> str:
    char = match.group()
    if char in _NAMED:
        return _NAMED[char]
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def visible(text: str, keep: str = "") -> str:
    """``text`` with control, direction and undecodable characters (except those in
    ``keep``) written as escapes."""
    return _pattern(keep).sub(_escape, text)


def html_text(value) -> str:
    """``str(value)`` as inert HTML text: :func:`visible`'s escapes (control, direction and
    undecodable characters, which no UTF-8 page can carry), then HTML's (``< > & " '``).
    Every HTML view writes text that comes from a dump through it."""
    return html.escape(visible(str(value)))


@functools.lru_cache(maxsize=8)
def _pattern(keep: str) -> re.Pattern:
    """:data:`_UNSAFE` less the characters of ``keep`` (one scan of the text)."""
    return re.compile(f"(?![{re.escape(keep)}])" + _UNSAFE.pattern) if keep else _UNSAFE


class _Visible:
    """A text stream that writes what it is given through :func:`visible` (lines and tabs
    kept); everything else is the wrapped stream's."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text: str) -> int:
        self._stream.write(visible(text, keep="\n\t"))
        return len(text)

    def __getattr__(self, name):
        return getattr(self._stream, name)


def warn(message: str, category: type[Warning] = UserWarning, stacklevel: int = 1) -> None:
    """``warnings.warn`` with the message through :func:`visible`: paths and names from a
    dump reach a notebook's or script's stderr as escapes, as the CLI's output does.
    ``stacklevel`` counts from the caller, as for ``warnings.warn``."""
    import warnings

    warnings.warn(visible(message), category, stacklevel=stacklevel + 1)


@contextlib.contextmanager
def visible_streams():
    """``sys.stdout`` and ``sys.stderr`` through :func:`visible` for the duration."""
    out, err = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _Visible(out), _Visible(err)
    try:
        yield
    finally:
        sys.stdout, sys.stderr = out, err
