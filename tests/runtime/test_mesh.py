"""Pipelines times data-parallel replicas on a 2-D mesh (dp, pp): a step equals the unsplit
model's on the global batch, for p = 1, d = 2 and p = 2, d = 1 on 2 ranks and p = 2, d = 2 on
4 (oversubscribed: correctness only).  Every rank's gradients (averaged over its replicas) and
parameters after a few steps match the unsplit model's; the loss is the global batch's.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from _runtime_jobs import launch_job, reference, refused_run

pytestmark = pytest.mark.multirank

TIGHT = {"rtol": 1e-9, "atol": 1e-11}
GPT = {
    "model": "pipeplan.models.gpt:gpt",
    "kwargs": {"vocab": 32, "d_model": 16, "n_layers": 4, "n_heads": 2, "seq_len": 8},
}
#: SGD with momentum, not Adam: Adam scales a gradient by its own size, so the key bias's
#: gradient, zero up to rounding (softmax ignores a constant added to every key), would take
#: the sign of the rounding, which the replicas' sum orders differently.
CONFIG = {"key": "momentum", "checkpoint": "except_last", "schedule": "gpipe",
          "optimizer": "momentum", "lr": 0.1, "steps": 3}  # fmt: skip
LAYOUTS = {"p1-d2": ([0], 2), "p2-d1": ([0, 3], 1), "p2-d2": ([0, 3], 2)}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_replicated_pipeline_equals_unsplit_model(name: str, tmp_path: Any) -> None:
    starts, replicas = LAYOUTS[name]
    world = len(starts) * replicas
    model = {"name": "gpt", **GPT, "starts": starts, "replicas": replicas}
    job = {"models": [model], "batch_size": 8, "microbatches": 2, "configs": [CONFIG]}
    ranks = [r["gpt"]["momentum"] for r in launch_job(job, world, tmp_path, timeout=300)]
    ref_loss, ref_grads, ref_params, ref_losses = reference(GPT, 8, "momentum", 0.1, 3)
    p = len(starts)
    for r, got in enumerate(ranks):
        if r % p == p - 1:  # every replica's last stage reports the global batch's loss
            assert got["loss"] == pytest.approx(ref_loss, rel=1e-12), r
            assert got["losses"] == pytest.approx(ref_losses, rel=1e-9), r
        for pname, grad in got["grads"].items():
            torch.testing.assert_close(grad, ref_grads[pname], **TIGHT, msg=f"rank {r} {pname}")
        for pname, value in got["params"].items():
            torch.testing.assert_close(value, ref_params[pname], **TIGHT, msg=f"rank {r} {pname}")
    for replica in range(replicas):
        mine = ranks[replica * p : (replica + 1) * p]
        assert set().union(*(set(g["params"]) for g in mine)) == set(ref_params)
        assert set().union(*(set(g["grads"]) for g in mine)) == set(ref_grads)


MLP = {
    "model": "pipeplan.models.mlp:mlp",
    "kwargs": {"width": 8, "depth": 4, "in_features": 8, "classes": 4},
}
#: pp 2 x dp 2 with FSDP2 on the dp axis, one family per entry: (model, unit starts, ranks for a
#: multi-chunk family or None).  ZB-V's V puts the model's two ends on rank 0, which FSDP2
#: cannot shard when they share a parameter (the GPT's tied embedding): the MLP has none.
SHARDED = {
    "gpipe": (GPT, [0, 3], None),
    "1f1b": (GPT, [0, 3], None),
    "interleaved1f1b": (GPT, [0, 2, 3, 5], 2),
    "zbv": (MLP, [0, 1, 2, 4], 2),
}


def test_sharded_pipeline_equals_unsplit_model(tmp_path: Any) -> None:
    """pp 2 x dp 2, each stage (chunk) wrapped in FSDP2's fully_shard over its dp group: the
    loss and every gradient (gathered from the shards) equal the unsplit model's for GPipe,
    1F1B, interleaved 1F1B and ZB-V, in float64, and so do the parameters after 3 steps.
    One launch of 4 ranks runs all four."""
    models = []
    for fam, (model, starts, ranks) in SHARDED.items():
        cfg = {**CONFIG, "key": fam, "schedule": fam, "checkpoint": "never", "mode": "shard"}
        if ranks is not None:
            cfg["ranks"] = ranks
        models.append(
            {"name": fam, **model, "starts": starts, "replicas": 2, "keys": [fam], "cfg": cfg}
        )
    job = {
        "models": models,
        "batch_size": 8,
        "microbatches": 2,
        "configs": [m.pop("cfg") for m in models],
    }
    ranks_out = launch_job(job, 4, tmp_path, timeout=600)
    for fam, (model, _, _) in SHARDED.items():
        got = [out[fam][fam] for out in ranks_out]
        for r, one in enumerate(got):
            assert set(one["sharded"]) == {"DTensor"}, (fam, r)  # FSDP2 holds every parameter
        _assert_unsplit(model, got, TIGHT, fam)


def _assert_unsplit(
    model: dict[str, Any], got: list[dict[str, Any]], tolerance: dict[str, float], what: str
) -> None:
    """Each rank's loss (where it has one), gradients and parameters after 3 steps (``got``,
    one per rank) are the unsplit model's, and the ranks hold every gradient between them."""
    ref_loss, ref_grads, ref_params, ref_losses = reference(model, 8, "momentum", 0.1, 3)
    seen: set[str] = set()
    for r, one in enumerate(got):
        if one["loss"] is not None:
            assert one["loss"] == pytest.approx(ref_loss, rel=1e-12), (what, r)
            assert one["losses"] == pytest.approx(ref_losses, rel=1e-9), (what, r)
        for pname, grad in one["grads"].items():
            torch.testing.assert_close(
                grad, ref_grads[pname], **tolerance, msg=f"{what} {r} {pname}"
            )
        for pname, value in one["params"].items():
            torch.testing.assert_close(
                value, ref_params[pname], **tolerance, msg=f"{what} {r} {pname}"
            )
        seen |= set(one["grads"])
    assert seen == set(ref_grads), what


#: A transformers Llama whose 4 heads and 2 KV heads split over t = 2 (the zoo's has 1 KV head).
LLAMA_CONFIG = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 32,
    "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": 64, "max_position_embeddings": 16,
    "use_cache": False,
}  # fmt: skip
#: A T5 whose 2 heads split over t = 2, cut after its first encoder layer: the layer's
#: relative-position bias (its table split with the heads) crosses the cut, and the decoder's
#: cross-attention makes a zero bias of both heads in the graph.
T5 = {"model": "pipeplan.models.zoo:t5", "kwargs": {"d_model": 16, "n_layers": 2, "seq_len": 8}}
#: DTensors on all 4 ranks: every block's 4 (GPT); every layer's 7 and the head (Llama); T5's 6
#: per encoder layer, 10 per decoder layer and one bias table per stack.
SPLIT_TENSORS = {"llama": (7 * 2 + 1) * 2, "t5": (7 + 27) * 2}
#: Sums over the tp ranks (the row-wise all-reduce, forward; the column-wise input's gradient,
#: backward) reorder the float64 additions of a dot product: a few ulps of the largest term
#: (measured: at most 1.0e-15 of a gradient's largest entry, GPT; 6.4e-16, Llama).
TP_TOLERANCE = {"rtol": 1e-12, "atol": 1e-13}


def test_tensor_parallel_pipeline_equals_unsplit_model(tmp_path: Any) -> None:
    """pp 2 x tp 2 on 4 ranks (device mesh (dp, pp, tp), tp innermost): each stage's attention
    and MLP projections split column- then row-wise by torch's parallelize_module.  The loss
    and every gradient (gathered from the shards) equal the unsplit model's in float64, and so
    do the parameters after 3 momentum steps, for the bundled GPT (fx graph, MLP split, tied
    embedding and head summed over the tp index's pipeline ranks; stage 0 recomputed), a
    transformers Llama with grouped KV heads (export graph, whose baked head counts the split
    rewrites; its head split over the vocabulary, the logits gathered) and a T5 (per-head position bias split and gathered at the cut); and the GPT as
    interleaved 1F1B and ZB-V plans of 2 ranks x 2 chunks."""
    llama_file = tmp_path / "llama.json"
    llama_file.write_text(json.dumps(LLAMA_CONFIG))
    llama = {"model": f"hf:{llama_file}", "kwargs": {"seq_len": 8}}
    chunked = {"checkpoint": "never", "ranks": 2}
    cases = {
        "gpt": (GPT, [0, 3], CONFIG),
        "llama": (llama, [0, 2], CONFIG),
        "interleaved": (GPT, [0, 2, 3, 5], {**CONFIG, **chunked, "schedule": "interleaved1f1b"}),
        "zbv": (GPT, [0, 2, 3, 5], {**CONFIG, **chunked, "schedule": "zbv"}),
        "t5": (T5, [0, 2], CONFIG),
    }
    configs = [{**cfg, "key": name} for name, (_, _, cfg) in cases.items()]
    models = [{"name": name, **model, "starts": starts, "tp": 2, "keys": [name]}
              for name, (model, starts, _) in cases.items()]  # fmt: skip
    job = {"models": models, "batch_size": 8, "microbatches": 2, "configs": configs}
    out = launch_job(job, 4, tmp_path, timeout=600)
    for name, (model, _, _) in cases.items():
        got = [ranks[name][name] for ranks in out]
        has_loss = [one["loss"] is not None for one in got]  # both tp ranks of the last stage
        assert has_loss == ([True] * 2 + [False] * 2 if name == "zbv" else [False] * 2 + [True] * 2)
        _assert_unsplit(model, got, TP_TOLERANCE, name)
        # every block's 4 split tensors (GPT) or every layer's 7 (Llama) on its 2 tp ranks
        split = sum(one["sharded"].count("DTensor") for one in got)
        assert split == SPLIT_TENSORS.get(name, 4 * 4 * 2), (name, split)


@pytest.mark.slow
def test_tensor_parallel_replicas_equal_unsplit_model(tmp_path: Any) -> None:
    """pp 2 x dp 2 x tp 2 on 8 ranks (oversubscribed: correctness only): replicated replicas of
    the GPT, and replicas sharded by FSDP2 over tensor-parallel DTensors (its 2-D composition)
    of the GPT and the Llama; the loss, every gradient and the parameters after 3 steps equal
    the unsplit model's."""
    llama_file = tmp_path / "llama.json"
    llama_file.write_text(json.dumps(LLAMA_CONFIG))
    llama = {"model": f"hf:{llama_file}", "kwargs": {"seq_len": 8}}
    cases = {"replicate": (GPT, "replicate"), "shard": (GPT, "shard"),
             "llama-shard": (llama, "shard")}  # fmt: skip
    configs = [{**CONFIG, "key": name, "mode": mode, "checkpoint": "never"}
               for name, (_, mode) in cases.items()]  # fmt: skip
    models = [{"name": name, **model, "starts": [0, 3 if model is GPT else 2], "tp": 2,
               "replicas": 2, "keys": [name]} for name, (model, _) in cases.items()]  # fmt: skip
    job = {"models": models, "batch_size": 8, "microbatches": 2, "configs": configs}
    out = launch_job(job, 8, tmp_path, timeout=900)
    for name, (model, mode) in cases.items():
        got = [ranks[name][name] for ranks in out]
        assert [one["loss"] is not None for one in got] == [False, False, True, True] * 2
        if mode == "shard":
            assert {kind for one in got for kind in one["sharded"]} == {"DTensor"}, name
        _assert_unsplit(model, got, TP_TOLERANCE, name)


@pytest.mark.parametrize(
    ("zoo", "message"),
    [
        ("llama", "--tensor-parallel 2 does not divide the model's kv_heads (1)"),
        ("gpt2", "GPT2LMHeadModel has no tensor-parallel layout"),
    ],
)
def test_a_plan_whose_model_cannot_split_t_ways_is_refused_in_one_line(
    zoo: str, message: str, tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """The zoo's Llama has 1 KV head (t = 2 cannot split it); GPT-2's projections are fused
    Conv1D layers (no layout): ``pipeplan run`` refuses either plan before it starts a rank,
    in one line, with status 2."""
    model = (f"pipeplan.models.zoo:{zoo}", {"n_layers": 1, "d_model": 16, "vocab": 32,
                                             "seq_len": 8})  # fmt: skip
    assert message in refused_run(model, tmp_path, capsys, tensor_parallel=2)


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
