"""Which nodes act on each token alone (pipeplan.intake.per_token), on an exported graph of
the ops a transformer block uses around its projections, and an fx graph's modules."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.fx import symbolic_trace

from pipeplan.intake.per_token import per_token


class _Ops(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.proj = nn.Linear(8, 8)

    def forward(self, x: Tensor) -> tuple[Tensor, ...]:
        rms = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)  # per token
        pooled = x.mean(1)  # over the sequence: not
        first = x[:, 0]  # a slice of the sequence: not
        return self.norm(rms), self.proj(rms), pooled, first, torch.softmax(x, dim=1)


def _classified(gm: torch.fx.GraphModule) -> dict[str, bool]:
    out = {}
    for n in gm.graph.nodes:
        if n.op not in ("call_function", "call_method", "call_module"):
            continue
        first = n.args[0] if n.args and isinstance(n.args[0], torch.fx.Node) else None
        val = first.meta.get("val") if first is not None else None
        module = gm.get_submodule(n.target) if n.op == "call_module" else None
        out[n.name] = per_token(n, module, val.dim() if isinstance(val, Tensor) else None)
    return out


def test_exported_aten_ops_by_what_they_reduce_over() -> None:
    gm = torch.export.export(_Ops(), (torch.randn(2, 4, 8),)).module()
    got = _classified(gm)
    ops = {n.name: str(n.target) for n in gm.graph.nodes if n.name in got}
    per = {ops[k] for k, v in got.items() if v}
    not_per = {ops[k] for k, v in got.items() if not v}
    assert {"aten.pow.Tensor_Scalar", "aten.add.Tensor", "aten.rsqrt.default",
            "aten.mul.Tensor", "aten.layer_norm.default"} <= per  # fmt: skip
    # mean over -1 is per token, over 1 is not (both are aten.mean.dim)
    means = [got[k] for k, v in ops.items() if v == "aten.mean.dim"]
    assert sorted(means) == [False, True]
    assert {"aten.linear.default", "aten.select.int", "aten.softmax.int"} <= not_per


def test_fx_modules_and_a_tuple_result() -> None:
    gm = symbolic_trace(_Ops())
    got = _classified(gm)
    assert got["norm"] and not got["proj"]
    node = next(n for n in gm.graph.nodes if n.name == "getitem")  # x[:, 0]: a tensor's slice
    assert not per_token(node, None, 3)
    assert per_token(node, None, None)  # the same call on a tuple of a per-token op's results
