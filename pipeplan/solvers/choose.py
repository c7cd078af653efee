"""One request, one plan: which solver plans which schedule families.

``PlanOptions.schedule`` names a family or ``auto`` (the default of ``pipeplan plan`` and
:func:`pipeplan.plan`).  Two kinds of solver plan them:

* the one-chunk solvers (``SOLVERS``: the exact DP, CP-SAT, the baselines) plan GPipe and 1F1B
  by the closed form (:mod:`pipeplan.planner.costmodel`, with compute contention k);
* the schedule solver (:func:`pipeplan.solvers.multichunk.solve_schedule`) plans every family,
  its chunks per rank v, cuts, m and recomputation, by replaying torch's own action order.

:func:`solve` decides (after :func:`check_solver`, the one check of which solver plans what):

``schedule`` = a multi-chunk family
    the schedule solver; only with the DP solver, otherwise
    :class:`~pipeplan.planner.errors.InvalidRequestError`.
``schedule`` = ``gpipe`` or ``1f1b``
    the named solver.
``schedule`` = ``auto``, DP solver
    T* = min(T_sched, T_gpipe, T_1f1b) (the simulated steps: the closed form's T(m) is a bound
    where updates end the step): the schedule solver's best plan over every allowed
    family (``PlanOptions.families``), beside the DP's GPipe and 1F1B plans, all of them charged
    the same compute contention k.  Where a one-chunk plan wins, the DP's own plan is returned.
    Status ``optimal`` when the schedule solver's was (it enumerated every family,
    cut, m and mask) and the winner is no slower than its plan; otherwise ``feasible`` with the
    gap (T* - L) / T* to the schedule solver's work bound L, which holds for every family.
``schedule`` = ``auto``, another solver
    the faster of that solver's GPipe and 1F1B plans (a plan that fits before one that does not).
"""

from __future__ import annotations

from collections.abc import Sequence

from pipeplan.planner.errors import InfeasiblePlanError, InvalidRequestError
from pipeplan.planner.types import Cluster, Plan, PlanOptions, Profile
from pipeplan.solvers import SOLVERS

__all__ = ["ONE_CHUNK", "check_solver", "solve"]

#: The families the one-chunk solvers plan (by the closed form).
ONE_CHUNK: tuple[str, ...] = ("gpipe", "1f1b")


def check_solver(options: PlanOptions, solver: str) -> None:
    """Raise :class:`~pipeplan.planner.errors.InvalidRequestError` for a request no solver
    plans: an unknown ``solver``, or multi-chunk families (``options.schedule``, or every one
    of ``options.families`` under ``auto``) asked of a one-chunk solver: only the schedule
    solver (``--solver dp``) plans them.  :func:`solve` checks its request with it, and
    :func:`pipeplan.plan` checks a request for devices with it before any depth is solved."""
    if solver not in SOLVERS:
        raise InvalidRequestError(
            f"--solver {solver!r} is unknown; choose one of {', '.join(SOLVERS)}"
        )
    if options.families == ():
        raise InvalidRequestError("the request allows no schedule family; allow one or more")
    if solver == "dp":
        return
    fam = options.schedule
    if fam not in ("auto", *ONE_CHUNK):
        raise InvalidRequestError(
            f"--schedule {fam} is planned by the schedule solver (--solver dp), not with "
            f"--solver {solver}; drop --solver, or plan --schedule auto, gpipe or 1f1b"
        )
    if fam == "auto" and not any(f in ONE_CHUNK for f in options.families or ONE_CHUNK):
        raise InvalidRequestError(
            f"the request allows {', '.join(options.families or ())}, which the schedule "
            f"solver plans (--solver dp), not --solver {solver}; drop --solver, or allow "
            "gpipe or 1f1b"
        )


def _simulated(plan: Plan) -> float:
    """The step the simulator gives the plan: the closed form's T(m) is a bound where updates
    and tied all-reduces end the step, and the schedule solver's plans are their replay, which
    equals the simulator for GPipe and 1F1B (contention included)."""
    return plan.simulated_step_time_s or plan.step_time_s


def _fastest(plans: Sequence[Plan]) -> Plan:
    """A plan that fits before one that does not, then the least simulated step, then the
    earlier."""
    return min(plans, key=lambda p: (not p.feasible, _simulated(p)))


def _one_chunk_plans(
    profile: Profile, cluster: Cluster, options: PlanOptions, solver: str
) -> list[Plan]:
    """``solver``'s GPipe and 1F1B plans (of those ``options.families`` allows), the first
    refusal raised when neither has one."""
    families = [f for f in ONE_CHUNK if options.families is None or f in options.families]
    plans: list[Plan] = []
    errors: list[InfeasiblePlanError | InvalidRequestError] = []
    for fam in families:
        try:
            plans.append(
                SOLVERS[solver](profile, cluster, options.model_copy(update={"schedule": fam}))
            )
        except (InfeasiblePlanError, InvalidRequestError) as exc:  # 1F1B with m < p, say
            errors.append(exc)
    if not plans:
        raise errors[0]
    return plans


def _one_chunk(profile: Profile, cluster: Cluster, options: PlanOptions, solver: str) -> Plan:
    """The faster of ``solver``'s GPipe and 1F1B plans (of those ``options.families`` allows)."""
    return _fastest(_one_chunk_plans(profile, cluster, options, solver))


def solve(
    profile: Profile,
    cluster: Cluster,
    options: PlanOptions | None = None,
    solver: str = "dp",
    *,
    final_gap: bool = True,
) -> Plan:
    """The plan for ``options.schedule`` by ``solver`` (module docstring).  ``final_gap``:
    the schedule solver raises its candidates' bounds once its plan is found
    (:mod:`pipeplan.solvers.final_gap`; a search over many meshes leaves it out).  Raises
    :class:`~pipeplan.planner.errors.InfeasiblePlanError` when nothing fits and
    :class:`~pipeplan.planner.errors.InvalidRequestError` for a combination no solver plans."""
    from pipeplan.solvers.multichunk import solve_schedule

    options = options or PlanOptions(schedule="auto")
    check_solver(options, solver)
    one_pipeline = solver == "dp"
    fam = options.schedule
    if fam in ONE_CHUNK:
        return SOLVERS[solver](profile, cluster, options)
    if fam != "auto":  # one pipeline: check_solver refuses a multi-chunk family otherwise
        return solve_schedule(profile, cluster, options, final_gap=final_gap)
    multi = options.families is None or any(f not in ONE_CHUNK for f in options.families)
    if not (one_pipeline and multi):
        return _one_chunk(profile, cluster, options, solver)
    singles: list[Plan] = []
    dp_plans: list[Plan] = []  # the schedule solver's seeds too: solved once
    failed: InfeasiblePlanError | None = None
    if any(f in ONE_CHUNK for f in options.families or ONE_CHUNK):
        try:  # a bad request for one chunk per rank is bad for every family: it stands
            dp_plans = _one_chunk_plans(profile, cluster, options, "dp")
            singles.append(_fastest(dp_plans))
        except InfeasiblePlanError as exc:
            failed = exc
    try:
        sched = solve_schedule(profile, cluster, options, dp_plans=dp_plans, final_gap=final_gap)
    except InfeasiblePlanError:
        if singles:
            return singles[0]
        if failed is not None:  # the DP's reason names the least memory a partition needs
            raise failed from None
        raise
    # a one-chunk family's plan is the DP's own (exact under the closed form, with contention)
    best = _fastest([*singles] if singles and sched.schedule in ONE_CHUNK else [sched, *singles])
    if best is sched:
        return sched
    T = _simulated(best)
    bound = sched.lower_bound_s or 0.0
    optimal = sched.status == "optimal" and T <= sched.step_time_s * (1 + 1e-9)
    return best.model_copy(
        update={
            "status": "optimal" if optimal else "feasible",
            "gap": None if optimal else (max(0.0, (T - bound) / T) if T > 0 else 0.0),
            "lower_bound_s": bound,
            "solve_time_s": (best.solve_time_s or 0.0) + (sched.solve_time_s or 0.0),
            "weighed": sched.weighed,
        }
    )
