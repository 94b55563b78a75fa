"""The module tree of a diff: the hierarchy of the dotted entry names, each node with the worst
share of its threshold below it and its counts of diverging, one-sided and NaN/Inf entries.

Built from the health table (:func:`tdinspect.compare.entries.health`), so the tree, the HTML
report, the explorer and the dashboard say the same. Plain data: the views render it
(:func:`tdinspect.report.tree_html` for a page that needs no kernel).

Examples
--------
>>> t = diff.tree()                  # doctest: +SKIP
>>> t                                # the path to the first divergence, as text  # doctest: +SKIP
>>> t.node("model.layers.2").worst   # doctest: +SKIP
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np
import pandas as pd

from tdinspect.naming import parse_key


@dataclass
class Node:
    """One module (or one op/label under a module) of the tree.

    Attributes
    ----------
    name : str
        The last part of its path (``q_proj``; ``/aten.mm.default`` under a module, ``[out0]``
        under an op).
    path : str
        The whole path (``model.layers.0.self_attn.q_proj``).
    children : dict
        name -> Node, in execution order.
    worst : float
        The largest share of its threshold among the rows at and below it (``inf``: a
        structural row; NaN: nothing compared).
    worst_at : tuple or None
        ``(key, pass, rank)`` of that row, what a click on the node shows.
    entries, diverging, one_sided, nonfinite : int
        Rows (entry, pass, rank) at and below it, and how many of them diverge, are on one
        side only, hold NaN/Inf on one side.
    open : bool
        On the path to the first divergence (shown expanded).
    """

    name: str
    path: str
    depth: int
    children: dict = field(default_factory=dict)
    worst: float = math.nan
    worst_at: tuple | None = None
    own_worst: float = math.nan
    own_at: tuple | None = None
    entries: int = 0
    diverging: int = 0
    one_sided: int = 0
    nonfinite: int = 0
    open: bool = False

    def walk(self):
        """This node and every node below it, depth first in execution order."""
        yield self
        for child in self.children.values():
            yield from child.walk()

    @property
    def target(self) -> tuple | None:
        """What the node opens: its own worst row when it is an entry, else the worst below it."""
        return self.own_at if self.own_at is not None else self.worst_at


def key_path(op: str) -> list[str]:
    """The tree path of an entry name: the module's dotted parts, then its op, then each label
    (``model.ln/aten.add.Tensor[out0]`` -> ``["model", "ln", "/aten.add.Tensor", "[out0]"]``):
    an op's inputs and outputs meet under the op."""
    return list(_key_path(op))


@lru_cache(maxsize=65536)  # a tree is built again for each threshold: its names are parsed once
def _key_path(op: str) -> tuple[str, ...]:
    """:func:`key_path`, kept per name."""
    try:
        parts = parse_key(op)
    except ValueError:
        return (op,)
    path = parts.module.split(".") if parts.module else []
    if parts.op:
        path.append("/" + parts.op)
    path += [f"[{label}]" for label in parts.labels]
    return tuple(path or [op])


def _worse(a: float, b: float) -> bool:
    """Whether share ``a`` is worse than ``b`` (NaN: nothing compared, never worse)."""
    return not math.isnan(a) and (math.isnan(b) or a > b)


class ModuleTree:
    """The module tree of a diff at one metric and threshold (:meth:`tdinspect.Diff.tree`).

    Attributes
    ----------
    root : Node
        An unnamed node above the top-level names (``model``).
    first : tuple or None
        ``(key, pass, rank)`` of the first divergent row in execution order.
    metric : str
    threshold : str
        The threshold in words.
    """

    def __init__(self, health: pd.DataFrame, metric: str, threshold: str = ""):
        self.metric, self.threshold = metric, threshold
        self.root = Node("", "", -1)
        self._nodes: dict[str, Node] = {"": self.root}
        self.first = None
        # one pass over the distinct names (a 40-pass diff holds each name 40 times), counted
        # with numpy: a groupby of named aggregations costs more than the tree it feeds
        df = health.reset_index(drop=True)
        codes, ops = pd.factorize(df["op"], sort=False)
        n = len(ops)
        count = np.bincount(codes, minlength=n)
        sums = [
            np.bincount(codes, weights=df[c].to_numpy(float), minlength=n).astype(int)
            for c in ("diverges", "one_sided", "nonfinite")
        ]
        score = df["share"].fillna(-1.0).to_numpy(float)
        # each op's first row of the largest share: sorted by op, share falling, row
        by = np.lexsort((np.arange(len(df)), -score, codes))
        bests = by[np.r_[0, np.flatnonzero(np.diff(codes[by])) + 1]] if len(df) else by
        keys, passes, ranks = df["key"].tolist(), df["pass"].tolist(), df["rank"].tolist()
        shares = df["share"].tolist()
        for op, n, bad, one, nonfinite, best in zip(ops, count, *sums, bests):
            share, at = shares[best], (keys[best], int(passes[best]), int(ranks[best]))
            chain = self._chain(op)
            for node in chain:
                node.entries += int(n)
                node.diverging += int(bad)
                node.one_sided += int(one)
                node.nonfinite += int(nonfinite)
                if node.worst_at is None or _worse(share, node.worst):
                    node.worst, node.worst_at = share, at
            leaf = chain[-1]
            if leaf.own_at is None or _worse(share, leaf.own_worst):
                leaf.own_worst, leaf.own_at = share, at
        hits = df.index[df["diverges"].to_numpy(bool)]
        if len(hits):
            i = hits[0]
            self.first = (keys[i], int(passes[i]), int(ranks[i]))
            for node in self._chain(df["op"].iat[i]):
                node.open = True
        self.root.open = True

    def _chain(self, op: str) -> list[Node]:
        """The nodes from the root to ``op``'s, made where missing (root included)."""
        node, chain, path = self.root, [self.root], ""
        for part in key_path(op):
            path = path + ("." if path and not part.startswith(("/", "[")) else "") + part
            child = node.children.get(part)
            if child is None:
                child = node.children[part] = self._nodes[path] = Node(part, path, node.depth + 1)
            node = child
            chain.append(node)
        return chain

    def node(self, path: str) -> Node:
        """The node at ``path`` (``"model.layers.2.mlp"``); ``KeyError`` naming it when absent."""
        try:
            return self._nodes[path]
        except KeyError:
            raise KeyError(f"no module {path!r} in this tree") from None

    def path_of(self, key: str) -> list[Node]:
        """The nodes from the top to the entry ``key`` (its ``::callN`` ignored)."""
        from tdinspect.naming import split_call

        nodes, node = [], self.root
        for part in key_path(split_call(key)[0]):
            node = node.children.get(part)
            if node is None:
                break
            nodes.append(node)
        return nodes

    def lines(self, all_nodes: bool = False) -> list[tuple[Node, bool]]:
        """The nodes shown (the open ones' children), each with whether it is expanded; every
        node with ``all_nodes``."""
        out = []

        def visit(node):
            for child in node.children.values():
                expanded = all_nodes or child.open
                out.append((child, expanded and bool(child.children)))
                if expanded:
                    visit(child)

        visit(self.root)
        return out

    def __repr__(self) -> str:
        from tdinspect.report import tree_text

        return tree_text(self)

    def _repr_html_(self) -> str:
        from tdinspect.report import tree_html

        return tree_html(self)
