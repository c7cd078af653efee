"""torchvision importable on a CPU-only torch, even from its CUDA wheel.

The only torchvision wheel served for torch 2.13 is the CUDA build.  Its C++ extension
(``torchvision/_C.so``) does not load against the CPU torch, which torchvision tolerates, but
its import then registers fake kernels for ``torchvision::nms`` and ``torchvision::qnms``,
ops the extension would have defined, and fails: ``operator torchvision::nms does not exist``.
Any library that imports torchvision fails with it (``transformers`` and ``timm`` do).  The
classifiers need none of its C++ ops, so :func:`define_missing_ops` defines those two op
schemas through ``torch.library`` (no kernel: calling them raises) when torchvision is
installed and its extension does not load; where it loads, the extension defines them and
nothing is done.  ``import pipeplan`` has it called just before torchvision is first imported
(an import hook: :class:`pipeplan._TorchvisionOps`), so every process that imports pipeplan
(the command, the ranks, the tests) can import torchvision, ``transformers`` and ``timm``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

__all__ = ["define_missing_ops"]

SCHEMAS = {
    "nms": "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "qnms(Tensor qdets, Tensor scores, float iou_threshold) -> Tensor",
}
_LIBRARIES: list[torch.library.Library] = []  # kept alive: dropping one undefines its ops


def _defined(op: str) -> bool:
    try:
        torch._C._get_schema(f"torchvision::{op}", "")
    except RuntimeError:
        return False
    return True


def define_missing_ops() -> list[str]:
    """Define the torchvision op schemas its import needs and its extension did not; returns
    the ops defined (none when torchvision is absent or its extension loads)."""
    if all(_defined(op) for op in SCHEMAS):
        return []
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return []
    for folder in spec.submodule_search_locations:
        for path in Path(folder).glob("_C.*"):
            try:
                torch.ops.load_library(str(path))
            except (ImportError, OSError):
                continue
    missing = [op for op in SCHEMAS if not _defined(op)]
    if missing:
        lib = torch.library.Library("torchvision", "FRAGMENT")
        for op in missing:
            lib.define(SCHEMAS[op])
        _LIBRARIES.append(lib)
    return missing
