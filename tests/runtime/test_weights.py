"""Stage-local materialization, checkpoints and measured memory, end to end on 2 CPU ranks.

Each rank builds the bundled GPT (tied embedding and head) on meta and materializes only its
stage: the weights it saves are exactly what the whole model materialized with the same seed
gets, and the unsplit model loads them with ``load_state_dict``.  Started from a checkpoint,
each rank reads only its stage's tensors and the loss is the unsplit model's.  A checkpoint
that does not match, or a parameter nothing initialises, stops the run with one line and
status 2.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _runtime_jobs import make_plan
from safetensors.torch import save_file

from pipeplan.intake.meta import materialize
from pipeplan.intake.model import load_model
from pipeplan.intake.trace import trace_model
from pipeplan.planner.io import load_report, write_json
from pipeplan.runtime.checkpoint import CheckpointReader

GPT = (
    "pipeplan.models.gpt:gpt",
    {"vocab": 32, "d_model": 16, "n_layers": 4, "n_heads": 2, "seq_len": 8},
)
BARE = ("_weights_models:bare", {})
PIPEPLAN = [sys.executable, "-c", "from pipeplan.cli import main; main()"]
ENV = {**os.environ, "PYTHONPATH": str(Path(__file__).parent), "OMP_NUM_THREADS": "1"}


def _plan(path: Path, model: tuple[str, dict[str, int]], starts: list[int]) -> Path:
    spec = load_model(*model)
    traced = trace_model(spec.module, spec.batch(2)[0])
    write_json(path, make_plan(*model, traced, starts=starts, batch_size=8, microbatches=4,
                               dtype="float32"))  # fmt: skip
    return path


@pytest.fixture(scope="module")
def plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _plan(tmp_path_factory.mktemp("weights") / "plan.json", GPT, [0, 3])


def _run(args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*PIPEPLAN, "run", *args], check=False, capture_output=True, text=True, timeout=180,
        env=ENV,
    )  # fmt: skip


def _load(directory: Path) -> dict[str, torch.Tensor]:
    reader = CheckpointReader(directory)
    return {k: reader.read(k) for k in sorted(reader.keys())}


@pytest.mark.multirank
def test_stage_init_equals_the_whole_model_and_the_unsplit_model_loads_the_shards(
    plan: Path, tmp_path: Path
) -> None:
    saved, report = tmp_path / "saved", tmp_path / "report.json"
    args = ["--steps", "1", "--warmup", "1", "--lr", "0", "--seed", "5"]
    proc = _run([str(plan), *args, "--save", str(saved), "--report", str(report)])
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in saved.iterdir()) == ["latest", "step-000002"]
    assert sorted(p.name for p in (saved / "step-000002").iterdir()) == [
        "manifest.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
        "train-00000-of-00002.pt",
        "train-00001-of-00002.pt",
    ]
    whole = load_model(*GPT, meta=True).module
    materialize(whole, [n for n, _ in whole.named_parameters()], torch.device("cpu"), seed=5)
    state = _load(saved)
    assert "head.proj.weight" not in state  # the tied head is the embedding, written once
    unsplit = load_model(*GPT).module
    missing, unexpected = unsplit.load_state_dict(state, strict=False)
    assert (missing, unexpected) == (["head.proj.weight"], [])
    assert unsplit.head.proj.weight is unsplit.embed.tok.weight
    expected = dict(whole.named_parameters())
    for name, p in unsplit.named_parameters():
        assert torch.equal(p, expected[name]), name
    stages = load_report(report).stages
    params = [sum(p.numel() * 4 for p in m.parameters()) for m in (unsplit.embed, unsplit.head)]
    assert all(s.peak_memory_bytes is not None for s in stages)
    assert stages[0].peak_memory_bytes > params[0] and stages[1].peak_memory_bytes > params[1]
    assert all(s.resident_growth_bytes is not None for s in stages)


@pytest.mark.multirank
def test_each_rank_reads_only_its_stage_and_trains_from_the_checkpoint(
    plan: Path, tmp_path: Path
) -> None:
    model = load_model(*GPT).module  # other values than any seeded initialisation
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5)
    state = {k: v for k, v in model.state_dict().items() if k != "head.proj.weight"}
    ckpt = tmp_path / "start.safetensors"
    save_file(state, str(ckpt))
    run_dir, report = tmp_path / "run", tmp_path / "report.json"
    run_dir.mkdir()
    cmd = [sys.executable, "-m", "pipeplan.runtime.forkrun", "--standalone", "--nproc-per-node", "2",
           "-m", "pipeplan.runtime.worker", str(plan), "--steps", "1", "--warmup", "0", "--lr", "0",
           "--quiet", "--weights", str(ckpt), "--run-dir", str(run_dir), "--report", str(report),
           "--save", str(tmp_path / "again")]  # fmt: skip
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=180, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    reads = [set(json.loads((run_dir / f"weights-{r}.json").read_text())) for r in (0, 1)]
    assert reads[0] | reads[1] == set(state)
    assert reads[0] & reads[1] == {"embed.tok.weight"}  # the tied head reads the embedding
    assert all(len(r) < len(state) for r in reads)
    assert {k for k in reads[0] if k.startswith("blocks.")} == {
        k for k in state if k.startswith(("blocks.0.", "blocks.1."))
    }
    again = _load(tmp_path / "again")
    assert again.keys() == state.keys() and all(torch.equal(again[k], state[k]) for k in state)
    spec = load_model(*GPT)
    inputs, target = spec.batch(8)
    expected = float(spec.loss(model(*inputs), target).detach())
    assert load_report(report).losses[0] == pytest.approx(expected, rel=1e-5)


@pytest.mark.multirank
def test_a_checkpoint_that_does_not_match_stops_the_run_with_one_line(
    plan: Path, tmp_path: Path
) -> None:
    state = {k: v for k, v in load_model(*GPT).module.state_dict().items()}
    missing = tmp_path / "missing.safetensors"
    save_file({k: v for k, v in state.items() if k not in ("head.proj.weight", "blocks.3.fc.weight")},
              str(missing))  # fmt: skip
    proc = _run([str(plan), "--steps", "1", "--weights", str(missing)])
    assert proc.returncode == 2, proc.stderr
    assert "lacks tensor 'blocks.3.fc.weight'" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
    assert "stage" not in proc.stderr  # found from the header before any rank started
    wrong = tmp_path / "float64.safetensors"
    save_file({k: v.double() for k, v in state.items() if k != "head.proj.weight"}, str(wrong))
    proc = _run([str(plan), "--steps", "1", "--weights", str(wrong)])
    assert proc.returncode == 2 and "is float64 but the plan runs float32" in proc.stderr


@pytest.mark.multirank
def test_a_parameter_nothing_initialises_stops_the_run_and_init_full_runs_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    """``--init stage`` refuses a parameter nothing initialises, naming it; ``full`` runs it,
    and so does the default, ``auto``, which builds the whole model where it fits (issue 31)."""
    plan = _plan(tmp_path / "bare.json", BARE, [0, 1])
    proc = _run([str(plan), "--steps", "1", "--init", "stage"])
    assert proc.returncode == 2, proc.stderr
    assert re.search(r"parameter layers\.[01]\.gain \(Scaled\) has no values", proc.stderr)
    assert len(proc.stderr.strip().splitlines()) == 1
    proc = _run([str(plan), "--steps", "1", "--init", "full"])
    assert proc.returncode == 0, proc.stderr
    proc = _run([str(plan), "--steps", "1"])
    assert proc.returncode == 0, proc.stderr
    assert "note: nothing initialises Scaled.layers.0.gain" in proc.stdout
    assert "every rank builds the whole model" in proc.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--init", "lazy"], "--init 'lazy' is not auto, stage or full"),
        (["--weights", "/no/such.safetensors"], "--weights /no/such.safetensors does not exist"),
    ],
)
def test_bad_weight_options_fail_before_launch(
    plan: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    from pipeplan.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["run", str(plan), *args])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
