"""The zoo: architectures this project did not write, brought as their users would.

For every case (:mod:`benchmarks.zoo.cases`): profile with the default options, plan 2 and 4
stages with the DP, then run the 2-stage plan for 2 steps on 2 ranks (one torchrun launch for
all cases, float64 where the model allows, gloo) and check the loss and every gradient against the unsplit model on
the full batch (:mod:`benchmarks.zoo.main`, which also makes benchmarks/zoo/README.md's table).
"""

from __future__ import annotations

import pytest
from _cached import once_per_session

from benchmarks.zoo.cases import CASES, TOLERANCE
from benchmarks.zoo.main import ZooRun, compare, run_zoo

pytestmark = pytest.mark.multirank

#: The cases whose model repeats another case's path layer for layer, marked ``slow`` (``make
#: test-all`` runs them; benchmarks/zoo runs every case): Mistral and Qwen2 are Llama's decoder
#: (a sliding window as long as the sequence, biases on q, k, v), RoBERTa and ELECTRA BERT's
#: encoder (other position ids, an embedding projection).  ``make test`` keeps one of each kind.
REPEATS = ("mistral", "qwen2", "roberta", "electra")
SUITE = tuple(n for n in CASES if n not in REPEATS)
NAMES = [*SUITE, *(pytest.param(n, marks=pytest.mark.slow) for n in REPEATS)]
# One worker profiles and runs each half once (make test runs xdist with --dist loadfile).


@pytest.fixture(scope="module")
def suite_zoo(tmp_path_factory: pytest.TempPathFactory) -> ZooRun:
    return once_per_session(tmp_path_factory, "zoo", lambda out: run_zoo(out, list(SUITE)))


@pytest.fixture(scope="module")
def repeats_zoo(tmp_path_factory: pytest.TempPathFactory) -> ZooRun:
    return once_per_session(
        tmp_path_factory, "zoo_repeats", lambda out: run_zoo(out, list(REPEATS))
    )


@pytest.fixture
def zoo(request: pytest.FixtureRequest, name: str) -> ZooRun:
    """The run that holds case ``name``."""
    return request.getfixturevalue("suite_zoo" if name in SUITE else "repeats_zoo")  # type: ignore[no-any-return]


def test_the_suite_keeps_the_representative_of_each_case_marked_slow() -> None:
    assert sorted([*SUITE, *REPEATS]) == sorted(CASES) and len(REPEATS) == 4
    assert {"llama", "bert"} <= set(SUITE)


@pytest.mark.parametrize("name", NAMES)
def test_profiles_and_plans_with_defaults(zoo: ZooRun, name: str) -> None:
    profile = zoo.profiles[name]
    assert profile.n_units >= 4, [u.name for u in profile.units]
    for p in (2, 4):
        plan = zoo.plans[name][p]
        assert plan.n_stages == p and plan.feasible, (p, plan.status)


@pytest.mark.parametrize("name", NAMES)
def test_two_rank_run_equals_unsplit_model(zoo: ZooRun, name: str) -> None:
    result = compare(name, zoo)
    assert result["error"] is None, f"{result['error']}\n{zoo.stderr[-3000:]}"
    assert not result["missing"], result["missing"]
    tol = TOLERANCE.get(name, 1e-9)
    assert result["loss_rel"] <= tol
    assert result["grad_rel"] <= tol
