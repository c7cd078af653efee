"""Sequence parallelism (:mod:`pipeplan.runtime.tp_sequence`): where it shards, gathers,
scatters and reduces in a stage's graph, read from the rewritten graph without running a
collective, and on 4 ranks the loss and every gradient of pp 2 x tp 2 runs equal to the
unsplit model's."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from _runtime_jobs import launch_job, refused_run
from test_mesh import CONFIG, GPT, LLAMA_CONFIG, T5, TP_TOLERANCE, _assert_unsplit
from torch import Tensor, nn
from torch.fx import GraphModule, symbolic_trace
from torch.fx.passes.shape_prop import ShapeProp

from pipeplan.intake.tp_layout import Style
from pipeplan.planner.errors import InvalidRequestError
from pipeplan.runtime.tp_sequence import (
    SequenceComm,
    SequenceRole,
    hidden_size,
    is_hidden,
    local_share,
    shard_sequence,
)

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


@pytest.mark.multirank
def test_sequence_parallel_pipeline_equals_unsplit_model(tmp_path: Any) -> None:
    """pp 2 x tp 2 with sequence parallelism on 4 ranks: the bundled GPT (fx graph, its
    LayerNorm modules made functional, its whole attention gathered and scattered back, stage 0
    recomputed), a transformers Llama (export graph, RMSNorm in aten ops) as ZB-V chunks (the
    norms' gradient all-reduces in the weight pass; its loss reads the logits split over the
    vocabulary, --loss-parallel) and a T5 (per-head bias and an encoder state crossing the
    cut); and the Llama as pp 1 x dp 2 x tp 2, sharded by FSDP2 over its replicas, loss-parallel
    too.  The loss, every gradient and the parameters after 3 steps equal the unsplit model's
    in float64, each hidden state crosses the cut as the rank's half of the sequence, and every
    stage holds sequence collectives (the test fails if the runtime ran the norms whole)."""
    llama_file = tmp_path / "llama.json"
    llama_file.write_text(json.dumps(LLAMA_CONFIG))
    llama = {"model": f"hf:{llama_file}", "kwargs": {"seq_len": 8}}
    zbv = {"checkpoint": "never", "ranks": 2, "schedule": "zbv"}
    split_loss = {"checkpoint": "never", "loss_parallel": True}
    cases = {  # name -> (model, starts, config, hidden size, replicas)
        "gpt": (GPT, [0, 3], CONFIG, 16, 1),
        "llama": (llama, [0, 1, 2, 3], {**CONFIG, **zbv, **split_loss}, 32, 1),
        "t5": (T5, [0, 2], CONFIG, 16, 1),
        "fsdp": (llama, [0], {**CONFIG, **split_loss, "mode": "shard"}, 32, 2),
    }
    configs = [{**cfg, "key": name, "sequence_parallel": True}
               for name, (_, _, cfg, _, _) in cases.items()]  # fmt: skip
    models = [{"name": name, **model, "starts": starts, "tp": 2, "replicas": d, "keys": [name]}
              for name, (model, starts, _, _, d) in cases.items()]  # fmt: skip
    job = {"models": models, "batch_size": 8, "microbatches": 2, "configs": configs}
    out = launch_job(job, 4, tmp_path, timeout=600)
    for name, (model, starts, _, d, _) in cases.items():
        got = [ranks[name][name] for ranks in out]
        _assert_unsplit(model, got, TP_TOLERANCE, name)
        hidden = [shape for one in got for shape in one["received"] if shape[-1] == d]
        assert all(shape == (4, 4, d) for shape in hidden), (name, hidden)
        assert hidden or len(starts) == 1, name
        assert all(one["sequence"] for one in got), name
    # the Llama's loss reads its logits split over the vocabulary (64): each rank sends 32
    for name in ("llama", "fsdp"):
        sent = [shape for one in out for shape in one[name][name]["sent"]]
        logits = [s[1:] for s in sent if len(s) == 3 and s[1] == 8 and s[2] in (32, 64)]
        assert logits and set(logits) == {(8, 32)}, (name, sent)
    assert {k for one in out for k in one["fsdp"]["fsdp"]["sharded"]} == {"DTensor"}


@pytest.mark.multirank
def test_a_sequence_the_tp_ranks_cannot_share_stops_the_run_in_one_line(
    tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """A Llama of sequence 7 planned at tp 2 with sequence parallelism: ``pipeplan run`` stops
    with status 2 and one line naming the length and the fix, no traceback."""
    llama_file = tmp_path / "llama.json"
    llama_file.write_text(json.dumps(LLAMA_CONFIG))
    err = refused_run((f"hf:{llama_file}", {"seq_len": 7}), tmp_path, capsys,
                      tensor_parallel=2, sequence_parallel=True)  # fmt: skip
    assert "does not divide the sequence length 7" in err, err
