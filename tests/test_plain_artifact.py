"""Plain artifacts: checks generated one a line over a small runtime, refusing what the
generic driver refuses, with the same words."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

import torch_precompile.artifact.render as render
from torch_precompile import PrecompileError, precompile
from torch_precompile.artifact.plain_checks import is_plain

from conftest import assert_same, model_state, run_python

logging.getLogger("torch_precompile").setLevel(logging.ERROR)


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)
        self.norm = torch.nn.LayerNorm(3)
        self.register_buffer("scale", torch.full((3,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.norm(self.fc(x))) * self.scale


class Other(Net):
    pass


def infer(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return m(x)


def infer_with_history(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return m(x)


def train(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    loss = m(x).square().mean()
    loss.backward()
    return loss.detach()


def _net() -> Net:
    torch.manual_seed(0)
    return Net()


def _both(fn: Callable[..., Any], example: Sequence[Any], backend: str) -> tuple[str, str]:
    """The plain artifact of ``fn`` and the generic driver's for the same capture."""
    plain = precompile(fn, *example, backend=backend)[0]
    original = render.is_plain
    render.is_plain = lambda *_: False  # type: ignore[assignment]
    try:
        generic = precompile(fn, *example, backend=backend)[0]
    finally:
        render.is_plain = original
    return plain, generic


def _pairs(fn: Callable[..., Any], backend: str) -> tuple[str, str]:
    example = (_net(), torch.randn(5, 4))
    with _grad_mode(fn):
        # The first capture in a process may see the test runner's own lazy imports read.
        precompile(fn, *example, backend=backend)
        return _both(fn, example, backend)


def _grad_mode(fn: Callable[..., Any]) -> Any:
    """Inference as a server captures and calls it; a training step under grad mode."""
    return torch.no_grad() if fn is infer else torch.enable_grad()


def _eval(m: Net) -> Net:
    return m.eval()


def _hook(m: Net) -> Net:
    m.fc.register_forward_hook(lambda *_: None)
    return m


def _forward_set(m: Net) -> Net:
    m.norm.forward = lambda x: x  # type: ignore[method-assign]
    return m


def _other_class(m: Net) -> Net:
    other = Other()
    other.load_state_dict(m.state_dict())
    return other


def _wider(m: Net) -> Net:
    m.fc = torch.nn.Linear(4, 3, bias=False)
    return m


def _extra_buffer(m: Net) -> Net:
    m.register_buffer("scale", torch.ones(3))
    return m


def _frozen(m: Net) -> Net:
    m.fc.weight.requires_grad_(False)
    return m


def _double(m: Net) -> Net:
    return m.double()


# (name, change to the model, the input given)
CALLS: list[tuple[str, Callable[[Net], Any], Callable[[], Any]]] = [
    ("as captured", lambda m: m, lambda: torch.randn(5, 4)),
    ("other shape", lambda m: m, lambda: torch.randn(6, 4)),
    ("other dtype", lambda m: m, lambda: torch.randn(5, 4, dtype=torch.float64)),
    ("transposed", lambda m: m, lambda: torch.randn(4, 5).t()),
    ("not a tensor", lambda m: m, lambda: [1.0, 2.0]),
    ("a list of one tensor", lambda m: m, lambda: [torch.randn(5, 4)]),
    ("requiring grad", lambda m: m, lambda: torch.randn(5, 4, requires_grad=True)),
    ("eval mode", _eval, lambda: torch.randn(5, 4)),
    ("a hook", _hook, lambda: torch.randn(5, 4)),
    ("a forward set", _forward_set, lambda: torch.randn(5, 4)),
    ("another class", _other_class, lambda: torch.randn(5, 4)),
    ("no bias", _wider, lambda: torch.randn(5, 4)),
    ("an extra buffer", _extra_buffer, lambda: torch.randn(5, 4)),
    ("a frozen weight", _frozen, lambda: torch.randn(5, 4)),
    ("float64 weights", _double, lambda: torch.randn(5, 4)),
    ("not a model", lambda m: "model", lambda: torch.randn(5, 4)),
]


def _outcome(
    code: str, fn: Callable[..., Any], change: Callable[[Net], Any], given: Callable[[], Any]
) -> Any:
    run = precompile.load(code, None)
    torch.manual_seed(1)
    model, x = change(_net()), given()
    try:
        with _grad_mode(fn):
            return ("ran", run(model, x))
    except PrecompileError as error:
        return ("refused", str(error))


@pytest.mark.parametrize("backend", ["eager", "inductor"])
@pytest.mark.parametrize(
    "fn", [infer, infer_with_history, train], ids=["infer", "with-history", "train"]
)
def test_plain_refuses_what_the_generic_driver_refuses_in_its_words(backend, fn) -> None:
    plain, generic = _pairs(fn, backend)
    assert "forward = PlainForward(" in plain and "class Driver" not in plain
    assert "class Driver" in generic
    refused = 0
    for name, change, given in CALLS:
        ours = _outcome(plain, fn, change, given)
        theirs = _outcome(generic, fn, change, given)
        assert ours[0] == theirs[0], (name, ours, theirs)
        if ours[0] == "refused":
            refused += 1
            assert ours[1] == theirs[1], name
        else:
            assert_same(ours[1], theirs[1])
            assert ours[1].requires_grad == theirs[1].requires_grad, name
    assert refused >= 10


def _remembered(fn: Callable[..., Any]) -> tuple[Callable[..., Any], Net, torch.Tensor]:
    model, x = _net(), torch.randn(5, 4)
    code, cache = precompile(fn, model, x, backend="eager")
    run = precompile.load(code, cache)
    run(model, x)  # passes the full check: the model is remembered
    return run, model, x


def _called(run: Callable[..., Any], model: Net, x: torch.Tensor) -> Any:
    try:
        return ("ran", run(model, x).item())
    except PrecompileError as error:
        return ("refused", str(error))


@pytest.mark.parametrize(
    "change",
    [
        lambda m: m.norm.eval(),
        lambda m: m.fc.register_forward_pre_hook(lambda *_: None),
        lambda m: torch.nn.modules.module.register_module_forward_hook(lambda *_: None),
        lambda m: setattr(m.fc, "forward", lambda x: x),
        lambda m: delattr(m.fc, "bias"),
        lambda m: setattr(m.fc, "weight", torch.nn.Parameter(torch.ones(3, 4))),
        lambda m: setattr(m.fc, "weight", torch.nn.Parameter(torch.ones(2, 4))),
        lambda m: m.fc.weight.data.resize_(2, 4),
        lambda m: m.fc.weight.register_hook(lambda g: g),
        lambda m: m.norm.register_buffer("extra", torch.ones(1)),
    ],
    ids=[
        "eval",
        "hook",
        "global-hook",
        "forward",
        "deleted",
        "replaced",
        "replaced-other-shape",
        "resized",
        "tensor-hook",
        "new-buffer",
    ],
)
def test_a_remembered_model_answers_as_a_full_check_would(change) -> None:
    """A change after a call that passed: the remembered artifact and a fresh load (which
    checks in full) refuse alike, with the same words, or compute alike."""
    run, model, x = _remembered(train)
    fresh_pair = precompile(train, _net(), x, backend="eager")  # loaded after the change
    handle = change(model)
    try:
        state = model_state(model)
        remembered = _called(run, model, x)
        if remembered[0] == "refused":  # a refused call wrote nothing, .grad included
            for key, value in model_state(model).items():
                assert (value is None) == (state[key] is None), key
                assert value is None or torch.equal(value, state[key]), key
        fresh = precompile.load(*fresh_pair)
        assert remembered == _called(fresh, model, x)
    finally:
        if isinstance(handle, torch.utils.hooks.RemovableHandle):
            handle.remove()


def test_the_class_forward_patched_after_a_call_is_refused(monkeypatch) -> None:
    run, model, x = _remembered(infer)
    monkeypatch.setattr(torch.nn.Linear, "forward", lambda self, x: x)
    with pytest.raises(PrecompileError, match="forward"):
        run(model, x)


def test_plain_specs_are_those_without_generic_features() -> None:
    def spec_of(fn: Callable[..., Any], *args: Any) -> Any:
        code = precompile(fn, *args, backend="eager")[0]
        from torch_precompile.spec import parse_spec

        return parse_spec(code)

    x = torch.randn(2, 4)
    # The first capture in a process may see the test runner's own lazy imports read.
    precompile(infer, torch.nn.Linear(4, 4), x, backend="eager")
    with torch.no_grad():
        assert is_plain(spec_of(infer, torch.nn.Linear(4, 4), x), True)
    assert is_plain(spec_of(infer, torch.nn.Linear(4, 4), x), True)  # results with history
    assert is_plain(spec_of(lambda x: x.sin(), x), True)
    assert is_plain(spec_of(lambda x: x.add_(1) * 2, x), True)  # writes its input
    assert not is_plain(spec_of(lambda x: x.add_(1), x), True)  # returns its input: an alias
    assert is_plain(spec_of(train, _net(), torch.randn(5, 4)), True)
    tied = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    tied[1].weight = tied[0].weight
    assert is_plain(spec_of(infer, tied, x), True)


class Tally(torch.nn.Module):
    """Writes a buffer in place at every call, as BatchNorm's running statistics."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)
        self.register_buffer("total", torch.zeros(5, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.total.add_(x)
        return self.fc(x) + self.total


def _tally(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return m(x)


def _scaled_in_place(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return m(x.mul_(2))


# (name, the input given for a model, whether it must hold the same values as the capture's)
WRITE_CALLS: list[tuple[str, Callable[[torch.nn.Module], torch.Tensor]]] = [
    ("a tensor of its own", lambda m: torch.randn(5, 4)),
    ("the written buffer itself", lambda m: m.total),
    ("a view of the written buffer", lambda m: m.total.view(4, 5).t().t().view(5, 4)),
    ("a transposed tensor", lambda m: torch.randn(4, 5).t()),
]


@pytest.mark.parametrize("backend", ["eager", "inductor"])
@pytest.mark.parametrize("fn", [_tally, _scaled_in_place], ids=["buffer", "input"])
def test_writes_in_place_are_plain_and_checked_as_the_generic_driver_does(backend, fn) -> None:
    """A graph that writes a buffer or an input in place: the plain artifact writes what eager
    writes, and refuses a call whose inputs share memory with what it writes, in the generic
    driver's words, leaving every tensor as it was."""
    torch.manual_seed(0)
    example = (Tally(), torch.randn(5, 4))
    with torch.no_grad():
        plain, generic = _both(fn, example, backend)
    assert "forward = PlainForward(" in plain and "class Driver" in generic
    for name, given in WRITE_CALLS:
        outcomes = []
        for code in (plain, generic):
            run = precompile.load(code, None)
            torch.manual_seed(1)
            model = Tally()
            x = given(model)
            before = (model_state(model), x.clone())
            try:
                with torch.no_grad():
                    outcomes.append(("ran", run(model, x), model.total.clone(), x.clone()))
            except PrecompileError as error:
                outcomes.append(("refused", str(error)))
                assert torch.equal(x, before[1]), name  # nothing written
                for key, value in model_state(model).items():
                    was = before[0][key]
                    assert value is was is None or torch.equal(value, was), (name, key)
        ours, theirs = outcomes
        assert ours[0] == theirs[0], (name, ours, theirs)
        assert ours[0] == "refused" or "buffer" not in name, name
        if ours[0] == "refused":
            assert ours[1] == theirs[1], name
            assert "shares memory" in ours[1] or "strides" in ours[1], name
            continue
        torch.manual_seed(1)
        model = Tally()
        x = given(model)
        with torch.no_grad():
            want = fn(model, x)
        for got, expected in zip(ours[1:], (want, model.total, x), strict=True):
            assert_same(got, expected)
        for got, expected in zip(theirs[1:], (want, model.total, x), strict=True):
            assert_same(got, expected)


def _adamw_step(
    m: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, t: torch.Tensor
) -> torch.Tensor:
    loss = torch.nn.functional.cross_entropy(m(x), t)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def _stepped_once(m: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    _adamw_step(m, opt, torch.randn(5, 4), torch.tensor([0, 1, 2, 0, 1]))


def _wrong_state(m: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    _stepped_once(m, opt)
    opt.state[m.fc.weight]["exp_avg"] = torch.zeros(3)


def _stale_grad(m: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    m.fc.weight.grad = torch.ones_like(m.fc.weight)


def _decay(m: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.param_groups[0]["weight_decay"] = 0.5


def _lr_text(m: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.param_groups[0]["lr"] = "fast"


def _scheduled(m: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.param_groups[0]["lr"] = 0.5


def _hooked(m: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.register_step_pre_hook(lambda *_: None)


# (name, how the optimizer is built over the model, a change to both before the call)
OPTIMIZER_CALLS: list[tuple[str, Callable[..., Any], Callable[..., None]]] = [
    ("fresh", lambda m: torch.optim.AdamW(m.parameters(), lr=0.1), lambda m, o: None),
    ("stepped before", lambda m: torch.optim.AdamW(m.parameters(), lr=0.1), _stepped_once),
    ("another lr", lambda m: torch.optim.AdamW(m.parameters(), lr=0.1), _scheduled),
    ("another class", lambda m: torch.optim.Adam(m.parameters(), lr=0.1), lambda m, o: None),
    (
        "two groups",
        lambda m: torch.optim.AdamW([{"params": [m.fc.weight]}, {"params": [m.fc.bias]}]),
        lambda m, o: None,
    ),
    ("other parameters", lambda m: torch.optim.AdamW(_net().parameters()), lambda m, o: None),
    ("an option changed", lambda m: torch.optim.AdamW(m.parameters(), lr=0.1), _decay),
    ("lr not a number", lambda m: torch.optim.AdamW(m.parameters(), lr=0.1), _lr_text),
    ("a stale grad", lambda m: torch.optim.AdamW(m.parameters(), lr=0.1), _stale_grad),
    ("state of another shape", lambda m: torch.optim.AdamW(m.parameters()), _wrong_state),
    ("a step hook", lambda m: torch.optim.AdamW(m.parameters(), lr=0.1), _hooked),
]


def _optimizer_outcome(code: str, build: Callable[..., Any], change: Callable[..., None]) -> Any:
    run = precompile.load(code, None)
    torch.manual_seed(3)
    model = _net()
    opt = build(model)
    change(model, opt)
    x, t = torch.randn(5, 4), torch.tensor([2, 1, 0, 0, 1])
    before = (model_state(model), {k: dict(v) for k, v in opt.state.items()})
    try:
        loss = run(model, opt, x, t)
    except PrecompileError as error:
        assert model_state(model).keys() == before[0].keys()
        for key, value in model_state(model).items():
            was = before[0][key]
            assert value is was is None or torch.equal(value, was), key
        assert {k: dict(v) for k, v in opt.state.items()} == before[1]  # nothing installed
        return ("refused", str(error), error.check_stage)
    state = [v.clone() for entries in opt.state.values() for v in entries.values()]
    return ("ran", loss, [p.detach().clone() for p in model.parameters()], state)


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_an_optimizer_step_is_plain_and_checked_as_the_generic_driver_does(backend) -> None:
    """An optimizer argument: the plain artifact steps it as the generic driver does and
    refuses what it refuses, with its words, leaving model, gradients and state as they were."""
    torch.manual_seed(0)
    example = (_net(), torch.randn(5, 4), torch.tensor([0, 1, 2, 0, 1]))
    opt = torch.optim.AdamW(example[0].parameters(), lr=0.1)
    plain, generic = _both(_adamw_step, (example[0], opt, *example[1:]), backend)
    assert "OPTIMIZERS = OptimizerSteps([" in plain and "class Driver" in generic
    refused = 0
    for name, build, change in OPTIMIZER_CALLS:
        ours = _optimizer_outcome(plain, build, change)
        theirs = _optimizer_outcome(generic, build, change)
        assert ours[0] == theirs[0], (name, ours, theirs)
        if ours[0] == "refused":
            refused += 1
            assert ours[1:] == theirs[1:], name
            continue
        for got, want in zip(ours[1:], theirs[1:], strict=True):
            assert_same(got, want)
    assert refused == 8


class TiedHead(torch.nn.Module):
    """An embedding and an output layer sharing one weight, as language models do."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(10, 4)
        self.fc = torch.nn.Linear(4, 4)
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.fc(self.emb(ids))))


def _untied(m: TiedHead) -> None:
    m.head.weight = torch.nn.Parameter(m.emb.weight.detach().clone())


def _tied_elsewhere(m: TiedHead) -> None:
    m.head.weight = torch.nn.Parameter(torch.randn(10, 4))
    m.emb.weight = m.head.weight


def _fc_tied(m: TiedHead) -> None:
    m.fc.bias = m.fc.bias
    m.fc.weight = m.emb.weight  # a tie the capture did not have (and another shape)


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_tied_weights_are_plain_and_checked_as_the_generic_driver_does(backend) -> None:
    """One tensor per tie, a gradient for it as eager gives, and a call whose ties differ
    refused in the generic driver's words."""
    torch.manual_seed(0)
    ids = torch.randint(0, 10, (3, 5))
    plain, generic = _both(train, (TiedHead(), ids), backend)
    assert "forward = PlainForward(" in plain and "class Driver" in generic
    for change in (lambda m: None, _untied, _tied_elsewhere, _fc_tied):
        outcomes = []
        for code in (plain, generic):
            torch.manual_seed(1)
            model = TiedHead()
            change(model)
            try:
                outcomes.append(
                    ("ran", precompile.load(code, None)(model, ids), model.emb.weight.grad)
                )
            except PrecompileError as error:
                outcomes.append(("refused", str(error)))
        assert outcomes[0][0] == outcomes[1][0], outcomes
        if outcomes[0][0] == "refused":
            assert outcomes[0][1] == outcomes[1][1]
        else:
            torch.manual_seed(1)
            model = TiedHead()
            change(model)  # tied elsewhere: the same ties over other tensors runs
            want = train(model, ids)
            for ran in outcomes:
                assert_same(ran[1], want)
                assert_same(ran[2], model.emb.weight.grad)


SCALE = 2.0


def scaled(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return m(x) * SCALE


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_a_global_read_is_plain_and_checked_as_the_generic_driver_does(backend) -> None:
    """A global fn reads: GLOBALS checks it at every call, refusing another value in the
    generic driver's words, at the same stage."""
    global SCALE
    model, x = _net(), torch.randn(5, 4)
    with torch.no_grad():
        plain, generic = _both(scaled, (model, x), backend)
    assert "GLOBALS = GlobalReads([" in plain and "class Driver" in generic
    runs = [precompile.load(code, None) for code in (plain, generic)]
    with torch.no_grad():
        for run in runs:
            assert_same(run(model, x), scaled(model, x))
        SCALE = 3.0
        try:
            refusals = []
            for run in runs:
                with pytest.raises(PrecompileError, match="global 'SCALE' of module") as info:
                    run(model, x)
                refusals.append((str(info.value), info.value.check_stage))
            assert refusals[0] == refusals[1]
        finally:
            SCALE = 2.0
        for run in runs:
            assert_same(run(model, x), scaled(model, x))


def test_a_plain_artifact_runs_in_a_fresh_process(tmp_path) -> None:
    model, x = _net(), torch.randn(5, 4)
    code, _ = precompile(train, model, x, backend="eager")
    (tmp_path / "artifact.py").write_text(code)
    out = run_python(
        "import torch, runpy\n"
        f"namespace = runpy.run_path({str(tmp_path / 'artifact.py')!r})\n"
        "torch.manual_seed(0)\n"
        "from test_plain_artifact import _net, train\n"
        "m, e = _net(), _net()\n"
        "x = torch.randn(5, 4)\n"
        "got, want = namespace['forward'](m, x), train(e, x)\n"
        "assert torch.allclose(got, want, atol=1e-6)\n"
        "assert torch.allclose(m.fc.weight.grad, e.fc.weight.grad, atol=1e-6)\n"
        "try:\n"
        "    namespace['forward'](m.eval(), x)\n"
        "except Exception as error:\n"
        "    print(type(error).__name__, 'eval mode' in str(error))\n"
    )
    assert "PrecompileError True" in out.stdout, out.stderr


def _momentum_step(m: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> Any:
    loss = m(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def test_an_aliased_written_input_is_refused_before_an_optimizer_changes() -> None:
    """A graph that writes a buffer, with an optimizer argument: a call passing that buffer
    as its input is refused before a fresh optimizer is given its zero state, in both forms."""
    captured = Tally()
    opt = torch.optim.SGD(captured.parameters(), lr=0.1, momentum=0.9)
    refusals = []
    for code in _both(_momentum_step, (captured, opt, torch.randn(5, 4)), "eager"):
        model = Tally()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        with pytest.raises(PrecompileError, match="shares memory") as info:
            precompile.load(code, None)(model, opt, model.total)
        assert len(opt.state) == 0 and torch.equal(model.total, torch.zeros(5, 4))
        refusals.append((str(info.value), info.value.check_stage))
    assert refusals[0] == refusals[1]
