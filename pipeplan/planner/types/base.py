"""What every shared type builds on: file schemas, option names and the frozen base model."""

from __future__ import annotations

import hashlib
import json
from typing import Final, Literal

from pydantic import BaseModel, ConfigDict

__all__ = [
    "CLUSTER_SCHEMA",
    "OPTIMIZERS",
    "OPTIMIZER_STATES",
    "PLAN_SCHEMA",
    "PROFILE_SCHEMA",
    "REPORT_SCHEMA",
    "CheckpointPolicy",
    "FrozenModel",
    "OptimizerName",
    "ScheduleChoice",
    "ScheduleName",
    "canonical_hash",
]

PROFILE_SCHEMA: Final = "pipeplan.profile/1"
PLAN_SCHEMA: Final = "pipeplan.plan/1"
CLUSTER_SCHEMA: Final = "pipeplan.cluster/1"
REPORT_SCHEMA: Final = "pipeplan.run-report/1"

CheckpointPolicy = Literal["auto", "always", "except_last", "never"]
ScheduleName = Literal[
    "gpipe", "1f1b", "interleaved1f1b", "loopedbfs", "zb-interleaved", "zbv", "dualpipev"
]
#: What a request may ask for: a family, or ``auto`` (every family, chosen by the simulator).
ScheduleChoice = Literal[
    "auto", "gpipe", "1f1b", "interleaved1f1b", "loopedbfs", "zb-interleaved", "zbv", "dualpipev"
]
OptimizerName = Literal["sgd", "momentum", "adam"]
#: ``--optimizer`` choices (``momentum`` is SGD with momentum 0.9).
OPTIMIZERS: tuple[OptimizerName, ...] = ("sgd", "momentum", "adam")

#: Optimizer state tensors kept per parameter (k in the memory model).
OPTIMIZER_STATES: dict[str, int] = {"sgd": 0, "momentum": 1, "adam": 2}


class FrozenModel(BaseModel):
    """A frozen pydantic model that rejects unknown fields and validates its defaults."""

    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)


def canonical_hash(obj: BaseModel) -> str:
    """16 hex digits of the SHA-256 of the model's JSON, keys sorted (a content fingerprint)."""
    text = json.dumps(obj.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]
