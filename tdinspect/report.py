"""HTML and text renderings of DumpSet, Diff and Divergence (no IPython needed).

Used by ``_repr_html_`` in notebooks and by the CLI's tables, so a notebook
and a terminal show the same facts.
"""

from __future__ import annotations

import html
import math
from typing import Any

_STYLE = ("<style>.tdi{font-family:ui-monospace,monospace;font-size:12px}"
          ".tdi table{border-collapse:collapse}.tdi td,.tdi th{padding:2px 8px;"
          "border-bottom:1px solid #ddd;text-align:left}.tdi .bad{color:#b00;font-weight:bold}"
          ".tdi .ok{color:#070}</style>")


def fmt(v: Any) -> str:
    """A number as people read it (3 significant digits), anything else as text."""
    if isinstance(v, float):
        if math.isnan(v):
            return "-"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return f"{v:.3g}"
    return str(v)


def _table(headers: list[str], rows: list[list[Any]], bad_row: int | None = None) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = []
    for n, row in enumerate(rows):
        cls = ' class="bad"' if n == bad_row else ""
        body.append(f"<tr{cls}>" + "".join(f"<td>{html.escape(fmt(c))}</td>" for c in row) + "</tr>")
    return f"<table><tr>{head}</tr>{''.join(body)}</table>"


def text_table(headers: list[str], rows: list[list[Any]]) -> str:
    """A plain aligned table for terminals."""
    cells = [headers] + [[fmt(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def dumpset_html(ds) -> str:
    from .dumpset import _human

    s = ds.summary()
    facts = [["path", s["path"]], ["level", s["level"]], ["ops", s["ops"]],
             ["calls (max)", s["max_calls"]], ["passes", s["passes"]], ["ranks", s["ranks"]],
             ["entries", s["entries"]], ["tensor bytes", _human(s["bytes"])],
             ["statistics only", s["stats_only"]]]
    if s["skipped"]:
        facts.append(["skipped passes", s["skipped"]])
    first = ds.pass_indexes()[0]
    rows = [[k, first.dtype[i], str(first.shape[i]), first.module_type[i]]
            for i, k in enumerate(first.keys[:8])]
    return (f"{_STYLE}<div class='tdi'><b>DumpSet</b>{_table(['', ''], facts)}"
            f"<p>first entries of pass {first.index}, rank {first.rank}:</p>"
            f"{_table(['key', 'dtype', 'shape', 'module'], rows)}</div>")


def divergence_html(div) -> str:
    rows = [[k, v] for k, v in div.before] + [[div.key, div.value]]
    where = f"pass {div.pass_}" + (f", rank {div.rank}" if div.rank else "")
    return (f"{_STYLE}<div class='tdi'><b>First divergence</b>: <span class='bad'>"
            f"{html.escape(div.key)}</span> ({where}, call {div.call})<br>"
            f"{html.escape(div.reason)}<br>{_table(['entries up to it', div.metric], rows, len(rows) - 1)}"
            "</div>")


def diff_html(diff) -> str:
    div = diff.first_divergence()
    head = (f"<b>Diff</b> A (reference) = {html.escape(str(diff.a.path))}<br>"
            f"B = {html.escape(str(diff.b.path))}<br>mode: {diff.mode}, align: {diff.align}, "
            f"metric: {diff.default_metric}<br>")
    structural = [row for rows in diff._results.values() for row in
                  rows.loc[rows["structural"], ["pass", "rank", "key", "reason"]].values.tolist()]
    problems = ""
    if structural:
        problems = (f"<p>structural problems in the {len(diff._results)} pass(es) read so far "
                    f"({len(structural)}; first 10):</p>"
                    + _table(["pass", "rank", "key", "reason"], structural[:10]))
    if div is None:
        return f"{_STYLE}<div class='tdi'>{head}<span class='ok'>no divergence</span>{problems}</div>"
    return f"{_STYLE}<div class='tdi'>{head}</div>" + divergence_html(div) + \
        (f"{_STYLE}<div class='tdi'>{problems}</div>" if problems else "")


def replay_html(result) -> str:
    rows = [[o["key"], o.get("rel_diff"), o.get("max_abs"), o.get("cosine")] for o in result.outputs]
    return (f"{_STYLE}<div class='tdi'><b>Replay</b> of {html.escape(result.op)} against a "
            f"{html.escape(str(result.dtype).removeprefix('torch.'))} re-run on its recorded inputs: "
            f"the op's own error<br>{_table(['output', 'rel_diff', 'max_abs', 'cosine'], rows)}</div>")
