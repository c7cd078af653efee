"""torchtitan 0.3's Llama 3 debug model (its RoPE table in complex64 buffers): its loss
uncast, after ``module.to(dtype=float32)`` and after ``cast_floating(float32)``; run as a script
by test_spec.py (torchtitan's stand-ins stay out of the test process).  Prints one JSON line."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "export"))

from titan_split import _install_stand_ins

_install_stand_ins()

import torch
from torch import nn
from torchtitan.models.llama3 import model_registry

from pipeplan.intake.spec import cast_floating


def main() -> dict[str, object]:
    torch.manual_seed(0)
    model = model_registry("debugmodel").model.build()
    model.init_states(buffer_device=torch.device("cpu"))
    ids, target = torch.randint(0, 2000, (2, 2, 64), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(64).expand(2, 64)

    def loss(m: nn.Module) -> float:
        with torch.no_grad():
            out = m(ids, positions, m.get_attention_masks(positions))
        return float(nn.functional.cross_entropy(out.flatten(0, 1), target.flatten()))

    return {
        "buffers": sorted({str(b.dtype) for b in model.buffers()}),
        "uncast": loss(model),
        "to": loss(copy.deepcopy(model).to(dtype=torch.float32)),
        "cast_floating": loss(cast_floating(copy.deepcopy(model), torch.float32)),
    }


if __name__ == "__main__":
    print(json.dumps(main()))
