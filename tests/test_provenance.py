"""Each op of a captured graph names the user's source line that produced it."""

from __future__ import annotations

import inspect
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from torch_precompile import precompile
from torch_precompile.internals.tracing import graph_function_source
from torch_precompile.trace import capture

TORCH_DIR = str(Path(torch.__file__).parent)


class TwoLayers(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.hidden = torch.nn.Linear(4, 5)
        self.out = torch.nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.hidden(x)))


def step(model: torch.nn.Module, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    loss = F.cross_entropy(model(x), t)
    loss.backward()
    return loss


def _example() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(2, 4), torch.tensor([0, 2])


def _comment(fn: Callable[..., Any], code: str) -> str:
    """The ``# File:`` comment fx writes for the line of ``fn`` whose text is ``code``."""
    lines, first = inspect.getsourcelines(fn)
    number = first + next(i for i, line in enumerate(lines) if line.strip() == code)
    # Named relative to where it was built (the tests' directory): no absolute path.
    return f"# File: {os.path.relpath(__file__)}:{number} in {fn.__name__}, code: {code}"


def _comment_above(source: str, op: str) -> str | None:
    """The last ``# File:`` comment before the first line that calls ``op``."""
    comment = None
    for line in source.splitlines():
        if line.strip().startswith("# File:"):
            comment = line.strip()
        elif f"torch.ops.aten.{op}." in line:
            return comment
    raise AssertionError(f"no {op} in the source")


def _file_comments(source: str) -> list[str]:
    return [line.strip() for line in source.splitlines() if line.strip().startswith("# File:")]


def test_eager_artifact_names_the_users_lines_not_torchs() -> None:
    model = torch.nn.Linear(4, 3)
    code, cache = precompile(step, model, *_example(), backend="eager")
    loss_line = _comment(step, "loss = F.cross_entropy(model(x), t)")
    # nn.Linear's own frame (in torch/nn/modules) is skipped: its ops name the caller's line.
    assert _comment_above(code, "addmm") == loss_line
    assert _comment_above(code, "nll_loss_forward") == loss_line
    assert _comment_above(code, "nll_loss_backward") == _comment(step, "loss.backward()")
    assert _file_comments(code) and not any(TORCH_DIR in c for c in _file_comments(code))
    x, t = _example()
    expected = F.cross_entropy(model(x), t)
    assert torch.equal(precompile.load(code, cache)(model, x, t), expected)


def test_a_users_module_names_its_forward() -> None:
    code, _ = precompile(step, TwoLayers(), *_example(), backend="eager")
    forward_line = _comment(TwoLayers.forward, "return self.out(torch.relu(self.hidden(x)))")
    assert _comment_above(code, "addmm") == forward_line
    assert _comment_above(code, "relu") == forward_line
    assert _comment_above(code, "nll_loss_forward") == _comment(
        step, "loss = F.cross_entropy(model(x), t)"
    )


def test_fake_and_symbolic_traces_name_the_users_lines() -> None:
    loss_line = _comment(step, "loss = F.cross_entropy(model(x), t)")
    on_fakes = capture(step, (torch.nn.Linear(4, 3), *_example()), "eager", on_fakes=True)
    assert _comment_above(graph_function_source(on_fakes.graph, "g"), "addmm") == loss_line
    x, t = _example()
    torch._dynamo.decorators.mark_unbacked(x, 0)
    torch._dynamo.decorators.mark_unbacked(t, 0)
    symbolic = capture(step, (torch.nn.Linear(4, 3), x, t), "inductor")
    source = graph_function_source(symbolic.graph, "g")
    assert _comment_above(source, "nll_loss_forward") == loss_line
    assert not any(TORCH_DIR in c for c in _file_comments(source))


def test_torchs_tracer_is_left_as_it_was() -> None:
    import torch.fx.experimental.proxy_tensor as proxy_tensor
    import torch.fx.proxy
    from torch.fx.experimental.proxy_tensor import PythonKeyTracer, make_fx

    before = dict(PythonKeyTracer.__dict__)
    module_before = (proxy_tensor.extract_val, torch.fx.proxy.CapturedTraceback)
    capture(step, (torch.nn.Linear(4, 3), *_example()), "eager")
    assert dict(PythonKeyTracer.__dict__) == before
    assert (proxy_tensor.extract_val, torch.fx.proxy.CapturedTraceback) == module_before
    # A plain make_fx with stack traces keeps torch's own filter (frames named forward only).
    gm = make_fx(lambda x: torch.relu(x), record_stack_traces=True)(torch.randn(2))
    assert all(not n.meta.get("stack_trace") for n in gm.graph.nodes)


def test_each_value_is_described_by_a_fake_tensor_of_its_layout() -> None:
    """The capture's stand-in makes each node's fake value itself: of one fake mode, with
    the real value's shape, strides, dtype and device (a transpose keeps its strides)."""
    from torch._subclasses.fake_tensor import FakeTensor

    def fn(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return model(x).t().contiguous().t() * 2

    model, x = TwoLayers(), torch.randn(2, 4)
    graph = capture(fn, (model, x), "eager").graph.graph
    real = {n.name: n for n in graph.nodes if n.op == "call_function"}
    values = [n.meta["val"] for n in real.values()]
    assert values and all(isinstance(v, FakeTensor) for v in values)
    assert len({id(v.fake_mode) for v in values}) == 1
    expected = fn(model, x)
    last = next(n for n in reversed(list(real.values())) if n.target is torch.ops.aten.mul.Tensor)
    fake = last.meta["val"]
    assert (fake.shape, fake.stride(), fake.dtype, fake.device) == (
        expected.shape,
        expected.stride(),
        expected.dtype,
        expected.device,
    )
    assert fake.stride() == (1, 2)  # the transposed layout, not a contiguous one


def test_inductor_kernels_name_the_aten_ops_they_compute() -> None:
    """The retrace for Inductor keeps each captured node's meta: the kernels' comments name
    the ATen operators they fuse, not an empty list."""
    code, _ = precompile(step, torch.nn.Linear(4, 3), *_example(), wrapper="python")
    origins = re.findall(r"Original ATen: \[(.*)\]", code)
    assert origins and all(origins), origins
    assert any("aten.addmm" in o for o in origins), origins


def test_the_generated_codes_positional_arguments_are_named() -> None:
    """Above call(), each argK_1 of Inductor's code is named after what it holds: a model
    tensor, an input, an optimizer's state or learning rate."""
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def adamw_step(model, opt, x, t):
        step(model, x, t)
        opt.step()
        opt.zero_grad()

    code, _ = precompile(adamw_step, model, opt, *_example(), wrapper="cpp")
    block = code[code.index("# call's flat inputs") : code.index("\ndef call(flat_inputs):")]
    named = re.findall(r"^#   (arg\d+_1) +(\w+)", block, re.M)
    assert named[:3] == [("arg0_1", "p_weight"), ("arg1_1", "p_bias"), ("arg2_1", "in_x")]
    assert named[-1][1].startswith("opt_lr") and "exp_avg_sq" in block


def test_a_removed_working_directory_does_not_break_capture(monkeypatch) -> None:
    """Graph comments name files relative to the working directory, when there is one: a
    removed one (os.getcwd() raising) leaves the sys.path roots."""
    from torch_precompile.internals.origin import shown_path

    def removed() -> str:
        raise FileNotFoundError(2, "No such file or directory")

    monkeypatch.setattr(os, "getcwd", removed)
    assert shown_path(torch.__file__) == os.path.join("torch", "__init__.py")
    assert shown_path("/nowhere/step.py") == "step.py"
