"""Old import paths, kept for one release (0.2 removes them).

The modules that loaded and traced models, drew plans and exported them lived in
``pipeplan.planner`` until 0.1; they now live in :mod:`pipeplan.intake`, :mod:`pipeplan.report`
and :mod:`pipeplan.export` (and the synthetic profiles in :mod:`pipeplan.profiler.synthetic`; the
solvers' resolved request, chunk costs and tensor-parallel profile in :mod:`pipeplan.solvers`).
Importing an old path gives the new module itself (the same object, so ``isinstance`` and
monkeypatching agree) and a :class:`DeprecationWarning` naming the new path.  The aliases are served by an import hook installed by ``import pipeplan``; the ground
floor itself holds no upward import.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from collections.abc import Sequence
from types import ModuleType
from typing import Final

__all__ = ["MOVED", "install"]

_INTAKE = ("model", "hf_source", "meta", "usercode", "trace", "graph", "refine")
_SOLVERS = ("request", "chunks", "tensor_parallel")
_REPORT = ("plots", "timeline_plots", "frames", "terminal", "compare", "canvas", "progress")

#: Old module path -> new module path.
MOVED: Final[dict[str, str]] = {
    **{f"pipeplan.planner.{m}": f"pipeplan.intake.{m}" for m in _INTAKE},
    **{f"pipeplan.planner.{m}": f"pipeplan.report.{m}" for m in _REPORT},
    "pipeplan.planner.export": "pipeplan.export",
    "pipeplan.planner.synthetic": "pipeplan.profiler.synthetic",
    **{f"pipeplan.planner.{m}": f"pipeplan.solvers.{m}" for m in _SOLVERS},
}


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds each old path and loads it as the new module, with a warning."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        """A placeholder: the import system stamps its spec on what this returns."""
        return ModuleType(spec.name)

    def exec_module(self, module: ModuleType) -> None:
        """Put the new module under the old name; the import returns what ``sys.modules``
        holds once this is done, so the placeholder is dropped."""
        old = module.__name__
        new = MOVED[old]
        warnings.warn(
            f"{old} moved to {new}; the old path goes in pipeplan 0.2",
            DeprecationWarning,
            stacklevel=2,
        )
        sys.modules[old] = importlib.import_module(new)


def install() -> None:
    """Put the alias finder on ``sys.meta_path`` (once)."""
    if not any(isinstance(f, _Alias) for f in sys.meta_path):
        sys.meta_path.insert(0, _Alias())
