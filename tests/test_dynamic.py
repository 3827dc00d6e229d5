"""Dynamic dims, on both backends: one artifact for every size of the dims marked with
mark_unbacked, with every size rule checked before any kernel runs."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn
from torch._dynamo.decorators import mark_dynamic, mark_unbacked

from torch_precompile import PrecompileError, precompile
from torch_precompile.trace import capture

from conftest import BACKENDS, assert_same, model_state, poisoned_toolchain, run_python
from workloads import MLP, Block, PartlyFrozen, block_step, infer, mse_step

SIZES = [0, 1, 5, 33]  # 5 is the example size


def _marked(t: torch.Tensor, *dims: int, **options) -> torch.Tensor:
    for dim in dims:
        mark_unbacked(t, dim, **options)
    return t


@pytest.fixture(scope="module", params=BACKENDS)
def mlp_infer(request: pytest.FixtureRequest):
    torch.manual_seed(0)
    model = PartlyFrozen().eval()
    code, cache = precompile(infer, model, _marked(torch.randn(5, 4), 0), backend=request.param)
    return model, code, cache, precompile.load(code, cache)


@pytest.fixture(scope="module", params=BACKENDS)
def mlp_train(request: pytest.FixtureRequest):
    torch.manual_seed(0)
    model = PartlyFrozen()
    x = _marked(torch.randn(5, 4), 0, shape_id="batch")
    t = _marked(torch.randn(5, 2), 0, shape_id="batch")
    code, cache = precompile(mse_step, model, x, t, backend=request.param)
    return model, code, cache, precompile.load(code, cache)


@pytest.fixture(scope="module", params=BACKENDS)
def block_train(request: pytest.FixtureRequest):
    torch.manual_seed(0)
    model = Block()
    x, t = torch.randn(2, 5, 16), torch.randn(2, 5, 16)
    for tensor in (x, t):
        mark_unbacked(tensor, 0, shape_id="batch")
        mark_unbacked(tensor, 1, shape_id="seq", min=2)
    code, cache = precompile(block_step, model, x, t, backend=request.param)
    return model, code, cache, precompile.load(code, cache)


@pytest.mark.parametrize("size", SIZES)
def test_inference_at_every_size(size: int, mlp_infer) -> None:
    model, _, _, run = mlp_infer
    x = torch.randn(size, 4)
    assert_same(run(model, x), model(x))


def test_marked_dims_are_recorded_as_none(mlp_infer) -> None:
    spec = precompile.inspect(mlp_infer[1])
    assert [leaf.shape for leaf in spec.inputs] == [(None, 4)]
    assert [(d.shape_id, d.places) for d in spec.dynamic_dims] == [("", ((0, 0),))]
    # Inductor's kernels assume the example's memory format; the eager graph, which views
    # no input here, takes any layout.
    assert spec.inputs[-1].strides == ("contiguous" if spec.backend == "inductor" else None)


def test_static_dims_are_still_checked(mlp_infer) -> None:
    model, _, _, run = mlp_infer
    with pytest.raises(
        PrecompileError,
        match=r"input x: expected shape \(\*, 4\) \(\* is "
        r"dynamic\), got \(3, 5\)",
    ):
        run(model, torch.randn(3, 5))


def test_batchnorm_on_a_marked_batch_is_refused_clearly() -> None:
    """torch.batch_norm itself decides on numel() == 0, which an unbacked batch cannot answer."""
    with pytest.raises(
        PrecompileError,
        match=r"branches on, or needs a fixed value of.*"
        r"Eq\(8\*u0, 0\)",
    ):
        precompile(infer, MLP().eval(), _marked(torch.randn(5, 4), 0))


@pytest.mark.parametrize("size", SIZES)
def test_training_step_at_every_size(size: int, mlp_train) -> None:
    model, _, _, run = mlp_train
    compiled_model, eager_model = copy.deepcopy(model), copy.deepcopy(model)
    x, t = torch.randn(size, 4), torch.randn(size, 2)
    for _ in range(2):
        assert_same(run(compiled_model, x, t), mse_step(eager_model, x, t))
    assert_same(model_state(compiled_model), model_state(eager_model))


@pytest.mark.parametrize(("batch", "seq"), [(0, 3), (1, 2), (2, 5), (3, 11)])
def test_transformer_block_training_step(batch: int, seq: int, block_train) -> None:
    model, _, _, run = block_train
    compiled_model, eager_model = copy.deepcopy(model), copy.deepcopy(model)
    x, t = torch.randn(batch, seq, 16), torch.randn(batch, seq, 16)
    assert_same(run(compiled_model, x, t), block_step(eager_model, x, t), atol=1e-5)
    assert_same(model_state(compiled_model), model_state(eager_model), atol=1e-5)


def test_transformer_block_inference_dynamic_batch_and_sequence(backend: str) -> None:
    torch.manual_seed(0)
    model = Block().eval()
    x = torch.randn(2, 5, 16)
    mark_unbacked(x, 0)
    mark_unbacked(x, 1, min=2)
    run = precompile.load(*precompile(infer, model, x, backend=backend))
    for batch, seq in [(0, 4), (1, 2), (4, 7)]:
        y = torch.randn(batch, seq, 16)
        assert_same(run(model, y), model(y), atol=1e-5)
    with pytest.raises(
        PrecompileError,
        match=r"input x: dim 1 is 1, outside the declared "
        r"range \[2, inf\]",
    ):
        run(model, torch.randn(2, 1, 16))


def test_inductor_decision_on_a_dynamic_dim_is_explained() -> None:
    x = _marked(torch.randn(2, 5, 16), 1)
    with pytest.raises(PrecompileError, match=r"whether input x dim 1 == 1.*min=2"):
        precompile(infer, Block().eval(), x)


def test_shape_id_mismatch_is_rejected(mlp_train) -> None:
    model, _, _, run = mlp_train
    with pytest.raises(
        PrecompileError,
        match=r"input t dim 0 \(=4\) must equal input x dim 0 "
        r"\(=3\): they share shape_id 'batch'",
    ):
        run(model, torch.randn(3, 4), torch.randn(4, 2))


def test_relation_between_independent_marks_is_enforced(backend: str) -> None:
    a, b = _marked(torch.randn(5), 0), _marked(torch.randn(5), 0)
    code, cache = precompile(lambda a, b: (a + b) * 2, a, b, backend=backend)
    assert [(r.expr, r.readable) for r in precompile.inspect(code).size_relations] == [
        (("==", ("d", 0), ("d", 1)), "input a dim 0 == input b dim 0")
    ]
    run = precompile.load(code, cache)
    assert_same(run(torch.ones(3), torch.ones(3)), torch.full((3,), 4.0))
    with pytest.raises(
        PrecompileError,
        match=r"input a dim 0 \(=3\) must equal input b dim 0 "
        r"\(=5\)",
    ):
        run(torch.ones(3), torch.ones(5))


def test_multiple_of_relation_is_enforced(backend: str) -> None:
    code, cache = precompile(
        lambda x: x.reshape(-1, 4).sum(1), _marked(torch.randn(8), 0), backend=backend
    )
    run = precompile.load(code, cache)
    assert_same(run(torch.ones(12)), torch.full((3,), 4.0))
    assert_same(run(torch.ones(0)), torch.ones(0))
    with pytest.raises(
        PrecompileError,
        match=r"must satisfy \(input x dim 0 % 4\) == 0.*"
        "input x dim 0 = 10",
    ):
        run(torch.ones(10))


def test_bounds_of_every_occurrence_are_enforced(backend: str) -> None:
    x = _marked(torch.randn(4, 3), 0, shape_id="n", max=8)
    y = _marked(torch.randn(4, 3), 0, shape_id="n", min=2)
    code, cache = precompile(lambda x, y: x * y, x, y, backend=backend)
    assert [leaf.bounds for leaf in precompile.inspect(code).inputs] == [
        {0: (None, 8)},
        {0: (2, None)},
    ]
    run = precompile.load(code, cache)
    assert_same(run(torch.ones(8, 3), torch.ones(8, 3)), torch.ones(8, 3))
    with pytest.raises(
        PrecompileError,
        match=r"input y: dim 0 is 1, outside the declared "
        r"range \[2, inf\]",
    ):
        run(torch.ones(1, 3), torch.ones(1, 3))
    with pytest.raises(
        PrecompileError,
        match=r"input x: dim 0 is 9, outside the declared "
        r"range \[0, 8\]",
    ):
        run(torch.ones(9, 3), torch.ones(9, 3))


def test_hint_override_reaches_the_shape_env() -> None:
    x, y = torch.randn(4, 3), torch.randn(5, 3)
    mark_unbacked(x, 0, hint_override=4096)
    mark_unbacked(y, 0)
    captured = capture(lambda x, y: (x * 2, y * 3), (x, y), "inductor")
    size_x, size_y = (t.shape[0].node.expr for t in captured.example_inputs)
    # The hint belongs to x's dim 0 alone; y's marked dim has none.
    assert size_x != size_y
    assert captured.fake_mode.shape_env.var_to_hint_override == {size_x: 4096}
    run = precompile.load(*precompile(lambda x: x * 2, x))
    assert_same(run(torch.ones(7, 3)), torch.full((7, 3), 2.0))


def test_strict_marks_are_dynamic_and_refuse_specialization() -> None:
    x = _marked(torch.randn(5, 4), 0, strict=True)
    run = precompile.load(*precompile(lambda x: x.sum(0), x))
    assert_same(run(torch.ones(9, 4)), torch.full((4,), 9.0))
    y = _marked(torch.randn(5, 4), 0, strict=True)
    with pytest.raises(PrecompileError, match="fixes the dynamic dim 0 of input x to 5"):
        precompile(lambda x: x.reshape(20), y)


def test_branch_on_a_marked_dim_is_rejected() -> None:
    x = _marked(torch.randn(5, 4), 0)
    with pytest.raises(
        PrecompileError,
        match="branches on, or needs a fixed value of, a dim marked with mark_unbacked",
    ):
        precompile(lambda x: x * 2 if x.shape[0] > 3 else x, x)


def test_unsupported_marks_are_rejected() -> None:
    x = torch.randn(5, 4)
    mark_dynamic(x, 0)
    with pytest.raises(PrecompileError, match="mark_dynamic.*mark_unbacked instead"):
        precompile(lambda x: x * 2, x)
    y = torch.randn(5, 4)
    mark_unbacked(y, 0, specialize_on=[lambda n: n == 1])
    with pytest.raises(PrecompileError, match="specialize_on"):
        precompile(lambda y: y * 2, y)


def test_marked_subclass_is_rejected() -> None:
    from torch.testing._internal.two_tensor import TwoTensor

    t = TwoTensor(torch.randn(5, 4), torch.randn(5, 4))
    t._dynamo_unbacked_indices = {0}
    with pytest.raises(
        PrecompileError,
        match=r"input t is a tensor subclass \(TwoTensor\) "
        "with a mark_unbacked dim",
    ):
        precompile(lambda t: t * 2, t)


def test_marked_input_in_an_odd_layout_is_rejected() -> None:
    x = _marked(torch.randn(4, 5).t(), 0)
    with pytest.raises(
        PrecompileError, match="neither contiguous, channels_last nor channels_last_3d"
    ):
        precompile(lambda x: x * 2, x)


def test_eager_copies_a_viewed_input_into_the_memory_format_it_was_traced_on() -> None:
    """The eager graph views x: a call in another layout gets a copy in the example's memory
    format, unless the graph writes x (then the copy would take the write: refused)."""
    x = _marked(torch.randn(5, 4), 0)
    code, cache = precompile(lambda x: x.view(-1) * 2, x, backend="eager")
    assert [leaf.strides for leaf in precompile.inspect(code).inputs] == ["contiguous"]
    run = precompile.load(code, cache)
    y = torch.randn(4, 6).t()  # (6, 4), not contiguous
    assert_same(run(y), y.contiguous().view(-1) * 2)

    def written(x: torch.Tensor) -> torch.Tensor:
        x.add_(1)
        return x.view(-1)

    run = precompile.load(*precompile(written, _marked(torch.randn(5, 4), 0), backend="eager"))
    z = torch.zeros(3, 4)
    assert_same(run(z), torch.ones(12))
    assert_same(z, torch.ones(3, 4))  # the write reached the caller's tensor, as in eager
    with pytest.raises(
        PrecompileError,
        match=r"^input x: the graph writes this input or returns a view of it, and its views "
        r"were traced on the contiguous memory format \(the example's\); got strides \(1, 6\)\. "
        r"Pass it in that format \(\.contiguous\(memory_format=\.\.\.\)\)\.$",
    ):
        run(torch.randn(4, 6).t())


def test_channels_last_marked_input_round_trips() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU())
    x = _marked(torch.randn(2, 3, 6, 6).to(memory_format=torch.channels_last), 0)
    run = precompile.load(*precompile(infer, model, x))
    for batch in (0, 1, 3):
        y = torch.randn(batch, 3, 6, 6).to(memory_format=torch.channels_last)
        assert_same(run(model, y), model(y), atol=1e-5)
    with pytest.raises(PrecompileError, match="assume the channels_last memory format"):
        run(model, torch.randn(3, 3, 6, 6))


def test_dynamic_artifact_loads_from_cache_without_a_compiler(mlp_train, tmp_path) -> None:
    """In a fresh process with no compiler, two training steps at two new batch sizes, no
    zero_grad between them: losses, accumulated gradients and parameters equal eager's."""
    model, code, cache, _ = mlp_train
    (tmp_path / "a.py").write_text(code)
    (tmp_path / "a.cache").write_bytes(cache)
    torch.save(model.state_dict(), tmp_path / "state.pt")
    env, marker = poisoned_toolchain(tmp_path)
    proc = run_python(
        f"""
        import copy, json, sys, torch
        from torch_precompile import precompile
        from workloads import PartlyFrozen, mse_step
        run = precompile.load(open({str(tmp_path / "a.py")!r}).read(),
                              open({str(tmp_path / "a.cache")!r}, "rb").read())
        model = PartlyFrozen()
        model.load_state_dict(torch.load({str(tmp_path / "state.pt")!r}))
        eager = copy.deepcopy(model)

        def close(a, b):
            if a is None or b is None:
                return a is None and b is None
            return a.shape == b.shape and bool(torch.allclose(a, b, rtol=1e-4, atol=1e-5))

        differ = []
        for n in (1, 7):
            x, t = torch.randn(n, 4), torch.randn(n, 2)
            if not close(run(model, x, t), mse_step(eager, x, t)):
                differ.append(f"loss at batch {{n}}")
            for name, p in model.named_parameters():
                q = eager.get_parameter(name)
                if not close(p.detach(), q.detach()):
                    differ.append(f"{{name}} at batch {{n}}")
                if not close(p.grad, q.grad):
                    differ.append(f"{{name}}.grad at batch {{n}}")
            for name, b in model.named_buffers():
                if not close(b, eager.get_buffer(name)):
                    differ.append(f"buffer {{name}} at batch {{n}}")
        print(json.dumps({{"inductor": "torch._inductor" in sys.modules, "differ": differ,
                          "grads": sorted(n for n, p in model.named_parameters()
                                          if p.grad is not None)}}))
    """,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    # fc1 is frozen and `unused` takes no part: only fc2 gets gradients, as in eager.
    assert report == {"inductor": False, "differ": [], "grads": ["fc2.bias", "fc2.weight"]}
    assert not marker.exists()
