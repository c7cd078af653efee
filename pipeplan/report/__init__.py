"""Views of profiles and plans: terminal tables (:mod:`~pipeplan.report.terminal`), comparisons
(:mod:`~pipeplan.report.compare`), data frames (:mod:`~pipeplan.report.frames`), figures
(:mod:`~pipeplan.report.plots`, Gantt charts in :mod:`~pipeplan.report.timeline_plots`) and
progress bars (:mod:`~pipeplan.report.progress`).  Views read plans; they never re-solve."""

from __future__ import annotations

__all__: list[str] = []
