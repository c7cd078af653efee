"""The model spec's helpers (:mod:`pipeplan.intake.spec`): casting a model to the profile's or
run's dtype leaves complex and integer tensors alone (torchtitan's Llama keeps its RoPE table
``freqs_cis`` in complex64; ``module.to(dtype=...)`` drops its imaginary part)."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from pipeplan.intake.spec import cast_floating


class _Rotary(nn.Module):
    """A linear layer followed by a rotation of each pair of features by a complex table."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        angles = torch.arange(4, dtype=torch.float32) * 0.7
        self.register_buffer("freqs_cis", torch.polar(torch.ones(4), angles), persistent=False)
        self.register_buffer("count", torch.tensor(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        z = torch.view_as_complex(h.reshape(*h.shape[:-1], 4, 2).contiguous()) * self.freqs_cis
        return torch.view_as_real(z).flatten(-2) * self.count


def test_only_floating_point_tensors_take_the_dtype() -> None:
    torch.manual_seed(0)
    model = _Rotary()
    table, count = model.freqs_cis.clone(), model.count.clone()
    reference = copy.deepcopy(model)  # the uncast model's math at float64, written out
    reference.proj.double()
    reference.freqs_cis = reference.freqs_cis.to(torch.complex128)
    assert cast_floating(model, torch.float64) is model
    assert model.proj.weight.dtype == torch.float64
    assert model.freqs_cis.dtype == torch.complex64 and torch.equal(model.freqs_cis, table)
    assert model.count.dtype == torch.int64 and torch.equal(model.count, count)
    x = torch.randn(3, 8, dtype=torch.float64)
    torch.testing.assert_close(model(x), reference(x), rtol=1e-7, atol=1e-7)
    # what module.to(dtype=...) did: the table's imaginary part is gone, the forward differs
    dropped = copy.deepcopy(model)
    dropped.freqs_cis = dropped.freqs_cis.real.to(torch.complex64)
    assert not torch.allclose(dropped(x), reference(x))
    with pytest.warns(UserWarning, match="discards the imaginary part"):
        assert copy.deepcopy(model).to(dtype=torch.float64).freqs_cis.dtype == torch.float64


def test_a_torchtitan_llama_keeps_its_loss() -> None:
    """torchtitan's Llama 3 keeps its RoPE table in complex64: ``module.to`` moved its loss
    (8.176558 -> 8.176278 on 2026-11-27), ``cast_floating`` does not."""
    pytest.importorskip("torchtitan")
    run = subprocess.run(
        [sys.executable, str(Path(__file__).parent / "_titan_llama.py")],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["buffers"] == ["torch.complex64"]
    assert got["cast_floating"] == got["uncast"] != got["to"]
