"""Measure a model's units: forward/backward time, saved activations, parameters and cuts.

>>> from pipeplan.profiler import profile_model
>>> profile = profile_model("pipeplan.models.mlp:mlp", batch_size=4, model_kwargs={"width": 8,
...     "depth": 2, "in_features": 4}, repeats=1, warmup=0, progress=False, max_stages=3)
>>> [u.name for u in profile.units], profile.microbatch_sizes
(['layers.0', 'layers.1', 'layers.1[relu_1]', 'head'], (1, 2, 4))
"""

from __future__ import annotations

from pipeplan.profiler.whole import DTYPES, default_microbatch_sizes, profile_model

__all__ = ["DTYPES", "default_microbatch_sizes", "profile_model"]
