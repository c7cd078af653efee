"""The plan's degrees as the targets take them (:mod:`pipeplan.export.degrees`): the rank order
its layout implies, and a tensor-parallel degree checked against the dimensions the profile
says it splits: one line, exit 2, no file written.  The targets' own code reads the degrees in
test_torchtitan.py, test_megatron.py and test_deepspeed.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from _export_rules import GPT_NAMES, export_cli, meshed, named_profile, plan_of

from pipeplan.export import export_plan
from pipeplan.export.degrees import check_tensor_parallel, rank_order
from pipeplan.planner.errors import InvalidRequestError
from pipeplan.planner.io import write_json
from pipeplan.planner.types import Profile, UnitTensorParallel


def annotated(prof: Profile, divisors: dict[str, int]) -> Profile:
    """``prof`` with each block (``blocks.N``) split as a transformer block with ``divisors``."""
    split = UnitTensorParallel(
        styles={"attn.qkv": "colwise", "attn.out": "rowwise"},
        divisors=divisors,
        sharded_param_bytes=0,
        sharded_flop_fraction=0.9,
    )
    units = tuple(
        u.model_copy(update={"tensor_parallel": split}) if u.name.startswith("blocks.") else u
        for u in prof.units
    )
    return prof.model_copy(update={"units": units})


@pytest.mark.parametrize(
    ("t", "d", "replicas_outer", "want"),
    [
        (2, 2, True, "dp,pp,tp"),  # (r p + j) t: Plan.layout's own order
        (2, 2, False, "pp,dp,tp"),  # (j d + r) t: torchtitan's, Megatron's default
        (1, 3, True, "dp,pp,tp"),
        (4, 1, True, "pp,dp,tp"),  # one replica: the two orders coincide
    ],
)
def test_rank_order_reads_the_layout(t: int, d: int, replicas_outer: bool, want: str) -> None:
    plan = meshed(plan_of(named_profile(GPT_NAMES), [0, 5]), t, d=d, replicas_outer=replicas_outer)
    assert rank_order(plan) == want
    assert rank_order(plan.model_copy(update={"layout": ()})) == "pp,dp,tp"
    if d > 1:
        swapped = tuple(tuple(reversed(row)) for row in plan.layout)
        assert rank_order(plan.model_copy(update={"layout": swapped})) is None


def test_a_degree_the_model_cannot_take_is_one_line(tmp_path: Path, cli) -> None:
    """t = 4 against 2 key-value heads: one line naming the dimension, exit 2, no file; t = 2
    exports.  A profile with no splittable block refuses any t > 1."""
    prof = annotated(named_profile(GPT_NAMES), {"heads": 8, "kv_heads": 2, "hidden": 64})
    write_json(tmp_path / "profile.json", prof)
    base = plan_of(prof, [0, 5])
    for t in (4, 2):
        plan_file = tmp_path / f"plan{t}.json"
        write_json(plan_file, meshed(base, t))
        for target in ("torchtitan", "megatron"):
            out = tmp_path / f"plan{t}.{target}"
            code, text, err = export_cli(
                cli, plan_file, target, tmp_path, "--profile", str(tmp_path / "profile.json")
            )
            if t == 4:
                assert (code, text, out.exists()) == (2, "", False)
                assert err == (
                    f"error: {target}: the plan's tensor-parallel degree 4 does not divide "
                    f"blocks.0's kv_heads (2); plan again with a degree dividing 2\n"
                )
            else:
                assert code == 0 and out.exists(), err
    plain = named_profile(GPT_NAMES)
    with pytest.raises(InvalidRequestError, match="the profile finds no block to split"):
        export_plan(meshed(plan_of(plain, [0, 5]), 2), "megatron", plain)
    assert check_tensor_parallel(plan_of(plain, [0, 5]), "deepspeed", plain) == []


def test_fqns_notes_the_split_it_leaves_to_the_user() -> None:
    prof = annotated(named_profile(GPT_NAMES), {"heads": 8})
    result = export_plan(meshed(plan_of(prof, [0, 5]), 2), "fqns", prof)
    assert [n.split(";")[0] for n in result.notes] == ["fqns: lists each stage's modules only"]
    assert result.text == export_plan(plan_of(prof, [0, 5]), "fqns", prof).text
