"""The differentiable form: an artifact of a computation without backward, whose results carry
autograd history, used by training loops that call backward() and step optimizers themselves.

Each loop runs several steps against eager, on a second set of weights and new inputs.
"""

from __future__ import annotations

import copy
import json
import logging
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from torch_precompile import PrecompileError, precompile

from conftest import BACKENDS, run_python

# Inductor's lowering of backward graphs is what these tests check, on both backends.
pytestmark = [pytest.mark.timeout(900), pytest.mark.lowering]


class Net(nn.Module):
    """Linear, BatchNorm (writes its statistics), ReLU, Linear."""

    def __init__(self, d_in: int = 4, d_out: int = 2, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        # No bias before BatchNorm: its gradient is zero up to rounding, which Adam would
        # scale up into steps that differ between any two implementations.
        self.fc1, self.bn = nn.Linear(d_in, 8, bias=False), nn.BatchNorm1d(8)
        self.fc2 = nn.Linear(8, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


class Critic(nn.Module):
    """A GAN's critic; without BatchNorm, which would make the gradient of the generator's
    last bias zero (up to rounding, which Adam scales up)."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.fc1, self.fc2 = nn.Linear(2, 8), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def call(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return m(x)


class Built:
    """Artifacts built once per (name, backend) for this module."""

    def __init__(self) -> None:
        self.pairs: dict[tuple[str, str], Any] = {}

    def get(self, name: str, backend: str, make: Callable[[], Any]) -> Any:
        if (name, backend) not in self.pairs:
            self.pairs[name, backend] = make()
        return self.pairs[name, backend]


@pytest.fixture(scope="module")
def built() -> Built:
    return Built()


def net_artifact(built: Built, backend: str) -> Any:
    def make() -> Any:
        x = torch.randn(6, 4, requires_grad=True)
        return precompile.load(*precompile(call, Net(), x, backend=backend))

    return built.get("net", backend, make)


def twins(seed: int = 1, **kwargs: Any) -> tuple[nn.Module, nn.Module]:
    """A model with weights other than the capture's, and an identical eager copy."""
    model = Net(seed=seed, **kwargs)
    return model, copy.deepcopy(model)


def twin_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    """An input that requires grad, and an identical one for eager."""
    x = torch.randn(6, 4, requires_grad=True)
    return x, x.detach().clone().requires_grad_()


def assert_models_match(model: nn.Module, eager: nn.Module, atol: float = 1e-5) -> None:
    for (name, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=atol, rtol=1e-4, msg=_named(name))
        if q.grad is None:
            assert p.grad is None, name
        else:
            torch.testing.assert_close(
                p.grad, q.grad, atol=atol, rtol=1e-4, msg=_named(f"{name}.grad")
            )
    for (name, b), c in zip(model.named_buffers(), eager.buffers(), strict=True):
        torch.testing.assert_close(b, c, atol=atol, rtol=1e-4, msg=_named(name))


def _named(name: str) -> Callable[[str], str]:
    return lambda message: f"{name}: {message}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_results_carry_history_and_backward_matches_eager(built: Built, backend: str) -> None:
    run = net_artifact(built, backend)
    model, eager = twins()
    x, x_eager = twin_inputs()
    y, y_eager = run(model, x), eager(x_eager)
    assert y.requires_grad and y.grad_fn is not None
    torch.testing.assert_close(y, y_eager, atol=1e-5, rtol=1e-4)
    (y * y).sum().backward()
    (y_eager * y_eager).sum().backward()
    assert_models_match(model, eager)
    torch.testing.assert_close(x.grad, x_eager.grad, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_plain_loop_with_the_optimizer_outside(built: Built, backend: str) -> None:
    run = net_artifact(built, backend)
    model, eager = twins()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt_eager = torch.optim.AdamW(eager.parameters(), lr=1e-2)
    for step in range(3):
        torch.manual_seed(100 + step)
        x, t = torch.randn(6, 4), torch.randn(6, 2)
        for o, forward in ((opt, lambda x: run(model, x)), (opt_eager, eager)):
            o.zero_grad()
            nn.functional.mse_loss(forward(x), t).backward()
            o.step()
    assert_models_match(model, eager)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradients_accumulate_over_micro_batches(built: Built, backend: str) -> None:
    run = net_artifact(built, backend)
    model, eager = twins()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt_eager = torch.optim.SGD(eager.parameters(), lr=0.1)
    for step in range(2):
        for micro in range(4):
            torch.manual_seed(10 * step + micro)
            x, t = torch.randn(6, 4), torch.randn(6, 2)
            (nn.functional.mse_loss(run(model, x), t) / 4).backward()
            (nn.functional.mse_loss(eager(x), t) / 4).backward()
        assert_models_match(model, eager)  # the sums of four backwards, on .grad
        opt.step()
        opt_eager.step()
        opt.zero_grad()
        opt_eager.zero_grad()
    assert_models_match(model, eager)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_gan_two_models_two_optimizers_two_backwards(built: Built, backend: str) -> None:
    generate = net_artifact(built, backend)  # noise (6, 4) -> sample (6, 2)

    def make_critic() -> Any:
        # A plain example: the generator's output, which requires grad, comes at the call.
        return precompile.load(*precompile(call, Critic(), torch.randn(6, 2), backend=backend))

    judge = built.get("critic", backend, make_critic)
    gen, gen_eager = twins()
    critic = Critic(seed=1)
    critic_eager = copy.deepcopy(critic)
    bce = nn.functional.binary_cross_entropy_with_logits

    def step(
        g: Callable[..., Any],
        d: Callable[..., Any],
        g_opt: Any,
        d_opt: Any,
        noise: torch.Tensor,
        real: torch.Tensor,
    ) -> None:
        fake = g(noise)
        d_opt.zero_grad()
        d_loss = bce(d(real), torch.ones(6, 1)) + bce(d(fake.detach()), torch.zeros(6, 1))
        d_loss.backward()
        d_opt.step()
        g_opt.zero_grad()
        bce(d(fake), torch.ones(6, 1)).backward()
        g_opt.step()

    opts = [
        torch.optim.Adam(m.parameters(), lr=1e-2) for m in (gen, critic, gen_eager, critic_eager)
    ]
    for i in range(3):
        torch.manual_seed(i)
        noise, real = torch.randn(6, 4), torch.randn(6, 2)
        step(lambda z: generate(gen, z), lambda s: judge(critic, s), opts[0], opts[1], noise, real)
        step(gen_eager, critic_eager, opts[2], opts[3], noise, real)
    assert_models_match(gen, gen_eager)
    assert_models_match(critic, critic_eager)


def plain_module_artifact(built: Built, backend: str, wrapped_pair: Path) -> Any:
    """The module form of Net captured from a plain example (inductor: the saved pair)."""
    if backend == "inductor":
        return built.get("module", backend, lambda: precompile.load(wrapped_pair))
    return built.get(
        "module",
        backend,
        lambda: precompile.load(*precompile.module(Net(), torch.randn(6, 4), backend=backend).pair),
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_input_gradients_from_a_plain_capture(
    built: Built, backend: str, wrapped_pair: Path
) -> None:
    """Saliency and adversarial training: the input's gradient at some calls, none at
    others, from one artifact captured without an input that requires grad."""
    model, eager = twins()
    wrapped = precompile.module(model, artifact=plain_module_artifact(built, backend, wrapped_pair))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt_eager = torch.optim.SGD(eager.parameters(), lr=0.1)
    for step in range(3):
        torch.manual_seed(step)
        x, t = torch.randn(6, 4), torch.randn(6, 2)
        ours, theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
        nn.functional.mse_loss(wrapped(ours), t).backward()
        nn.functional.mse_loss(eager(theirs), t).backward()
        assert ours.grad is not None
        torch.testing.assert_close(ours.grad, theirs.grad, atol=1e-5, rtol=1e-4)
        assert_models_match(model, eager)
        # Train on the input moved along its gradient's sign: a call with no input gradient.
        adversarial = x + 0.1 * theirs.grad.sign()
        for m, o in ((wrapped, opt), (eager, opt_eager)):
            nn.functional.mse_loss(m(adversarial), t).backward()
            o.step()
            o.zero_grad()
    assert_models_match(model, eager)
    # Only the input's gradient, through torch.autograd.grad: the weights' .grad untouched.
    x = torch.randn(6, 4, requires_grad=True)
    (grad,) = torch.autograd.grad(wrapped(x).sum(), x)
    (grad_eager,) = torch.autograd.grad(eager(x).sum(), x)
    torch.testing.assert_close(grad, grad_eager, atol=1e-5, rtol=1e-4)
    assert all(p.grad is None for p in model.parameters())


def test_an_input_fn_writes_in_place_is_refused_when_it_requires_grad() -> None:
    def doubled_first(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        x.mul_(2)
        return m(x)

    run = precompile.load(*precompile(doubled_first, Critic(), torch.randn(6, 2), backend="eager"))
    critic = Critic()
    live = torch.randn(6, 2, requires_grad=True) * 1  # not a leaf: eager may write it
    before = live.detach().clone()
    with pytest.raises(
        PrecompileError,
        match="input x requires grad at this call but did not at capture, and "
        "fn writes it in place",
    ):
        run(critic, live)
    assert torch.equal(live, before) and all(p.grad is None for p in critic.parameters())
    x = torch.randn(6, 2)
    torch.testing.assert_close(run(critic, x.clone()), doubled_first(critic, x.clone()))


@pytest.mark.parametrize("backend", BACKENDS)
def test_checkpoint_around_the_artifact(built: Built, backend: str) -> None:
    run = net_artifact(built, backend)
    model, eager = twins()
    x, x_eager = twin_inputs()
    y = torch.utils.checkpoint.checkpoint(run, model, x, use_reentrant=False)
    y_eager = torch.utils.checkpoint.checkpoint(eager, x_eager, use_reentrant=False)
    y.pow(2).sum().backward()
    y_eager.pow(2).sum().backward()
    # The forward ran twice (once more inside backward), as eager's did: statistics too.
    assert_models_match(model, eager)
    torch.testing.assert_close(x.grad, x_eager.grad, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_autocast_bf16_around_the_artifact(built: Built, backend: str) -> None:
    def make() -> Any:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return precompile.load(*precompile(call, Net(), torch.randn(6, 4), backend=backend))

    run = built.get("autocast", backend, make)
    model, eager = twins()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt_eager = torch.optim.SGD(eager.parameters(), lr=0.1)
    for step in range(2):
        torch.manual_seed(step)
        x = torch.randn(6, 4)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y, y_eager = run(model, x), eager(x)
        assert y.dtype == y_eager.dtype == torch.bfloat16
        torch.testing.assert_close(y, y_eager, atol=2e-2, rtol=2e-2)
        y.float().pow(2).mean().backward()
        y_eager.float().pow(2).mean().backward()
        for p, q in zip(model.parameters(), eager.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, atol=5e-2, rtol=5e-2)
        opt.step()
        opt_eager.step()
        opt.zero_grad()
        opt_eager.zero_grad()


def test_a_second_backward_fails_as_eager_and_retain_graph_allows_it(built: Built) -> None:
    run = net_artifact(built, "eager")
    model, eager = twins()
    x = torch.randn(6, 4)
    loss = run(model, x).sum()
    loss.backward(retain_graph=True)
    first = model.fc1.weight.grad.clone()
    loss.backward()  # retained: the gradients add up, as eager's do
    torch.testing.assert_close(model.fc1.weight.grad, 2 * first)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        loss.backward()
    eager_loss = eager(x).sum()
    eager_loss.backward()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        eager_loss.backward()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_saved_tensor_written_before_backward_is_refused_as_eager(
    built: Built, backend: str
) -> None:
    run = net_artifact(built, backend)
    model, _ = twins()
    x = torch.randn(6, 4, requires_grad=True)
    loss = run(model, x).sum()
    with torch.no_grad():
        x.mul_(2)  # the forward saved x for the first layer's weight gradient
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_double_backward_is_refused_by_name(built: Built) -> None:
    run = net_artifact(built, "eager")
    model, _ = twins()
    x = torch.randn(6, 4, requires_grad=True)
    with pytest.raises(PrecompileError, match="double backward"):
        torch.autograd.grad(run(model, x).sum(), x, create_graph=True)


def test_under_no_grad_or_inference_mode_the_plain_graph_runs(built: Built) -> None:
    run = net_artifact(built, "eager")
    model, eager = twins()
    x = torch.randn(6, 4)
    with torch.no_grad():
        y = run(model, x)
    with torch.inference_mode():
        z = run(model, x)
    assert not y.requires_grad and not z.requires_grad
    with torch.no_grad():
        eager(x)
        torch.testing.assert_close(z, eager(x))
    model.requires_grad_(False)  # frozen: nothing needs history either
    assert run(model, x).grad_fn is None


@pytest.mark.parametrize("backend", BACKENDS)
def test_frozen_parameters_and_inputs_that_require_grad(built: Built, backend: str) -> None:
    def make() -> Any:
        net = Net()
        net.fc1.requires_grad_(False)
        x = torch.randn(6, 4, requires_grad=True)
        return precompile.load(*precompile(call, net, x, backend=backend))

    run = built.get("frozen", backend, make)
    model, eager = twins()
    model.fc1.requires_grad_(False)
    eager.fc1.requires_grad_(False)
    x, x_eager = twin_inputs()
    run(model, x).sum().backward()
    eager(x_eager).sum().backward()
    assert model.fc1.weight.grad is None
    assert_models_match(model, eager)
    torch.testing.assert_close(x.grad, x_eager.grad, atol=1e-5, rtol=1e-4)
    # x not requiring grad at a call: fine (its gradient is dropped).
    x2 = torch.randn(6, 4)
    run(model, x2).sum().backward()
    # A parameter frozen at capture but not now: the artifact has no gradient for it.
    model.fc1.weight.requires_grad_(True)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    grads = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
    with pytest.raises(PrecompileError, match="'fc1.weight' requires grad at this call"):
        run(model, x)
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n])
        assert (p.grad is None) == (grads[n] is None)


@pytest.mark.parametrize("backend", BACKENDS)
def test_dropout_masks_agree_between_forward_and_backward(built: Built, backend: str) -> None:
    class Drop(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(64, 64) + 0.5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return nn.functional.dropout(x * self.w, p=0.5, training=True)

    def make() -> Any:
        return precompile.load(*precompile(call, Drop(), torch.randn(64, 64), backend=backend))

    run = built.get("dropout", backend, make)
    model = Drop()
    x = torch.rand(64, 64) + 0.1  # no zeros of its own
    y = run(model, x)
    y.sum().backward()
    kept = y != 0
    assert 0.3 < kept.float().mean().item() < 0.7
    # d(sum y)/dw = x * mask / (1 - p): zero exactly where the forward dropped.
    torch.testing.assert_close(model.w.grad, torch.where(kept, 2 * x, torch.zeros_like(x)))


def test_what_was_not_captured_with_history_warns_or_refuses() -> None:
    with torch.no_grad():  # precompiled under no_grad: no backward is built
        pair = precompile(call, Net(), torch.randn(6, 4), backend="eager")
    assert precompile.inspect(pair.code).autograd.unavailable is not None
    run = precompile.load(*pair)
    model, _ = twins()
    with pytest.warns(UserWarning, match="no autograd history"):
        y = run(model, torch.randn(6, 4))
    assert not y.requires_grad
    frozen = Net()
    frozen.requires_grad_(False)
    run = precompile.load(*precompile(call, frozen, torch.randn(6, 4), backend="eager"))
    with pytest.raises(PrecompileError, match="requires grad at this call but did not"):
        run(Net(), torch.randn(6, 4))


def test_inspect_says_what_the_forward_saves(tmp_path: Path) -> None:
    x = torch.randn(6, 4, requires_grad=True)
    code, cache = precompile(call, Net(), x, backend="eager")
    record = precompile.inspect(code).autograd
    assert record.outputs == (0,) and len(record.inputs) == 6  # 5 parameters and x
    assert any(entry.startswith("in_x") for entry in record.saved)
    from torch_precompile import inspection

    path = precompile.save(code, cache, tmp_path / "net.py")
    text = inspection.render(inspection.describe(path))
    assert "autograd  : differentiable: results [0] carry history" in text
    assert "its backward gives 6 gradients" in text and "for inputs" not in text
    assert "values saved for backward" in text and "in_x: float32[6, 4]" in text


def test_inspect_names_each_form_and_where_gradients_come_from(tmp_path: Path) -> None:
    code, cache = precompile(call, Net(), torch.randn(6, 4), backend="eager")
    spec = precompile.inspect(code)
    x_index = len(spec.interned)  # the flat inputs: the model's tensors, then x
    assert spec.autograd is not None and spec.autograd.inputs == (0, 1, 2, 3, 4)
    assert spec.autograd_for_inputs is not None
    assert spec.autograd_for_inputs.inputs == (0, 1, 2, 3, 4, x_index)
    from torch_precompile import inspection

    text = inspection.render(inspection.describe(precompile.save(code, cache, tmp_path / "n.py")))
    assert "parameters: 5 (5 require grad: backward() after a call gives their gradients)" in text
    assert (
        "for inputs: where an input tensor requires grad that did not at capture: results [0] "
        "carry history; its backward gives 6 gradients;"
    ) in text

    # fn's own backward: the parameters line says so.
    def step(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        loss = m(x).sum()
        loss.backward()
        return loss.detach()

    trained = precompile(step, Critic(), torch.randn(6, 2), backend="eager")
    text = inspection.render(inspection.describe(precompile.save(*trained, tmp_path / "s.py")))
    assert "parameters: 4 (4 get gradients from fn's backward)" in text
    # Token ids never require grad: no second form.
    ids = torch.tensor([[1, 2, 3]])
    assert (
        precompile.inspect(
            precompile(call, nn.Embedding(10, 4), ids, backend="eager").code
        ).autograd_for_inputs
        is None
    )


# The module form.


@pytest.fixture(scope="module")
def wrapped_pair(tmp_path_factory: pytest.TempPathFactory) -> Path:
    wrapped = precompile.module(Net(), torch.randn(6, 4), backend="inductor")
    path = tmp_path_factory.mktemp("module") / "net.py"
    wrapped.save(path)
    return path


def test_the_module_form_is_the_model_for_training_code(wrapped_pair: Path) -> None:
    model, eager = twins()
    wrapped = precompile.module(model, artifact=precompile.load(wrapped_pair))
    assert isinstance(wrapped, nn.Module)
    assert list(wrapped.parameters()) == list(model.parameters())
    assert wrapped.state_dict().keys() == model.state_dict().keys()
    assert wrapped.fc1 is model.fc1  # attributes come from the model
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-2)
    opt_eager = torch.optim.AdamW(eager.parameters(), lr=1e-2)
    for step in range(3):
        torch.manual_seed(step)
        x, t = torch.randn(6, 4), torch.randn(6, 2)
        for m, o in ((wrapped, opt), (eager, opt_eager)):
            o.zero_grad()
            nn.functional.mse_loss(m(x), t).backward()
            o.step()
    assert_models_match(model, eager)
    wrapped.eval()
    assert not model.training
    with pytest.raises(PrecompileError, match="training"):
        wrapped(torch.randn(6, 4))
    wrapped.load_state_dict(eager.state_dict())


def test_the_module_form_with_both_modes() -> None:
    model, eager = twins()
    wrapped = precompile.module(model, torch.randn(6, 4), modes=("train", "eval"), backend="eager")
    x = torch.randn(6, 4)
    wrapped(x).sum().backward()
    eager(x).sum().backward()
    wrapped.eval()
    eager.eval()
    with torch.no_grad():
        torch.testing.assert_close(wrapped(x), eager(x))
    assert_models_match(model, eager)


def test_a_fresh_process_trains_through_the_saved_module(wrapped_pair: Path) -> None:
    script = f"""
        import copy, json, sys, torch
        from test_differentiable import Net
        from torch_precompile import precompile
        model = Net(seed=3)
        eager = copy.deepcopy(model)
        wrapped = precompile.module(model, artifact=precompile.load({str(wrapped_pair)!r}))
        x = torch.randn(6, 4)
        wrapped(x).pow(2).sum().backward()
        eager(x).pow(2).sum().backward()
        # An input that requires grad, as a pipeline's later stage receives it.
        ours = torch.randn(6, 4, requires_grad=True)
        theirs = ours.detach().clone().requires_grad_()
        wrapped(ours).pow(2).sum().backward()
        eager(theirs).pow(2).sum().backward()
        torch.testing.assert_close(ours.grad, theirs.grad, atol=1e-5, rtol=1e-4)
        for p, q in zip(model.parameters(), eager.parameters()):
            torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4)
        print(json.dumps({{"inductor_imported": "torch._inductor" in sys.modules,
                           "dynamo_imported": "torch._dynamo" in sys.modules}}))
    """
    done = run_python(script)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report == {"inductor_imported": False, "dynamo_imported": False}


def test_a_fresh_process_without_the_cache_builds_nothing_for_eager(tmp_path: Path) -> None:
    x = torch.randn(6, 4)  # plain: the call's input requires grad
    path = tmp_path / "net.py"
    path.write_text(precompile(call, Net(), x, backend="eager").code)
    script = f"""
        import copy, torch
        from test_differentiable import Net
        from torch_precompile import precompile
        run = precompile.load(open({str(path)!r}).read(), None)
        model = Net(seed=4)
        eager = copy.deepcopy(model)
        x = torch.randn(6, 4, requires_grad=True)
        x2 = x.detach().clone().requires_grad_()
        run(model, x).sum().backward()
        eager(x2).sum().backward()
        torch.testing.assert_close(x.grad, x2.grad)
        torch.testing.assert_close(model.fc1.weight.grad, eager.fc1.weight.grad)
        print("ok")
    """
    done = run_python(script)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_module_backward_hooks_leave_results_without_history_and_say_so() -> None:
    model = Net()
    seen: list[int] = []
    model.fc2.register_full_backward_hook(lambda *_: seen.append(1))
    code = precompile(call, model, torch.randn(6, 4), backend="eager").code
    assert "backward hooks" in precompile.inspect(code).autograd.unavailable
    run = precompile.load(code, None)
    with pytest.warns(UserWarning, match="backward hooks"):
        assert run(model, torch.randn(6, 4)).grad_fn is None


def test_results_that_need_no_history_build_no_backward_and_warn_of_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def detached(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return m(x).detach() * 2

    model = Net()
    with caplog.at_level(logging.WARNING, logger="torch_precompile"):
        code = precompile(detached, model, torch.randn(6, 4), backend="eager").code
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    record = precompile.inspect(code).autograd
    assert record.unavailable is None and record.outputs == ()
    run = precompile.load(code, None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # as eager: a result without history, and no word
        y = run(model, x := torch.randn(6, 4))
    assert y.grad_fn is None
    torch.testing.assert_close(y, detached(model, x))


def with_a_detached_copy(m: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    y = m(x)
    return y, y.detach() * 3


def test_a_detached_result_stops_gradients_as_in_eager() -> None:
    """Before (torch 2.14 and 2.15, whose tracer records ``detach`` as ``alias`` unless
    given a decomposition table): the detached result got history, and a backward through
    it put gradients on the weights that eager's does not."""
    run = precompile.load(*precompile(with_a_detached_copy, Net(), torch.randn(6, 4)))
    model, twin = twins()
    x = torch.randn(6, 4)
    ours, eager = run(model, x), with_a_detached_copy(twin, x)
    assert ours[1].grad_fn is None and ours[0].grad_fn is not None
    (ours[0].sum() + ours[1].pow(2).sum()).backward()
    (eager[0].sum() + eager[1].pow(2).sum()).backward()
    for ours_p, eager_p in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(ours_p.grad, eager_p.grad)


def test_the_module_form_refuses_bad_arguments_by_name() -> None:
    model = Net()
    cases = [
        (lambda: precompile.module(lambda x: x, torch.randn(6, 4)), "takes an nn.Module first"),
        (lambda: precompile.module(model, torch.randn(6, 4), modes=("test",)), "modes must"),
        (
            lambda: precompile.module(model, torch.randn(6, 4), example_kwargs=[1]),
            "example_kwargs must be a dict",
        ),
        (
            lambda: precompile.module(model, torch.randn(6, 4), optimize=True),
            "unknown keywords \\['optimize'\\]",
        ),
        (lambda: precompile.module(model, artifact="model.py"), "what precompile.load returned"),
        (
            lambda: precompile.module(model, torch.randn(6, 4), artifact=lambda *a: None),
            "takes no examples",
        ),
        (lambda: precompile.stages(lambda i: (model, ()), 2, 2), "stage_index one of"),
        (
            lambda: precompile.module(
                model,
                artifact=precompile.load(
                    *precompile(call, Net(), torch.randn(6, 4), backend="eager")
                ),
            ).save("x.py"),
            "made from a loaded artifact",
        ),
    ]
    for thunk, message in cases:
        with pytest.raises(PrecompileError, match=message):
            thunk()
