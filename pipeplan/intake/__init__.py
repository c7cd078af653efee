"""A user's model in: load it (:mod:`~pipeplan.intake.model`, ``hf:`` configs in
:mod:`~pipeplan.intake.hf_source`), build it on ``meta`` where it does not fit
(:mod:`~pipeplan.intake.meta`), trace it (:mod:`~pipeplan.intake.trace`) and group its graph into
units (:mod:`~pipeplan.intake.graph`, refined for a stage count in
:mod:`~pipeplan.intake.refine`).  Errors in the user's own code become one line
(:mod:`~pipeplan.intake.usercode`)."""

from __future__ import annotations

from pipeplan.intake.spec import ModelSpec, NamedInputs

__all__ = ["ModelSpec", "NamedInputs"]
