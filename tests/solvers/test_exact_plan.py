"""prove_candidates: which candidate the exact model takes first, and under what cutoff."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from pipeplan.solvers import exact_plan
from pipeplan.solvers.exact_order import ExactResult


@dataclass
class _Replay:
    makespan_s: float


class _Plan:
    def __init__(self, name: str, finds: float) -> None:
        self.name, self.finds = name, finds

    def fits(self, replay: Any) -> bool:
        return True


def test_the_incumbents_candidate_is_proven_first_and_lowers_the_others_cutoff(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Candidate a has the lower bound, b the search's best plan (2.0 s); b's model finds
    1.8 s, under which a is then refuted: a is solved second, with the cutoff at 1.8."""
    solved: list[tuple[str, float | None]] = []

    class Order:
        exact = True

        def __init__(self, cp: _Plan) -> None:
            self.cp = cp

        def hint(self, starts: list[int], recompute: list[bool]) -> None:
            pass

        def solve(self, budget: float, cutoff: float | None) -> ExactResult:
            solved.append((self.cp.name, cutoff))
            found = self.cp.finds < (cutoff or float("inf"))
            return ExactResult(
                starts=[0, 1], recompute=[False], model_s=self.cp.finds, bound_s=self.cp.finds,
                status="optimal" if found else "infeasible", exact=True, error_s=0.0,
                replay=_Replay(self.cp.finds) if found else None,
            )  # fmt: skip

    monkeypatch.setattr(exact_plan, "ExactOrder", Order)
    a, b = ("interleaved1f1b", 2, 4), ("interleaved1f1b", 3, 4)
    plans: dict[Any, Any] = {a: _Plan("a", 1.9), b: _Plan("b", 1.8)}
    best = {a: ([0, 1], [False], 3.0), b: ([0, 1], [False], 2.0)}
    proof = exact_plan.prove_candidates(plans, {a: 1.0, b: 1.5}, best, 5.0)
    assert solved == [("b", 2.0), ("a", 1.8)]
    assert proof.found == {b: ([0, 1], [False])}
    assert proof.proven == {a, b} and proof.bounds == {a: 1.9, b: 1.8}
