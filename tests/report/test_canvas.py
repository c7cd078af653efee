"""pipeplan.report.canvas: the figures of both plotting modules stay out of pyplot's way."""

from __future__ import annotations

import matplotlib

from pipeplan.report import plots, timeline_plots
from pipeplan.report.canvas import new_figure


def test_figures_leave_pyplot_alone(plans):
    """The modules draw on their own Agg canvases: no backend switch, no pyplot figure left open."""
    import matplotlib.pyplot as plt

    backend = matplotlib.get_backend()
    before = plt.get_fignums()
    figs = [new_figure((4, 3)), timeline_plots.gantt(plans[0]), plots.stage_times(plans)]
    assert matplotlib.get_backend() == backend
    assert plt.get_fignums() == before
    assert all(type(fig.canvas).__name__ == "FigureCanvasAgg" for fig in figs)
