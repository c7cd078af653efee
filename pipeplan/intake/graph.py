"""Group a traced model's nodes into units, and find what crosses each cut.

Used by both the profiler (measure each unit) and the runtime (build each stage), so that the
two agree on the units.  The graph comes from :func:`pipeplan.intake.trace.trace_model`.

1. :func:`group_units` groups the compute nodes into units, contiguous in graph order (so in
   topological order).  ``auto`` makes every item of the containers that cover the most nodes
   a unit (``blocks.3``; any ``ModuleList`` or ``Sequential``, of one class or mixed); the nodes
   before, between and after the blocks ("glue") become units of their own when they use
   parameters (``embed``, ``head``) and join a neighbour otherwise.  ``expanded`` names modules
   to split into their children (``""`` is the glue's root; a leaf module splits into its graph
   nodes); an entry ``cut:NODE`` starts a new unit at graph node ``NODE`` (with the parameters
   it reads), which splits any unit, glue and interleaved modules included.
   :mod:`pipeplan.intake.refine` chooses the entries so that no unit is too heavy to balance.
   ``top`` and ``depth:N`` key each node by its module N levels deep (nodes of shallower
   modules are glue); ``node`` makes every node a unit (a ``get_attr`` joins its user).
   Whatever the granularity, a node that mutates a value in place stays in the unit that made
   the value (:mod:`pipeplan.intake.inplace`).
2. :func:`cut_tensors` lists, for each cut, the nodes produced before it and used after it:
   the activations, residuals and skip connections a pipeline stage must send.

:func:`subgraph_module` builds the callable of a run of nodes (a unit or a stage).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

from torch import nn
from torch.fx import Graph, GraphModule, Node

from pipeplan.intake.inplace import keep_mutations_whole
from pipeplan.intake.trace import TracedModel, get_attr
from pipeplan.planner.errors import InvalidRequestError

__all__ = [
    "CUT",
    "GRANULARITIES",
    "UnitSpec",
    "compute_nodes",
    "cut_tensors",
    "group_units",
    "subgraph_module",
]

#: The values ``group_units`` accepts (``N`` is a positive integer).
GRANULARITIES = ("auto", "top", "depth:N", "node")

#: The prefix of an ``expanded`` entry that cuts a unit before a graph node (``cut:addmm_3``).
CUT = "cut:"

_COMPUTE_OPS = ("call_module", "call_function", "call_method", "get_attr")


@dataclass(frozen=True)
class UnitSpec:
    """One partition atom: a readable unique name and its nodes in graph order."""

    name: str
    nodes: tuple[str, ...]


def compute_nodes(gm: GraphModule) -> list[Node]:
    """The nodes a unit can hold (everything but placeholders and the output), in graph order."""
    return [n for n in gm.graph.nodes if n.op in _COMPUTE_OPS]


_PATH_FIXES = (
    (re.compile(r"^(L\['self'\]|L__self__|self)\.?"), ""),
    (re.compile(r"\[(\d+)\]"), r".\1"),
    (re.compile(r"getattr\((.*?), '(\w+)'\)"), r"\1.\2"),
)


def _clean_path(path: str) -> tuple[str, ...]:
    for pattern, repl in _PATH_FIXES:
        path = pattern.sub(repl, path)
    return tuple(p for p in path.split(".") if p)


def _module_info(gm: GraphModule, node: Node) -> tuple[tuple[str, ...], dict[tuple[str, ...], str]]:
    """The node's deepest module path and the class name of every module on its stack."""
    classes: dict[tuple[str, ...], str] = {}
    for path, cls in (node.meta.get("nn_module_stack") or {}).values():
        if str(path).startswith("_"):  # export's placeholder stacks, e.g. _empty_nn_module_stack
            continue
        name = cls if isinstance(cls, str) else f"{cls.__module__}.{cls.__qualname__}"
        classes[_clean_path(str(path))] = name
    if node.op == "call_module":
        path = _clean_path(str(node.target))
        sub = gm.get_submodule(str(node.target))
        classes[path] = f"{type(sub).__module__}.{type(sub).__qualname__}"
        return path, classes
    deepest = max(classes, key=len, default=())
    return deepest, classes


def _repeated_items(
    paths: dict[Node, tuple[str, ...]], classes: dict[tuple[str, ...], str]
) -> set[tuple[str, ...]]:
    """Items of the containers that together cover the most nodes.

    A container has digit-named children (a ``ModuleList`` or ``Sequential``, of
    one class or mixed: ``Sequential(Linear, ReLU, ...)``'s items are units too).  Among
    antichains of containers, choose by dynamic programming over the module tree the one
    covering most compute nodes, then the one whose containers each hold one class (a
    ``ModuleList`` of blocks over the ``Sequential`` layers inside each block), then the one
    with most items.
    """
    weight: Counter[tuple[str, ...]] = Counter()
    for path in paths.values():
        for i in range(len(path) + 1):
            weight[path[:i]] += 1
    children: dict[tuple[str, ...], set[tuple[str, ...]]] = {}
    for path in weight:
        if path:
            children.setdefault(path[:-1], set()).add(path)

    def best(p: tuple[str, ...]) -> tuple[int, bool, int, list[tuple[str, ...]]]:
        kids = sorted(children.get(p, ()))
        cover, uniform, count, items = 0, True, 0, list[tuple[str, ...]]()
        for kid in kids:
            c, u, k, i = best(kid)
            cover, uniform, count, items = cover + c, uniform and u, count + k, items + i
        digits = [k for k in kids if k[-1].isdigit()]
        if digits and all(k in classes for k in digits):
            mine = sum(weight[k] for k in digits)
            same = len({classes[k] for k in digits}) == 1
            if (mine, same, len(digits)) > (cover, uniform, count):
                return mine, same, len(digits), digits
        return cover, uniform, count, items

    return set(best(())[3])


def _owner_names(
    gm: GraphModule, nodes: list[Node], paths: dict[Node, tuple[str, ...]], strip: int
) -> str:
    """Name a glue run after the modules whose parameters it uses (their common prefix)."""
    owners = _owners(gm, nodes, paths, strip)
    common = _common_prefix(owners)
    return ".".join(common) if common else "+".join(".".join(o) for o in owners)


def _owners(
    gm: GraphModule, nodes: list[Node], paths: dict[Node, tuple[str, ...]], strip: int
) -> list[tuple[str, ...]]:
    """The modules whose parameters ``nodes`` use, in order of first use."""
    owners: list[tuple[str, ...]] = []
    for n in nodes:
        if n.op == "get_attr" and isinstance(get_attr(gm, str(n.target)), nn.Parameter):
            owner = _clean_path(str(n.target))[strip:-1]
        elif n.op == "call_module" and any(
            True for _ in gm.get_submodule(str(n.target)).parameters()
        ):
            owner = paths[n][strip:]
        else:
            continue
        if owner and owner not in owners:
            owners.append(owner)
    return owners


def _common_prefix(paths: Sequence[tuple[str, ...]]) -> tuple[str, ...]:
    if not paths:
        return ()
    n = 0
    while all(len(p) > n and p[n] == paths[0][n] for p in paths):
        n += 1
    return paths[0][:n]


def _key_function(granularity: str) -> Any:
    """``top`` = ``depth:1``: a node's unit is its module at depth N; shallower nodes are glue."""
    m = re.fullmatch(r"depth:(\d+)", "depth:1" if granularity == "top" else granularity)
    if m and int(m.group(1)) >= 1:
        depth = int(m.group(1))
        return lambda path: path[:depth] if len(path) >= depth else None
    raise InvalidRequestError(
        f"granularity {granularity!r} is not one of {', '.join(GRANULARITIES)} "
        f"(N a positive integer, e.g. depth:2)"
    )


def group_units(
    traced: TracedModel, granularity: str = "auto", expanded: Sequence[str] = ()
) -> list[UnitSpec]:
    """Group the compute nodes into units contiguous in graph order (see the module docstring).

    >>> import torch
    >>> from pipeplan.intake.trace import trace_model
    >>> traced = trace_model(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), (torch.randn(2, 4),))
    >>> [u.name for u in group_units(traced, "node")]
    ['_0', '_1']
    >>> net = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.ReLU(), nn.Tanh()))
    >>> traced = trace_model(net, (torch.randn(2, 4),))
    >>> [(u.name, u.nodes) for u in group_units(traced, "auto", ["cut:_1_1"])]
    [('0', ('_0',)), ('1', ('_1_0',)), ('1.1[_1_1]', ('_1_1',))]
    """
    gm = traced.gm
    nodes = compute_nodes(gm)
    order = {n: i for i, n in enumerate(nodes)}
    paths: dict[Node, tuple[str, ...]] = {}
    classes: dict[tuple[str, ...], str] = {}
    for n in nodes:
        paths[n], cls = _module_info(gm, n)
        classes.update(cls)

    keys: dict[Node, tuple[str, ...] | None] = {}
    if granularity == "node":
        keys = {n: (n.name,) for n in nodes}
    elif granularity == "auto":
        items = _repeated_items({n: p for n, p in paths.items() if n.op != "get_attr"}, classes)
        if len(items) < 2:
            items = {p[:1] for n, p in paths.items() if n.op != "get_attr" and p}  # as ``top``
        modules = [e for e in expanded if not e.startswith(CUT)]
        opened = {tuple(e.split(".")) if e else () for e in modules}
        # Opening a module deep inside an item opens the item and the modules on the way.
        opened |= {p[:i] for p in opened for i in range(1, len(p))}
        inner = {p[:i] for p in paths.values() for i in range(len(p))}  # modules with children
        above = {p[:i] for p in items for i in range(len(p))}  # the items' ancestors
        for n in nodes:
            path = paths[n]
            base = next((path[:i] for i in range(len(path) + 1) if path[:i] in items), ())
            glue_open = base == () and () in opened
            keys[n] = _expand(base, path, n.name, opened | above if glue_open else opened, inner)
    else:
        key_of = _key_function(granularity)
        keys = {n: key_of(paths[n]) for n in nodes}
    for n in nodes:  # a parameter belongs where it is used
        if n.op == "get_attr":
            first = min((u for u in n.users if u in order), key=order.__getitem__, default=None)
            keys[n] = keys.get(first) if first is not None else None

    # Names drop the prefix every module path shares (a wrapper's attribute name).
    strip = len(_common_prefix([p for n, p in paths.items() if n.op != "get_attr" and p]))
    # Merge every key's span [first, last] with the spans it overlaps.
    spans: dict[tuple[str, ...], list[int]] = {}
    for n in nodes:
        key = keys[n]
        if key is not None:
            spans.setdefault(key, [order[n], order[n]])[1] = order[n]
    merged: list[tuple[int, int, list[str]]] = []
    for key, (lo, hi) in sorted(spans.items(), key=lambda kv: kv[1][0]):
        if merged and lo <= merged[-1][1]:
            a, b, names = merged[-1]
            merged[-1] = (a, max(b, hi), names + [_key_name(key, strip)])
        else:
            merged.append((lo, hi, [_key_name(key, strip)]))

    # Glue: runs between spans; a run that uses parameters is a unit, else joins a neighbour.
    bounds: list[tuple[int, int, str]] = []
    cursor = 0
    for lo, hi, names in merged + [(len(nodes), len(nodes), [])]:
        if lo > cursor:
            name = _owner_names(gm, nodes[cursor:lo], paths, strip)
            if name or not bounds and lo == len(nodes):
                bounds.append((cursor, lo - 1, name or "glue"))
            elif bounds:
                a, _, label = bounds[-1]
                bounds[-1] = (a, lo - 1, label)
            else:
                lo = cursor  # leading parameter-free glue joins the first span
        if names:
            bounds.append((lo, hi, "+".join(names)))
        cursor = hi + 1

    cuts = {e[len(CUT) :] for e in expanded if e.startswith(CUT)}
    if cuts:
        name_of = {n: _key_name(k, strip) for n, k in keys.items() if k is not None}

        def piece_label(piece: list[Node]) -> str:
            names = "+".join(dict.fromkeys(name_of[n] for n in piece if n in name_of))
            owners = _owners(gm, piece, paths, strip)
            return names or (".".join(owners[0]) if len(owners) == 1 else "")

        module_of = {n: ".".join(p[strip:]) for n, p in paths.items()}
        bounds = _apply_cuts(bounds, nodes, cuts, piece_label, module_of)

    bounds = keep_mutations_whole(bounds, nodes, gm)
    units: list[UnitSpec] = []
    seen: Counter[str] = Counter()
    for lo, hi, name in bounds:
        seen[name] += 1
        unique = name if seen[name] == 1 else f"{name}#{seen[name]}"
        units.append(UnitSpec(unique, tuple(n.name for n in nodes[lo : hi + 1])))
    if granularity == "node":  # a get_attr unit joins its user's
        return _fold_get_attr(gm, units)
    return units


def _apply_cuts(
    bounds: list[tuple[int, int, str]],
    nodes: list[Node],
    cuts: set[str],
    label: Callable[[list[Node]], str],
    module_of: dict[Node, str],
) -> list[tuple[int, int, str]]:
    """Split the runs ``bounds`` where a node of ``cuts`` starts (with the ``get_attr`` nodes
    just before it, the parameters it reads); unknown names and ``get_attr`` nodes are ignored.

    A piece is named by ``label``: after the units its nodes' keys name (``model.norm``,
    ``lm_head``), else after the one module whose parameters it uses.  A piece with no such name,
    or with the name of an earlier piece of the run, is named by its first node and that node's
    module (``module_of``): ``blocks.0.attn[add_3]``, or ``[add]`` in the model's own
    ``forward``; but when no piece has a name, the first keeps the run's.
    """
    starts: set[int] = set()
    for i, n in enumerate(nodes):
        if n.name in cuts and n.op != "get_attr":
            while i > 0 and nodes[i - 1].op == "get_attr":
                i -= 1
            starts.add(i)
    out: list[tuple[int, int, str]] = []
    for lo, hi, name in bounds:
        edges = [lo, *sorted(s for s in starts if lo < s <= hi), hi + 1]
        if len(edges) == 2:
            out.append((lo, hi, name))
            continue
        pieces = [nodes[a:b] for a, b in pairwise(edges)]
        labels = [label(p) for p in pieces]
        if not any(labels):
            labels[0] = name
        used: set[str] = set()
        for a, piece, text in zip(edges, pieces, labels):
            if not text or text in used:
                first = next((n for n in piece if n.op != "get_attr"), piece[0])
                text = f"{module_of[first]}[{first.name}]"
            used.add(text)
            out.append((a, a + len(piece) - 1, text))
    return out


def _key_name(key: tuple[str, ...], strip: int) -> str:
    """``blocks.3``; a graph node of a split leaf module is ``blocks.3.norm[pow_1]``."""
    return ".".join(key[strip:]).replace(".[", "[") or "root"


def _expand(
    key: tuple[str, ...],
    path: tuple[str, ...],
    node: str,
    opened: set[tuple[str, ...]],
    inner: set[tuple[str, ...]],
) -> tuple[str, ...] | None:
    """A node's unit key once the ``opened`` modules are split into their children.

    An opened module's nodes go to its child on their path; a node of the opened module itself
    is glue when the module has children, and a unit of its own (``module[node]``) when it has none
    (a leaf module split into graph nodes).  The root ``()`` is the glue outside every item;
    opening it passes through the items' ancestors (a wrapper's ``model``) to the modules
    beside the items.
    """
    while key in opened:
        if len(path) > len(key):
            key = path[: len(key) + 1]
        elif key in inner:
            return None
        else:
            return (*key, f"[{node}]")
    return key or None


def _fold_get_attr(gm: GraphModule, units: list[UnitSpec]) -> list[UnitSpec]:
    ops = {n.name: n.op for n in gm.graph.nodes}
    out: list[UnitSpec] = []
    pending: tuple[str, ...] = ()
    for u in units:
        if all(ops[x] == "get_attr" for x in u.nodes):
            pending += u.nodes
        else:
            out.append(UnitSpec(u.name, pending + u.nodes))
            pending = ()
    if pending:
        out.append(UnitSpec("params", pending))
    return out


# --------------------------------------------------------------------------------------------
# Cuts and sub-graphs
# --------------------------------------------------------------------------------------------


def cut_tensors(traced: TracedModel, units: list[UnitSpec]) -> list[tuple[str, ...]]:
    """For each cut k (between ``units[k]`` and ``units[k + 1]``) the nodes live across it.

    A node is live across cut k when it is a placeholder or produced in a unit <= k and used in
    a unit > k or by the graph's output.  Names are in graph order.
    """
    where: dict[str, int] = {}
    for k, unit in enumerate(units):
        for name in unit.nodes:
            where[name] = k
    n = len(units)
    cuts: list[list[str]] = [[] for _ in range(max(n - 1, 0))]
    for node in traced.gm.graph.nodes:
        if node.op == "output":
            continue
        made = -1 if node.op == "placeholder" else where.get(node.name)
        if made is None:
            raise InvalidRequestError(f"node {node.name!r} is in no unit; regroup the graph")
        last = max((n if u.op == "output" else where[u.name] for u in node.users), default=made)
        for k in range(max(made, 0), min(last, n - 1)):
            cuts[k].append(node.name)
    return [tuple(c) for c in cuts]


def subgraph_module(
    traced: TracedModel,
    nodes: Sequence[str],
    inputs: Sequence[str],
    outputs: Sequence[str],
) -> GraphModule:
    """A GraphModule running ``nodes``: takes ``inputs`` positionally, returns ``outputs``.

    ``inputs`` must hold every value the nodes use that they do not make (placeholders or
    nodes of earlier units); the result always returns a tuple.  Submodules and parameters are
    shared with ``traced.gm``, not copied.
    """
    gm = traced.gm
    by_name = {n.name: n for n in gm.graph.nodes}
    graph = Graph()
    env: dict[Node, Node] = {}
    for name in inputs:
        env[by_name[name]] = graph.placeholder(name)
    for name in nodes:
        node = by_name[name]
        missing = [a.name for a in node.all_input_nodes if a not in env]
        if missing:
            raise InvalidRequestError(
                f"node {name!r} uses {missing}, which are neither inputs nor earlier nodes"
            )
        env[node] = graph.node_copy(node, env.__getitem__)
    graph.output(tuple(env[by_name[name]] for name in outputs))
    return GraphModule(gm, graph, class_name="Subgraph")
