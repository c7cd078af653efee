"""Sequence parallelism (:mod:`pipeplan.intake.tp_sequence`): where it shards, gathers,
scatters and reduces in a stage's graph, read from the rewritten graph without running a
collective (the 4-rank runs equal to the unsplit model are in ``tests/runtime/test_mesh.py``)."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn
from torch.fx import GraphModule, symbolic_trace
from torch.fx.passes.shape_prop import ShapeProp

from pipeplan.intake.tp_layout import Style
from pipeplan.intake.tp_sequence import (
    SequenceComm,
    SequenceRole,
    hidden_size,
    is_hidden,
    local_share,
    shard_sequence,
)
from pipeplan.planner.errors import InvalidRequestError

D, S = 8, 4


class _Block(nn.Module):
    """A pre-norm MLP block and a pooled first token: x + down(gelu(up(ln(x)))), x[:, 0]."""

    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.up = nn.Linear(D, 4 * D)
        self.down = nn.Linear(4 * D, D)

    def forward(self, x: Tensor, mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        y = x + self.down(nn.functional.gelu(self.up(self.ln(x))))
        return y, y[:, 0], mask


STYLES: dict[str, Style] = {"up": "colwise", "down": "rowwise"}


def _split(*, received: tuple[bool, ...], last: bool) -> tuple[GraphModule, object]:
    body = symbolic_trace(_Block())
    inputs = (torch.randn(2, S, D, requires_grad=True), torch.ones(2, S))
    ShapeProp(body).propagate(*inputs)
    split = shard_sequence(
        body, STYLES, inputs, SequenceRole(D, received, last), rank=1, t=2, group=None
    )
    return body, split


def _comms(body: GraphModule) -> dict[str, tuple[str, str]]:
    """Each collective node -> (its kind, the node it reads)."""
    out = {}
    for n in body.graph.nodes:
        if n.op == "call_module" and isinstance(body.get_submodule(n.target), SequenceComm):
            out[n.name] = (body.get_submodule(n.target).kind, n.args[0].name)
    return out


def test_a_received_hidden_state_stays_sharded_through_per_token_ops() -> None:
    """The received (b, S, d) input arrives as the rank's share; the norm runs on it, its
    weight and bias all-reduce their partial gradients, the column-wise projection reads the
    gathered sequence, the row-wise output is reduce-scattered by torch's style and the
    residual add keeps the share, which the stage sends as it is.  A slice of the sequence
    reads the gathered value; the mask (not a hidden state) is untouched."""
    body, split = _split(received=(True, False), last=False)
    assert split.inputs == [0] and split.rowwise == {"down"}  # type: ignore[attr-defined]
    comms = sorted(_comms(body).values())
    assert comms == [("gather", "add"), ("gather", "layer_norm"), ("reduce", "ln_bias"),
                     ("reduce", "ln_weight")]  # fmt: skip
    outputs = {n.name for n in split.outputs}  # type: ignore[attr-defined]
    assert outputs == {"add"}  # sent sharded; the pooled token (gathered) and mask whole


def test_the_first_stage_scatters_the_whole_residual_and_the_last_gathers_its_outputs() -> None:
    """Stage 0's input is the model's (whole): the norm and the column-wise projection run on
    it unsharded, and the residual meets the row-wise output's share through a scatter.  The
    last stage hands the loss its outputs whole."""
    body, split = _split(received=(), last=True)
    assert split.inputs == []  # type: ignore[attr-defined]
    comms = sorted(_comms(body).values())
    assert comms == [("gather", "add"), ("scatter", "x")]
    out = next(n for n in body.graph.nodes if n.op == "output")
    assert [a.name for a in out.args[0][:1]] == ["_seq_gather_add"]


def test_a_hidden_state_is_cut_to_the_ranks_share_and_nothing_else() -> None:
    x = torch.arange(2 * S * D, dtype=torch.float32).reshape(2, S, D)
    mask, ids = torch.ones(2, 1, S, S), torch.zeros(2, S, dtype=torch.long)
    got = local_share([x, mask, ids], D, 1, 2)
    assert torch.equal(got[0], x[:, 2:]) and got[1] is mask and got[2] is ids
    assert is_hidden(x, D) and not is_hidden(ids, D) and not is_hidden(x, D + 1)


def test_a_sequence_the_ranks_cannot_share_is_refused_in_one_line() -> None:
    with pytest.raises(InvalidRequestError, match="--tensor-parallel 2 does not divide the "
                       "sequence length 3") as exc:  # fmt: skip
        local_share([torch.zeros(2, 3, D)], D, 0, 2)
    assert "\n" not in str(exc.value) and "without --sequence-parallel" in str(exc.value)


def test_the_hidden_size_is_the_row_wise_projections_output() -> None:
    block = _Block()
    assert hidden_size(block, STYLES) == D
    with pytest.raises(InvalidRequestError, match="one hidden size"):
        hidden_size(block, {"up": "rowwise", "down": "rowwise"})
