"""The schedule families' per-rank action lists: torch's own, each action once, in exact order."""

from __future__ import annotations

import pytest
from torch.distributed.pipelining import schedules as ts

from pipeplan.planner.families import FAMILIES, Action, action_order, check, rank_of_stage

CASES = [(f, v, p, m) for f in FAMILIES for v in FAMILIES[f].v[:2] for p, m in [(2, 4), (4, 8)]]


@pytest.mark.parametrize(("family", "v", "p", "m"), CASES)
def test_every_action_once_on_its_rank_in_a_valid_order(
    family: str, v: int, p: int, m: int
) -> None:
    if check(family, p, v, m) is not None:
        pytest.skip(check(family, p, v, m))
    order = action_order(family, p, v, m)
    owner = rank_of_stage(family, p, v)
    seen: dict[tuple[str, int, int], int] = {}
    for r, acts in enumerate(order):
        for k, a in enumerate(acts):
            assert owner[a.stage] == r
            assert (a.kind, a.stage, a.microbatch) not in seen
            seen[(a.kind, a.stage, a.microbatch)] = k
    n = p * v
    for s in range(n):
        for i in range(m):
            assert ("F", s, i) in seen
            back = [k for k in "BI" if (k, s, i) in seen]
            assert len(back) == 1
            assert seen[("F", s, i)] < seen[(back[0], s, i)]
            if back[0] == "I":
                assert seen[("I", s, i)] < seen[("W", s, i)]
    if FAMILIES[family].torch_class != "Schedule1F1B":  # torch checks its own lists too
        tsa = {
            r: [ts._Action(a.stage, ts._ComputationType(a.kind), a.microbatch) for a in acts]
            for r, acts in enumerate(order)
        }
        ts._validate_schedule(tsa, p, n, m)


def _drawn(family: str, p: int, m: int) -> list[str]:
    return [" ".join(f"{a.kind}{a.microbatch}" for a in r) for r in action_order(family, p, 1, m)]


def test_gpipe_and_1f1b_orders_exact() -> None:
    """The picture in :mod:`pipeplan.planner.families`, p = 3, m = 4."""
    assert _drawn("gpipe", 3, 4) == ["F0 F1 F2 F3 B0 B1 B2 B3"] * 3
    assert _drawn("1f1b", 3, 4) == [
        "F0 F1 F2 B0 F3 B1 B2 B3",
        "F0 F1 B0 F2 B1 F3 B2 B3",
        "F0 B0 F1 B1 F2 B2 F3 B3",
    ]
    assert _drawn("1f1b", 4, 4)[0] == "F0 F1 F2 F3 B0 B1 B2 B3"  # warm-up min(m, p - r - 1)
    assert _drawn("1f1b", 2, 5)[1] == "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4"
    assert action_order("1f1b", 2, 1, 2)[1] == (
        Action("F", 1, 0), Action("B", 1, 0), Action("F", 1, 1), Action("B", 1, 1)
    )  # fmt: skip


def test_torch_refuses_what_the_family_cannot_run() -> None:
    assert check("1f1b", 4, 1, 2) is not None
    assert "DualPipeV" in (check("dualpipev", 4, 2, 6) or "")
    assert check("zbv", 4, 3, 8) is not None
    assert check("interleaved1f1b", 4, 2, 6) is None
    with pytest.raises(ValueError, match="unknown schedule"):
        check("pipedream", 2, 1, 2)
