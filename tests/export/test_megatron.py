"""Megatron's two forms, the layout and the first/last pair (:mod:`pipeplan.export.megatron`),
and megatron-core's own ``TransformerConfig`` parsing both (the ``targets`` extra) and building
the plan's layers per stage; with tensor parallelism, the same config taking the degree and
sequence parallelism beside the layout, and megatron-core's ``RankGenerator`` placing the
ranks as the plan's layout does."""

from __future__ import annotations

from itertools import pairwise
from pathlib import Path

import pytest
from _export_rules import (
    GPT_NAMES,
    GiB,
    megatron_args,
    megatron_core_layers,
    megatron_parse,
    megatron_uneven,
    megatron_validate,
    meshed,
    named_profile,
    plan_of,
)

from pipeplan.api import target_allowed_cuts
from pipeplan.export import export_plan, megatron_layout
from pipeplan.planner.io import write_json
from pipeplan.planner.types import Cluster, PlanOptions
from pipeplan.solvers import SOLVERS


@pytest.mark.parametrize(
    ("starts", "layout", "counts"),
    [
        ([0, 3, 6], "Et*2|t*3|t*3L", [2, 3, 3]),
        ([0, 4, 6, 8], "Et*3|t*2|t*2|tL", [3, 2, 2, 1]),
        ([0, 1, 9], "E|t*8|L", None),  # stages without a decoder layer: no first/last pair
        ([0, 2, 5, 9], "Et|t*3|t*4|L", None),
        ([0, 2, 5, 7], "Et|t*3|t*2|t*2L", None),  # uneven middle: the layout only
        ([0], "Et*8L", None),
        ([0, 5], "Et*4|t*4L", [4, 4]),  # two stages: the pair alone
    ],
)
def test_megatron_layout_and_first_last_counts(starts, layout, counts, tmp_path, cli) -> None:
    prof = named_profile(GPT_NAMES)
    plan_file = tmp_path / "plan.json"
    write_json(plan_file, plan_of(prof, starts))
    code, out, err = cli(["export", str(plan_file), "--to", "megatron"])
    assert code == 0, err
    lines = out.splitlines()
    first = megatron_args(lines[0])
    assert first["--pipeline-model-parallel-layout"] == layout
    parsed = megatron_parse(layout)
    megatron_validate(parsed, len(starts), 8)
    bounds = [*starts, len(GPT_NAMES)]
    expected = [sum(n.startswith("blocks.") for n in GPT_NAMES[a:b]) for a, b in pairwise(bounds)]
    assert [st.count("t") for st in parsed] == expected
    if len(starts) > 1:  # megatron-core wants pipeline_dtype only with pipeline parallelism
        assert megatron_core_layers(out) == [expected] * len(lines)
    if counts is None:
        assert len(lines) == 1
        assert len(starts) == 1 or "cannot express this plan" in err
    else:
        flags = megatron_args(lines[1])
        got = megatron_uneven(
            8,
            int(flags["--pipeline-model-parallel-size"]),
            int(flags["--decoder-first-pipeline-num-layers"]),
            int(flags["--decoder-last-pipeline-num-layers"]),
        )
        assert got == counts and err == ""


def test_megatron_layout_string_is_compact() -> None:
    # The reference parser first reproduces the examples in parse_str_to_list's own docstring
    # and comments.
    assert megatron_parse("Ettt|(tt|)*29,m|L") == [["E", "t", "t", "t"]] + [["t", "t"]] * 29 + [
        ["m"],
        ["L"],
    ]
    assert megatron_parse("(|tt)*2,E") == [[], ["t", "t"], ["t", "t", "E"]]
    assert megatron_layout([(True, 1, False), (False, 12, True)]) == "Et|t*12L"
    assert megatron_parse("Et|t*12L") == [["E", "t"], ["t"] * 12 + ["L"]]


def test_megatron_prices_the_closest_first_last_pair(tmp_path: Path, cli) -> None:
    """Layers 1, 3, 2, 2: the pair cannot give an uneven middle. 1, 3, 3, 1 and 2, 2, 2, 2
    each move one cut by one layer; the cheaper under the cost model is named, with its
    price, and the layout still says the plan itself."""
    prof = named_profile(GPT_NAMES)
    write_json(tmp_path / "profile.json", prof)
    plan_file = tmp_path / "plan.json"
    plan = plan_of(prof, [0, 2, 5, 7])
    write_json(plan_file, plan)
    code, out, err = cli(["export", str(plan_file), "--to", "megatron"])
    assert code == 0 and out.count("\n") == 1
    assert "cannot express this plan: the middle stages hold different counts ([3, 2])" in err
    assert "--decoder-last-pipeline-num-layers 1 ([1, 3, 3, 1] layers per stage)" in err
    assert "(give --profile to price it)" in err

    code, out2, err = cli(
        ["export", str(plan_file), "--to", "megatron", "--profile", str(tmp_path / "profile.json")]
    )
    assert code == 0 and out2 == out and err.count("\n") == 1
    priced = {
        (1, 3, 3, 1): plan_of(prof, [0, 2, 5, 8]).step_time_s,  # blocks start at unit 1
        (2, 2, 2, 2): plan_of(prof, [0, 3, 5, 7]).step_time_s,
    }
    best = min(priced, key=priced.__getitem__)
    assert f"({list(best)} layers per stage): predicted step {priced[best] * 1e3:.4g} ms" in err
    assert f"vs {plan.step_time_s * 1e3:.4g} ms planned" in err


def test_megatron_core_reads_the_export(llama) -> None:
    """The layout line and the commented first/last pair through megatron-core's own
    TransformerConfig: each builds the plan's decoder layers per stage, and the two together
    are refused (the comment says the pair replaces the layout)."""
    torch = pytest.importorskip("torch")
    config_mod = pytest.importorskip("megatron.core.transformer.transformer_config")
    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    _, prof = llama
    for p in (2, 3, 4):
        cluster = Cluster.homogeneous(p, GiB)
        options = PlanOptions(allowed_cuts=target_allowed_cuts(prof, "megatron"))
        plan = SOLVERS["dp"](prof, cluster, options)
        result = export_plan(plan, "megatron", prof)
        layers = [ks.count("t") for ks in result.stage_keys]
        lines = result.text.splitlines()
        args = megatron_args(lines[0])
        common = {
            "num_layers": int(args["--num-layers"]),
            "hidden_size": 32,
            "num_attention_heads": 4,
            "pipeline_model_parallel_size": int(args["--pipeline-model-parallel-size"]),
            "pipeline_dtype": torch.float32,
        }
        layout = args["--pipeline-model-parallel-layout"]
        config = config_mod.TransformerConfig(**common, pipeline_model_parallel_layout=layout)
        built = config.pipeline_model_parallel_layout
        assert [built.get_num_layers_to_build(pp_rank=j) for j in range(p)] == layers
        if len(lines) > 1:
            assert lines[1].startswith("# or, replacing the line above")
            flags = megatron_args(lines[1])
            pair = {
                "num_layers_in_first_pipeline_stage": int(
                    flags["--decoder-first-pipeline-num-layers"]
                ),
                "num_layers_in_last_pipeline_stage": int(
                    flags["--decoder-last-pipeline-num-layers"]
                ),
            }
            config = config_mod.TransformerConfig(**common, **pair)
            assert [get_num_layers_to_build(config, pp_rank=j) for j in range(p)] == layers
            with pytest.raises(ValueError, match="cannot be set with other pipeline layout"):
                config_mod.TransformerConfig(
                    **common, **pair, pipeline_model_parallel_layout=layout
                )


def test_megatron_core_takes_a_tensor_parallel_export(llama) -> None:
    """Issue 44: a 2-stage plan of the Llama on 2 tensor-parallel ranks with sequence
    parallelism, and on 2 replicas (made by hand from the solver's plan, as the planner will
    make it).  megatron-core's TransformerConfig takes the exported degree and
    ``--sequence-parallel`` with the layout, and builds the plan's layers per stage; it would
    refuse them with 3 heads, or without t > 1 (the checks the export's line meets).  Its
    RankGenerator, in the order the line selects, puts each (replica, stage) on the plan's
    ranks: ``--use-tp-pp-dp-mapping`` for the plan's replicas-outermost layout, the default
    for a pipeline-outermost one."""
    torch = pytest.importorskip("torch")
    config_mod = pytest.importorskip("megatron.core.transformer.transformer_config")
    from megatron.core.parallel_state import RankGenerator

    _, prof = llama
    options = PlanOptions(allowed_cuts=target_allowed_cuts(prof, "megatron"))
    solved = SOLVERS["dp"](prof, Cluster.homogeneous(2, GiB), options)
    for replicas_outer in (True, False):
        plan = meshed(solved, 2, sp=True, d=2, replicas_outer=replicas_outer)
        result = export_plan(plan, "megatron")  # the profile has no TP annotations to check
        assert not result.notes
        flags = megatron_args(result.text.splitlines()[0])
        t = int(flags["--tensor-model-parallel-size"])
        p = int(flags["--pipeline-model-parallel-size"])
        assert (t, flags["--sequence-parallel"]) == (2, "")
        assert ("--use-tp-pp-dp-mapping" in flags) == replicas_outer
        common = {
            "num_layers": int(flags["--num-layers"]),
            "hidden_size": 32,
            "pipeline_model_parallel_size": p,
            "pipeline_dtype": torch.float32,
            "pipeline_model_parallel_layout": flags["--pipeline-model-parallel-layout"],
        }
        tp = {"tensor_model_parallel_size": t, "sequence_parallel": "--sequence-parallel" in flags}
        config = config_mod.TransformerConfig(**common, **tp, num_attention_heads=4)
        assert (config.tensor_model_parallel_size, config.sequence_parallel) == (2, True)
        built = config.pipeline_model_parallel_layout
        layers = [ks.count("t") for ks in result.stage_keys]
        assert [built.get_num_layers_to_build(pp_rank=j) for j in range(p)] == layers
        with pytest.raises(ValueError, match="num_attention_heads"):
            config_mod.TransformerConfig(**common, **tp, num_attention_heads=3)
        with pytest.raises(ValueError, match="sequence parall"):
            config_mod.TransformerConfig(
                **common, num_attention_heads=4, tensor_model_parallel_size=1,
                sequence_parallel=True,
            )  # fmt: skip
        # Megatron-LM's --use-tp-pp-dp-mapping selects this order (its default: tp-cp-ep-dp-pp)
        order = "tp-cp-ep-pp-dp" if "--use-tp-pp-dp-mapping" in flags else "tp-cp-ep-dp-pp"
        d = plan.cluster.data_parallel
        ranks = RankGenerator(tp=t, ep=1, dp=d, pp=p, cp=1, order=order)
        want_pp = sorted(
            [plan.layout[r][j] + k for j in range(p)] for r in range(d) for k in range(t)
        )
        want_tp = sorted(
            [plan.layout[r][j] + k for k in range(t)] for r in range(d) for j in range(p)
        )
        assert sorted(ranks.get_ranks("pp")) == want_pp
        assert sorted(ranks.get_ranks("tp")) == want_tp
    # A layout that is neither order: a note, and the default order
    odd = solved.model_copy(
        update={"cluster": plan.cluster, "layout": ((0, 6), (2, 4))}
    )  # fmt: skip
    result = export_plan(odd, "megatron")
    assert "--use-tp-pp-dp-mapping" not in result.text
    assert len(result.notes) == 1 and "is neither of Megatron's rank orders" in result.notes[0]
