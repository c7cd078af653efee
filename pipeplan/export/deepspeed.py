"""DeepSpeed: the flat ``layers`` list of ``PipelineModule`` and its ``parts``: stage s holds
``layers[parts[s]:parts[s + 1]]``; and the plain per-stage module lists (``fqns``)."""

from __future__ import annotations

import json
from collections.abc import Sequence

__all__ = ["deepspeed_text", "fqns_text", "json_object"]


def json_object(fields: dict[str, object]) -> str:
    """A JSON object with one field per line, each value on one line."""
    body = ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in fields.items())
    return "{\n" + body + "\n}\n"


def deepspeed_text(stage_keys: Sequence[Sequence[str]]) -> str:
    """The ``{num_stages, parts, layers}`` object."""
    flat = [k for ks in stage_keys for k in ks]
    parts = [0]
    for ks in stage_keys:
        parts.append(parts[-1] + len(ks))
    return json_object({"num_stages": len(stage_keys), "parts": parts, "layers": flat})


def fqns_text(stage_keys: Sequence[Sequence[str]]) -> str:
    """A JSON list of module names per stage."""
    rows = ",\n".join(f"  {json.dumps(list(ks))}" for ks in stage_keys)
    return f"[\n{rows}\n]\n"
