"""Calls into the user's code, and what a failure there says.

An exception raised by the user's model callable, ``make_batch``, loss or ``forward`` becomes
one :class:`~pipeplan.planner.errors.UserCodeError` line: which of them raised, the exception, and the
user's file and line, i.e. the deepest frame of the traceback that is not in the standard
library, torch, ``transformers`` or pipeplan's own packages (``planner``, ``profiler``,
``solvers``, ``runtime``):

    error: the model's loss raised AttributeError: 'Tensor' object has no attribute 'logits'
    (mymodels.py:109)

The original exception stays attached as ``__cause__``; ``pipeplan --debug`` (or
``PIPEPLAN_DEBUG=1``) prints its traceback.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import sysconfig
import traceback
from collections.abc import Iterator
from pathlib import Path

from pipeplan.planner.errors import PipeplanError, UserCodeError

__all__ = ["model_name", "user_code", "user_error", "user_location"]

_ROOT = Path(__file__).resolve().parents[1]
_OURS = tuple(str(_ROOT / pkg) + os.sep for pkg in ("planner", "profiler", "solvers", "runtime"))


@functools.cache
def _library_dirs() -> tuple[str, ...]:
    dirs = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib")}
    for name in ("torch", "transformers", "typer", "click"):
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            dirs.update(spec.submodule_search_locations)
    return tuple(str(Path(d).resolve()) + os.sep for d in dirs)


def _is_library(filename: str) -> bool:
    if filename.startswith("<"):  # generated code: fx's GraphModule forward, exec'd strings
        return True
    path = str(Path(filename).resolve())
    return path.startswith(_OURS) or path.startswith(_library_dirs())


def _short(filename: str) -> str:
    rel = os.path.relpath(filename)
    return rel if not rel.startswith("..") else filename


def user_location(exc: BaseException, *, user_only: bool = False) -> str | None:
    """``file:line`` of the deepest frame of ``exc``'s traceback in the user's code (or the
    deepest frame at all when every frame is a library's, unless ``user_only``); ``None``
    without a traceback."""
    frames = traceback.extract_tb(exc.__traceback__)
    mine = [f for f in frames if not _is_library(f.filename)]
    if not (mine or frames) or (user_only and not mine):
        return None
    frame = (mine or frames)[-1]
    return f"{_short(frame.filename)}:{frame.lineno}"


def model_name(module: object) -> str:
    """The class name of the user's model: the model inside pipeplan's
    :class:`~pipeplan.intake.model.NamedInputs` wrapper, not the wrapper."""
    inner = getattr(module, "model", None) if type(module).__name__ == "NamedInputs" else None
    return type(inner if inner is not None else module).__name__


def user_error(what: str, exc: BaseException) -> UserCodeError:
    """``what`` raised ``exc``: one line with the exception and the user's file and line."""
    text = " ".join(str(exc).split())
    if len(text) > 300:
        text = text[:297] + "..."
    where = user_location(exc)
    suffix = f" ({where})" if where else ""
    return UserCodeError(f"{what} raised {type(exc).__name__}: {text}{suffix}")


@contextlib.contextmanager
def user_code(what: str) -> Iterator[None]:
    """Turn an exception raised inside the block into :func:`user_error` (``what`` says whose
    code, e.g. ``"the model's loss"``); pipeplan's own errors pass through."""
    try:
        yield
    except PipeplanError:
        raise
    except Exception as exc:
        raise user_error(what, exc) from exc
