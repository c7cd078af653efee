"""Plan and profile files: atomic, deterministic, validated with the bad field named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeplan.planner.errors import FileFormatError, InvalidRequestError
from pipeplan.planner.io import (
    dumps,
    load_any,
    load_plan,
    load_profile,
    parse_bytes,
    parse_rate,
    write_json,
)
from pipeplan.planner.types import Cluster, Plan, Profile
from pipeplan.profiler.synthetic import synthetic_profile
from pipeplan.solvers.dp import solve_dp


@pytest.fixture
def profile() -> Profile:
    return synthetic_profile(6, batch_size=8, seed=2)


def test_round_trip(tmp_path: Path, profile: Profile) -> None:
    write_json(tmp_path / "p.json", profile)
    assert load_profile(tmp_path / "p.json") == profile
    plan = solve_dp(profile, Cluster.homogeneous(2, 2**30))
    write_json(tmp_path / "plan.json", plan)
    assert load_plan(tmp_path / "plan.json") == plan
    assert isinstance(load_any(tmp_path / "plan.json"), Plan)
    assert list(plan.to_frame()["stage"]) == [0, 1]
    assert len(profile.to_frame()) == 6 * len(profile.microbatch_sizes)


def test_deterministic_bytes(profile: Profile) -> None:
    a = solve_dp(profile, Cluster.homogeneous(2, 2**30)).model_copy(update={"solve_time_s": None})
    b = solve_dp(profile, Cluster.homogeneous(2, 2**30)).model_copy(update={"solve_time_s": None})
    assert dumps(a) == dumps(b)


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d.update(schema="pipeplan.profile/0"), "expected 'pipeplan.profile/1'"),
        (lambda d: d.update(batch_size=-1), "field batch_size"),
        (lambda d: d["units"][0].update(param_bytes="x"), "field units.0.param_bytes"),
        (lambda d: d.pop("units"), "field units"),
        (lambda d: d.update(microbatch_sizes=[3]), "does not divide"),
    ],
)
def test_bad_profile_fields(tmp_path: Path, profile: Profile, mutate, message: str) -> None:
    data = json.loads(dumps(profile))
    mutate(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(FileFormatError, match=message):
        load_profile(path)


def test_corrupt_and_missing(tmp_path: Path) -> None:
    (tmp_path / "c.json").write_text('{"schema": "pipeplan.plan/1", ')
    with pytest.raises(FileFormatError, match="not valid JSON"):
        load_plan(tmp_path / "c.json")
    with pytest.raises(FileFormatError, match="no such file"):
        load_plan(tmp_path / "missing.json")


def test_atomic_write_leaves_no_partial_file(tmp_path: Path, profile: Profile, monkeypatch) -> None:
    target = tmp_path / "p.json"
    from pipeplan.planner import io

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(io.os, "fsync", boom)
    with pytest.raises(OSError):
        write_json(target, profile)
    assert list(tmp_path.iterdir()) == []


def test_sizes() -> None:
    assert parse_bytes("16GiB") == 16 * 2**30
    assert parse_bytes("512MB") == 512 * 10**6
    assert parse_bytes("1e9") == 10**9
    assert parse_rate("10GB/s") == 1e10
    assert parse_rate("8Gbit/s") == 1e9
    for bad, says in (
        ("-5GiB", "must be positive"),
        ("0", "must be positive"),
        ("lots", "is not a size"),
        ("5XB", "is not a size"),
    ):
        with pytest.raises(InvalidRequestError, match=says):
            parse_bytes(bad)


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_written_files_get_the_mode_open_would_give(
    tmp_path: Path, profile: Profile, umask: int
) -> None:
    """Atomic writes go through mkstemp (mode 0600); the file they leave has 0666 less the
    umask, as a plain open would give it."""
    import os
    import stat

    old = os.umask(umask)
    try:
        write_json(tmp_path / "p.json", profile)
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "p.json").stat().st_mode) == 0o666 & ~umask
