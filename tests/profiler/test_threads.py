"""Profiling with the runtime's per-rank thread count."""

from __future__ import annotations

import pytest
import torch

from planner.errors import InvalidRequestError
from profiler import profile_model


def test_threads_recorded_and_restored() -> None:
    before = torch.get_num_threads()
    prof = profile_model("models.mlp:mlp", batch_size=4, model_kwargs={"width": 32, "depth": 2,
                         "in_features": 32}, microbatch_sizes=[4], warmup=0, repeats=1,
                         progress=False, threads=1)
    assert prof.device.threads == 1
    assert torch.get_num_threads() == before
    with pytest.raises(InvalidRequestError, match="threads 0"):
        profile_model("models.mlp:mlp", batch_size=4, threads=0, progress=False)
