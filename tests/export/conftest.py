"""Fixtures of the export tests: profiles of real models, and a plan file of named units."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path

import pytest
from _cached import once_per_session
from _export_rules import (
    GPT_NAMES,
    MODELS,
    named_profile,
    plan_of,
)

from pipeplan.planner.io import write_json
from pipeplan.planner.types import Profile
from pipeplan.profiler import profile_model


@pytest.fixture(scope="session")
def real(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Path, Profile]]:
    """Profiles of the bundled and zoo models, each made on first use (once for every export
    test module, on whichever xdist worker asks first: :mod:`_cached`)."""
    cache: dict[str, tuple[Path, Profile]] = {}

    def build(name: str, root: Path) -> tuple[Path, Profile]:
        model, kwargs, max_stages, _ = MODELS[name]
        prof = profile_model(
            model,
            batch_size=4,
            model_kwargs=kwargs,
            microbatch_sizes=[2],
            warmup=0,
            repeats=1,
            progress=False,
            max_stages=max_stages,
        )
        path = root / f"{name}.profile.json"
        write_json(path, prof)
        return path, prof

    def get(name: str) -> tuple[Path, Profile]:
        if name not in cache:  # profiled once per session, whichever worker asks first
            cache[name] = once_per_session(
                tmp_path_factory, f"export_profile_{name}", partial(build, name)
            )
        return cache[name]

    return get


@pytest.fixture
def plan_file(tmp_path: Path) -> Path:
    path = tmp_path / "plan.json"
    write_json(path, plan_of(named_profile(GPT_NAMES), [0, 5]))
    return path


@pytest.fixture(scope="session")
def llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Profile]:
    """A refined profile of the zoo's 4-layer Llama (units inside the layers), made once per
    session (:mod:`_cached`)."""

    def build(root: Path) -> tuple[Path, Profile]:
        prof = profile_model(
            "pipeplan.models.zoo:llama",
            batch_size=8,
            model_kwargs={"n_layers": 4, "d_model": 32, "seq_len": 8},
            microbatch_sizes=[2, 4],
            warmup=0,
            repeats=1,
            progress=False,
            max_stages=8,
        )
        path = root / "llama.profile.json"
        write_json(path, prof)
        return path, prof

    return once_per_session(tmp_path_factory, "export_llama", build)
