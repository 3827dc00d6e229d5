"""Artifacts compute what eager computes: outputs, gradients, buffers, effects."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.utils._pytree as pytree

from torch_precompile import PrecompileError, precompile

from conftest import assert_same, model_state, modules_in, run_eager_and_compiled
from workloads import WORKLOADS, mse_step

# The inductor twin of each test here is kept: Inductor's lowering is part of what it checks.
pytestmark = pytest.mark.lowering

DETERMINISTIC = [
    "mlp_infer",
    "mlp_train",
    "tied",
    "two_models",
    "frozen",
    "pytree",
    "literals",
    "mask",
    "mutate",
]


def _inputs_from_seed(name: str, seed: int) -> list[Any]:
    """The workload's runtime inputs (not its models) drawn from another seed: same shapes
    and Python values as the example, other tensor values."""
    torch.manual_seed(seed)
    return [a for a in WORKLOADS[name].make_args() if not isinstance(a, torch.nn.Module)]


def _with_inputs(args: tuple[Any, ...], inputs: list[Any]) -> tuple[Any, ...]:
    fresh = iter(copy.deepcopy(inputs))
    return tuple(a if isinstance(a, torch.nn.Module) else next(fresh) for a in args)


def _same_tensors(a: Any, b: Any) -> bool:
    pairs = zip(pytree.tree_leaves(a), pytree.tree_leaves(b), strict=True)
    return all(torch.equal(x, y) for x, y in pairs if isinstance(x, torch.Tensor))


@pytest.mark.parametrize("name", DETERMINISTIC)
def test_matches_eager_over_two_calls(name: str, backend: str, artifacts) -> None:
    """The example's inputs, then inputs from two other seeds, on the same models: results,
    .grad (accumulated across the calls), buffers and mutated inputs all match eager's."""
    run = artifacts.load(name, backend)
    workload = WORKLOADS[name]
    eager_args, compiled_args = workload.args(), workload.args()
    example = _inputs_from_seed(name, 0)
    for seed in (0, 1, 2):
        inputs = _inputs_from_seed(name, seed)
        if seed:  # a graph that baked the example's values would still pass without this
            assert not _same_tensors(inputs, example), "seed gave the example's inputs again"
        eager_call, compiled_call = (
            _with_inputs(eager_args, inputs),
            _with_inputs(compiled_args, inputs),
        )
        assert_same(run(*compiled_call), workload.fn(*eager_call))
        assert_same(
            [a for a in compiled_call if not isinstance(a, torch.nn.Module)],
            [a for a in eager_call if not isinstance(a, torch.nn.Module)],
        )
        assert_same(model_state(*modules_in(compiled_args)), model_state(*modules_in(eager_args)))


def test_training_loop_with_optimizer(backend: str, artifacts) -> None:
    run = artifacts.load("mlp_train", backend)
    workload = WORKLOADS["mlp_train"]
    model, x, t = workload.args()
    eager_model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    eager_opt = torch.optim.SGD(eager_model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(3):
        opt.zero_grad()
        eager_opt.zero_grad()
        loss = run(model, x, t)
        eager_loss = mse_step(eager_model, x, t)
        opt.step()
        eager_opt.step()
        assert_same(loss, eager_loss)
    assert_same(model_state(model), model_state(eager_model))


def test_batchnorm_statistics_land_on_runtime_model(backend: str, artifacts) -> None:
    run = artifacts.load("mlp_train", backend)
    workload = WORKLOADS["mlp_train"]
    model, x, t = workload.args()
    reference = copy.deepcopy(model)
    before = model.bn.running_mean.clone()
    for _ in range(2):
        run(model, x, t)
        workload.fn(reference, x, t)
    assert not torch.equal(model.bn.running_mean, before)
    for name, buffer in reference.named_buffers():  # the same update eager makes, twice
        torch.testing.assert_close(dict(model.named_buffers())[name], buffer, rtol=1e-5, atol=1e-6)
    assert model.bn.num_batches_tracked.item() == 2


def test_tied_weights_are_one_input_with_one_gradient(backend: str, artifacts) -> None:
    code, _ = artifacts.pair("tied", backend)
    spec = precompile.inspect(code)
    names = [t.name for t in spec.parameters]
    assert names.count("embed.weight") == 1
    assert "head.weight" not in names
    assert {t.name: t.tied_to for t in spec.model if t.tied_to} == {"head.weight": "embed.weight"}
    run = artifacts.load("tied", backend)
    _, _, eager_args, compiled_args = run_eager_and_compiled("tied", run)
    ours, eager = compiled_args[0], eager_args[0]
    assert ours.head.weight is ours.embed.weight  # still one parameter, so one .grad
    torch.testing.assert_close(ours.embed.weight.grad, eager.embed.weight.grad)
    # That one gradient is the sum of both uses' (the embedding's and the head's), as eager's.
    untied = copy.deepcopy(eager)
    untied.zero_grad()
    untied.head.weight = torch.nn.Parameter(untied.embed.weight.detach().clone())
    WORKLOADS["tied"].fn(untied, eager_args[1])
    assert untied.head.weight.grad.abs().sum() > 0 and untied.embed.weight.grad.abs().sum() > 0
    torch.testing.assert_close(
        ours.embed.weight.grad, untied.embed.weight.grad + untied.head.weight.grad
    )


def test_several_models_get_qualified_names(backend: str, artifacts) -> None:
    spec = precompile.inspect(artifacts.pair("two_models", backend)[0])
    assert [i for i, a in enumerate(spec.args) if a.is_model] == [0, 2]
    assert [t.name for t in spec.parameters] == [
        "m0.proj.weight",
        "m0.proj.bias",
        "m1.out.weight",
        "m1.out.bias",
    ]
    assert [t.name for t in spec.buffers] == ["m1.scale"]


def test_refusals_name_the_model_argument_by_its_name(backend: str, artifacts) -> None:
    run = artifacts.load("two_models", backend)
    encoder, x, head = WORKLOADS["two_models"].args()
    head.eval()
    with pytest.raises(PrecompileError, match=r"^model argument head is in eval mode"):
        run(encoder, x, head)
    head.train()
    head.out.register_forward_hook(lambda *_: None)
    with pytest.raises(PrecompileError, match=r"^module 'out' of model argument head has hooks"):
        run(encoder, x, head)
    encoder, x, head = WORKLOADS["two_models"].args()
    head.double()
    with pytest.raises(PrecompileError, match=r"^parameter 'out.weight' of model argument head:"):
        run(encoder, x, head)


def test_frozen_and_unused_parameters_keep_no_grad(backend: str, artifacts) -> None:
    spec = precompile.inspect(artifacts.pair("frozen", backend)[0])
    assert [t.name for t in spec.model if t.gets_grad] == ["fc2.weight", "fc2.bias"]
    model, x, t = WORKLOADS["frozen"].args()
    artifacts.load("frozen", backend)(model, x, t)
    assert model.fc1.weight.grad is None and model.unused.grad is None
    assert model.fc2.weight.grad is not None


def test_bare_backward_step_returns_none(backend: str) -> None:
    model, x, t = WORKLOADS["mlp_train"].args()

    def step(m, x, t):
        torch.nn.functional.mse_loss(m(x), t).backward()

    run = precompile.load(*precompile(step, model, x, t, backend=backend))
    eager_model = copy.deepcopy(model)
    assert run(model, x, t) is None
    step(eager_model, x, t)
    assert_same(model_state(model), model_state(eager_model))


def test_input_mutation_and_aliasing_outputs(backend: str, artifacts) -> None:
    run = artifacts.load("mutate", backend)
    model, x = WORKLOADS["mutate"].args()
    original = x.clone()
    y, x_out, row = run(model, x)
    torch.testing.assert_close(x, original * 2)
    assert x_out.data_ptr() == x.data_ptr()
    assert row.data_ptr() == x.data_ptr()
    torch.testing.assert_close(y, model(original * 2).detach())


def test_dropout_statistics_match_eager(backend: str, artifacts) -> None:
    run = artifacts.load("dropout", backend)
    model, x = WORKLOADS["dropout"].args()
    outs = [run(model, x) for _ in range(4)]
    dropped = torch.stack([(o == 0).float().mean() for o in outs])
    assert ((dropped - 0.5).abs() < 0.05).all(), dropped
    assert not torch.equal(outs[0], outs[1]), "dropout masks must differ between calls"
    kept = outs[0] != 0
    torch.testing.assert_close(outs[0][kept], (model.fc(x) * 2)[kept].detach())


def test_dropout_eager_backend_reproduces_eager_draws() -> None:
    model, x = WORKLOADS["dropout"].args()
    run = precompile.load(*precompile(WORKLOADS["dropout"].fn, model, x, backend="eager"))
    torch.manual_seed(7)
    compiled = run(model, x)
    torch.manual_seed(7)
    torch.testing.assert_close(compiled, model(x).detach())


def test_python_values_and_none_results(backend: str, artifacts) -> None:
    run = artifacts.load("pytree", backend)
    model, batch = WORKLOADS["pytree"].args()
    out = run(model, batch)
    assert out["none"] is None and out["parts"][1] == ["tag", 3]


def test_constant_results_next_to_tensors(backend: str) -> None:
    model, x = WORKLOADS["mlp_infer"].args()

    def fn(m, x):
        return m(x).relu(), 2.5, float("inf"), float("nan"), "label", 7, True, None

    out = precompile.load(*precompile(fn, model, x, backend=backend))(model, x)
    assert out[1:3] == (2.5, float("inf")) and out[3] != out[3]
    assert out[4:] == ("label", 7, True, None)
    assert_same(out[0], model(x).relu())


def test_nothing_to_compile(backend: str) -> None:
    x = torch.randn(3)
    if backend == "inductor":
        with pytest.raises(PrecompileError, match="nothing to compile.*backend='eager'"):
            precompile(lambda x: (x, 3), x, backend=backend)
    else:
        run = precompile.load(*precompile(lambda x: (x, 3), x, backend=backend))
        out = run(x)
        assert out[0] is x and out[1] == 3
