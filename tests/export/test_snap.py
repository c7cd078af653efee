"""How cuts a target cannot make move to the closest plan it can run, priced by the cost model
(:mod:`pipeplan.export.snap`); and the cuts a target can make (``target_cuts``): a refined
profile planned ``--for`` a target is never worse than planning freely and then snapping the
cuts on export, and exports without moving a cut."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _export_rules import (
    GiB,
    ds_fields,
    export_cli,
    megatron_args,
    named_profile,
    plan_of,
    titan_config,
)

from pipeplan.api import target_allowed_cuts
from pipeplan.export import ModelLayout, export_plan, target_cuts
from pipeplan.export.snap import legal_cuts
from pipeplan.planner.errors import InvalidRequestError
from pipeplan.planner.evaluate import evaluate
from pipeplan.planner.io import load_plan, load_profile, write_json
from pipeplan.planner.types import Cluster, PlanOptions
from pipeplan.solvers import SOLVERS


def test_a_cut_inside_a_block_moves_to_the_cheaper_neighbour(real, tmp_path: Path, cli) -> None:
    profile_file, prof = real("llama")
    names = [u.name for u in prof.units]
    layout = ModelLayout.of(names)
    inside = [b for b, ok in enumerate(legal_cuts(layout.keys("torchtitan"))) if not ok]
    assert inside, f"llama was not refined into pieces of blocks: {names}"
    cut = inside[len(inside) // 2]
    cluster = Cluster.homogeneous(2, GiB)
    options = PlanOptions(microbatches=2)
    plan = evaluate(prof, cluster, options, [cut], 2, solver="dp")
    plan_file = tmp_path / "inside.plan.json"
    write_json(plan_file, plan)
    legal = [b for b, ok in enumerate(legal_cuts(layout.keys("torchtitan"))) if ok and b > 0]
    down = max(b for b in legal if b < cut)
    up = min(b for b in legal if b > cut)
    priced = {b: evaluate(prof, cluster, options, [b], 2, solver="x") for b in (down, up)}
    best = min(priced, key=lambda b: priced[b].step_time_s)

    # Without the profile: one line naming the cut and the fix, exit 2, no file.
    code, text, err = export_cli(cli, plan_file, "torchtitan", tmp_path)
    block = layout.block_key(layout.modules[cut][0])
    assert code == 2 and text == ""
    assert err.count("\n") == 1 and "Traceback" not in err
    assert f"torchtitan cannot cut inside {block}" in err and "give --profile" in err

    code, text, err = export_cli(
        cli, plan_file, "torchtitan", tmp_path, "--profile", str(profile_file)
    )
    assert code == 0, err
    assert err.count("\n") == 1 and f"starts its stages at units [0, {best}]" in err
    assert f"predicted step {priced[best].step_time_s * 1e3:.4g} ms" in err
    assert f"vs {plan.step_time_s * 1e3:.4g} ms planned" in err
    parts = titan_config(text)["module_fqns_per_model_part"]
    assert isinstance(parts, list)
    first = [layout.block_key(m).removeprefix("model.") for ps in layout.modules[:best] for m in ps]
    assert {n for n in parts[0] if n != "rotary_emb"} == {
        {"embed_tokens": "tok_embeddings"}.get(n, n) for n in first
    }
    # fqns can name pieces of a block: the same plan needs no move.
    code, text, err = export_cli(cli, plan_file, "fqns", tmp_path)
    assert code == 0 and err == "" and len(json.loads(text)) == 2


def test_cuts_that_round_onto_each_other_spread_over_the_edges(tmp_path: Path, cli) -> None:
    """Three cuts inside one block all round to its two edges: they take the legal positions
    in order instead (the embedding's edge, the block's, the loss's)."""
    names = ["embed", "blocks.0.a", "blocks.0.b", "blocks.0.c", "blocks.0.d", "blocks.1", "head"]
    prof = named_profile(names)
    write_json(tmp_path / "profile.json", prof)
    plan_file = tmp_path / "plan.json"
    write_json(plan_file, plan_of(prof, [0, 2, 3, 4]))
    code, out, err = cli(
        ["export", str(plan_file), "--to", "megatron", "--profile", str(tmp_path / "profile.json")]
    )
    assert code == 0, err
    assert megatron_args(out.splitlines()[0])["--pipeline-model-parallel-layout"] == "E|t|t|L"
    assert "megatron cannot cut inside blocks.0" in err and "(3 such cuts)" in err
    expected = plan_of(prof, [0, 1, 5, 6]).step_time_s
    assert f"at units [0, 1, 5, 6]: predicted step {expected * 1e3:.4g} ms" in err


def test_many_cuts_move_to_their_nearest_edge() -> None:
    """Past ten cuts to move, each takes its nearest edge (the one before, on a tie) and the
    2**k roundings are not all priced."""
    names = ["embed", *(f"blocks.{i}.{x}" for i in range(12) for x in "ab"), "head"]
    prof = named_profile(names)
    starts = [0, *(names.index(f"blocks.{i}.b") for i in range(12))]
    plan = plan_of(prof, starts)
    result = export_plan(plan, "deepspeed", prof)
    assert result.adjustment is not None and "(12 such cuts)" in result.adjustment.reason
    moved = [s.first_unit for s in result.adjustment.plan.stages]
    assert moved == [0, *(b - 1 for b in starts[1:])]
    assert result.adjustment.plan.step_time_s == plan_of(prof, moved).step_time_s
    parts = ds_fields(result.text)["parts"]
    assert parts == [0, 1, *range(2, 13), 14]  # embed; one block per stage; the last two + head


def test_fqns_moves_a_cut_inside_a_leaf_module(tmp_path: Path, cli) -> None:
    names = ["embed", "blocks.0.norm", "blocks.0.norm[pow_1]", "blocks.0.mlp", "head"]
    prof = named_profile(names)
    write_json(tmp_path / "profile.json", prof)
    plan_file = tmp_path / "plan.json"
    write_json(plan_file, plan_of(prof, [0, 2]))
    code, out, err = cli(
        ["export", str(plan_file), "--to", "fqns", "--profile", str(tmp_path / "profile.json")]
    )
    assert code == 0 and "fqns cannot cut inside blocks.0.norm" in err
    price = {b: plan_of(prof, [0, b]).step_time_s for b in (1, 3)}
    best = min(price, key=price.__getitem__)
    modules = [[n for n in part if "[" not in n] for part in (names[:best], names[best:])]
    assert json.loads(out) == modules  # module names: a sub-unit's "[...]" is its module's


# ``plan --for TARGET``: planned within the target's cuts, never worse than snapping on export.


LLAMA_NAMES = [
    "model.embed_tokens",
    *(f"model.layers.{i}.{part}" for i in range(4) for part in ("self_attn", "mlp")),
    "model.norm+lm_head",
]


def test_torchtitan_cuts_leave_a_layer_on_every_stage() -> None:
    """torchtitan 0.3.0's transformers backend fails on a stage without a decoder layer, so
    its cuts start after layer 0's first unit and at layer 3's start at the latest; megatron
    and deepspeed cut at every block edge, fqns between any modules."""
    assert target_cuts(LLAMA_NAMES, "torchtitan") == (3, 5, 7)
    assert target_cuts(LLAMA_NAMES, "megatron") == (1, 3, 5, 7, 9)
    assert target_cuts(LLAMA_NAMES, "deepspeed") == (1, 3, 5, 7, 9)
    assert target_cuts(LLAMA_NAMES, "fqns") == tuple(range(1, 10))
    with pytest.raises(InvalidRequestError, match="torchtitan: the block list transformer.h"):
        target_cuts(
            ["transformer.wte", "transformer.h.0", "transformer.h.1", "lm_head"], "torchtitan"
        )


@pytest.mark.parametrize("target", ["torchtitan", "megatron", "deepspeed"])
def test_for_target_is_never_worse_than_export_then_snap(llama, target: str) -> None:
    _, prof = llama
    cluster = Cluster.homogeneous(3, GiB)
    free = SOLVERS["dp"](prof, cluster, PlanOptions())
    snapped = export_plan(free, target, prof)  # type: ignore[arg-type]
    today = free if snapped.adjustment is None else snapped.adjustment.plan
    allowed = target_allowed_cuts(prof, target)
    planned = SOLVERS["dp"](prof, cluster, PlanOptions(allowed_cuts=allowed))
    if {s.first_unit for s in today.stages[1:]} <= set(allowed):
        assert planned.step_time_s <= today.step_time_s * (1 + 1e-9)
    else:  # the snapped plan leaves a stage without a decoder layer: torchtitan cannot run it
        assert target == "torchtitan"
        assert any(n.startswith("torchtitan: stage(s)") for n in snapped.notes)
    assert planned.step_time_s >= free.step_time_s * (1 - 1e-9)
    result = export_plan(planned, target, prof)  # type: ignore[arg-type]
    assert result.adjustment is None
    assert not [n for n in result.notes if n.startswith("torchtitan: stage(s)")]


def test_plan_for_on_the_command_line(llama, tmp_path: Path, cli) -> None:
    path, _ = llama
    out = tmp_path / "plan.json"
    code, _, err = cli(
        ["plan", str(path), "--stages", "4", "--memory", "1GiB", "--for", "torchtitan"]
        + ["--no-calibration", "-o", str(out)]
    )
    assert code == 0, err
    plan = load_plan(out)
    allowed = set(target_allowed_cuts(load_profile(path), "torchtitan"))
    assert {s.first_unit for s in plan.stages[1:]} <= allowed
    code, _text, err = cli(["export", str(out), "--to", "torchtitan", "--profile", str(path)])
    assert code == 0 and "note:" not in err, err
    code, _, err = cli(["plan", str(path), "--stages", "3", "--for", "xla", "-o", str(out)])
    assert code == 2 and err.startswith("error: --for 'xla' is not one of") and err.count("\n") == 1
    # --for also keeps schedule auto to the families the target runs: DeepSpeed runs its own
    ds = ["plan", str(path), "--stages", "2", "--memory", "1GiB", "--for", "deepspeed"]
    code, _, err = cli([*ds, "-o", str(out)])
    assert code == 0 and load_plan(out).schedule == "1f1b", err
    code, _, err = cli([*ds, "--schedule", "zbv", "-o", str(tmp_path / "no.json")])
    assert code == 2 and err.count("\n") == 1 and not (tmp_path / "no.json").exists()
    assert "--schedule zbv is not what deepspeed runs (1f1b)" in err


def test_devices_leave_out_depths_the_target_cannot_cut(llama) -> None:
    """--devices with --for: a depth needing more cuts than the target allows is a row of the
    frontier that says so, not an error."""
    from pipeplan.solvers.devices import plan_devices

    _, prof = llama
    options = PlanOptions(allowed_cuts=(5,))
    choices = plan_devices(prof, 4, Cluster.homogeneous(1, GiB), options, SOLVERS["dp"])
    by_depth = {c.stages: c for c in choices}
    assert by_depth[4].plan is None and "only 1 allowed cut(s)" in by_depth[4].reason
    plan = by_depth[2].plan
    assert plan is not None and [s.first_unit for s in plan.stages] == [0, 5]
