"""What capture enforces, and what it leaves untouched on the caller's side."""

from __future__ import annotations

import collections

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torch_precompile import PrecompileError, precompile

from conftest import assert_same
from workloads import MLP, WORKLOADS, infer, mse_step

GLOBAL_SHIFT = torch.ones(3)


def test_example_grads_keep_value_and_identity(backend: str) -> None:
    model, x, t = WORKLOADS["mlp_train"].args()
    mse_step(model, x, t)  # a warm-up step leaves .grad set
    before = {n: p.grad for n, p in model.named_parameters()}
    values = {n: g.clone() for n, g in before.items()}
    precompile(mse_step, model, x, t, backend=backend)
    for n, p in model.named_parameters():
        assert p.grad is before[n]
        torch.testing.assert_close(p.grad, values[n])


def test_example_grads_restored_when_fn_raises(backend: str) -> None:
    model, x, t = WORKLOADS["mlp_train"].args()
    model.fc1.weight.grad = marker = torch.full_like(model.fc1.weight, 7.0)

    def failing(m, x, t):
        F.mse_loss(m(x), t).backward()
        raise KeyError("boom")

    with pytest.raises(KeyError, match="boom"):
        precompile(failing, model, x, t, backend=backend)
    assert model.fc1.weight.grad is marker and bool((marker == 7).all())
    assert model.fc2.weight.grad is None


def test_capture_leaves_example_buffers_inputs_and_rng_alone(backend: str) -> None:
    model, x, t = WORKLOADS["mlp_train"].args()
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    x_before = x.clone()

    def step(m, x, t):
        x.add_(1)
        return F.dropout(m(x), 0.2).sum()

    torch.manual_seed(3)
    precompile(step, model, x, t, backend=backend)
    after_capture = torch.rand(1)
    torch.manual_seed(3)
    assert torch.equal(after_capture, torch.rand(1))
    assert torch.equal(x, x_before)
    for n, b in model.named_buffers():
        assert torch.equal(b, buffers[n]), n


def test_closed_over_tensor_is_rejected_with_its_origin(backend: str) -> None:
    model, x = WORKLOADS["mlp_infer"].args()
    with pytest.raises(
        PrecompileError,
        match=r"global 'GLOBAL_SHIFT'.*shape \(3,\), dtype "
        r"torch.float32",
    ):
        precompile(lambda m, x: m(x) + GLOBAL_SHIFT, model, x, backend=backend)
    local_shift = torch.ones(3)
    with pytest.raises(PrecompileError, match="variable 'local_shift' closed over by fn"):
        precompile(lambda m, x: m(x) + local_shift, model, x, backend=backend)


def test_unregistered_module_attribute_is_rejected(backend: str) -> None:
    model, x = WORKLOADS["mlp_infer"].args()
    model.fc2.offset = torch.zeros(3)  # a plain attribute, not a buffer
    with pytest.raises(
        PrecompileError,
        match=r"unregistered module attribute m\.fc2\.offset"
        r".*register_buffer",
    ):
        precompile(lambda m, x: m(x) + m.fc2.offset, model, x, backend=backend)


def test_a_tensor_read_forward_and_backward_is_named_once(backend: str) -> None:
    model, x, _ = WORKLOADS["mlp_train"].args()
    model.fc2.scale = torch.full((3,), 2.0)  # read by the forward and by the backward

    def step(m, x):
        m(x).mul(m.fc2.scale).pow(2).mean().backward()

    with pytest.raises(PrecompileError) as caught:
        precompile(step, model, x, backend=backend)
    assert str(caught.value).count("unregistered module attribute m.fc2.scale") == 1


def test_tensor_literals_are_embedded(backend: str, artifacts) -> None:
    code, _ = artifacts.pair("literals", backend)
    assert "torch.tensor([1.0, -2.0, inf]" in code
    assert "torch.tensor([], dtype=torch.float32" in code


def test_huge_literal_is_rejected(backend: str) -> None:
    model, x = WORKLOADS["mlp_infer"].args()
    values = [0.5] * 70000
    with pytest.raises(PrecompileError, match="70000 elements.*buffer"):
        precompile(lambda m, x: m(x).sum() + torch.tensor(values).sum(), model, x, backend=backend)


def test_buffer_gradient_is_rejected(backend: str) -> None:
    model, x = WORKLOADS["mlp_infer"].args()
    model.register_buffer("gain", torch.ones(3, requires_grad=True))
    with pytest.raises(PrecompileError, match="buffer 'gain' received a gradient"):
        precompile(lambda m, x: (m(x) * m.gain).sum().backward(), model, x, backend=backend)


def test_input_gradient_is_rejected(backend: str) -> None:
    model, x = WORKLOADS["mlp_infer"].args()
    x.requires_grad_(True)
    with pytest.raises(PrecompileError, match="input received a gradient"):
        precompile(lambda m, x: m(x).sum().backward(), model, x, backend=backend)


def test_control_flow_operator_is_rejected(backend: str) -> None:
    model, x = WORKLOADS["mlp_infer"].args()

    def branchy(m, x):
        return torch.cond(x.sum() > 0, lambda x: m(x), lambda x: m(-x), (x,))

    with pytest.raises(PrecompileError, match=r"torch\.cond"):
        precompile(branchy, model, x, backend=backend)


def test_effectful_operator_is_rejected(backend: str) -> None:
    model, x = WORKLOADS["mlp_infer"].args()

    def noisy(m, x):
        torch.ops.aten._print("step")
        return m(x)

    with pytest.raises(PrecompileError, match=r"effectful operator aten\._print"):
        precompile(noisy, model, x, backend=backend)


Pair = collections.namedtuple("Pair", ["a", "b"])


def test_unserializable_output_structure_is_rejected(backend: str) -> None:
    model, x = WORKLOADS["mlp_infer"].args()
    with pytest.raises(PrecompileError, match="_register_namedtuple"):
        precompile(lambda m, x: Pair(m(x), x), model, x, backend=backend)


def test_unserializable_input_structure_falls_back_to_leaf_count(backend: str) -> None:
    model, x = WORKLOADS["mlp_infer"].args()
    code, cache = precompile(lambda m, p: m(p.a) + p.b, model, Pair(x, x[:, :3]), backend=backend)
    assert precompile.inspect(code).in_spec is None
    run = precompile.load(code, cache)
    assert_same(run(model, Pair(x, x[:, :3])), model(x) + x[:, :3])
    with pytest.raises(PrecompileError, match="hold 3 leaves; the captured ones held 2"):
        run(model, (x, x[:, :3], x))


def test_unrecordable_python_value_is_rejected(backend: str) -> None:
    model, x = WORKLOADS["mlp_infer"].args()
    with pytest.raises(
        PrecompileError,
        match=r"input cfg is a builtins.object, which is neither "
        r"a tensor nor an immutable value.*frozen dataclasses",
    ):
        precompile(lambda m, x, cfg: m(x), model, x, object(), backend=backend)


def test_unsupported_result_leaf_is_rejected(backend: str) -> None:
    model, x = WORKLOADS["mlp_infer"].args()
    with pytest.raises(PrecompileError, match="result holds a object"):
        precompile(lambda m, x: (m(x), object()), model, x, backend=backend)


@pytest.mark.lowering
def test_decompositions_are_applied(backend: str) -> None:
    model, x = nn.Linear(4, 3), torch.randn(2, 4)
    table = {torch.ops.aten.relu.default: lambda t: torch.clamp(t, min=0)}
    code, cache = precompile(
        lambda m, x: torch.relu(m(x)), model, x, backend="eager", decompositions=table
    )
    # Comments quote the user's source lines, the decomposition's own among them.
    statements = "\n".join(line for line in code.splitlines() if not line.lstrip().startswith("#"))
    assert "aten.clamp" in statements and "aten.relu" not in statements
    assert_same(precompile.load(code, cache)(model, x), torch.relu(model(x)))


def test_graph_inputs_are_named_after_what_they_hold() -> None:
    model, x = MLP(), torch.randn(5, 4)
    code, _ = precompile(infer, model, x, backend="eager")
    assert "def captured_graph(p_fc1_weight" in code
    assert "b_bn_running_mean" in code and "in_x" in code
