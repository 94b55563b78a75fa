"""The module tree widget: one row per shown node of a :class:`~tdinspect.compare.tree.ModuleTree`
(a swatch of its worst share of its threshold, its name and counts); clicking a node opens or
closes it and shows its worst entry.

Collapsed except the path to the first divergence and the paths a person opened; the entry on
show is marked. ipywidgets only (buttons and HTML swatches), no script.
"""

from __future__ import annotations

import ipywidgets as W

from tdinspect.report import share_colour, share_text
from tdinspect.util.terminal import html_text, visible


def _swatch(share: float) -> str:
    return (
        "<span style='display:inline-block;width:11px;height:11px;border-radius:2px;"
        f"margin-top:6px;background:{share_colour(share)}'></span>"
    )


def node_text(node, expanded: bool) -> str:
    """A node's button text: ``▾ mlp  12x  (6 entries, 2 diverging)``."""
    mark = "▾" if expanded else ("▸" if node.children else "·")
    counts = [f"{node.entries}"]
    for n, what in ((node.diverging, "⚠"), (node.one_sided, "one-sided"), (node.nonfinite, "NaN/Inf")):
        if n:
            counts.append(f"{n} {what}")
    return visible(f"{mark} {node.name}  {share_text(node.worst)}  ({', '.join(counts)})")


class TreePanel:
    """The module tree of a diff, as widgets.

    Attributes
    ----------
    tree : ModuleTree or None
    rows : ipywidgets.VBox
        One ``HBox(swatch, button)`` per shown node.
    widget : ipywidgets.VBox
    on_pick : callable or None
        Called with ``(key, pass, rank)`` of the node clicked (its own worst entry, else the
        worst below it).
    """

    def __init__(self):
        self.title = W.HTML()
        self.rows = W.VBox(layout=W.Layout(align_items="flex-start"))
        self.widget = W.VBox(
            [self.title, self.rows],
            layout=W.Layout(
                max_height="420px", overflow="auto", border="1px solid var(--jp-border-color2,#ddd)"
            ),
        )
        self.tree = None
        self.on_pick = None
        self._opened: set[str] = set()  # paths a person opened (kept across trees)
        self._closed: set[str] = set()  # paths a person closed
        self._marked: str | None = None  # the node of the entry on show
        self._rows: list[tuple[W.HBox, W.HTML, W.Button]] = []  # by position, reused
        self._paths: list[str] = []  # the node each row shows

    def set_tree(self, tree) -> None:
        """Show ``tree`` (a new metric or threshold), keeping what a person opened and closed."""
        self.tree = tree
        for node in tree.root.walk():
            if node.path in self._opened:
                node.open = True
            elif node.path in self._closed:
                node.open = False
        # not the words of the explorer's label ("first divergence"), which pages look for
        first = f"diverges first at <b>{html_text(tree.first[0])}</b>" if tree.first else "nothing diverges"
        self.title.value = f"<b>module tree</b> <small>({first}; colour: worst share of threshold)</small>"
        self.render()

    def mark(self, key: str | None) -> None:
        """Open the path to entry ``key`` and mark its node (the entry the view shows)."""
        if self.tree is None or key is None:
            return
        nodes = self.tree.path_of(key)
        for node in nodes[:-1]:
            node.open = True
        self._marked = nodes[-1].path if nodes else None
        self.render()

    def render(self) -> None:
        """Show the tree's open lines. Rows are kept by position and given the node of their
        line: a pick that opens another layer changes a few texts instead of making (and the
        page drawing) widgets for every node newly shown."""
        lines = self.tree.lines()
        while len(self._rows) < len(lines):
            self._rows.append(self._row(len(self._rows)))
        self._paths = [node.path for node, _ in lines]
        for (node, expanded), (box, swatch, button) in zip(lines, self._rows):
            box.layout.margin = f"0 0 0 {node.depth * 16}px"
            swatch.value = _swatch(node.worst)
            button.description = node_text(node, expanded)
            button.tooltip = visible(node.path)
            button.button_style = "info" if node.path == self._marked else ""
        if len(self.rows.children) != len(lines):
            self.rows.children = [box for box, _, _ in self._rows[: len(lines)]]

    def _row(self, i: int) -> tuple[W.HBox, W.HTML, W.Button]:
        """The widgets of the ``i``-th line: a swatch and a button that clicks its node."""
        swatch = W.HTML(layout=W.Layout(margin="0 4px 0 0"))
        button = W.Button(layout=W.Layout(width="auto", height="26px", padding="0 8px", margin="1px 0"))
        button.on_click(lambda _: self.click(self._paths[i]))
        # flex 0 0 auto: a long tree scrolls, its rows never squeeze into one another
        return W.HBox([swatch, button], layout=W.Layout(flex="0 0 auto")), swatch, button

    def click(self, path: str) -> None:
        """What a click on node ``path`` does: open or close it, and show its worst entry."""
        node = self.tree.node(path)
        if node.children:
            node.open = not node.open
            (self._opened if node.open else self._closed).add(path)
            (self._closed if node.open else self._opened).discard(path)
        self.render()
        if self.on_pick is not None and node.target is not None:
            self.on_pick(*node.target)
