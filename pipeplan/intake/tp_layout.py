"""Which modules of a model split over tensor-parallel ranks, and how (Megatron's layout).

A transformer block has two sub-blocks that Megatron-LM (Shoeybi et al., 2019) splits over t
ranks without communication inside them: attention (query, key and value projections
column-wise, so each rank holds 1 / t of the heads; the output projection row-wise) and the
MLP (gate and up projections column-wise; down row-wise).  Each sub-block then ends in one
all-reduce of its output in the forward, and one of its input's gradient in the backward.
torch's :func:`~torch.distributed.tensor.parallel.parallelize_module` applies it with
``ColwiseParallel`` and ``RowwiseParallel``; torchtitan's ``parallelize_llama`` does the same.

:func:`find_layout` recognises the projections:

1. from ``transformers``' own tensor-parallel plan where the model has one
   (``config.base_model_tp_plan``: Llama, Mistral, Qwen2, Gemma and the rest of that family),
   keeping its ``colwise`` and ``rowwise`` entries;
2. otherwise by the names the zoo's architectures and the bundled models give their
   ``nn.Linear`` projections (:data:`PAIRS`): an opening set of siblings, column-wise, and the
   closing projection, row-wise, both present.

and, beside the blocks, the output head that ``transformers``' model-level plan splits over
the vocabulary with its output gathered (``colwise_gather``: each rank computes 1 / t of the
logits, one all-gather makes them whole for the loss), unless it is tied to the embedding.

A fused query-key-value projection (GPT-2's ``c_attn``, the bundled GPT's ``qkv``) is not
split: its columns are query, key and value one after the other, so t contiguous shards are
not t sets of heads.  A model with nothing recognised gets ``None`` and a reason.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from torch import nn

from pipeplan.planner.errors import InvalidRequestError

__all__ = [
    "PAIRS",
    "Layout",
    "Style",
    "check_degree",
    "find_layout",
    "is_head_table",
    "parallel_style",
    "unit_styles",
]

Style = Literal["colwise", "rowwise", "colwise_gather"]

#: (opening projections, closing projection, where the closing one sits relative to the
#: opening ones' parent): "." is the same module, a dotted path climbs to the parent's parent
#: first (BERT's ``attention.self.query`` closes in ``attention.output.dense``).
PAIRS: tuple[tuple[frozenset[str], str], ...] = (
    (frozenset({"q_proj", "k_proj", "v_proj"}), "o_proj"),
    (frozenset({"q_proj", "k_proj", "v_proj"}), "out_proj"),
    (frozenset({"q_proj", "k_proj", "v_proj"}), "dense"),
    (frozenset({"q", "k", "v"}), "o"),
    (frozenset({"query", "key", "value"}), "../output.dense"),
    (frozenset({"query_proj", "key_proj", "value_proj"}), "../output.dense"),
    (frozenset({"gate_proj", "up_proj"}), "down_proj"),
    (frozenset({"w1", "w3"}), "w2"),
    (frozenset({"wi_0", "wi_1"}), "wo"),
    (frozenset({"wi"}), "wo"),
    (frozenset({"fc1"}), "fc2"),
    (frozenset({"fc"}), "out"),
    (frozenset({"intermediate.dense"}), "output.dense"),
)

_HEADS = ("num_attention_heads", "n_head", "num_heads", "n_heads", "encoder_attention_heads")
_KV_HEADS = ("num_key_value_heads", "n_kv_heads")


@dataclass(frozen=True)
class Layout:
    """A model's tensor-parallel split."""

    styles: dict[str, Style]
    """Qualified name of each split ``nn.Linear`` -> its style."""
    divisors: dict[str, int] = field(default_factory=dict)
    """Dimension -> size that t must divide (heads, KV heads, each split projection's split
    features)."""
    source: str = "names"
    """``transformers`` (the config's ``base_model_tp_plan``) or ``names`` (:data:`PAIRS`)."""

    def styles_under(self, prefix: str) -> dict[str, Style]:
        """The styles of the modules inside ``prefix`` (a unit's or a stage's module)."""
        dot = prefix + "." if prefix else ""
        return {k: v for k, v in self.styles.items() if k.startswith(dot) or k == prefix}


def find_layout(model: nn.Module) -> Layout | str:
    """``model``'s tensor-parallel layout, or one line saying why it has none (module
    docstring)."""
    linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    styles = _from_transformers(model, linears)
    source = "transformers"
    if not styles:
        styles, source = _from_names(linears), "names"
    if not styles:
        return (
            "no attention or MLP projections recognised (nn.Linear column-then-row pairs such "
            "as q_proj/k_proj/v_proj + o_proj, gate_proj/up_proj + down_proj); tensor "
            "parallelism stays 1"
        )
    styles.update(_gathered_head(model, linears))
    divisors: dict[str, int] = {}
    config = getattr(model, "config", None)
    for key, attrs in (("heads", _HEADS), ("kv_heads", _KV_HEADS)):
        for attr in attrs:
            value = getattr(config, attr, None) if config is not None else None
            if isinstance(value, int) and value > 0:
                divisors[key] = value
                break
    for name, style in styles.items():
        lin = linears[name]
        size = lin.in_features if style == "rowwise" else lin.out_features
        key = f"{name.rsplit('.', 1)[-1]} features"
        if divisors.setdefault(key, size) != size:
            divisors.setdefault(f"{name} features", size)
    return Layout(styles, divisors, source)


def _gathered_head(model: nn.Module, linears: dict[str, nn.Linear]) -> dict[str, Style]:
    """The output head that ``transformers``' own plan splits over the vocabulary with its
    output gathered (``_tp_plan``: ``lm_head: colwise_gather_output``; Llama, Mistral, Qwen2
    and their kin), unless its weight is tied to an embedding, which stays whole."""
    plan = getattr(model, "_tp_plan", None) or getattr(type(model), "_tp_plan", None)
    if not isinstance(plan, dict):
        return {}
    tied = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    return {
        name: "colwise_gather"
        for name, style in plan.items()
        if style == "colwise_gather_output"
        and name in linears
        and id(linears[name].weight) not in tied
    }


def check_degree(layout: Layout, t: int) -> None:
    """Raise :class:`InvalidRequestError` naming the first dimension ``t`` does not divide."""
    for dim, size in layout.divisors.items():
        if size % t:
            raise InvalidRequestError(
                f"--tensor-parallel {t} does not divide the model's {dim} ({size}); give a "
                f"divisor of {size}"
            )


def _from_transformers(model: nn.Module, linears: dict[str, nn.Linear]) -> dict[str, Style]:
    config = getattr(model, "config", None)
    plan = getattr(config, "base_model_tp_plan", None)
    if not isinstance(plan, dict) or not plan:
        return {}
    prefix = getattr(model, "base_model_prefix", "")
    out: dict[str, Style] = {}
    for name in linears:
        rel = name[len(prefix) + 1 :] if prefix and name.startswith(prefix + ".") else name
        for pattern, style in plan.items():
            if style in ("colwise", "rowwise") and fnmatch.fnmatchcase(rel, pattern):
                out[name] = style
                break
    return _paired(out)


def _from_names(linears: dict[str, nn.Linear]) -> dict[str, Style]:
    names = set(linears)
    out: dict[str, Style] = {}
    for parent in sorted({n.rsplit(".", 1)[0] if "." in n else "" for n in names}):
        for opening, closing in PAIRS:
            heads = [_join(parent, o) for o in sorted(opening)]
            if not all(h in names for h in heads):
                continue
            close = _resolve(parent, closing)
            if close not in names or close in out:
                continue
            for h in heads:
                out[h] = "colwise"
            out[close] = "rowwise"
            break
    # "intermediate.dense" opens relative to a layer: match it as a two-level name too.
    for name in sorted(names):
        if name.endswith(".intermediate.dense") and name not in out:
            layer = name[: -len(".intermediate.dense")]
            close = f"{layer}.output.dense"
            if close in names and close not in out:
                out[name], out[close] = "colwise", "rowwise"
    return out


def _paired(styles: dict[str, Style]) -> dict[str, Style]:
    """Keep a plan's entries only where a module has both column- and row-wise children
    (a partial match would leave a sub-block unsplit on one side)."""
    by_parent: dict[str, set[str]] = {}
    for name, style in styles.items():
        by_parent.setdefault(name.rsplit(".", 1)[0], set()).add(style)
    return {
        n: s for n, s in styles.items() if by_parent[n.rsplit(".", 1)[0]] == {"colwise", "rowwise"}
    }


def _join(parent: str, child: str) -> str:
    return f"{parent}.{child}" if parent else child


def _resolve(parent: str, rel: str) -> str:
    while rel.startswith("../"):
        parent = parent.rsplit(".", 1)[0] if "." in parent else ""
        rel = rel[3:]
    return _join(parent, rel)


def unit_styles(layout: Layout, params: Iterable[str]) -> dict[str, Style]:
    """The styles of the split modules whose weights are among ``params`` (a unit's
    parameter names)."""
    wanted = {p.rsplit(".", 1)[0] for p in params}
    return {k: v for k, v in layout.styles.items() if k in wanted}


def is_head_table(name: str) -> bool:
    """Whether an ``nn.Embedding`` child named ``name`` of an attention module (the parent of
    column-wise projections) holds one column per head, and so splits with them: T5's
    relative-position bias table, whose name says ``bias``."""
    return "bias" in name


def parallel_style(style: str) -> Any:
    """torch's ``ParallelStyle`` for a layout's style: ``ColwiseParallel``, ``RowwiseParallel``,
    or for a head split over the vocabulary ``ColwiseParallel`` with its output gathered whole
    (``Replicate``), so the loss reads whole logits."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if style == "rowwise":
        return RowwiseParallel()
    return (
        ColwiseParallel(output_layouts=Replicate())
        if style == "colwise_gather"
        else ColwiseParallel()
    )
