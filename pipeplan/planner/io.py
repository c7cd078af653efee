"""Reading and writing pipeplan's JSON files, atomically, and parsing sizes and rates.

Files are written to a temporary file in the destination directory and renamed into place, so a
failure never leaves a partial file.  Loading validates the schema version and every field; the
error names the file and the first bad field.
"""

from __future__ import annotations

import json
import math
import os
import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO, TypeVar

from pydantic import BaseModel, ValidationError

from pipeplan.planner.errors import FileFormatError, InvalidRequestError
from pipeplan.planner.types import Cluster, Plan, Profile, RunReport

__all__ = [
    "calibration_file",
    "dumps",
    "format_bytes",
    "load_any",
    "load_cluster",
    "load_plan",
    "load_profile",
    "load_report",
    "parse_bytes",
    "parse_duration",
    "parse_rate",
    "write_atomic",
    "write_json",
    "write_text",
]

M = TypeVar("M", bound=BaseModel)


def dumps(obj: BaseModel) -> str:
    """Deterministic JSON text of a model: sorted keys, two-space indent, trailing newline."""
    data = obj.model_dump(mode="json", by_alias=True)
    return json.dumps(data, indent=2, sort_keys=True, allow_nan=False) + "\n"


def write_text(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` to ``path`` atomically (temporary file + rename)."""
    write_atomic(path, lambda fh: fh.write(text.encode()))


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_atomic(path: str | os.PathLike[str], write: Callable[[BinaryIO], object]) -> None:
    """Call ``write`` on a temporary file beside ``path``, then rename it to ``path``: a reader
    sees the old file or the whole new one, never half of it, and a failed ``write`` leaves
    nothing.  The file gets the mode a plain ``open`` would (0666 less the umask), not
    ``mkstemp``'s 0600."""
    path = Path(path)
    directory = path.parent if str(path.parent) else Path(".")
    if not directory.is_dir():
        raise InvalidRequestError(f"cannot write {path}: directory {directory} does not exist")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory)
    try:
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def write_json(path: str | os.PathLike[str], obj: BaseModel) -> None:
    """Write a Profile, Plan, Cluster or RunReport atomically as deterministic JSON."""
    write_text(path, dumps(obj))


def _read(path: str | os.PathLike[str]) -> dict[str, object]:
    p = Path(path)
    if not p.is_file():
        raise FileFormatError(f"{p}: no such file")
    try:
        data = json.loads(p.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FileFormatError(f"{p}: not valid JSON ({exc}); regenerate the file") from None
    if not isinstance(data, dict):
        raise FileFormatError(f"{p}: expected a JSON object, got {type(data).__name__}")
    return data


def _validate(path: str | os.PathLike[str], data: dict[str, object], cls: type[M]) -> M:
    expected = cls.model_fields["schema_"].default
    found = data.get("schema")
    if found != expected:
        raise FileFormatError(
            f"{path}: schema is {found!r}, expected {expected!r}; "
            f"regenerate it with this version of pipeplan"
        )
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(x) for x in err["loc"]) or "(root)"
        raise FileFormatError(f"{path}: field {loc}: {err['msg']}") from None


def calibration_file(kind: str) -> Path:
    """Where ``pipeplan calibrate`` keeps this machine's latest calibration for a device kind
    (``cpu``, ``cuda``) and where ``pipeplan plan`` finds it: ``$PIPEPLAN_HOME/cluster-KIND.json``,
    ``PIPEPLAN_HOME`` defaulting to ``$XDG_CACHE_HOME/pipeplan`` (``~/.cache/pipeplan``)."""
    home = os.environ.get("PIPEPLAN_HOME")
    if not home:
        cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        home = str(Path(cache) / "pipeplan")
    return Path(home) / f"cluster-{kind}.json"


def load_profile(path: str | os.PathLike[str]) -> Profile:
    return _validate(path, _read(path), Profile)


def load_plan(path: str | os.PathLike[str]) -> Plan:
    return _validate(path, _read(path), Plan)


def load_cluster(path: str | os.PathLike[str]) -> Cluster:
    return _validate(path, _read(path), Cluster)


def load_report(path: str | os.PathLike[str]) -> RunReport:
    return _validate(path, _read(path), RunReport)


def load_any(path: str | os.PathLike[str]) -> Profile | Plan | Cluster | RunReport:
    """Load whichever pipeplan file ``path`` is, by its ``schema`` field."""
    data = _read(path)
    schema = str(data.get("schema", ""))
    classes: tuple[type[Profile | Plan | Cluster | RunReport], ...] = (
        Profile,
        Plan,
        Cluster,
        RunReport,
    )
    for cls in classes:
        if schema == cls.model_fields["schema_"].default:
            return _validate(path, data, cls)
    raise FileFormatError(
        f"{path}: schema {schema!r} is not a pipeplan profile, plan, cluster or run report"
    )


_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_SIZE = re.compile(r"^\s*([-+]?[0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_bytes(text: str, what: str = "memory") -> int:
    """Parse ``16GiB``, ``512MB``, ``1e9`` into bytes; reject negatives and unknown units."""
    m = _SIZE.match(str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise InvalidRequestError(
            f"{what} {text!r} is not a size; write e.g. 16GiB, 512MB or 1000000"
        )
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if value <= 0 or not math.isfinite(value):
        raise InvalidRequestError(f"{what} {text!r} must be positive")
    return int(value)


def parse_rate(text: str, what: str = "bandwidth") -> float:
    """Parse ``10GB/s`` or ``25Gbit/s`` into bytes per second."""
    t = str(text).strip()
    bits = False
    for suffix in ("bit/s", "bps"):
        if t.lower().endswith(suffix):
            t, bits = t[: -len(suffix)], True
            break
    else:
        if t.lower().endswith("/s"):
            t = t[:-2]
    value = parse_bytes(t, what)
    return value / 8 if bits else float(value)


def parse_duration(text: str, what: str = "latency") -> float:
    """Parse ``5us``, ``2ms``, ``0.1s`` into seconds (zero allowed)."""
    m = re.match(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*(s|ms|us|ns)?\s*$", str(text))
    if not m:
        raise InvalidRequestError(f"{what} {text!r} is not a duration; write e.g. 5us or 2ms")
    per_second = {"s": 1.0, "ms": 1e3, "us": 1e6, "ns": 1e9}[m.group(2) or "s"]
    return float(m.group(1)) / per_second


def format_bytes(n: float) -> str:
    """Human-readable bytes, binary units: ``format_bytes(3 * 2**30) == '3.00 GiB'``."""
    for unit, scale in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"
