"""pipeplan.profiler.profile_model (:mod:`pipeplan.profiler.whole`) on the bundled models:
fields, units, cuts, tied weights, errors; and its options: threads, rounds, and the loss
measured alongside the units."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from pipeplan.intake.model import load_model
from pipeplan.planner.errors import InvalidRequestError
from pipeplan.planner.io import load_profile, write_json
from pipeplan.planner.types import Profile
from pipeplan.profiler import default_microbatch_sizes, profile_model
from pipeplan.profiler.device import Clock
from pipeplan.profiler.measure import measure_updates

FAST = {"warmup": 1, "repeats": 2, "progress": False}
GPT = {"vocab": 512, "d_model": 32, "n_layers": 2, "n_heads": 2, "seq_len": 16}
RESNET = {"width": 8, "blocks": "1,1", "image": 16}
MLP = {"width": 64, "depth": 3, "in_features": 32}


@pytest.fixture(scope="module")
def gpt_profile() -> Profile:
    # max_stages=2: units refined for 2 stages only (every block is under half the model).
    return profile_model(
        "pipeplan.models.gpt:gpt", batch_size=8, model_kwargs=GPT, max_stages=2, **FAST
    )


def test_every_field_is_filled(gpt_profile: Profile) -> None:
    p = gpt_profile
    assert p.model == "pipeplan.models.gpt:gpt" and p.model_kwargs == GPT
    assert p.tracer == "fx" and len(p.graph_fingerprint) == 16
    assert p.device.kind == "cpu" and p.device.threads == 1
    assert p.torch_version == torch.__version__ and p.dtype == "float32"
    assert p.microbatch_sizes == (1, 2, 4, 8) and (p.warmup, p.repeats) == (1, 2)
    assert [u.name for u in p.units] == ["embed", "blocks.0", "blocks.1", "head"]
    assert p.grouping is not None and (p.grouping.max_stages, p.grouping.base_units) == (2, 4)
    assert p.input_bytes_per_sample == 16 * 8  # seq_len int64 tokens
    assert len(p.cuts) == 3 and all(c.bytes_per_sample == 16 * 32 * 4 for c in p.cuts)


def test_optimizer_updates_are_timed() -> None:
    p = profile_model("pipeplan.models.mlp:mlp", batch_size=4, model_kwargs=MLP, **FAST)
    assert set(p.update_s) == {"sgd", "momentum", "adam"}
    assert all(t > 0 for t in p.update_s.values())
    # The curve: growing prefixes of the units, the last one all of the model's parameters.
    total = sum(u.param_bytes for u in p.units)
    prefixes = {sum(u.param_bytes for u in p.units[: k + 1]) for k in range(p.n_units)}
    assert set(p.update_curve) == set(p.update_s)
    for name, points in p.update_curve.items():
        sizes = [w for w, _ in points]
        assert sizes == sorted(set(sizes)) and set(sizes) <= prefixes and sizes[-1] == total
        assert len(sizes) >= 2 and all(t > 0 for _, t in points)
        assert points[-1][1] == p.update_s[name]


def test_timing_the_updates_leaves_the_parameters_alone() -> None:
    module = load_model("pipeplan.models.mlp:mlp", MLP).module
    params = list(module.parameters())
    before = [t.detach().clone() for t in params]
    times = measure_updates(params, clock=Clock(torch.device("cpu")), warmup=1, repeats=3)
    assert set(times) == {"sgd", "momentum", "adam"}
    assert all(torch.equal(a, b) for a, b in zip(params, before))
    assert all(t.grad is None for t in params)


def test_times_positive_and_saved_bytes_grow_with_microbatch(gpt_profile: Profile) -> None:
    for unit in gpt_profile.units:
        for t in unit.timings.values():
            assert t.forward_s > 0 and t.backward_s > 0 and t.peak_bytes is None
        saved = [unit.timings[b].saved_bytes for b in gpt_profile.microbatch_sizes]
        assert saved == sorted(saved) and saved[-1] > saved[0] > 0


def test_tied_embedding_counts_once(gpt_profile: Profile) -> None:
    module = load_model("pipeplan.models.gpt:gpt", GPT).module
    unique = sum(p.numel() * p.element_size() for p in module.parameters())
    assert sum(u.param_bytes for u in gpt_profile.units) == unique
    embed, head = gpt_profile.units[0], gpt_profile.units[-1]
    assert "embed.tok.weight" in embed.params and "embed.tok.weight" in head.params
    assert head.param_bytes == 2 * 32 * 4  # only the final LayerNorm
    # ... yet the head's largest parameter is the embedding it reads, whose gradient it makes.
    assert embed.largest_param_bytes == head.largest_param_bytes == 512 * 32 * 4
    assert gpt_profile.units[1].largest_param_bytes == 32 * 128 * 4  # a block's MLP weight


def test_json_round_trip(gpt_profile: Profile, tmp_path: Path) -> None:
    path = tmp_path / "gpt.profile.json"
    write_json(path, gpt_profile)
    assert load_profile(path) == gpt_profile


def test_resnet_cut_inside_a_block_carries_the_skip() -> None:
    p = profile_model(
        "pipeplan.models.resnet:resnet",
        batch_size=2,
        model_kwargs=RESNET,
        granularity="depth:4",
        **FAST,
    )
    k = next(i for i, u in enumerate(p.units) if u.name == "stages.0.0.conv1")
    main = p.units[k].timings[2].output_bytes // 2
    assert p.cuts[k].bytes_per_sample > main and len(p.cuts[k].tensors) == 2
    assert p.model_kwargs == RESNET


def test_float64_and_explicit_sizes() -> None:
    p = profile_model(
        "pipeplan.models.mlp:mlp",
        batch_size=6,
        model_kwargs=MLP,
        microbatch_sizes=[3, 6],
        dtype="float64",
        **FAST,
    )
    assert p.microbatch_sizes == (3, 6) and p.dtype == "float64"
    assert p.input_bytes_per_sample == 32 * 8
    assert p.units[0].param_bytes == (32 * 64 + 64) * 8


def test_hf_model_profiles_through_export() -> None:
    pytest.importorskip("transformers")
    kwargs = {"vocab": 64, "d_model": 16, "n_layers": 2, "n_heads": 2, "seq_len": 8}
    p = profile_model(
        "pipeplan.models.hf:gpt2", batch_size=2, model_kwargs=kwargs, max_stages=2, **FAST
    )
    assert p.tracer == "export" and p.n_units == 4


def test_microbatch_size_must_divide_batch() -> None:
    with pytest.raises(
        InvalidRequestError, match=r"micro-batch size 3 does not divide batch size 8"
    ):
        profile_model("pipeplan.models.mlp:mlp", batch_size=8, microbatch_sizes=[2, 3], **FAST)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without CUDA")
def test_cuda_without_cuda_is_a_clear_error() -> None:
    with pytest.raises(InvalidRequestError, match="CUDA is not available"):
        profile_model("pipeplan.models.mlp:mlp", batch_size=2, device="cuda", **FAST)


def test_bad_arguments() -> None:
    with pytest.raises(InvalidRequestError, match="dtype 'int8'"):
        profile_model("pipeplan.models.mlp:mlp", batch_size=2, dtype="int8", **FAST)
    with pytest.raises(InvalidRequestError, match="granularity 'layers'"):
        profile_model(
            "pipeplan.models.mlp:mlp", batch_size=2, model_kwargs=MLP, granularity="layers", **FAST
        )


def test_default_sizes() -> None:
    assert default_microbatch_sizes(32) == (1, 2, 4, 8, 16, 32)
    assert default_microbatch_sizes(12) == (1, 2, 4, 12)


# --------------------------------------------------------------------------------------------
# Profile options: threads, rounds, the loss
# --------------------------------------------------------------------------------------------


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


def test_checkpointed_backward_is_measured(monkeypatch: pytest.MonkeyPatch) -> None:
    # Count the checkpoints the sweep takes and the runs of their functions: a backward
    # through a non-reentrant checkpoint runs its function again (the recomputation).
    from torch.utils.checkpoint import checkpoint

    from pipeplan.profiler import sweep

    calls = {"checkpoint": 0, "run": 0}

    def counted(fn: Any, *args: Any, **kwargs: Any) -> Any:
        calls["checkpoint"] += 1

        def run(*a: Any) -> Any:
            calls["run"] += 1
            return fn(*a)

        return checkpoint(run, *args, **kwargs)

    monkeypatch.setattr(sweep, "checkpoint", counted)
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
        assert t.recompute_backward_s is not None and t.recompute_backward_s > 0
        # The checkpointed forward runs too; it includes at least one checkpoint call's cost.
        assert t.recompute_forward_s is not None
        assert t.recompute_forward_s >= prof.checkpoint_call_s[0]  # clipped there (sweep.py)
    # One checkpoint call costs something of its own (tens of microseconds on a CPU), forward
    # and backward, but far less than a unit.
    call_f, call_b = prof.checkpoint_call_s
    assert 0 < call_f < 1e-3 and 0 < call_b < 1e-3
    # Every checkpointed forward that was timed was recomputed in its backward: each function
    # ran twice (not a timing comparison, which a noisy host can turn over).
    assert calls["checkpoint"] > 0
    assert calls["run"] == 2 * calls["checkpoint"]
