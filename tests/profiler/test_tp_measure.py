"""``pipeplan profile --tensor-parallel 2`` (pipeplan.profiler.tp_measure): a tiny Llama's layers
measured split over 2 gloo ranks, and the bad degrees refused before anything is measured."""

from __future__ import annotations

from typing import Any

import pytest

from pipeplan.planner.errors import InvalidRequestError
from pipeplan.profiler import profile_model
from pipeplan.profiler.tp_measure import measure_split, measure_tensor_parallel

FAST: dict[str, Any] = {"warmup": 0, "repeats": 1, "progress": False, "microbatch_sizes": (2,)}
LLAMA = {"n_layers": 2, "d_model": 32, "heads": 4, "kv_heads": 2}


def test_a_llama_layer_is_measured_split_on_two_ranks() -> None:
    model = "pipeplan.models.zoo:llama"
    options = {"method": "units", "max_stages": 1, "threads": 1, **FAST}
    profile = profile_model(model, batch_size=2, model_kwargs=LLAMA, **options)
    split = measure_tensor_parallel(profile, 2, warmup=0, repeats=2, threads=1)
    got = measure_split(profile, 2, warmup=0, repeats=1, threads=1)
    *layers, head = [u for u in split.units if u.tensor_parallel is not None]
    assert len(layers) == 2 and layers[1].measured_as == layers[0].index
    assert list(got) == [layers[0].index]  # measured once, copied to the identical layer
    # the head splits over the vocabulary, but its unit is two modules (norm, lm_head): modelled
    assert head.tensor_parallel is not None and not head.tp_timings
    for u in layers:
        tp = u.tensor_parallel
        assert tp is not None
        timing = u.tp_timings[2][2]
        assert timing == layers[0].tp_timings[2][2]
        assert timing.forward_s > 0 and timing.backward_s > 0
        assert timing.output_bytes == u.timings[2].output_bytes  # all-reduced: whole again
        assert 0 < timing.saved_bytes < u.timings[2].saved_bytes
    tp = layers[0].tensor_parallel
    assert tp is not None
    # Each rank holds half of every split weight and the whole of the two RMSNorms.
    assert got[layers[0].index].param_bytes == layers[0].param_bytes - tp.sharded_param_bytes // 2
    assert all(not u.tp_timings for u in split.units if u.tensor_parallel is None)


@pytest.mark.parametrize(
    ("model", "kwargs", "message"),
    [
        ("llama", {"n_layers": 1}, r"does not divide the model's kv_heads \(1\)"),
        ("gpt2", {"n_layers": 1}, r"--tensor-parallel 2: no attention or MLP projections"),
    ],
)
def test_a_degree_the_model_cannot_take_is_one_line_before_measuring(
    model: str, kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        profile_model(
            f"pipeplan.models.zoo:{model}", batch_size=2, model_kwargs=kwargs,
            tensor_parallel=2, **FAST,
        )  # fmt: skip
