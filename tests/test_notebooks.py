"""Execute every notebook in ``notebooks/`` so that none can rot, and keep them output-free.

Each notebook runs in a fresh ``python3`` kernel (the virtual environment's, from
``ipykernel``) with the repository's packages importable and a scratch working directory.
Budget: each notebook under 2 minutes on a 2-core CPU.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))

#: Modules a notebook needs beyond the planner itself; a missing one skips that notebook.
NEEDS: dict[str, tuple[str, ...]] = {
    "compare_plans": ("profiler", "pipeplan.report.compare"),
    "devices": ("profiler", "pipeplan.solvers.devices"),
    "microbatches": ("profiler",),
    "predicted_vs_measured": ("profiler", "pipeplan.runtime.launch"),
}

#: Seconds a notebook may take, all cells together.
BUDGET_S = 120.0
CELL_TIMEOUT_S = 300


def test_the_notebooks_are_there() -> None:
    assert {nb.stem for nb in NOTEBOOKS} == set(NEEDS)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_committed_without_outputs(path: Path) -> None:
    nbformat = pytest.importorskip("nbformat")
    nb = nbformat.read(path, as_version=4)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert cell.outputs == [], f"{path.name} cell {i} has outputs; clear them"
            assert cell.execution_count is None, f"{path.name} cell {i} has an execution count"


#: Notebooks that launch several ranks (``pipeplan run``).
MULTIRANK = {"predicted_vs_measured"}


@pytest.mark.parametrize(
    "path",
    [
        pytest.param(nb, marks=pytest.mark.multirank) if nb.stem in MULTIRANK else nb
        for nb in NOTEBOOKS
    ],
    ids=lambda p: p.stem,
)
def test_notebook_runs(path: Path, tmp_path: Path) -> None:
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    for module in NEEDS.get(path.stem, ()):
        pytest.importorskip(module, reason=f"{path.name} needs {module}, which is not installed")
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        nb,
        timeout=CELL_TIMEOUT_S,
        kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path)}},
    )
    start = time.perf_counter()
    client.execute()
    elapsed = time.perf_counter() - start
    assert elapsed < BUDGET_S, f"{path.name} took {elapsed:.0f} s (budget {BUDGET_S:.0f} s)"
    images = sum(
        "image/png" in out.get("data", {})
        for cell in nb.cells
        if cell.cell_type == "code"
        for out in cell.outputs
    )
    assert images >= 1, f"{path.name} displayed no figure"
