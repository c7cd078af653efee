"""The per-rank profile of t-way tensor parallelism, checked by hand against its formulas."""

from __future__ import annotations

from typing import Any

import pytest

from pipeplan.planner.collectives import ring_cost
from pipeplan.planner.errors import InvalidRequestError
from pipeplan.planner.types import (
    Cluster,
    CutTensor,
    Link,
    Profile,
    Timing,
    UnitTensorParallel,
)
from pipeplan.profiler.synthetic import synthetic_profile
from pipeplan.solvers.tensor_parallel import (
    check_loss_parallel,
    check_tensor_parallel,
    collective_s,
    source_note,
    tp_profile,
)

INTRA = Link(bandwidth_Bps=1e9, latency_s=1e-5)

ANN = UnitTensorParallel(  # a Llama layer's split: 5 column-wise projections, 2 row-wise
    styles={
        **{f"attn.{x}": "colwise" for x in "qkv"},
        "attn.o": "rowwise",
        "mlp.gate": "colwise",
        "mlp.up": "colwise",
        "mlp.down": "rowwise",
    },
    divisors={"heads": 8, "kv_heads": 4},
    sharded_param_bytes=0,  # set per unit below
    sharded_flop_fraction=0.9,
    sharded_saved_fraction=0.6,
    allreduces=2,
    allreduce_bytes_per_sample=1000,
)


def annotated(prof: Profile, units: tuple[int, ...] = (1, 2)) -> Profile:
    """``prof`` with ``units`` split (80 % of their parameters) and I/W measured."""
    out = []
    for u in prof.units:
        timings = {b: t.model_copy(update={"backward_input_s": 0.4 * t.backward_s,
                                           "backward_weight_s": 0.6 * t.backward_s,
                                           "weight_held_bytes": t.saved_bytes // 2})
                   for b, t in u.timings.items()}  # fmt: skip
        update: dict[str, object] = {"timings": timings}
        if u.index in units:
            share = int(0.8 * u.param_bytes)
            update["tensor_parallel"] = ANN.model_copy(update={"sharded_param_bytes": share})
            update["largest_param_bytes"] = share // 2
        out.append(u.model_copy(update=update))
    return prof.model_copy(update={"units": tuple(out)})


def _cluster(t: int, sp: bool = False, host: float = 0.0, seq: float = 0.0) -> Cluster:
    return Cluster.homogeneous(1, 2**40).model_copy(
        update={"tensor_parallel": t, "intra_node_link": INTRA, "sequence_parallel": sp,
                "tp_op_overhead_s": host, "tp_sequence_overhead_s": seq}
    )  # fmt: skip


def test_a_split_unit_by_hand() -> None:
    """The forward all-reduces each row-wise projection's output; the backward each column-wise
    projection's input gradient, one by one as torch's ColwiseParallel does (5 of 500 b bytes
    here, against 2 of 1000 b in all in the forward); each of the 7 split projections adds the
    host's o_tp to the forward and to the backward's input part, not to its weight part."""
    prof = annotated(synthetic_profile(4, batch_size=8, microbatch_sizes=[2, 4], seed=3))
    host = 3e-5
    per = tp_profile(prof, _cluster(4, host=host))
    u, v = prof.units[1], per.units[1]
    t, s = 4, 1 - 0.9 + 0.9 / 4
    for b in (2, 4):
        # two all-reduces of 1000 b bytes in all, a ring over 4 ranks: 2 (3/4) bytes / bw + 2 (3) a
        c = 2 * 3 / 4 * 1000 * b / 1e9 + 2 * 2 * 3 * 1e-5
        assert collective_s(_cluster(4), 1000 * b, 2) == pytest.approx(c)
        cb = 2 * 3 / 4 * 2500 * b / 1e9 + 5 * 2 * 3 * 1e-5  # five of 500 b bytes each
        one, got = u.timings[b], v.timings[b]
        assert got.forward_s == pytest.approx(one.forward_s * s + c + 7 * host)
        assert got.backward_s == pytest.approx(one.backward_s * s + cb + 7 * host)
        assert got.backward_input_s == pytest.approx(one.backward_input_s * s + cb + 7 * host)  # type: ignore[operator]
        assert got.backward_weight_s == pytest.approx(one.backward_weight_s * s)  # type: ignore[operator]
        assert got.saved_bytes == round(one.saved_bytes * (0.4 + 0.6 / 4))
        assert got.weight_held_bytes == round(one.weight_held_bytes * (0.4 + 0.6 / 4))  # type: ignore[operator]
        assert got.output_bytes == one.output_bytes
    whole = u.param_bytes - int(0.8 * u.param_bytes)
    assert v.param_bytes == whole + round(int(0.8 * u.param_bytes) / t)
    assert v.largest_param_bytes == max(round(u.largest_param_bytes / t), whole)
    # units without a split, the cuts, the loss: as they were
    assert per.units[0] == prof.units[0] and per.units[3] == prof.units[3]
    assert per.cuts == prof.cuts and per.loss == prof.loss
    assert tp_profile(prof, _cluster(1)) is prof


def _with_head() -> tuple[Profile, Any]:
    """A synthetic profile whose unit 3 is a head split over a vocabulary of 64 (4000 bytes of
    logits and 500 of input per sample); the profile and that unit."""
    head = UnitTensorParallel(
        styles={"lm_head": "colwise_gather"}, divisors={"lm_head features": 64},
        sharded_param_bytes=0, sharded_flop_fraction=1.0, allgather_bytes_per_sample=4000,
        gather_input_bytes_per_sample=500,
    )  # fmt: skip
    prof = synthetic_profile(4, batch_size=8, microbatch_sizes=[2], seed=3)
    return prof, prof.units[3].model_copy(update={"tensor_parallel": head})


def test_a_head_split_over_the_vocabulary_gathers_its_output() -> None:
    """A ``colwise_gather`` head: its forward all-gathers the logits (4000 b bytes, a ring of
    3/4 of them per rank and 3 latencies), its backward all-reduces its input's gradient (500 b
    bytes); its output stays whole for the loss; nothing is all-reduced in the forward."""
    prof, last = _with_head()
    prof = prof.model_copy(update={"units": (*prof.units[:3], last)})
    got, one = tp_profile(prof, _cluster(4)).units[3].timings[2], last.timings[2]
    gather = 3 / 4 * 4000 * 2 / 1e9 + 3 * 1e-5
    assert collective_s(_cluster(4), 4000 * 2, 1, "gather") == pytest.approx(gather)
    assert ring_cost(INTRA, 4, "all_gather") == pytest.approx((3 / 4 / 1e9, 3 * 1e-5))
    assert got.forward_s == pytest.approx(one.forward_s / 4 + gather)
    all_reduce = 2 * 3 / 4 * 500 * 2 / 1e9 + 2 * 3 * 1e-5
    assert got.backward_s == pytest.approx(one.backward_s / 4 + all_reduce)
    assert got.output_bytes == one.output_bytes


def test_loss_parallel_keeps_the_logits_split_and_splits_the_loss() -> None:
    """With --loss-parallel the head's forward gathers nothing and its output is 1/t; the
    loss's compute and bytes are 1/t, and its forward gains three all-reduces of one float per
    token (4000 bytes of logits per sample over a vocabulary of 64: 62.5 bytes per sample)."""
    prof, last = _with_head()
    loss = Timing(forward_s=0.4, backward_s=0.2, saved_bytes=8000, output_bytes=4)
    prof = prof.model_copy(update={"units": (*prof.units[:3], last), "loss": {2: loss}})
    lp = _cluster(4).model_copy(update={"loss_parallel": True})
    got, one = tp_profile(prof, lp), last.timings[2]
    all_reduce = 2 * 3 / 4 * 500 * 2 / 1e9 + 2 * 3 * 1e-5
    assert got.units[3].timings[2].forward_s == pytest.approx(one.forward_s / 4)
    assert got.units[3].timings[2].backward_s == pytest.approx(one.backward_s / 4 + all_reduce)
    assert got.units[3].timings[2].output_bytes == round(one.output_bytes / 4)
    three = collective_s(_cluster(4), 3 * 62.5 * 2, 3)
    assert got.loss[2].forward_s == pytest.approx(0.1 + three)
    assert (got.loss[2].backward_s, got.loss[2].saved_bytes) == (pytest.approx(0.05), 2000)
    assert tp_profile(prof, _cluster(4)).loss == prof.loss  # whole without it
    check_loss_parallel(prof)
    with pytest.raises(InvalidRequestError, match="--loss-parallel needs a head split over"):
        check_loss_parallel(prof.model_copy(update={"units": prof.units[:3]}))


def test_a_faster_device_pays_the_collectives_as_they_are() -> None:
    """The solvers divide a profile's seconds by the device's speed; the all-reduces and the
    host cost are the link's and the host's seconds, so a device 4 times the profiled host's
    speed still pays them whole (it paid a quarter of them before)."""
    prof = annotated(synthetic_profile(4, batch_size=8, microbatch_sizes=[2], seed=3))
    fast = _cluster(4, host=3e-5)
    fast = fast.model_copy(
        update={"devices": tuple(d.model_copy(update={"speed": 4.0}) for d in fast.devices)}
    )
    slow = tp_profile(prof, _cluster(4, host=3e-5)).units[1].timings[2]
    got = tp_profile(prof, fast).units[1].timings[2]
    one = prof.units[1].timings[2]
    s = 1 - 0.9 + 0.9 / 4
    c = slow.forward_s - one.forward_s * s  # the forward's collectives and host cost
    assert c > 0
    assert got.forward_s / 4 == pytest.approx(one.forward_s * s / 4 + c)
    cb = slow.backward_s - one.backward_s * s
    assert got.backward_s / 4 == pytest.approx(one.backward_s * s / 4 + cb)


def test_sequence_parallel_splits_the_rest_and_the_cuts() -> None:
    """Reduce-scatter + all-gather cost what the all-reduce does on a ring, and the backward
    adds the row-wise outputs' all-gathers (2 of 500 b bytes); the saved bytes divide the
    sub-blocks' share (0.6) and the per-token ops' (0.25) by t and keep the rest; a unit
    ending row-wise sends 1 / t of its output, and at every cut the hidden states (tensors of a
    row-wise output's 500 bytes per sample), not the others."""
    prof = annotated(synthetic_profile(4, batch_size=8, microbatch_sizes=[2], seed=3))
    units = [u.model_copy(update={"tensor_parallel": u.tensor_parallel.model_copy(
                update={"sequence_saved_fraction": 0.25})}) if u.tensor_parallel else u
             for u in prof.units]  # fmt: skip
    cuts = [c.model_copy(update={"tensors": (CutTensor(node="h", bytes_per_sample=500),
                                             CutTensor(node="mask", bytes_per_sample=64)),
                                 "bytes_per_sample": 564}) for c in prof.cuts]  # fmt: skip
    prof = prof.model_copy(update={"cuts": tuple(cuts), "units": tuple(units)})
    plain, sp = tp_profile(prof, _cluster(2)), tp_profile(prof, _cluster(2, sp=True))
    (a_ar, b_ar) = ring_cost(INTRA, 2, "all_reduce")
    (a_rs, b_rs), (a_ag, b_ag) = (
        ring_cost(INTRA, 2, "reduce_scatter"),
        ring_cost(INTRA, 2, "all_gather"),
    )
    assert (a_rs + a_ag, b_rs + b_ag) == pytest.approx((a_ar, b_ar))
    one, got, base = prof.units[1].timings[2], sp.units[1].timings[2], plain.units[1].timings[2]
    assert got.forward_s == pytest.approx(base.forward_s)
    assert got.backward_s == pytest.approx(base.backward_s + a_ag * 1000 * 2 + 2 * b_ag)
    # o_sp per row-wise projection (2 here): once in the forward, twice in the backward; o_sp
    # is sequence parallelism's alone, nothing without it
    hosted = tp_profile(prof, _cluster(2, sp=True, seq=1e-3)).units[1].timings[2]
    assert hosted.forward_s == pytest.approx(got.forward_s + 2e-3)
    assert hosted.backward_s == pytest.approx(got.backward_s + 4e-3)
    assert hosted.backward_input_s == pytest.approx(got.backward_input_s + 4e-3)
    assert tp_profile(prof, _cluster(2, seq=1e-3)).units[1].timings[2] == base
    assert got.saved_bytes == round(one.saved_bytes * (0.15 + 0.85 / 2))
    assert base.saved_bytes == round(one.saved_bytes * (0.4 + 0.6 / 2))
    assert got.output_bytes == round(one.output_bytes / 2)
    assert [c.bytes_per_sample for c in sp.cuts] == [314] * len(cuts)
    assert [[x.bytes_per_sample for x in c.tensors] for c in sp.cuts] == [[250, 64]] * len(cuts)
    assert plain.cuts == prof.cuts


def test_measured_timings_are_used_as_they_stand() -> None:
    prof = annotated(synthetic_profile(4, batch_size=8, microbatch_sizes=[2, 4], seed=3))
    measured = Timing(forward_s=0.5, backward_s=0.75, saved_bytes=7, output_bytes=9)
    units = list(prof.units)
    units[1] = units[1].model_copy(update={"tp_timings": {2: {2: measured}}})
    prof = prof.model_copy(update={"units": tuple(units)})
    per = tp_profile(prof, _cluster(2))
    assert per.units[1].timings[2] == measured
    assert per.units[1].timings[4].forward_s != units[1].timings[4].forward_s  # modelled
    assert source_note(prof, _cluster(2)) == (
        "tensor parallel 2: 2 units split (0 measured at t = 2, 2 modelled from the unsharded "
        "times), 2 run whole"
    )
    full = {2: {b: measured for b in (2, 4)}}
    units[2] = units[2].model_copy(update={"tp_timings": full})
    units[1] = units[1].model_copy(update={"tp_timings": full})
    both = prof.model_copy(update={"units": tuple(units)})
    assert "(2 measured at t = 2, 0 modelled" in source_note(both, _cluster(2))
    # measured without sequence parallelism: a plan with it models every unit
    assert "(0 measured at t = 2, 2 modelled" in source_note(both, _cluster(2, sp=True))
    assert tp_profile(both, _cluster(2, sp=True)).units[1].timings[2] != measured
    # and a head split over the vocabulary, measured with its logits gathered, is modelled
    # under loss parallelism, which keeps them split; the layers' measurements still hold
    ann = units[2].tensor_parallel
    assert ann is not None
    head = ann.model_copy(update={"styles": {"lm_head": "colwise_gather"}})
    units[2] = units[2].model_copy(update={"tensor_parallel": head})
    with_head = prof.model_copy(update={"units": tuple(units)})
    split_loss = _cluster(2).model_copy(update={"loss_parallel": True})
    assert "(1 measured at t = 2, 1 modelled" in source_note(with_head, split_loss)
    per = tp_profile(with_head, split_loss)
    assert per.units[1].timings[2] == measured and per.units[2].timings[2] != measured


def test_bad_degrees_name_the_dimension() -> None:
    prof = annotated(synthetic_profile(4, batch_size=8, microbatch_sizes=[2], seed=3))
    check_tensor_parallel(prof, 4)
    with pytest.raises(
        InvalidRequestError, match=r"--tensor-parallel 8 does not divide the model's kv_heads \(4"
    ):
        tp_profile(prof, _cluster(8))
    with pytest.raises(InvalidRequestError, match="does not divide the model's heads"):
        check_tensor_parallel(prof, 3)
    plain = synthetic_profile(4, batch_size=8, microbatch_sizes=[2], seed=3).model_copy(
        update={"tensor_parallel_note": "no attention or MLP projections recognised"}
    )
    with pytest.raises(InvalidRequestError, match="no attention or MLP projections recognised"):
        tp_profile(plain, _cluster(2))


def test_a_cut_held_split_by_heads_is_charged_its_gather() -> None:
    """Bytes t ranks hold split by heads at a cut go once more over the stage link (the
    all-gather before the send, bounded above); t = 1 gathers nothing."""
    prof = annotated(synthetic_profile(4, batch_size=8, microbatch_sizes=[2], seed=3))
    cuts = list(prof.cuts)
    cuts[1] = cuts[1].model_copy(update={"tp_gather_bytes_per_sample": 300})
    prof = prof.model_copy(update={"cuts": tuple(cuts)})
    two = tp_profile(prof, _cluster(2))
    assert two.cuts[1].bytes_per_sample == prof.cuts[1].bytes_per_sample + 300
    assert two.cuts[0] == prof.cuts[0] and two.cuts[2] == prof.cuts[2]
    assert tp_profile(prof, _cluster(1)) is prof
