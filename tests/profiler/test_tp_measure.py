"""``pipeplan profile --tensor-parallel 2`` (pipeplan.profiler.tp_measure): a tiny Llama's traced
units measured split over 2 gloo ranks as the runtime splits them, and the bad degrees refused
before anything is measured."""

from __future__ import annotations

from typing import Any

import pytest

from pipeplan.planner.errors import InvalidRequestError, UnitMeasureError
from pipeplan.profiler import profile_model, tp_measure
from pipeplan.profiler.tp_measure import measure_split, measure_tensor_parallel

FAST: dict[str, Any] = {"warmup": 0, "repeats": 1, "progress": False, "microbatch_sizes": (2,)}
LLAMA = {"n_layers": 2, "d_model": 32, "heads": 4, "kv_heads": 2}


def test_a_llama_layer_is_measured_split_on_two_ranks() -> None:
    model = "pipeplan.models.zoo:llama"
    options = {"method": "units", "max_stages": 1, "threads": 1, **FAST}
    profile = profile_model(model, batch_size=2, model_kwargs=LLAMA, **options)
    split = measure_tensor_parallel(profile, 2, warmup=0, repeats=2, threads=1)
    got = measure_split(profile, 2, warmup=0, repeats=1, threads=1)
    whole = measure_split(profile, 1, warmup=0, repeats=1, threads=1)
    *layers, head = [u for u in split.units if u.tensor_parallel is not None]
    assert len(layers) == 2 and layers[1].measured_as == layers[0].index
    # measured once, copied to the identical layer; the head (norm and lm_head) is measured too
    assert list(got) == [layers[0].index, head.index]
    # unsplit in the harness, a traced unit saves exactly what the profile measured (the eager
    # module saved less: no repeat_kv copies of k and v)
    for u in (layers[0], head):
        assert whole[u.index].timings[2].saved_bytes == u.timings[2].saved_bytes
    # the head's logits are split over the vocabulary and gathered whole again
    assert head.tp_timings[2][2].output_bytes == head.timings[2].output_bytes
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


def _fake_ranks(tmp_path: Any, script: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """A stand-in for the rank processes: ``sys.executable`` replaced by a shell script called
    as ``-m pipeplan.profiler.tp_measure REQUEST RANK``; returns the request's path."""
    exe = tmp_path / "python"
    exe.write_text("#!/bin/sh\nREQ=$3\nRANK=$4\nDIR=$(dirname $REQ)\n" + script)
    exe.chmod(0o755)
    monkeypatch.setattr(tp_measure.sys, "executable", str(exe))
    request = tmp_path / "request.json"
    request.write_text("{}")
    return str(request)


WROTE_THEN_ABORTED = (
    'echo "{}" > $DIR/rank$RANK.json\n'
    'if [ "$RANK" = 1 ]; then echo "terminate called without an active exception" >&2;'
    " exit 134; fi\n"
)
FAILED_FIRST = (
    'if [ "$RANK" = 1 ]; then echo "RuntimeError: the split failed" >&2; exit 1; fi\nsleep 30\n'
)


@pytest.mark.parametrize(
    ("script", "error"),
    [(WROTE_THEN_ABORTED, None), (FAILED_FIRST, r"split 2 ways failed: RuntimeError: the split")],
)
def test_a_rank_that_fails_stops_the_measure_unless_every_rank_wrote(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, script: str, error: str | None
) -> None:
    """gloo's teardown can abort a rank after the last barrier: the results stand.  A rank
    failing before it wrote stops the others, in one line with its last error line."""
    request = _fake_ranks(tmp_path, script, monkeypatch)
    if error is None:
        tp_measure._launch(request, 2, timeout_s=30)
    else:
        with pytest.raises(UnitMeasureError, match=error):
            tp_measure._launch(request, 2, timeout_s=30)
