"""HTML and text renderings of DumpSet, Diff and Divergence (no IPython needed).

Used by ``_repr_html_`` in notebooks and by the CLI's tables, so a notebook
and a terminal show the same facts. The HTML has collapsible sections (like
xarray's reprs), numbers in scientific notation through a pandas ``Styler``,
and CSS that takes its colours from the JupyterLab theme variables
(``--jp-*``), so it reads in light and dark themes alike. Every name that
comes from a dump is escaped.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

from tdinspect.util.terminal import html_text, visible

# Colours only through the theme's variables; outside JupyterLab they fall back to the text colour.
_STYLE = """<style>
.tdi{font-family:var(--jp-code-font-family,monospace);font-size:var(--jp-code-font-size,12px);
color:var(--jp-content-font-color1,inherit);line-height:1.45}
.tdi table{border-collapse:collapse;margin:2px 0 6px 0}
.tdi th,.tdi td{padding:2px 8px;text-align:left;
border-bottom:1px solid var(--jp-border-color2,currentColor)}
.tdi th{color:var(--jp-content-font-color2,inherit);font-weight:600}
.tdi details{margin:2px 0}
.tdi summary{cursor:pointer;color:var(--jp-content-font-color0,inherit);font-weight:600}
.tdi summary .n{color:var(--jp-content-font-color2,inherit);font-weight:normal}
.tdi .bad{color:var(--jp-error-color1,currentColor);font-weight:bold}
.tdi .warn{color:var(--jp-warn-color1,currentColor)}
.tdi .ok{color:var(--jp-success-color1,currentColor)}
.tdi .note{border-left:3px solid var(--jp-warn-color1,currentColor);padding:2px 8px;margin:4px 0;
background:var(--jp-layout-color2,transparent)}
</style>"""


def fmt(v: Any) -> str:
    """A number as people read it (3 significant digits), anything else as text."""
    if isinstance(v, float):
        if math.isnan(v):
            return "-"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return f"{v:.3g}"
    return str(v)


def _sci(v: Any) -> str:
    """Small and large numbers in scientific notation; others with enough digits to tell
    0.99996 from 1 (cosine)."""
    if isinstance(v, float) and math.isfinite(v) and v != 0:
        return f"{v:.2e}" if not 1e-3 <= abs(v) < 1e4 else f"{v:.6g}"
    return fmt(v)


def _cell(v: Any) -> str:
    return html_text(_sci(v))


def styled(df, highlight_row: int | None = None) -> str:
    """A DataFrame as an HTML table: floats in scientific notation, text and column names
    escaped (:func:`~tdinspect.util.terminal.html_text`), no index."""
    styler = df.style.format(_cell, na_rep="–").format_index(html_text, axis=1).hide(axis="index")
    if highlight_row is not None and 0 <= highlight_row < len(df):
        styler = styler.apply(
            lambda r: ["font-weight:bold" if r.name == df.index[highlight_row] else "" for _ in r], axis=1
        )
    return styler.to_html()


def _table(headers: list[str], rows: list[list[Any]], bad_row: int | None = None) -> str:
    head = "".join(f"<th>{html_text(h)}</th>" for h in headers)
    body = []
    for n, row in enumerate(rows):
        cls = ' class="bad"' if n == bad_row else ""
        body.append(f"<tr{cls}>" + "".join(f"<td>{_cell(c)}</td>" for c in row) + "</tr>")
    return f"<table><tr>{head}</tr>{''.join(body)}</table>"


def section(title: str, body: str, *, count: Any = None, open_: bool = False) -> str:
    """A collapsible section (``<details>``); ``count`` is shown beside the title."""
    n = "" if count is None else f" <span class='n'>({html_text(count)})</span>"
    return f"<details{' open' if open_ else ''}><summary>{html_text(title)}{n}</summary>{body}</details>"


def _box(inner: str) -> str:
    return f"{_STYLE}<div class='tdi'>{inner}</div>"


def human_bytes(n: float) -> str:
    """A byte count as people read it: ``512 B``, ``1.5 KB``, ``3.2 GB`` (powers of 1024).

    Examples
    --------
    >>> human_bytes(512), human_bytes(1536), human_bytes(3 << 40)
    ('512 B', '1.5 KB', '3.0 TB')
    """
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def text_table(headers: list[str], rows: list[list[Any]]) -> str:
    """A plain aligned table for terminals (cells escaped: :func:`tdinspect.util.terminal.visible`)."""
    cells = [headers] + [[visible(fmt(c)) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def dumpset_html(ds) -> str:
    import pandas as pd

    s = ds.summary()
    facts = [
        ["path", s["path"]],
        ["level", s["level"]],
        ["ops", s["ops"]],
        ["calls (max)", s["max_calls"]],
        ["passes", s["passes"]],
        ["ranks", s["ranks"]],
        ["entries", s["entries"]],
        ["tensor bytes", human_bytes(s["bytes"])],
        ["statistics only", s["stats_only"]],
    ]
    first = ds.pass_indexes()[0]
    uninit = sum(sum(pi.uninitialized) for pi in ds.pass_indexes())
    if uninit:
        facts.append(["uninitialised entries (not saved)", uninit])
    keys = [k for k in first.keys if ds.keeps(k)]
    pos = [first.position[k] for k in keys]
    rows = pd.DataFrame(
        {
            "key": keys,
            "dtype": [first.dtype[i] for i in pos],
            "shape": [str(first.shape[i]) for i in pos],
            "module": [first.module_type[i] or "" for i in pos],
        }
    )
    parts = [
        f"<b>DumpSet</b> {html_text(s['path'])}",
        section("facts", _table(["", ""], facts), open_=True),
        section(f"entries of pass {first.index}, rank {first.rank}", styled(rows), count=len(rows)),
    ]
    if s["skipped"]:
        parts.append(
            section(
                "skipped passes (unreadable)",
                "<br>".join(html_text(x) for x in ds.skipped),
                count=s["skipped"],
            )
        )
    return _box("".join(parts))


def _divergence_body(div) -> str:
    import pandas as pd

    where = f"pass {div.pass_}" + (f", rank {div.rank}" if div.rank else "")
    rows = pd.DataFrame([*div.before, (div.key, div.value)], columns=["entries up to it", div.metric])
    return (
        f"<span class='bad'>{html_text(div.key)}</span> ({where}, call {div.call}): "
        f"{html_text(div.reason)}" + styled(rows, highlight_row=len(rows) - 1)
    )


def divergence_html(div) -> str:
    body = "<b>First divergence</b>: " + _divergence_body(div)
    se = getattr(div, "structural_entries", None)
    if se is not None and len(se):
        body += section("structural entries set aside", styled(se), count=len(se))
    return _box(body)


def _numbers(values) -> str:
    """Sorted ints as a short list, runs folded: ``[2]``, ``[1..326] (326)``, ``[0, 4..9] (7)``."""
    values = sorted(values)
    runs = []
    for v in values:
        if runs and v == runs[-1][1] + 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    parts = [str(a) if a == b else f"{a}, {b}" if b == a + 1 else f"{a}..{b}" for a, b in runs]
    shown = ", ".join(parts[:6]) + (", ..." if len(parts) > 6 else "")
    return f"[{shown}]" + (f" ({len(values)})" if len(values) > 3 else "")


def side_differences(diff) -> list[str]:
    """What differs in structure between the two sides (:meth:`tdinspect.Diff.one_sided`), in words.

    Lines such as ``"passes only in B: [3]"``, ``"passes only in B: [1..326] (326)"`` or ``"entries only in A: 2 (pass 0, rank 0: ...)"``;
    empty when both sides hold the same ranks, passes and entry names.
    """
    differ = diff.one_sided()
    out = []
    for what in ("ranks", "passes"):
        for side in ("A", "B"):
            if differ[what][side]:
                out.append(f"{what} only in {side}: {_numbers(differ[what][side])}")
    for side, found in differ["entries"].items():
        if found:
            (rank, p), names = found[0]
            shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
            n = sum(len(x) for _, x in found)
            out.append(
                f"entry names only in {side}: {n} in {len(found)} pass(es) (first: pass {p}, "
                f"rank {rank}: {shown})"
            )
    return out


class DiffSummary:
    """One summary of a Diff at a metric and threshold: what differs, the first divergence.

    What ``%tdi_diff`` shows, and what a Diff shows at its defaults.

    Examples
    --------
    >>> DiffSummary(diff, threshold=0.999, metric="cosine")   # doctest: +SKIP
    """

    def __init__(
        self,
        diff,
        threshold: float | dict | None = None,
        metric: str | None = None,
        structural: str | None = None,
    ):
        self.diff = diff
        self.metric = diff.default_metric if metric is None else metric
        self.threshold = threshold
        # the summary says what was not compared (self.verdict), not a warning
        self.verdict = diff.verdict(threshold, self.metric, structural)
        self.divergence, self.gap = self.verdict.divergence, self.verdict.stopped
        self.nearest = None if self.divergence else diff.nearest(threshold, self.metric, False)

    def structural(self) -> Counter:
        """Structural problems by kind, over the passes compared so far."""
        kinds: Counter = Counter()
        for reason in self.diff.structural_read()["reason"]:
            kinds[
                reason.split(" (")[0]
                if reason.startswith("NaN")
                else ("shape mismatch" if reason.startswith("shape") else reason)
            ] += 1
        return kinds

    def __repr__(self) -> str:
        d = self.diff
        lines = [f"Diff A={d.a.path} (reference), B={d.b.path}: {d.mode}, align={d.align}"]
        lines += [f"  sides differ: {x}" for x in side_differences(d)]
        if d.spec.describe():
            lines.append(f"  compared with: {d.spec.describe()}")
        lines.append(f"  threshold: {self.threshold_text()}")
        if self.divergence:
            lines.append(f"  first divergence: {self.divergence!r}")
        elif self.verdict.outcome == "incomplete":
            lines.append(f"  {self.verdict.text} ({self.metric})")
        else:
            lines.append(f"  no divergence ({self.metric}): {self._matched()}")
        if self.nearest:
            lines.append(f"  nearest: {self.nearest['text']}")
        return visible("\n".join(lines), keep="\n")  # paths and names from the dump

    def _matched(self) -> str:
        """``all 21 entries compared, none past its threshold (4 left out by allow_uncompared)``:
        the verdict's own words, never "every entry" when some were allowed out."""
        return self.verdict.text.removeprefix("matches: ")

    def threshold_text(self) -> str:
        """``auto (rel_diff u/4, ...: float32 1.5e-08)`` (the values of the dtypes compared so
        far) or the number given."""
        return self.diff.threshold_text(self.threshold, self.metric)

    def _thr_text(self) -> str:
        return html_text(self.threshold_text())

    def _repr_html_(self) -> str:
        d = self.diff
        head = (
            f"<b>Diff</b> A (reference) = {html_text(d.a.path)}<br>"
            f"B = {html_text(d.b.path)}<br>mode: {d.mode}, align: {d.align}, "
            f"metric: {html_text(self.metric)}, threshold: {self._thr_text()}"
        )
        parts = [head]
        differ = side_differences(d)
        if differ:
            parts.append(
                "<div class='note'><b>the two sides differ:</b><br>"
                + "<br>".join(html_text(x) for x in differ)
                + "</div>"
            )
        if self.divergence is None:
            if self.verdict.outcome == "incomplete":
                parts.append(
                    f"<p><b>incomplete</b>: no divergence among the {self.verdict.compared} entries "
                    f"compared ({html_text(self.metric)} at threshold {self._thr_text()}), but "
                    f"{html_text(self.verdict.gap)}</p>"
                )
            else:
                parts.append(
                    f"<p><span class='ok'>no divergence</span> ({html_text(self.metric)} "
                    f"at threshold {self._thr_text()}): {html_text(self._matched())}</p>"
                )
            if self.nearest:
                parts.append(f"<div class='note'>nearest: {html_text(self.nearest['text'])}</div>")
        else:
            parts.append(section("first divergence", _divergence_body(self.divergence), open_=True))
        kinds = self.structural()
        total, read = sum(kinds.values()), len(d.passes_read)
        if total:
            body = _table(["kind", "entries"], [[k, n] for k, n in kinds.most_common()])
            body += styled(d.structural_read().head(20))
            parts.append(
                section(
                    f"structural problems in the {read} of {len(d.rank_passes())} "
                    f"(rank, pass) pairs compared so far",
                    body,
                    count=total,
                )
            )
        return _box("".join(parts))


def diff_html(diff, threshold=None, metric=None) -> str:
    return DiffSummary(diff, threshold, metric)._repr_html_()


def replay_html(result) -> str:
    import pandas as pd

    rows = pd.DataFrame(
        [[o["key"], o.get("rel_diff"), o.get("max_abs"), o.get("cosine")] for o in result.outputs],
        columns=["output", "rel_diff", "max_abs", "cosine"],
    )
    args = getattr(result, "args", [])
    other = getattr(result, "other_args", None)
    names = list(dict.fromkeys([n for n, _ in args] + [n for n, _ in other or []]))
    a, b = dict(args), dict(other or [])
    table = pd.DataFrame(
        [[n, a.get(n, "")] + ([b.get(n, "")] if other is not None else []) for n in names],
        columns=["argument", "recorded"] + (["other run"] if other is not None else []),
    )
    return _box(
        f"<b>Replay</b> of {html_text(result.op)} against a "
        f"{html_text(str(result.dtype).removeprefix('torch.'))} re-run on its recorded "
        f"inputs: the op's own error{styled(rows)}"
        + (section("recorded arguments", styled(table), count=len(names), open_=True) if names else "")
    )


def share_colour(share: float) -> str:
    """The colour of a share of its threshold on a log scale: green far below it, amber near
    it, red past it (darker the further), grey when nothing was compared (NaN).

    Examples
    --------
    >>> share_colour(0.0), share_colour(1e-5), share_colour(0.5), share_colour(2.0)
    ('hsl(120,55%,42%)', 'hsl(120,55%,42%)', 'hsl(46,83%,45%)', 'hsl(0,75%,43%)')
    """
    if share != share:
        return "hsl(0,0%,55%)"
    if share <= 1:
        # 1e-4 of the threshold and below: green; the threshold itself: amber
        t = min(1.0, max(0.0, (math.log10(share) + 4) / 4)) if share > 0 else 0.0
        return f"hsl({round(120 - 80 * t)},{round(55 + 30 * t)}%,{round(42 + 3 * t)}%)"
    t = min(1.0, math.log10(share) / 4) if math.isfinite(share) else 1.0
    return f"hsl(0,75%,{round(45 - 20 * t)}%)"


def share_text(share: float) -> str:
    """A share of the threshold as people read it: ``0.3%``, ``12x``, ``structural``, ``-``."""
    if share != share:
        return "-"
    if math.isinf(share):
        return "structural"
    return f"{share * 100:.2g}%" if share < 1 else f"{share:.3g}x"


def _counts(node) -> str:
    parts = [f"{node.entries} entries"]
    for n, what in (
        (node.diverging, "diverging"),
        (node.one_sided, "one-sided"),
        (node.nonfinite, "NaN/Inf"),
    ):
        if n:
            parts.append(f"{n} {what}")
    return ", ".join(parts)


def node_label(node) -> str:
    """A node's one-line summary: ``self_attn  worst 12x of threshold  (8 entries, 3 diverging)``."""
    w = node.worst
    worst = (
        "nothing compared"
        if w != w
        else "structural"
        if math.isinf(w)
        else f"worst {share_text(w)} of threshold"
    )
    return f"{node.name}  {worst}  ({_counts(node)})"


_SWATCH = (
    "display:inline-block;width:0.8em;height:0.8em;border-radius:2px;margin-right:6px;vertical-align:middle"
)


def _tree_node_html(node) -> str:
    style = f"{_SWATCH};background:{share_colour(node.worst)}"
    bad = "font-weight:bold;" if node.diverging else ""
    head = (
        f"<span style='{style}'></span><span style='{bad}'>{html_text(node.name)}</span> "
        f"<span style='opacity:0.75'>{html_text(share_text(node.worst))} &middot; "
        f"{html_text(_counts(node))}</span>"
    )
    if not node.children:
        return f"<div style='margin-left:1.1em' title='{html_text(node.path)}'>{head}</div>"
    inner = "".join(_tree_node_html(c) for c in node.children.values())
    return (
        f"<details{' open' if node.open else ''} style='margin-left:0.6em'>"
        f"<summary title='{html_text(node.path)}' style='cursor:pointer'>{head}</summary>"
        f"<div style='border-left:1px dotted #999;margin-left:0.35em'>{inner}</div></details>"
    )


def tree_html(tree) -> str:
    """A module tree (:class:`tdinspect.compare.tree.ModuleTree`) as nested ``<details>`` with
    inline styles: it reads without a kernel or a script (nbviewer, an HTML export, a saved report).
    Each node's swatch is its worst share of its threshold (:func:`share_colour`); the path to
    the first divergence is open."""
    first = (
        f"first divergence: <b>{html_text(tree.first[0])}</b> (pass {tree.first[1]})"
        if tree.first
        else "no divergence"
    )
    legend = " ".join(
        f"<span style='{_SWATCH};background:{share_colour(s)}'></span>{t}"
        for s, t in (
            (1e-5, "&le;0.01%"),
            (0.05, "5%"),
            (0.9, "90%"),
            (3.0, "past it"),
            (float("nan"), "not compared"),
        )
    )
    body = "".join(_tree_node_html(c) for c in tree.root.children.values())
    return (
        "<div style='font-family:monospace;font-size:12px;line-height:1.5'>"
        f"<div><b>module tree</b> ({html_text(tree.metric)} at threshold {html_text(tree.threshold)}): "
        f"{first}</div><div style='margin:2px 0 4px 0'>share of threshold: {legend}</div>{body}</div>"
    )


def tree_text(tree) -> str:
    """The open part of a module tree as indented text (names made safe to print)."""
    lines = [
        f"ModuleTree ({tree.metric}): "
        + (f"first divergence {tree.first[0]}" if tree.first else "no divergence")
    ]
    for node, expanded in tree.lines():
        mark = "v" if expanded else ("+" if node.children else " ")
        lines.append(f"{'  ' * node.depth}{mark} {node_label(node)}")
    return visible("\n".join(lines), keep="\n")


def health_html(df, limit: int = 200) -> str:
    """The health table (:meth:`tdinspect.Diff.health`), worst share first, as an HTML table
    (``limit`` rows)."""
    shown = df.sort_values(["diverges", "share"], ascending=False, kind="stable").head(limit)
    shown = shown[
        ["pass", "rank", "key", "value", "threshold", "share", "growth", "nonfinite", "one_sided", "reason"]
    ]
    shown = shown.assign(share=[share_text(s) for s in shown["share"]])
    more = (
        f"<p>the first {limit} of {len(df)} rows: diff.health() holds them all</p>" if len(df) > limit else ""
    )
    return styled(shown) + more


def report_page(summary_html: str, tree, health, title: str) -> str:
    """A whole HTML document: a diff's summary, its module tree and its health table (the CLI's
    ``tdinspect report``); no script, every name escaped."""
    n = int(health["diverges"].sum())
    return (
        "<!DOCTYPE html><html><head><meta charset='utf-8'>"
        f"<title>{html_text(title)}</title></head><body>"
        f"{summary_html}{_box(section('module tree', tree_html(tree), open_=True))}"
        f"{_box(section('entries by share of their threshold', health_html(health), count=f'{n} diverging of {len(health)}', open_=True))}"
        "</body></html>"
    )
