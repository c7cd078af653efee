"""Figures on an Agg canvas of their own, made without pyplot, for the plotting modules.

:mod:`pipeplan.report.plots` (plan comparisons) and :mod:`pipeplan.report.timeline_plots` (schedules) draw
on these.  A figure made here is unknown to pyplot: nothing is shown, no global backend is
switched, and the figure is freed with its last reference.  Save one with ``fig.savefig`` or
let a notebook display it.
"""

from __future__ import annotations

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

__all__ = ["new_figure"]


def new_figure(figsize: tuple[float, float]) -> Figure:
    """An empty constrained-layout figure of ``figsize`` inches on an Agg canvas of its own."""
    fig = Figure(figsize=figsize, layout="constrained")
    FigureCanvasAgg(fig)
    return fig
