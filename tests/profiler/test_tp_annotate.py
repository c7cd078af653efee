"""Every new profile says what tensor parallelism divides in each unit
(pipeplan.profiler.tp_annotate), checked against hand counts on the zoo and the bundled GPT."""

from __future__ import annotations

import gc
import weakref
from functools import cache
from typing import Any

import pytest

from pipeplan.intake.model import load_model
from pipeplan.planner.errors import FingerprintMismatchError
from pipeplan.planner.types import Profile
from pipeplan.profiler import profile_model
from pipeplan.profiler.tp_annotate import annotate_profile

FAST: dict[str, Any] = {"warmup": 0, "repeats": 1, "progress": False, "microbatch_sizes": (2,)}
B = 2  # the micro-batch size measured (the annotation's per-sample bytes divide by it)


@cache
def _profile(model: str, max_stages: int = 1, **kwargs: Any) -> Profile:
    return profile_model(
        model, batch_size=B, model_kwargs=kwargs, method="whole", max_stages=max_stages, **FAST
    )


def _unit(profile: Profile, name: str) -> Any:
    (unit,) = [u for u in profile.units if u.name == name or u.name.endswith("." + name)]
    return unit


def test_a_llama_block_shards_its_seven_projections_exactly() -> None:
    d, seq = 32, 16  # the zoo's Llama: 2 heads of 16, 1 KV head, MLP 2 d, vocab 128
    profile = _profile("pipeplan.models.zoo:llama", n_layers=2, d_model=d, seq_len=seq)
    block = _unit(profile, "model.layers.0")
    tp = block.tensor_parallel
    assert tp is not None
    assert set(tp.styles) == {
        f"model.model.layers.0.{m}"
        for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
        + ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
    }
    # q, o: d x d; k, v: d/2 x d (one KV head); gate, up, down: 2 d x d; float32, no biases.
    assert tp.sharded_param_bytes == 4 * (2 * d * d + 2 * (d // 2) * d + 3 * 2 * d * d)
    assert block.param_bytes - tp.sharded_param_bytes == 4 * 2 * d  # the two RMSNorms
    assert tp.sharded_flop_fraction == 1.0  # norms and residuals make no matmul FLOPs
    assert tp.allreduces == 2
    assert tp.allreduce_bytes_per_sample == 2 * seq * d * 4
    assert tp.divisors["heads"] == 2 and tp.divisors["kv_heads"] == 1
    assert 0.5 < tp.sharded_saved_fraction < 1
    assert _unit(profile, "model.embed_tokens").tensor_parallel is None
    # the head splits over the vocabulary (128) and gathers its logits whole
    head = [u for u in profile.units if u.name.endswith("lm_head")][-1].tensor_parallel
    assert head is not None and head.styles == {"model.lm_head": "colwise_gather"}
    assert head.sharded_param_bytes == 4 * 128 * d and head.allreduces == 0
    assert head.allgather_bytes_per_sample == seq * 128 * 4  # the logits
    assert head.gather_input_bytes_per_sample == seq * d * 4  # the normed hidden state
    assert head.sharded_flop_fraction == 1.0 and head.divisors == {"lm_head features": 128}
    assert profile.tensor_parallel_note is None


def test_sequence_parallelism_divides_what_only_per_token_ops_save() -> None:
    """Per token, an RMSNorm saves its input, its rsqrt and the normalised value (2 d + 1
    floats), all per token; the projections after it save its output whole (gathered under
    sequence parallelism).  So the head's unit (the final norm, the head reading its output)
    has q = (2 d + 1) / (3 d + 1); layer 0's first norm reads the embedding whole (no row-wise
    output before it), so layer 0 has half of layer 1's q (two norms on the sequence's share)."""
    d = 32
    profile = _profile("pipeplan.models.zoo:llama", n_layers=2, d_model=d, seq_len=16)
    head = [u for u in profile.units if u.name.endswith("lm_head")][-1].tensor_parallel
    assert head is not None and head.sequence_saved_fraction == pytest.approx(
        (2 * d + 1) / (3 * d + 1)
    )
    first, second = (_unit(profile, f"model.layers.{i}").tensor_parallel for i in (0, 1))
    assert first is not None and second is not None
    assert second.sequence_saved_fraction == pytest.approx(2 * first.sequence_saved_fraction)
    assert 0 < second.sequence_saved_fraction < 1 - second.sharded_saved_fraction


def test_the_flop_fraction_is_the_hand_count_where_the_head_is_in_the_unit() -> None:
    d, seq = 32, 16
    profile = _profile("pipeplan.models.zoo:llama", n_layers=1, d_model=d, seq_len=seq)
    (root,) = profile.units  # one layer and max_stages 1: the whole model is one unit
    tp = root.tensor_parallel
    assert tp is not None
    n = B * seq  # tokens
    proj = 2 * n * d * (d + d // 2 + d // 2 + d) + 3 * 2 * n * d * 2 * d
    attention = 2 * (2 * B * 2 * seq * seq * (d // 2))  # QK^T and PV, 2 heads of d/2
    head = 2 * n * d * 128  # split over the vocabulary too
    assert tp.sharded_flop_fraction == pytest.approx(
        (proj + attention + head) / (proj + attention + head)
    )
    assert tp.allgather_bytes_per_sample == seq * 128 * 4


def test_an_mlp_alone_saves_its_input_whole_and_the_rest_sharded() -> None:
    profile = _profile("pipeplan.models.zoo:llama", max_stages=4, n_layers=2)
    tp = _unit(profile, "layers.0.mlp").tensor_parallel
    assert tp is not None
    # Saved: x (N d, read by gate and up: whole), gate's and up's outputs, SiLU's, the
    # product (4 N i, i = 2 d: sharded) -> 8 / 9.
    assert tp.sharded_saved_fraction == pytest.approx(8 / 9)
    assert tp.allreduces == 1
    assert "heads" not in tp.divisors


def test_the_bundled_gpt_splits_only_its_mlp() -> None:
    d, seq, vocab = 16, 8, 64
    profile = _profile(
        "pipeplan.models.gpt:gpt", n_layers=1, d_model=d, n_heads=2, seq_len=seq, vocab=vocab
    )
    tp = _unit(profile, "blocks").tensor_parallel
    assert tp is not None
    assert set(tp.styles) == {"blocks.0.fc", "blocks.0.out"}
    assert tp.sharded_param_bytes == 4 * (4 * d * d + 4 * d + 4 * d * d)  # fc's bias, not out's
    n = B * seq
    mlp, qkv, proj = 2 * 2 * n * d * 4 * d, 2 * n * d * 3 * d, 2 * n * d * d
    attention = 2 * (2 * B * 2 * seq * seq * (d // 2))
    assert tp.sharded_flop_fraction == pytest.approx(mlp / (mlp + qkv + proj + attention))
    assert tp.allreduces == 1 and tp.allreduce_bytes_per_sample == seq * d * 4
    assert "heads" not in tp.divisors


@pytest.mark.parametrize(("model", "sub_blocks"), [("bert", 2), ("t5", 5)])
def test_encoders_and_encoder_decoders_are_annotated(model: str, sub_blocks: int) -> None:
    profile = _profile(f"pipeplan.models.zoo:{model}", n_layers=1)
    split = [u for u in profile.units if u.tensor_parallel is not None]
    for u in split:
        tp = u.tensor_parallel
        assert tp is not None
        assert 0 < tp.sharded_param_bytes <= u.param_bytes
        assert 0.5 < tp.sharded_flop_fraction <= 1 and 0 < tp.sharded_saved_fraction < 1
    # One all-reduce per sub-block: BERT's layer has attention and an MLP; T5's encoder block
    # attention and an MLP, its decoder block self-attention, cross-attention and an MLP.
    assert sum(u.tensor_parallel.allreduces for u in split if u.tensor_parallel) == sub_blocks


def test_a_model_without_a_layout_gets_a_note() -> None:
    profile = _profile("pipeplan.models.zoo:gpt2", n_layers=1)
    assert all(u.tensor_parallel is None for u in profile.units)
    assert profile.tensor_parallel_note is not None and "stays 1" in profile.tensor_parallel_note


def test_annotating_again_from_the_spec_gives_the_same_and_checks_the_graph() -> None:
    kwargs = {"n_layers": 1, "d_model": 16, "n_heads": 2, "seq_len": 8, "vocab": 64}
    profile = _profile("pipeplan.models.gpt:gpt", **kwargs)
    bare = profile.model_copy(
        update={
            "units": tuple(u.model_copy(update={"tensor_parallel": None}) for u in profile.units)
        }
    )
    spec = load_model("pipeplan.models.gpt:gpt", kwargs, meta=True)
    assert annotate_profile(bare, spec) == profile
    other = load_model("pipeplan.models.gpt:gpt", {**kwargs, "n_layers": 2}, meta=True)
    with pytest.raises(FingerprintMismatchError, match="annotate the profile with the model"):
        annotate_profile(bare, other)


def test_annotating_leaves_no_reference_to_the_model() -> None:
    """Autograd keeps the walk's pack hook in C++, out of the garbage collector's sight; a
    bound method there kept the traced graph and the model's real weights alive after every
    profile (on a GPU: the bundled GPT's 709 MiB, held until the process ended)."""
    kwargs = {"n_layers": 1, "d_model": 16, "n_heads": 2, "seq_len": 8, "vocab": 64}
    profile = _profile("pipeplan.models.gpt:gpt", **kwargs)
    spec = load_model("pipeplan.models.gpt:gpt", kwargs)  # real weights
    weight = weakref.ref(next(spec.module.parameters()))
    annotate_profile(profile, spec)
    del spec
    gc.collect()
    assert weight() is None


def test_a_cut_inside_a_sub_block_or_after_t5s_position_bias_is_gathered() -> None:
    """Per cut, the bytes t ranks hold split by heads: none after a block's row-wise
    projection, the sharded activations of a cut inside Llama's attention, and T5's
    relative-position bias (looked up in a head table split with the heads) where a layer
    hands it to the next; each the sum of its sharded tensors' bytes."""
    llama = _profile("pipeplan.models.zoo:llama", max_stages=32, n_layers=1)
    after = {llama.units[c.after].name.rsplit(".", 2)[-1]: c for c in llama.cuts}
    assert after["q_proj"].tp_gather_bytes_per_sample > 0
    assert after["v_proj"].tp_gather_bytes_per_sample > 0
    assert after["o_proj"].tp_gather_bytes_per_sample == 0
    assert after["embed_tokens"].tp_gather_bytes_per_sample == 0
    for c in llama.cuts:
        assert c.tp_gather_bytes_per_sample <= c.bytes_per_sample
    t5 = _profile("pipeplan.models.zoo:t5", max_stages=64, n_layers=2)
    end = {t5.units[c.after].name: c for c in t5.cuts}
    # block 0's bias crosses the cut to block 1; the last block hands it to no one
    heads, seq = 2, 16  # the zoo T5's bias: (1, heads, seq, seq) float32, per sample of B
    assert (
        end["encoder.block.0.layer.1.dropout"].tp_gather_bytes_per_sample
        == heads * seq * seq * 4 // B
    )
    assert end["encoder.block.1.layer.1.dropout"].tp_gather_bytes_per_sample == 0
