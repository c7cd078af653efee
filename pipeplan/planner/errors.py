"""Named exceptions shared by every pipeplan package.

Every error a user can cause derives from :class:`PipeplanError`; the command line prints its
message as one line and exits non-zero.  Messages name the offending value and the fix.
"""

from __future__ import annotations

__all__ = [
    "FileFormatError",
    "FingerprintMismatchError",
    "InfeasiblePlanError",
    "InvalidRequestError",
    "ModelLoadError",
    "PipeplanError",
    "StageFailedError",
    "TraceError",
    "UnsupportedConstraintError",
    "UserCodeError",
]


class PipeplanError(Exception):
    """Base class of all errors pipeplan reports to users."""


class ModelLoadError(PipeplanError, ValueError):
    """A ``package.module:callable`` model name could not be loaded or returned the wrong thing."""


class TraceError(PipeplanError, RuntimeError):
    """Neither torch.fx nor torch.export could trace the model."""


class FileFormatError(PipeplanError, ValueError):
    """A profile, plan, cluster or run-report file is corrupt, of another schema version, or invalid."""


class InvalidRequestError(PipeplanError, ValueError):
    """Arguments that contradict each other or the profile (e.g. more stages than units)."""


class UnsupportedConstraintError(PipeplanError, ValueError):
    """A solver was asked for a constraint it cannot model (e.g. the DP and pinned units)."""


class InfeasiblePlanError(PipeplanError):
    """No partition fits the devices' memory.

    ``min_memory_bytes`` is the smallest per-device memory with which the best partition would
    fit (``None`` when even unlimited memory cannot help, e.g. more stages than units).
    """

    def __init__(self, message: str, min_memory_bytes: int | None = None) -> None:
        super().__init__(message)
        self.min_memory_bytes = min_memory_bytes


class FingerprintMismatchError(PipeplanError, ValueError):
    """A plan was made for a different model or graph than the one given."""


class StageFailedError(PipeplanError, RuntimeError):
    """A pipeline rank raised or died; the message names the stage and its error.

    ``bad_request`` is true when the ranks refused the request before the first step (a plan
    for another model, a checkpoint that does not match it): the command exits 2, not 1.
    ``signal`` is the signal number that stopped the job (SIGTERM, SIGINT), if one did: the
    command exits 128 + it, as a shell reports a process the signal ended.
    ``rank_traceback`` is the failing rank's own traceback, where it wrote one (``--debug``
    prints it: the rank's error file goes with the run's temporary folder).
    """

    def __init__(
        self,
        message: str,
        *,
        bad_request: bool = False,
        signal: int | None = None,
        rank_traceback: str | None = None,
    ) -> None:
        super().__init__(message)
        self.bad_request = bad_request
        self.signal = signal
        self.rank_traceback = rank_traceback

    @property
    def exit_code(self) -> int:
        """The command's exit status: 128 + signal, 2 for a bad request, else 1."""
        if self.signal is not None:
            return 128 + self.signal
        return 2 if self.bad_request else 1


class UnitMeasureError(PipeplanError, RuntimeError):
    """A unit measured alone (``pipeplan profile --method units``) failed on the inputs made
    for it; the message names the unit and its inputs known only by their shape."""


class UserCodeError(PipeplanError, RuntimeError):
    """The user's code raised: the model callable, ``make_batch``, the loss or ``forward``.

    The message names which, the exception and the user's file and line; the original
    exception is the ``__cause__`` (``pipeplan --debug`` prints its traceback).
    """
