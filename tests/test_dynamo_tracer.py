"""``tracer="dynamo"``: Dynamo reads fn's Python, and each guard becomes a check or a report.

Each test changes what fn's Python read after capture (a global, a class attribute, a
submodule's attribute, a value fn closes over, a hook, the ambient state) and expects the
artifact to match eager or to refuse naming the cause; graph breaks are carried (backward, an
optimizer step, a value read off a tensor) or refused naming the line; the guard report is
read back by ``inspect``; a saved, signed pair loads in a fresh process.
"""

from __future__ import annotations

import copy
import inspect
import json
import logging
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from torch_precompile import PrecompileError, precompile
from torch_precompile.inspection import describe, render

from conftest import run_python

SCALE = 2.0


class Settings:
    factor = 3.0  # a class attribute, read through the instance below


SETTINGS = Settings()


class Other:
    factor = 3.0


class Scaled(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inner = torch.nn.Linear(4, 3)
        self.inner.gain = 1.5  # a plain attribute of a submodule

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) * self.inner.gain


def scaled(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return m(x) * SCALE * SETTINGS.factor


def make_closure(c: float) -> Any:
    def fn(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return m(x) * c

    return fn


class Gain:
    def __init__(self, g: float) -> None:
        self.g = g


def make_helper(gain: Gain) -> Any:
    def helper(y: torch.Tensor) -> torch.Tensor:
        return y * gain.g

    return helper


CLOSED = make_closure(2.5)  # fn held in a global: a call finds its closure through it
HELPER = make_helper(Gain(3.0))  # a helper fn calls, closing over an object of the user's


def with_helper(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return HELPER(m(x))


@pytest.fixture
def restore_globals() -> Any:
    saved = (SCALE, Settings.factor, SETTINGS)
    yield
    globals()["SCALE"], Settings.factor, globals()["SETTINGS"] = saved


def _pair(fn: Any, *args: Any, backend: str = "eager", **options: Any) -> tuple[str, bytes]:
    return precompile(fn, *args, backend=backend, tracer="dynamo", **options)


def test_globals_read_by_fn_are_checked_at_every_call(backend: str, restore_globals: Any) -> None:
    m, x = Scaled(), torch.randn(2, 4)
    code, cache = _pair(scaled, m, x, backend=backend)
    f = precompile.load(code, cache)
    torch.testing.assert_close(f(m, x), scaled(m, x))
    globals()["SCALE"] = 5.0
    with pytest.raises(PrecompileError, match=r"global 'SCALE' of module test_dynamo_tracer is 5"):
        f(m, x)
    globals()["SCALE"] = 2.0
    Settings.factor = 4.0  # a class attribute read through an instance: the trace missed it
    with pytest.raises(PrecompileError, match=r"'Settings\.factor' of module test_dynamo_tracer"):
        f(m, x)
    Settings.factor = 3.0
    _refused_while_bound("SETTINGS", Other(), "SETTINGS", f, m, x)  # another class, same value
    torch.testing.assert_close(f(m, x), scaled(m, x))


def _refused_while_bound(name: str, value: Any, match: str, f: Any, *args: Any) -> None:
    """``f(*args)`` is refused, matching ``match``, while this module's global ``name`` is
    ``value``; then the global is put back."""
    kept = globals()[name]
    globals()[name] = value
    try:
        with pytest.raises(PrecompileError, match=match):
            f(*args)
    finally:
        globals()[name] = kept


def test_a_closure_value_is_reported_dropped_and_refused_on_request(
    backend: str, caplog: pytest.LogCaptureFixture
) -> None:
    m, x = torch.nn.Linear(4, 3), torch.randn(2, 4)
    fn = make_closure(2.5)
    with caplog.at_level(logging.WARNING, "torch_precompile"):
        code, _ = _pair(fn, m, x, backend=backend)
    assert "tracer='dynamo' dropped 1 guard(s)" in caplog.text and "c=2.5" in caplog.text
    dropped = [g for g in precompile.inspect(code).guards if g.outcome == "dropped"]
    assert [(g.kind, g.reads) for g in dropped] == [("CONSTANT_MATCH", "L['c']")]
    with pytest.raises(PrecompileError, match=r"require_all_guards=True: .* L\['c'\]: a value fn"):
        _pair(fn, m, x, backend=backend, require_all_guards=True)
    # Without anything to drop, require_all_guards takes the capture.
    code, _ = _pair(lambda m, x: m(x) * 2, m, x, backend=backend, require_all_guards=True)
    assert not [g for g in precompile.inspect(code).guards if g.outcome == "dropped"]


def test_closure_values_of_fn_held_in_a_global_are_checked_at_every_call(
    backend: str, restore_globals: Any
) -> None:
    m, x = torch.nn.Linear(4, 3), torch.randn(2, 4)
    code, cache = _pair(CLOSED, m, x, backend=backend, require_all_guards=True)
    checked = {g.reads: g.by for g in precompile.inspect(code).guards if g.outcome == "checked"}
    assert checked["L['c']"] == "read value CLOSED.__closure__.c == 2.5"
    f = precompile.load(code, cache)
    torch.testing.assert_close(f(m, x), CLOSED(m, x))
    cell = CLOSED.__closure__[0]
    cell.cell_contents = 3.0  # as a nonlocal assignment would
    refused = r"closure variable 'c' of CLOSED \(module test_dynamo_tracer\) is 3.0, but was 2.5"
    with pytest.raises(PrecompileError, match=refused):
        f(m, x)
    cell.cell_contents = 2.5
    again = make_closure(4.0)  # fn made again with another value
    _refused_while_bound("CLOSED", again, "closure variable 'c' of CLOSED .* is 4.0", f, m, x)
    torch.testing.assert_close(f(m, x), CLOSED(m, x))


def test_a_helpers_closure_and_a_global_objects_values_are_checked(
    backend: str, restore_globals: Any
) -> None:
    m, x = torch.nn.Linear(4, 3), torch.randn(2, 4)
    code, cache = _pair(with_helper, m, x, backend=backend)
    notes = {g.reads: g for g in precompile.inspect(code).guards}
    assert notes["G['HELPER'].__closure__[0].cell_contents.g"].outcome == "checked"
    assert notes["G['HELPER']"].outcome == "dropped"  # its code: a function no check compares
    f = precompile.load(code, cache)
    torch.testing.assert_close(f(m, x), with_helper(m, x))
    gain = HELPER.__closure__[0].cell_contents
    gain.g = 5.0  # changed in place, inside the object the helper closes over
    refused = r"closure variable 'gain.g' of HELPER \(module test_dynamo_tracer\) is 5.0"
    with pytest.raises(PrecompileError, match=refused):
        f(m, x)
    gain.g = 3.0
    stepper = STEPPER  # a method of an object held in a global reads its values there
    g = precompile.load(*_pair(stepper.step, m, x, backend=backend, require_all_guards=True))
    torch.testing.assert_close(g(m, x), stepper.step(m, x))
    stepper.scale = 4.0
    with pytest.raises(PrecompileError, match="global 'STEPPER.scale' of module .* is 4.0"):
        g(m, x)
    stepper.scale = 2.0
    torch.testing.assert_close(g(m, x), stepper.step(m, x))


def test_a_submodule_attribute_type_and_hooks_are_checked() -> None:
    m, x = Scaled(), torch.randn(2, 4)
    f = precompile.load(*_pair(lambda m, x: m(x), m, x))
    torch.testing.assert_close(f(m, x), m(x))
    m.inner.gain = 2.0
    with pytest.raises(PrecompileError, match="gain"):
        f(m, x)
    m.inner.gain = 1.5
    handle = m.inner.register_forward_hook(lambda mod, args, out: out * 2)
    with pytest.raises(PrecompileError, match="hook"):
        f(m, x)
    handle.remove()
    torch.testing.assert_close(f(m, x), m(x))
    guards = f.spec.guards
    by = {(g.kind, g.reads): g for g in guards}
    assert by[("CONSTANT_MATCH", "L['m']._modules[...].gain")].by == "read value gain == 1.5"
    assert any(g.by == "hook checks" for g in guards)


def test_ambient_state_is_checked() -> None:
    m, x = torch.nn.Linear(4, 3), torch.randn(2, 4)
    f = precompile.load(*_pair(lambda m, x: m(x), m, x))
    kinds = {g.kind: g for g in f.spec.guards}
    assert kinds["GRAD_MODE"].outcome == kinds["GLOBAL_STATE"].outcome == "checked"
    with (
        torch.autocast("cpu", dtype=torch.bfloat16),
        pytest.raises(PrecompileError, match="autocast"),
    ):
        f(m, x)


def _train_step(m: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> torch.Tensor:
    loss = m(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def test_a_training_step_is_carried_across_its_graph_breaks_and_capture_changes_nothing() -> None:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    twin = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    twin.load_state_dict(m.state_dict())
    opt = torch.optim.AdamW(m.parameters(), lr=0.01)
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=0.01)
    x = torch.randn(5, 4)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    f = precompile.load(*_pair(_train_step, m, opt, x))
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())
    assert not opt.state and all(p.grad is None for p in m.parameters())
    for _ in range(3):
        torch.testing.assert_close(f(m, opt, x), _train_step(twin, twin_opt, x))
    torch.testing.assert_close(m.state_dict(), twin.state_dict())
    opt.param_groups[0]["weight_decay"] = 0.5
    with pytest.raises(PrecompileError, match="weight_decay"):
        f(m, opt, x)


def test_a_value_read_off_a_tensor_is_carried_and_checked_per_call() -> None:
    m = torch.nn.Linear(4, 3)

    def fn(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        y = m(x)
        return y * 2 if x.sum().item() > 0 else y

    x = torch.ones(2, 4)
    f = precompile.load(*_pair(fn, m, x))
    torch.testing.assert_close(f(m, x), fn(m, x))
    # The refusal names the read (where fn made it), the value carried from capture and the
    # value this call's graph gave.
    line = fn.__code__.co_firstlineno + 2
    with pytest.raises(
        PrecompileError,
        match=r"^this call left the path the artifact was captured on: a tensor value read into "
        rf"Python \(bool\(\), \.item\(\), int\(\)\) at test_dynamo_tracer\.py:{line} \(fn\) was "
        r"8\.0 at capture and is -8\.0 now, so the result would be wrong: it is withheld\.",
    ):
        f(m, -x)


STEP_LOG = logging.getLogger("tests.dynamo_step")


def print_first(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    print("step")
    return m(x)


def print_after(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    y = m(x)
    print("step")
    return y


def log_first(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    logging.info("step")
    return m(x)


def log_after(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    y = m(x)
    logging.info("step")
    return y


def logger_first(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    STEP_LOG.warning("step")
    return m(x)


@pytest.mark.parametrize(
    ("fn", "call", "what"),
    [
        (print_first, 'print("step")', "print"),
        (print_after, 'print("step")', "print"),
        (log_first, 'logging.info("step")', "logging.info"),
        (log_after, 'logging.info("step")', "logging.info"),
        (logger_first, 'STEP_LOG.warning("step")', "logging.warning"),
    ],
    ids=["print-first", "print-after", "logging-first", "logging-after", "logger-first"],
)
def test_a_print_or_logging_call_is_refused_naming_the_line(fn: Any, call: str, what: str) -> None:
    """A print or logging call would run once, at capture: refused by its line, before the
    first tensor operation (where Dynamo has no graph to end) as after it."""
    m, x = torch.nn.Linear(4, 3), torch.randn(2, 4)
    lines, first = inspect.getsourcelines(fn)
    line = first + next(i for i, text in enumerate(lines) if call in text)
    with pytest.raises(
        PrecompileError,
        match=rf"^tracer='dynamo' refuses what fn prints, logs or warns: {re.escape(what)} "
        rf"\(test_dynamo_tracer\.py:{line} \({fn.__name__}\)\)\. Each would run once, at "
        r"capture, and never at a call of the artifact: move it out of fn, around the "
        r"artifact's call, or capture with tracer='make_fx' \(the default\), which runs it "
        r"once at capture and warns of it\.$",
    ):
        _pair(fn, m, x)


class RecurrentHead(torch.nn.Module):
    """An LSTM first, then more: Dynamo breaks on the LSTM with no graph before it."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = torch.nn.LSTM(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(x)
        return out.relu() * 2


def run_model(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return m(x)


def test_a_torch_module_dynamo_does_not_read_is_carried_first_as_later() -> None:
    """Dynamo does not read an LSTM; the make_fx trace carries it, as a module's first
    operation too (where Dynamo has no graph before it)."""
    torch.manual_seed(0)
    m, x = RecurrentHead(), torch.randn(5, 1, 4)
    run = precompile.load(*_pair(run_model, m, x))
    with torch.no_grad():
        torch.testing.assert_close(run(m, x), m(x))


def test_an_internal_error_of_dynamo_is_refused_and_changes_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch._dynamo

    def broken(*args: Any, **kwargs: Any) -> Any:
        def run(fn: Any) -> Any:
            def call(*call_args: Any) -> Any:
                fn(*call_args)  # fn runs, as under Dynamo, and then Dynamo fails
                raise AssertionError("an invariant of this release's Dynamo")

            return call

        return run

    m, x = torch.nn.Linear(4, 3), torch.randn(2, 4)
    weight = m.weight.detach().clone()
    monkeypatch.setattr(torch._dynamo, "optimize", broken)
    with pytest.raises(
        PrecompileError,
        match=r"could not read fn: AssertionError: an invariant of this release's Dynamo\. "
        r"Capture with tracer='make_fx'",
    ):
        _pair(_step, m, x)
    assert m.weight.grad is None and torch.equal(m.weight, weight)


def _step(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    loss = m(x).square().mean()
    loss.backward()
    return loss.detach()


def test_inspect_lists_the_guard_report(tmp_path: Path) -> None:
    m, x = Scaled(), torch.randn(2, 4)
    path = tmp_path / "scaled.py"
    precompile.save(*_pair(make_closure(2.0), m, x), path)
    report = describe(path)
    assert report["tracer"] == "dynamo"
    outcomes = {g["outcome"] for g in report["dynamo_guards"]}
    assert outcomes == {"checked", "fixed", "dropped"}
    text = render(report)
    assert "  dynamo    : guards " in text and "dropped  CONSTANT_MATCH L['c']" in text
    cli = subprocess.run(
        [sys.executable, "-m", "torch_precompile", "inspect", str(path), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert json.loads(cli.stdout)["dynamo_guards"] == report["dynamo_guards"]


MODULE = """
import torch
SCALE = 2.0


def make(c):
    def fn(m, x):
        return m(x) * SCALE * c

    return fn


fn = make(1.5)
"""


def test_a_signed_pair_loads_in_a_fresh_process_with_and_without_its_cache(
    tmp_path: Path,
) -> None:
    (tmp_path / "dyn_fn.py").write_text(MODULE)
    script = f"""
        import sys, torch
        sys.path.insert(0, {str(tmp_path)!r})
        import dyn_fn
        from torch_precompile import precompile
        torch.manual_seed(0)
        m, x = torch.nn.Linear(4, 3), torch.randn(2, 4)
        torch.save((m.state_dict(), x), {str(tmp_path / "inputs.pt")!r})
        code, cache = precompile(dyn_fn.fn, m, x, backend="eager", tracer="dynamo", sign_key=b"k")
        precompile.save(code, cache, {str(tmp_path / "a.py")!r}, sign_key=b"k")
    """
    made = run_python(script)
    assert made.returncode == 0, made.stderr
    for with_cache in (True, False):
        use = f"""
            import sys, torch
            sys.path.insert(0, {str(tmp_path)!r})
            import dyn_fn
            from torch_precompile import precompile, PrecompileError
            state, x = torch.load({str(tmp_path / "inputs.pt")!r})
            m = torch.nn.Linear(4, 3); m.load_state_dict(state)
            if {with_cache}:
                f = precompile.load_file({str(tmp_path / "a.py")!r}, verify_key=b"k")
            else:
                f = precompile.load(open({str(tmp_path / "a.py")!r}).read(), None)
            assert "torch._dynamo" not in sys.modules and "torch._inductor" not in sys.modules
            torch.testing.assert_close(f(m, x), dyn_fn.fn(m, x))
            for name, value in (("SCALE", 3.0), ("fn", dyn_fn.make(2.5))):
                kept = getattr(dyn_fn, name)
                setattr(dyn_fn, name, value)
                try:
                    f(m, x)
                except PrecompileError as e:
                    print("refused:", e)
                setattr(dyn_fn, name, kept)
        """
        used = run_python(textwrap.dedent(use))
        assert used.returncode == 0, used.stderr
        assert "refused: global 'SCALE' of module dyn_fn is 3.0" in used.stdout
        assert "refused: closure variable 'c' of fn (module dyn_fn) is 2.5" in used.stdout


def test_what_dynamo_does_not_read_yet_is_refused_by_name() -> None:
    from scaled_tensor import quantized_linear

    model = quantized_linear(torch.nn.Sequential(torch.nn.Linear(8, 4)).eval())
    with torch.no_grad(), pytest.raises(PrecompileError, match="does not read tensor subclasses"):
        _pair(lambda m, x: m(x), model, torch.randn(2, 8))


class Stepper:
    def __init__(self) -> None:
        self.scale = 2.0

    def __call__(self, m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return m(x) * self.scale

    def step(self, m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return m(x) * self.scale


STEPPER = Stepper()


def test_a_callable_objects_own_values_are_dropped_guards() -> None:
    m, x = torch.nn.Linear(4, 3), torch.randn(2, 4)
    stepper = Stepper()
    code, _ = _pair(stepper, m, x)  # a callable object: Dynamo reads its __call__
    dropped = [g for g in precompile.inspect(code).guards if g.outcome == "dropped"]
    assert [g.reads for g in dropped] == ["L['self']", "L['self'].scale"], dropped
    assert all("held by fn, not passed to it" in g.by for g in dropped)


def test_capture_puts_back_gradients_data_writes_and_leaves_no_environment() -> None:
    m = torch.nn.Linear(4, 3)
    m.weight.grad = torch.ones(3, 4)  # a backward at capture would add to it in place
    m.weight.register_hook(lambda g: g * 3)

    def step(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        m.bias.data.add_(0.0)  # a write through .data moves no version counter
        scale = float(os.environ.get("TP_DYNAMO_SCALE", "1"))
        loss = (m(x) * scale).square().mean()
        loss.backward()
        return loss.detach()

    os.environ["TP_DYNAMO_SCALE"], os.environ["TP_DYNAMO_SECRET"] = "2", "hunter2"
    try:
        before = {k: v.clone() for k, v in m.state_dict().items()}
        x = torch.randn(5, 4)
        code, cache = _pair(step, m, x)
        assert torch.equal(m.weight.grad, torch.ones(3, 4)) and m.bias.grad is None
        assert all(torch.equal(v, m.state_dict()[k]) for k, v in before.items())
        assert "hunter2" not in code  # the environment is never copied into the artifact
        twin = copy.deepcopy(m)
        twin.weight.register_hook(lambda g: g * 3)  # a copy holds no hooks, no gradients
        twin.weight.grad = torch.ones(3, 4)
        torch.testing.assert_close(precompile.load(code, cache)(m, x), step(twin, x))
        torch.testing.assert_close(m.weight.grad, twin.weight.grad)
        os.environ["TP_DYNAMO_SCALE"] = "3"
        with pytest.raises(PrecompileError, match="environment variable 'TP_DYNAMO_SCALE'"):
            precompile.load(code, cache)(m, x)
    finally:
        del os.environ["TP_DYNAMO_SCALE"], os.environ["TP_DYNAMO_SECRET"]


def test_a_capture_block_reads_each_variant_with_dynamo(
    tmp_path: Path, restore_globals: Any
) -> None:
    from torch_precompile import capture

    m = Scaled()
    with capture(scaled, artifact_path=tmp_path / "s.py", backend="eager", tracer="dynamo") as cap:
        for batch in (2, 3):  # two shapes: two variants, each read by Dynamo
            x = torch.randn(batch, 4)
            torch.testing.assert_close(cap(m, x), scaled(m, x))
    spec = precompile.inspect((tmp_path / "s.py").read_text())
    assert len(spec.all_variants) == 2 and all(v.guards for v in spec.all_variants)
    f = precompile.load_file(tmp_path / "s.py")
    Settings.factor = 5.0
    with pytest.raises(PrecompileError, match="Settings.factor"):
        f(m, torch.randn(3, 4))
