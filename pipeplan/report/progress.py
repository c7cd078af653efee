"""Progress bars for long work (profile, calibrate, run): one rich style, on stderr."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

__all__ = ["progress_bar"]


def progress_bar(enabled: bool) -> Progress:
    """A transient bar on stderr: description, bar, done of total, time elapsed; a no-op when
    not ``enabled`` (``--quiet``)."""
    return Progress(
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
        disable=not enabled,
    )
