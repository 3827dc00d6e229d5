"""Layouts: the inductor kernels assume the example's strides; the eager graph takes any."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from torch_precompile import PrecompileError, precompile

from conftest import assert_same
from workloads import WORKLOADS


def _transposed_copy(t: torch.Tensor) -> torch.Tensor:
    """Same shape and values, column-major strides."""
    return t.t().contiguous().t()


@pytest.mark.lowering
def test_input_in_another_layout(backend: str, artifacts) -> None:
    run = artifacts.load("mlp_train", backend)
    model, x, t = WORKLOADS["mlp_train"].args()
    eager_model = copy.deepcopy(model)
    before = model.bn.running_mean.clone()
    if backend == "inductor":
        with pytest.raises(
            PrecompileError,
            match=r"input x: the compiled kernels assume strides "
            r"\(4, 1\).*got \(1, 5\).*contiguous",
        ):
            run(model, _transposed_copy(x), t)
        assert torch.equal(model.bn.running_mean, before), "a kernel ran before the check"
        assert all(p.grad is None for p in model.parameters())
    else:
        assert_same(
            run(model, _transposed_copy(x), t), WORKLOADS["mlp_train"].fn(eager_model, x, t)
        )


def test_a_sparse_input_or_parameter_is_refused_by_its_layout(backend: str, artifacts) -> None:
    """Before (0.13.0): a sparse parameter reached the eager graph and failed there with
    torch's own error, and the inductor message spoke of strides (0, 0)."""
    run = artifacts.load("mlp_infer", backend)
    model, x = WORKLOADS["mlp_infer"].args()
    with pytest.raises(PrecompileError, match=r"input x: the graph reads a dense tensor, got a "):
        run(model, x.to_sparse())
    model.fc1.weight = nn.Parameter(model.fc1.weight.detach().to_sparse())
    with pytest.raises(PrecompileError, match=r"parameter 'fc1\.weight': the graph reads a dense"):
        run(model, x)


def test_a_nested_input_is_refused_by_its_layout(backend: str, artifacts) -> None:
    """Before (0.14.0): a nested tensor failed on its shape with torch's own error."""
    run = artifacts.load("mlp_infer", backend)
    model, x = WORKLOADS["mlp_infer"].args()
    nested = torch.nested.nested_tensor(list(x))
    with pytest.raises(PrecompileError, match=r"input x: .*got a nested one.*to_padded_tensor"):
        run(model, nested)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda x: torch.quantize_per_tensor(x, 0.1, 0, torch.qint8), r"a quantized tensor"),
        (lambda x: torch.nested.nested_tensor(list(x)), r"a nested tensor"),
        (lambda x: x.to_sparse(), r"a torch\.sparse_coo tensor"),
    ],
    ids=["quantized", "nested", "sparse"],
)
def test_an_unplain_example_input_is_refused_before_the_trace(make, match) -> None:
    """Before (0.14.0): quantized and nested inputs failed inside the trace with torch's own
    errors."""
    with pytest.raises(PrecompileError, match=rf"^input x is {match}.*plain dense tensors"):
        precompile(lambda m, x: m(x), nn.Linear(4, 4), make(torch.randn(2, 4)), backend="eager")


@pytest.mark.lowering
def test_parameter_in_another_layout(backend: str, artifacts) -> None:
    run = artifacts.load("mlp_infer", backend)
    model, x = WORKLOADS["mlp_infer"].args()
    expected = model(x)
    model.fc1.weight = nn.Parameter(_transposed_copy(model.fc1.weight.detach()))
    if backend == "inductor":
        with pytest.raises(
            PrecompileError,
            match="model parameter 'fc1.weight': the compiled kernels assume strides",
        ):
            run(model, x)
    else:
        assert_same(run(model, x), expected)


@pytest.mark.lowering
def test_channels_last_example_round_trips(backend: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU())
    x = torch.randn(2, 3, 6, 6).to(memory_format=torch.channels_last)
    run = precompile.load(*precompile(lambda m, x: m(x), model, x, backend=backend))
    assert_same(run(model, x), model(x))
    other = torch.randn(2, 3, 6, 6)
    if backend == "inductor":
        with pytest.raises(PrecompileError, match="assume strides"):
            run(model, other)
    else:
        assert_same(run(model, other), model(other))


def test_parameter_relaid_in_place_after_a_call(artifacts) -> None:
    """The driver's remembered check of a model it has seen still sees a changed layout: the
    kernels' own asserts of the inputs it checks are left out of the artifact."""
    code, _ = artifacts.pair("mlp_infer", "inductor")
    plain = code.split("\ndef graph_forward(")[0]  # the backward asserts what it is handed
    assert "assert_size_stride(arg" not in plain
    assert "assert_size_stride_grouped((arg" not in plain
    run = artifacts.load("mlp_infer", "inductor")
    model, x = WORKLOADS["mlp_infer"].args()
    run(model, x)
    model.fc1.weight.data = _transposed_copy(model.fc1.weight.detach())
    with pytest.raises(
        PrecompileError, match="model parameter 'fc1.weight': the compiled kernels assume strides"
    ):
        run(model, x)


def test_inputs_after_a_remembered_call_are_still_checked(artifacts) -> None:
    """A call whose inputs match the last ones that passed skips the checks in Python; any
    other input takes them all."""
    run = artifacts.load("mlp_infer", "inductor")
    model, x = WORKLOADS["mlp_infer"].args()
    run(model, x)
    run(model, x.clone())
    with pytest.raises(PrecompileError, match=r"input x: the compiled kernels assume strides"):
        run(model, _transposed_copy(x))
    with pytest.raises(PrecompileError, match="input x: expected dtype torch.float32"):
        run(model, x.double())
    with pytest.raises(PrecompileError, match=r"input x: expected shape \(5, 4\)"):
        run(model, x[:3])
    assert_same(run(model, x), WORKLOADS["mlp_infer"].fn(model, x))
