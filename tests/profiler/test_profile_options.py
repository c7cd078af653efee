"""Profile options: threads, rounds, and the loss measured alongside the units."""

from __future__ import annotations

import pytest
import torch

from pipeplan.planner.errors import InvalidRequestError
from pipeplan.profiler import profile_model


def test_threads_recorded_and_restored() -> None:
    before = torch.get_num_threads()
    prof = profile_model(
        "pipeplan.models.mlp:mlp",
        batch_size=4,
        model_kwargs={"width": 32, "depth": 2, "in_features": 32},
        microbatch_sizes=[4],
        warmup=0,
        repeats=1,
        progress=False,
        threads=1,
    )
    assert prof.device.threads == 1
    assert torch.get_num_threads() == before
    with pytest.raises(InvalidRequestError, match="threads 0"):
        profile_model("pipeplan.models.mlp:mlp", batch_size=4, threads=0, progress=False)


def test_rounds_take_the_median_of_round_medians() -> None:
    kwargs = {"width": 32, "depth": 2, "in_features": 32}
    prof = profile_model(
        "pipeplan.models.mlp:mlp",
        batch_size=4,
        model_kwargs=kwargs,
        microbatch_sizes=[2, 4],
        warmup=0,
        repeats=1,
        progress=False,
        threads=1,
        rounds=3,
    )
    assert prof.rounds == 3
    for unit in prof.units:
        assert set(unit.timings) == {2, 4}
        assert all(t.forward_s > 0 and t.forward_spread_s >= 0 for t in unit.timings.values())
    with pytest.raises(InvalidRequestError, match="rounds 0"):
        profile_model("pipeplan.models.mlp:mlp", batch_size=4, rounds=0, progress=False)


def test_merge_is_median_of_rounds() -> None:
    from pipeplan.planner.types import Timing
    from pipeplan.profiler.assemble import merge_rounds

    ts = [
        Timing(forward_s=f, backward_s=2 * f, saved_bytes=8, output_bytes=4)
        for f in (1.0, 9.0, 2.0)
    ]
    merged = merge_rounds(ts)
    assert merged.forward_s == 2.0 and merged.backward_s == 4.0
    assert merged.saved_bytes == 8


def test_loss_is_measured_per_size() -> None:
    prof = profile_model(
        "pipeplan.models.gpt:gpt",
        batch_size=4,
        microbatch_sizes=[1, 4],
        warmup=0,
        repeats=1,
        progress=False,
        threads=1,
        model_kwargs={"vocab": 512, "n_layers": 1, "d_model": 32, "seq_len": 16},
    )
    assert set(prof.loss) == {1, 4}
    assert all(t.forward_s > 0 and t.backward_s > 0 for t in prof.loss.values())
    # Cross-entropy saves its log-softmax: vocab x tokens floats per sample at least.
    assert prof.loss[4].saved_bytes >= 4 * 16 * 512 * 4
    assert prof.loss[4].saved_bytes > prof.loss[1].saved_bytes


def test_checkpointed_backward_is_measured() -> None:
    prof = profile_model(
        "pipeplan.models.mlp:mlp",
        batch_size=8,
        microbatch_sizes=[8],
        warmup=1,
        repeats=3,
        progress=False,
        threads=1,
        model_kwargs={"width": 128, "depth": 2, "in_features": 128},
        max_stages=3,  # the three layers: no unit split into single elementwise nodes
    )
    for unit in prof.units:
        t = unit.timings[8]
        assert t.recompute_backward_s is not None
        # It recomputes the forward, so it is not much cheaper than forward + backward.
        assert t.recompute_backward_s > 0.5 * (t.forward_s + t.backward_s)
        # The checkpointed forward runs too; it includes at least one checkpoint call's cost.
        assert t.recompute_forward_s is not None
        assert t.recompute_forward_s >= prof.checkpoint_call_s[0]  # clipped there (sweep.py)
    # One checkpoint call costs something of its own (tens of microseconds on a CPU), forward
    # and backward, but far less than a unit.
    call_f, call_b = prof.checkpoint_call_s
    assert 0 < call_f < 1e-3 and 0 < call_b < 1e-3
