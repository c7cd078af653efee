"""The loss on the last stage (pipeplan.runtime.loss): with loss parallelism a loss that cannot
read logits split over the vocabulary stops the run in one line.  That a parallel loss equals
the unsplit model's is tested on 4 ranks in ``test_mesh.py`` (the Llama case)."""

from __future__ import annotations

from pathlib import Path

import pytest
from _runtime_jobs import refused_run

MODEL = ("_loss_models:numpy_loss_llama", {"n_layers": 1, "d_model": 32, "vocab": 64,
                                           "seq_len": 8})  # fmt: skip


@pytest.mark.multirank
def test_a_loss_that_cannot_read_split_logits_stops_the_run_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A Llama planned at tp 2 with --loss-parallel whose loss calls ``.numpy()`` on the
    logits: ``pipeplan run`` stops before its first step with status 2 and one line naming
    the failure and the fix."""
    here = str(Path(__file__).parent)
    monkeypatch.syspath_prepend(here)
    monkeypatch.setenv("PYTHONPATH", here)
    err = refused_run(MODEL, tmp_path, capsys, tensor_parallel=2, loss_parallel=True)
    assert "--loss-parallel: the model's loss does not run on logits split" in err, err
    assert ".numpy() is not supported" in err and "plan without --loss-parallel" in err


def test_loss_parallel_without_a_vocabulary_split_head_is_refused_before_launch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The bundled GPT ties its head to the embedding (only its MLP splits): a plan asking for
    --loss-parallel is refused before any rank starts, in one line, status 2."""
    model = ("pipeplan.models.gpt:gpt", {"vocab": 32, "d_model": 16, "n_layers": 2,
                                         "n_heads": 2, "seq_len": 8})  # fmt: skip
    err = refused_run(model, tmp_path, capsys, tensor_parallel=2, loss_parallel=True)
    assert "--loss-parallel needs a head split over the vocabulary" in err, err
