"""Python state that fn changes while it is traced is refused at capture, never baked.

A trace records tensor operations only. Before this check, such state changed once, at capture,
and every call replayed that first change: a silently wrong result.
"""

from __future__ import annotations

import copy
import itertools
import logging

import pytest
import torch

import held_state
from test_optimizers import step
from torch_precompile import PrecompileError, precompile

from conftest import assert_same


class Counter(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.lin(x) * self.calls


class Recorder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.seen: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(x.shape[0])
        return self.lin(x)


def test_a_counter_attribute_is_refused_and_put_back(backend: str) -> None:
    """Before (torch-precompile 0.3.0): the artifact scaled by the capture-time count (1) at
    every call; on the third call eager scales by 3, and the outputs differed by up to 1.9
    (eager backend) and 3.0 (inductor) on this model."""
    model = Counter()
    with pytest.raises(
        PrecompileError,
        match=r"^fn changed attribute 'calls' of model m while it "
        r"was traced\..*register_buffer.*\(Capture put the old value back\.\)$",
    ):
        precompile(lambda m, x: m(x), model, torch.randn(2, 4), backend=backend)
    assert model.calls == 0


def test_a_list_appended_to_is_refused_and_put_back(backend: str) -> None:
    model = Recorder()
    seen = model.seen
    with pytest.raises(PrecompileError, match="fn changed attribute 'seen' of model m"):
        precompile(lambda m, x: m(x), model, torch.randn(2, 4), backend=backend)
    assert model.seen is seen and seen == []


class LazyTotal(torch.nn.Module):
    """Keeps a running total in a tensor it creates on the first call."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not hasattr(self, "total"):
            self.total = torch.zeros(())
        self.total = self.total + x.sum()
        return self.lin(x) * self.total


def test_a_tensor_fn_creates_and_keeps_is_refused_not_taken_for_a_literal(backend: str) -> None:
    """The total carries from one call to the next; as a literal built inside fn, every call
    would start it from zero again."""
    model = LazyTotal()
    with pytest.raises(
        PrecompileError,
        match=r"fn changed attribute 'total' of model m \(added "
        r"by fn\) while it was traced",
    ):
        precompile(lambda m, x: m(x), model, torch.randn(2, 4), backend=backend)
    assert not hasattr(model, "total")


class LazyBuffer(torch.nn.Module):
    """Registers a buffer on its first call."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if "offset" not in self._buffers:
            self.register_buffer("offset", torch.ones(4))
        return self.lin(x) + self.offset


def test_a_buffer_fn_registers_is_refused_and_taken_back(backend: str) -> None:
    """Before (0.14.0): the buffer was baked into the graph as a literal, and the model kept
    it from capture on: updates to it never reached the artifact."""
    model = LazyBuffer()
    with pytest.raises(
        PrecompileError,
        match=r"fn changed buffer 'offset' of model m \(registered by fn\).*Register it before",
    ):
        precompile(lambda m, x: m(x), model, torch.randn(2, 4), backend=backend)
    assert "offset" not in model._buffers


class Settings:
    """A mutable object: what fn reads of it could change after capture unseen."""

    def __init__(self) -> None:
        self.scale = 2.0


def test_an_unknown_stateful_object_argument_is_refused(backend: str) -> None:
    """Before (torch-precompile 0.4.0): an object was baked by its repr, so an object whose repr
    hides its state (here scale) was baked silently as it was at capture."""
    model = torch.nn.Linear(4, 4)
    with pytest.raises(
        PrecompileError,
        match=r"input settings is a test_python_state.Settings, "
        r"which is neither a tensor nor an immutable value",
    ):
        precompile(
            lambda m, x, settings: m(x) * settings.scale,
            model,
            torch.randn(2, 4),
            Settings(),
            backend=backend,
        )


def test_an_option_changed_inside_fn_is_refused(backend: str) -> None:
    def halving(
        model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, t: torch.Tensor
    ) -> torch.Tensor:
        opt.param_groups[0]["lr"] *= 0.5
        return step(model, opt, x, t)

    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(PrecompileError, match="fn changed 'lr' of param group 0 of optimizer opt"):
        precompile(halving, model, opt, torch.randn(2, 4), torch.tensor([0, 2]), backend=backend)
    assert opt.param_groups[0]["lr"] == 0.1


def test_a_stateless_optimizer_inside_fn_trains_like_eager(backend: str) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    eager = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    eager_opt = torch.optim.SGD(eager.parameters(), lr=0.1)
    start = copy.deepcopy(model.state_dict())
    run = precompile.load(
        *precompile(step, model, opt, torch.randn(2, 4), torch.tensor([0, 2]), backend=backend)
    )
    assert_same(model.state_dict(), start)  # capture applied no update
    for seed in range(1, 4):
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(seed))
        t = torch.tensor([seed % 3, 1])
        assert_same(run(model, opt, x, t), step(eager, eager_opt, x, t))
    assert_same(model.state_dict(), eager.state_dict())


def test_fn_failing_after_changing_state_reports_its_own_error(backend: str) -> None:
    def failing(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        model.calls += 1
        raise ValueError("fn's own failure")

    model = Counter()
    with pytest.raises(ValueError, match="fn's own failure"):
        precompile(failing, model, torch.randn(2, 4), backend=backend)
    assert model.calls == 0


STEPS = 0


def count_then_scale(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    global STEPS
    STEPS += 1
    return m(x) * STEPS


def _bump() -> int:
    global STEPS
    STEPS += 1
    return STEPS


def scale_by_helper(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return m(x) * _bump()


def test_a_global_fn_assigns_is_refused_and_put_back(backend: str) -> None:
    """Before: ``global STEPS; STEPS += 1`` ran once, at capture, and the artifact scaled by
    the capture's count at every call while eager counted on (silently different from the
    first call on). A helper of fn's module that assigns is followed too."""
    for fn, by in ((count_then_scale, "fn"), (scale_by_helper, "_bump")):
        with pytest.raises(
            PrecompileError,
            match=rf"^fn changed global 'STEPS' of module test_python_state, which {by}.* "
            r"assigns, while it was traced\..*\(Capture put the old value back\.\)$",
        ):
            precompile(fn, torch.nn.Linear(4, 4), torch.randn(2, 4), backend=backend)
        assert STEPS == 0


def test_a_closure_variable_fn_assigns_is_refused_and_put_back(backend: str) -> None:
    calls = 0

    def counted(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        nonlocal calls
        calls += 1
        return m(x) * calls

    with pytest.raises(PrecompileError, match=r"fn changed the 'calls' it closes over, which"):
        precompile(counted, torch.nn.Linear(4, 4), torch.randn(2, 4), backend=backend)
    assert calls == 0


def test_a_global_assigned_its_own_value_passes(backend: str) -> None:
    """Only a change is refused: setting a flag to the value it holds changes nothing."""

    def same(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        global STEPS
        STEPS = 0
        return m(x)

    model, x = torch.nn.Linear(4, 4), torch.randn(2, 4)
    run = precompile.load(*precompile(same, model, x, backend=backend))
    assert_same(run(model, x), model(x))


class Stats:
    """A plain object of the user's that fn keeps a count in."""

    def __init__(self) -> None:
        self.calls = 0


STATS = Stats()
COUNTER = itertools.count(1)


def count_in_an_object(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    STATS.calls += 1
    return m(x) * STATS.calls


def scale_by_next(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return m(x) * next(COUNTER)


def test_an_attribute_of_a_global_object_fn_changes_is_refused_and_put_back(backend) -> None:
    """Before: ``STATS.calls += 1`` ran once, at capture; every call scaled by 1 while eager
    counted on."""
    with pytest.raises(
        PrecompileError,
        match=r"^fn changed attribute 'calls' of global 'STATS' of module test_python_state, "
        r"which fn \(count_in_an_object\) reaches, while it was traced\.",
    ):
        precompile(count_in_an_object, torch.nn.Linear(4, 4), torch.randn(2, 4), backend=backend)
    assert STATS.calls == 0 and vars(STATS) == {"calls": 0}


class Trainer:
    """A training loop's object whose bound ``step`` is fn, counting its steps."""

    def __init__(self) -> None:
        self.steps = 0

    def step(self, m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        self.steps += 1
        return m(x) * self.steps

    __call__ = step


@pytest.mark.parametrize("form", ["bound method", "callable object"])
def test_an_attribute_of_the_object_fn_belongs_to_is_refused_and_put_back(
    backend: str, form: str
) -> None:
    """Before: ``self.steps += 1`` in a trainer's bound step ran once, at capture, and stayed
    (steps == 1); every call scaled by 1 while eager counted on."""
    trainer = Trainer()
    fn = trainer.step if form == "bound method" else trainer
    shown = {
        "bound method": r"the Trainer that fn \(Trainer\.step\) belongs to",
        "callable object": r"fn \(Trainer\), a callable Trainer",
    }[form]
    with pytest.raises(
        PrecompileError, match=rf"^fn changed attribute 'steps' of {shown}, while it was traced\."
    ):
        precompile(fn, torch.nn.Linear(4, 4), torch.randn(2, 4), backend=backend)
    assert vars(trainer) == {"steps": 0}


def test_an_object_fn_only_reads_passes_and_is_checked(backend) -> None:
    model, x = torch.nn.Linear(4, 4), torch.randn(2, 4)
    STATS.calls = 2
    try:
        run = precompile.load(
            *precompile(lambda m, x: m(x) * STATS.calls, model, x, backend=backend)
        )
        assert_same(run(model, x), model(x) * 2)
        STATS.calls = 3
        with pytest.raises(PrecompileError, match="STATS"):
            run(model, x)
    finally:
        STATS.calls = 0


def test_an_iterator_fn_reads_is_refused_at_capture(backend) -> None:
    """Before: the number ``next(COUNTER)`` gave at capture was a constant of the graph."""
    with pytest.raises(
        PrecompileError,
        match=r"^fn \(scale_by_next\) reads global 'COUNTER' of module test_python_state, an "
        r"iterator \(count\).*Pass what it yields as an argument of fn\.$",
    ):
        precompile(scale_by_next, torch.nn.Linear(4, 4), torch.randn(2, 4), backend=backend)
    assert next(copy.copy(COUNTER)) == 1  # not advanced by the refused capture


class CountedCalls(torch.nn.Module):
    """Counts its calls in a class attribute."""

    count = 0

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        type(self).count += 1
        return self.lin(x) * type(self).count


def step_in_a_module_dict(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    held_state.STATE["step"] += 1
    return m(x) * held_state.STATE["step"]


def doubled_module_global(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    held_state.SCALE = held_state.SCALE * 2
    return m(x) * held_state.SCALE


def test_state_of_the_users_modules_and_classes_fn_changes_is_refused(backend) -> None:
    """Before: a class-level counter, a dict of another module of the user's and a global of
    that module set through it changed once, at capture, and every call replayed that."""
    cases = [
        (lambda m, x: m(x), CountedCalls(), r"attribute 'count' of class CountedCalls"),
        (step_in_a_module_dict, torch.nn.Linear(4, 4), r"global 'STATE' of module held_state"),
        (doubled_module_global, torch.nn.Linear(4, 4), r"global 'SCALE' of module held_state"),
    ]
    for fn, model, named in cases:
        with pytest.raises(PrecompileError, match=rf"^fn changed {named}.*put the old value"):
            precompile(fn, model, torch.randn(2, 4), backend=backend)
    assert CountedCalls.count == 0
    assert held_state.STATE == {"step": 0} and held_state.SCALE == 1.0


def test_a_logger_fn_uses_is_no_state_of_the_users(backend) -> None:
    """A library's object keeps its own state (a logger fills its caches as it is used)."""
    log = logging.getLogger("test_python_state.fn")

    def logged(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        log.info("step")
        return m(x)

    model, x = torch.nn.Linear(4, 4), torch.randn(2, 4)
    run = precompile.load(*precompile(logged, model, x, backend=backend))
    assert_same(run(model, x), model(x))


class KeepsStats(torch.nn.Module):
    """Holds an object of the user's as an attribute and counts in it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.stats = Stats()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.stats.calls += 1
        return self.lin(x) * self.stats.calls


def test_an_object_a_module_holds_that_fn_changes_is_refused_and_put_back(backend) -> None:
    """Before: ``self.stats.calls += 1`` ran once, at capture; every call scaled by 1."""
    model = KeepsStats()
    with pytest.raises(
        PrecompileError, match=r"^fn changed attribute 'calls' of 'stats' of model m, while"
    ):
        precompile(lambda m, x: m(x), model, torch.randn(2, 4), backend=backend)
    assert model.stats.calls == 0
