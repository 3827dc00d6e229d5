"""Decisions fn takes on tensor values are re-checked at every call: same path or a loud error."""

from __future__ import annotations

import pytest
import torch

from torch_precompile import PrecompileError, precompile

from conftest import assert_same

# The inductor twin of each test here is kept: Inductor's lowering is part of what it checks.
pytestmark = pytest.mark.lowering


def branchy(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    y = x * 2 if bool((x > 0).all()) else x * 3
    return y[keep].sum(0)


@pytest.fixture
def run_branchy(backend: str):
    x = torch.rand(4, 3) + 0.1
    keep = torch.tensor([True, False, True, True])
    code, cache = precompile(branchy, x, keep, backend=backend)
    return precompile.load(code, cache), code, x, keep


def test_same_path_runs(run_branchy) -> None:
    run = run_branchy[0]
    other = torch.rand(4, 3) + 0.5
    shuffled = torch.tensor([False, True, True, True])
    assert_same(run(other, shuffled), branchy(other, shuffled))


def test_other_branch_is_refused_with_its_location(run_branchy) -> None:
    run, _, x, keep = run_branchy
    with pytest.raises(
        PrecompileError,
        match=r"left the path.*value read into Python.*"
        r"test_guards.py:\d+ \(branchy\) was True at capture and is False now",
    ):
        run(-x, keep)


def test_other_mask_count_is_refused(run_branchy) -> None:
    run, _, x, _ = run_branchy
    with pytest.raises(PrecompileError, match="number of True entries of a boolean index"):
        run(x, torch.tensor([True, False, False, True]))


def test_guards_are_in_the_spec(run_branchy) -> None:
    code = run_branchy[1]
    guards = [(g.description, g.expected) for g in precompile.inspect(code).value_guards]
    assert [expected for _, expected in guards] == [("const", True), ("const", 3)]


def test_unguardable_value_dependent_size_is_refused(backend: str) -> None:
    with pytest.raises(
        PrecompileError,
        match=r"aten\._unique2.*output size depends on tensor "
        "values",
    ):
        precompile(lambda x: torch.unique(x).sum(), torch.tensor([1, 2, 2]), backend=backend)
