"""Tensor parallelism with sequence parallelism (and loss parallelism where the head splits over
the vocabulary) on models this project did not write: the loss and every gradient equal the
unsplit model's.

One 2-rank launch (pp 1 x tp 2, float64, GPipe, m = 2) runs each model found by its own
``transformers`` layout: Mistral and Qwen2 (grouped KV heads, a sliding window, qkv biases),
Phi (partial rotary, a parallel residual) and GPT-NeoX (fused-per-head qkv split by heads) with
their heads split over the vocabulary and their losses reading the logits split, BERT (post-norm
LayerNorms between the sub-blocks) and BART (an encoder-decoder whose cross-attention reads
the encoder's state gathered).  The Llama, T5 and the bundled GPT run on 4 ranks in
``tests/runtime/test_mesh.py``.  Gemma computes its RMSNorm in float32 whatever the
model's dtype, so its norms' weight gradients, summed over each rank's tokens before the
all-reduce, differ from the unsplit sum in float32's last bits (measured 1.2e-7 of the
largest): it runs at float32's tolerance.  DeBERTa's split is refused by tensor parallelism
itself (a mask baked with the global head count), Mixtral's grouped matmul has no float64.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from _runtime_jobs import launch_job, reference

pytestmark = pytest.mark.multirank

ZOO = {"n_layers": 1, "d_model": 32, "vocab": 64, "seq_len": 8, "heads": 4}
#: name -> (kwargs, whether the head splits over the vocabulary, gradient tolerance)
MODELS: dict[str, tuple[dict[str, Any], bool, dict[str, float]]] = {
    "mistral": ({**ZOO, "kv_heads": 2}, True, {}),
    "qwen2": ({**ZOO, "kv_heads": 2}, True, {}),
    "phi": (ZOO, True, {}),
    "gpt_neox": (ZOO, True, {}),
    "bert": (ZOO, False, {}),
    "bart": (ZOO, False, {}),
    "gemma": ({**ZOO, "kv_heads": 2}, False, {"rtol": 1e-6, "atol": 1e-9}),
}
TIGHT = {"rtol": 1e-12, "atol": 1e-13}
CONFIG = {"checkpoint": "never", "schedule": "gpipe", "optimizer": "momentum", "lr": 0.1,
          "steps": 2, "sequence_parallel": True}  # fmt: skip


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[Any]:
    models = [{"name": n, "model": f"pipeplan.models.zoo:{n}", "kwargs": kw, "starts": [0],
               "tp": 2, "keys": [n]} for n, (kw, _, _) in MODELS.items()]  # fmt: skip
    configs = [{**CONFIG, "key": n, "loss_parallel": lp} for n, (_, lp, _) in MODELS.items()]
    job = {"models": models, "batch_size": 8, "microbatches": 2, "configs": configs}
    return launch_job(job, 2, Path(tmp_path_factory.mktemp("tp_zoo")), timeout=600)


@pytest.mark.parametrize("name", list(MODELS))
def test_sequence_parallel_zoo_model_equals_unsplit(name: str, ranks: list[Any]) -> None:
    kwargs, split_loss, tolerance = MODELS[name]
    model = {"model": f"pipeplan.models.zoo:{name}", "kwargs": kwargs}
    ref_loss, ref_grads, ref_params, _ = reference(model, 8, "momentum", 0.1, 2)
    got = [one[name][name] for one in ranks]
    assert [one["loss"] == pytest.approx(ref_loss, rel=1e-12) for one in got] == [True, True]
    for r, one in enumerate(got):
        assert set(one["grads"]) == set(ref_grads), name
        for pname, grad in one["grads"].items():
            torch.testing.assert_close(
                grad, ref_grads[pname], **(tolerance or TIGHT), msg=f"{name} {r} {pname}"
            )
        for pname, value in one["params"].items():
            torch.testing.assert_close(
                value, ref_params[pname], **(tolerance or TIGHT), msg=f"{name} {r} {pname}"
            )
        assert one["sequence"], name  # the norms ran on the rank's share of the sequence
        logits = [s for s in one["sent"] if s[-1] in (32, 64) and len(s) == 3 and s[1] == 8]
        assert (4, 8, 32 if split_loss else 64) in logits, (name, one["sent"])
