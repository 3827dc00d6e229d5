"""Every call is checked: arity, input structure, inputs, then models. Each failure names the
argument, what was expected and what was given."""

from __future__ import annotations

import copy
import re
from typing import Any

import pytest
import torch
from torch import nn

from torch_precompile import PrecompileError, precompile

from conftest import assert_same, model_state
from workloads import MLP, WORKLOADS, Encoder, Head, TiedLM


@pytest.fixture
def mlp(backend: str, artifacts):
    model, x, t = WORKLOADS["mlp_train"].args()
    return artifacts.load("mlp_train", backend), model, x, t


def test_arity(mlp) -> None:
    run, model, x, t = mlp
    with pytest.raises(
        PrecompileError,
        match=r"expected 3 positional arguments \(m \(model\), "
        r"x \(input\), t \(input\)\), got 2",
    ):
        run(model, x)
    with pytest.raises(PrecompileError, match="got 4"):
        run(model, x, t, t)
    with pytest.raises(PrecompileError, match=r"keyword arguments \['t'\]"):
        run(model, x, t=t)


def test_input_shape_dtype_device(mlp) -> None:
    run, model, x, t = mlp
    with pytest.raises(PrecompileError, match=r"input x: expected shape \(5, 4\), got \(6, 4\)"):
        run(model, torch.randn(6, 4), t)
    with pytest.raises(
        PrecompileError, match="input t: expected dtype torch.float32, got torch.float64"
    ):
        run(model, x, t.double())
    with pytest.raises(PrecompileError, match="input x: expected device cpu, got meta"):
        run(model, x.to("meta"), t)
    with pytest.raises(
        PrecompileError,
        match=r"input x: expected a tensor of shape \(5, 4\), "
        "got str",
    ):
        run(model, "x", t)


def test_a_wrong_shape_names_the_ways_to_serve_it(mlp) -> None:
    """The refusal of another shape says how one artifact can serve it: the dims that differ
    marked dynamic on the example, or a variant per shape."""
    run, model, _, t = mlp
    ways = (
        "Shapes are specialized to the example: precompile again for this shape, mark {} "
        "dynamic on the example with torch._dynamo.decorators.mark_unbacked before "
        "precompiling, or capture each shape as a variant of one artifact (capture())."
    )
    with pytest.raises(PrecompileError, match=re.escape(ways.format("dim 0"))):
        run(model, torch.randn(6, 4), t)
    with pytest.raises(PrecompileError, match=re.escape(ways.format("dims 0, 1"))):
        run(model, torch.randn(6, 5), t)
    with pytest.raises(PrecompileError, match=re.escape(ways.format("the dims"))):
        run(model, torch.randn(5, 4, 1), t)


def test_input_structure(backend: str, artifacts) -> None:
    run = artifacts.load("pytree", backend)
    model, batch = WORKLOADS["pytree"].args()
    wrong = dict(batch)
    del wrong["scale"]
    with pytest.raises(
        PrecompileError,
        match=r"different structure.*expected \(\{'x': "
        r"Tensor\(5, 4\), 'scale': 2\.0",
    ):
        run(model, wrong)
    with pytest.raises(
        PrecompileError,
        match=r"input batch\['scale'\]: expected the value "
        r"2\.0, got 3\.0",
    ):
        run(model, {**batch, "scale": 3.0})
    with pytest.raises(
        PrecompileError,
        match=r"input batch\['extras'\]\[1\]\[1\]: expected "
        r"the value 'tag', got 'other'",
    ):
        run(model, {**batch, "extras": [batch["extras"][0], (batch["extras"][1][0], "other")]})
    with pytest.raises(
        PrecompileError,
        match=r"input batch\['scale'\]: expected the value 2\.0, "
        "got 2",
    ):
        run(model, {**batch, "scale": 2})


def test_non_module_at_model_position(mlp) -> None:
    run, model, x, t = mlp
    with pytest.raises(
        PrecompileError, match="argument m was a torch.nn.Module at capture; got OrderedDict"
    ):
        run(model.state_dict(), x, t)


def test_model_with_other_structure(mlp) -> None:
    run, model, x, t = mlp
    bigger = MLP(hidden=9)
    with pytest.raises(
        PrecompileError,
        match=r"parameter 'fc1.weight': expected shape \(8, 4\)"
        r".*got shape \(9, 4\)",
    ):
        run(bigger, x, t)
    renamed = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 3))
    with pytest.raises(
        PrecompileError,
        match="^model argument m does not match the captured "
        "model: where the captured model m has parameter 'fc1.weight', the runtime "
        "model has parameter '0.weight'. Pass",
    ):
        run(renamed, x, t)
    extra = copy.deepcopy(model)
    extra.fc2.register_buffer("extra", torch.zeros(1))
    with pytest.raises(
        PrecompileError,
        match="model argument m does not match the captured "
        "model: it has buffer 'fc2.extra' beyond the captured model's parameters "
        "and buffers",
    ):
        run(extra, x, t)
    missing = copy.deepcopy(model)
    missing.bn.register_buffer("num_batches_tracked", None)
    with pytest.raises(PrecompileError, match="lacks buffer 'bn.num_batches_tracked'"):
        run(missing, x, t)


def test_model_dtype_and_device(mlp) -> None:
    run, model, x, t = mlp
    with pytest.raises(
        PrecompileError,
        match="parameter 'fc1.weight'.*dtype torch.float32.*got .*dtype torch.float64",
    ):
        run(copy.deepcopy(model).double(), x, t)
    with pytest.raises(
        PrecompileError, match="parameter 'fc1.weight'.*device cpu.*got .*device meta"
    ):
        run(copy.deepcopy(model).to("meta"), x, t)


def test_weight_tying_must_match(backend: str, artifacts) -> None:
    run = artifacts.load("tied", backend)
    model, ids = WORKLOADS["tied"].args()
    untied = copy.deepcopy(model)
    untied.head.weight = nn.Parameter(untied.embed.weight.detach().clone())
    with pytest.raises(
        PrecompileError, match="'head.weight' was tied to 'embed.weight' at capture"
    ):
        run(untied, ids)
    mlp_run = artifacts.load("mlp_infer", backend)
    mlp_model, x = WORKLOADS["mlp_infer"].args()
    tied = copy.deepcopy(mlp_model)
    tied.fc1.bias = tied.bn.weight
    with pytest.raises(PrecompileError, match="'bn.weight' is tied to 'fc1.bias' at runtime"):
        mlp_run(tied, x)


def _bitwise_state(*modules: nn.Module) -> dict[str, Any]:
    """Every parameter, .grad and buffer of ``modules`` as raw bytes (None for no .grad)."""
    return {
        name: None if value is None else value.reshape(-1).view(torch.uint8).tolist()
        for name, value in model_state(*modules).items()
    }


def test_swapped_models(backend: str, artifacts) -> None:
    """Models passed in each other's positions are refused with the first parameter that
    differs, what was expected and what was given; the call touches neither model nor the
    input; the right call then computes what eager computes."""
    run = artifacts.load("two_models", backend)
    encoder, x, head = WORKLOADS["two_models"].args()
    wrong_first, wrong_last = Head(), Encoder()
    before, x_before = _bitwise_state(wrong_first, wrong_last), x.clone()
    with pytest.raises(
        PrecompileError,
        match="^"
        + re.escape(
            "model argument encoder does not match the captured model: where the captured "
            "model encoder has parameter 'proj.weight', the runtime model has parameter "
            "'out.weight'. Pass a model with the same parameters and buffers, in the same "
            "order."
        )
        + "$",
    ):
        run(wrong_first, x, wrong_last)
    assert _bitwise_state(wrong_first, wrong_last) == before
    assert torch.equal(x, x_before)
    eager_encoder, eager_head = copy.deepcopy(encoder), copy.deepcopy(head)
    assert_same(run(encoder, x, head), WORKLOADS["two_models"].fn(eager_encoder, x, eager_head))
    assert_same(model_state(encoder, head), model_state(eager_encoder, eager_head))


def test_new_weights_same_structure_are_accepted(backend: str, artifacts) -> None:
    run = artifacts.load("tied", backend)
    _, ids = WORKLOADS["tied"].args()
    torch.manual_seed(123)
    other = TiedLM()
    loss = run(other, ids)
    expected = WORKLOADS["tied"].fn(copy.deepcopy(other), ids)
    torch.testing.assert_close(loss, expected)


def test_checks_run_in_order(mlp) -> None:
    """A call wrong in every way reports the first rule: arity, structure, inputs, model."""
    run, _, x, t = mlp
    bad_model = MLP(hidden=9)
    with pytest.raises(PrecompileError, match="positional arguments"):
        run(bad_model, [x], t, t)
    with pytest.raises(PrecompileError, match="different structure"):
        run(bad_model, [x], t.double())
    with pytest.raises(PrecompileError, match="input t"):
        run(bad_model, x, t.double())
    with pytest.raises(PrecompileError, match="fc1.weight"):
        run(bad_model, x, t)


def test_model_changes_between_calls_are_seen(backend: str, artifacts) -> None:
    """The driver remembers a model's tensors between calls; every change must still count."""
    run = artifacts.load("mlp_infer", backend)
    model, x = WORKLOADS["mlp_infer"].args()
    torch.testing.assert_close(run(model, x), model(x).detach())
    model.fc2.weight = nn.Parameter(torch.zeros_like(model.fc2.weight))
    torch.testing.assert_close(run(model, x), model(x).detach())
    model.fc2.bias.data = torch.ones(3)
    torch.testing.assert_close(run(model, x), model(x).detach())
    original = model.fc1.weight.data
    model.fc1.weight.data = torch.randn(9, 4)
    with pytest.raises(PrecompileError, match=r"'fc1.weight': expected shape \(8, 4\)"):
        run(model, x)
    model.fc1.weight.data = original
    model.fc2 = nn.Linear(8, 4)
    with pytest.raises(PrecompileError, match=r"'fc2.weight': expected shape \(3, 8\)"):
        run(model, x)
    model.fc2 = nn.Linear(8, 3).eval()
    model.fc2.register_buffer("late", torch.zeros(1))
    with pytest.raises(PrecompileError, match="it has buffer 'fc2.late' beyond"):
        run(model, x)
    del model.fc2.late
    torch.testing.assert_close(run(model, x), model(x).detach())
    model.extra = nn.Identity().eval()  # a module with no tensors still changes the structure
    with pytest.raises(PrecompileError, match="submodules differ.*new: 'extra'"):
        run(model, x)
    del model.extra
    torch.testing.assert_close(run(model, x), model(x).detach())
    bias = model.fc2.bias
    del model.fc2.bias  # a member removed from a remembered model
    with pytest.raises(PrecompileError, match="'fc2.bias'"):
        run(model, x)
    model.fc2.bias = bias
    torch.testing.assert_close(run(model, x), model(x).detach())
    model.fc2.weight = model.fc1.weight  # re-tied: now one tensor under two names
    with pytest.raises(PrecompileError, match="'fc2.weight' is tied to 'fc1.weight' at runtime"):
        run(model, x)


def test_module_mode_is_part_of_the_contract(backend: str, artifacts) -> None:
    run = artifacts.load("mlp_infer", backend)  # captured in eval mode
    model, x = WORKLOADS["mlp_infer"].args()
    assert not model.training
    torch.testing.assert_close(run(model, x), model(x).detach())
    model.train()
    with pytest.raises(
        PrecompileError,
        match="the model is in training mode, but was captured "
        r"in eval mode.*Call \.eval\(\)",
    ):
        run(model, x)
    model.eval()
    model.fc1.train()
    with pytest.raises(PrecompileError, match="module 'fc1' is in training mode"):
        run(model, x)
    model.fc1.eval()
    torch.testing.assert_close(run(model, x), model(x).detach())
    model.fc2.training = True  # set directly, not by .train()
    with pytest.raises(PrecompileError, match="module 'fc2' is in training mode"):
        run(model, x)
    model.fc2.training = False
    train_run = artifacts.load("mlp_train", backend)  # captured in training mode
    trained, tx, tt = WORKLOADS["mlp_train"].args()
    trained.eval()
    with pytest.raises(
        PrecompileError,
        match=r"in eval mode, but was captured in training "
        r"mode.*Call \.train\(\)",
    ):
        train_run(trained, tx, tt)


def test_requires_grad_is_fixed_at_capture_for_a_training_step(backend: str, artifacts) -> None:
    run = artifacts.load("mlp_train", backend)
    model, x, t = WORKLOADS["mlp_train"].args()
    run(model, x, t)
    model.fc2.bias.requires_grad_(False)
    with pytest.raises(
        PrecompileError,
        match=r"model parameter 'fc2.bias' has "
        "requires_grad=False, but was captured with requires_grad=True",
    ):
        run(model, x, t)
    model.fc2.bias.requires_grad_(True)
    with pytest.raises(PrecompileError, match="input x has requires_grad=True"):
        run(model, x.clone().requires_grad_(), t)
    frozen_run = artifacts.load("frozen", backend)
    frozen, fx, ft = WORKLOADS["frozen"].args()
    frozen.fc1.weight.requires_grad_(True)
    with pytest.raises(PrecompileError, match="'fc1.weight' has requires_grad=True"):
        frozen_run(frozen, fx, ft)


def test_frozen_parameters_run_as_inference(backend: str, artifacts) -> None:
    run = artifacts.load("mlp_infer", backend)
    model, x = WORKLOADS["mlp_infer"].args()
    model.requires_grad_(False)
    result = run(model, x)
    assert result.grad_fn is None
    torch.testing.assert_close(result, model(x))
    # An input that requires grad where the capture's did not: the result carries its
    # history, as eager's does, and the backward gives eager's gradient.
    ours, theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    result = run(model, ours)
    assert result.grad_fn is not None
    result.pow(2).sum().backward()
    model(theirs).pow(2).sum().backward()
    torch.testing.assert_close(ours.grad, theirs.grad)
    assert all(p.grad is None for p in model.parameters())
    with torch.no_grad():
        torch.testing.assert_close(run(model, x), model(x))


def divided(m: nn.Module, x: torch.Tensor, s: float) -> torch.Tensor:
    return m(x) / s  # 1 / 0.0 is inf, 1 / -0.0 is -inf


@pytest.mark.parametrize(("captured", "other"), [(0.0, -0.0), (-0.0, 0.0)])
def test_a_float_input_is_compared_with_its_sign(captured: float, other: float) -> None:
    """A float value input of 0.0 is not -0.0 (nor the reverse): the graph baked the sign.
    Before: compared with ==, a call with the other zero returned the captured zero's result
    (inf where eager gives -inf) with no error."""
    model, x = nn.Linear(4, 4), torch.randn(5, 4)
    run = precompile.load(*precompile(divided, model, x, captured, backend="eager"))
    with torch.no_grad():
        torch.testing.assert_close(run(model, x, captured), divided(model, x, captured))
    with pytest.raises(
        PrecompileError,
        match=rf"input s: expected the value {re.escape(repr(captured))}, got "
        rf"{re.escape(repr(other))}\.",
    ):
        run(model, x, other)


@pytest.mark.lowering
def test_negative_and_conjugate_views_are_refused_by_compiled_kernels(
    backend: str, artifacts
) -> None:
    """A negative view (``x.conj().imag`` makes one) keeps its memory as it was, with a bit
    that ATen's kernels honour. Before: the inductor artifact read the memory as it is and
    gave the negated input's result with no error. The eager backend runs ATen's kernels, so
    it agrees with eager; inductor refuses, also after a call that passed (the remembered
    path), and writes nothing."""
    run, model, x, t = artifacts.load("mlp_train", backend), *WORKLOADS["mlp_train"].args()
    negative = (-x)._neg_view()  # the same values as x, held negated
    assert negative.is_neg() and torch.equal(negative, x)
    expected = WORKLOADS["mlp_train"].fn(copy.deepcopy(model), x, t)
    run(model, x, t)  # remembered
    before = model_state(model)
    if backend == "eager":
        assert_same(run(copy.deepcopy(model), negative, t), expected)
        return
    with pytest.raises(PrecompileError, match=r"input x is a negative view: .*\.resolve_neg\(\)"):
        run(model, negative, t)
    assert_same(model_state(model), before)
    assert_same(run(copy.deepcopy(model), negative.resolve_neg(), t), expected)
