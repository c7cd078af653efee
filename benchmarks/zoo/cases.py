"""The zoo the suite runs: every ``pipeplan.models.zoo`` architecture and the bundled models, tiny."""

from __future__ import annotations

from typing import Any

#: name -> (model, kwargs).  Sizes are tiny: the suite checks behaviour, not speed.
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    **{
        name: (f"pipeplan.models.zoo:{name}", {"n_layers": 2, "d_model": 16, "vocab": 64, "seq_len": 8})
        for name in (
            "gpt2",
            "llama",
            "mistral",
            "qwen2",
            "gpt_neox",
            "phi",
            "gemma",
            "mixtral",
            "bert",
            "roberta",
            "electra",
            "deberta",
            "t5",
            "bart",
            "vit",
        )
    },
    "gpt": ("pipeplan.models.gpt:gpt", {"vocab": 32, "d_model": 16, "n_layers": 4, "n_heads": 2, "seq_len": 8}),
    "resnet": ("pipeplan.models.resnet:resnet", {"width": 4, "blocks": "1,1", "image": 8}),
    "mlp": ("pipeplan.models.mlp:mlp", {"width": 8, "depth": 4, "in_features": 6, "classes": 3}),
    "hf-llama": ("pipeplan.models.hf:llama", {"vocab": 64, "d_model": 16, "n_layers": 2, "n_heads": 2,
                                     "n_kv_heads": 1, "seq_len": 8}),
}  # fmt: skip

#: Cases that cannot run in float64, and why: they run in float32.
FLOAT32 = {"mixtral": "transformers' grouped_mm experts take no float64 on CPU"}

#: Largest relative error of the loss and of every gradient (see benchmarks.zoo.main.compare):
#: 1e-9 unless the model computes in float32 somewhere (then a stated, looser bound).
TOLERANCE = {"mixtral": 1e-4, "gemma": 1e-6}
LOOSE_WHY = {**FLOAT32, "gemma": "its RMSNorm computes in float32 whatever the model's dtype"}

BATCH = 4
MICROBATCHES = 2
STEPS = 2
