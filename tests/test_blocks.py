"""Repeated blocks compiled once: the operations of blocks that came out the same are one
piece of code, run once per block with its own tensors, equal to eager over several steps, in
a fresh process, with and without the cache; a block that differs gets code of its own."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest
import torch

from torch_precompile import PrecompileError, precompile
from torch_precompile.inspection import describe, render

from conftest import run_python

DEPTH = 3


class Block(torch.nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.up = torch.nn.Linear(width, 2 * width)
        self.down = torch.nn.Linear(2 * width, width)
        self.scale = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.scale * self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Net(torch.nn.Module):
    def __init__(self, depth: int = DEPTH) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(8, 16)
        self.layers = torch.nn.ModuleList(Block() for _ in range(depth))
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def infer(model: Net, x: torch.Tensor) -> torch.Tensor:
    return model(x)


def step(model: Net, x: torch.Tensor) -> torch.Tensor:
    loss = model(x).square().mean()
    loss.backward()
    return loss.detach()


def optimizer_step(model: Net, x: torch.Tensor, opt: torch.optim.Optimizer) -> torch.Tensor:
    loss = step(model, x)
    opt.step()
    opt.zero_grad()
    return loss


def shared_runs(code: str) -> list[int]:
    """How many block calls each piece of code runs for, where it runs for several."""
    return [
        int(n)
        for n in re.findall(r"^ *# Piece \d+ of \d+: the \w+ of .*run (\d+) times", code, re.M)
    ]


# In a fresh process: each pair against eager on new weights, two calls each, with and
# without the cache; the differentiable form's backward run by the caller.
FRESH = """
    import json, torch
    from torch_precompile import precompile
    from test_blocks import Net, infer, step, optimizer_step
    pairs = {pairs!r}
    differ = []
    def same(what, a, b):
        if not torch.allclose(a, b, rtol=1e-4, atol=1e-5):
            differ.append(what)
    for use_cache in (True, False):
        for form, (code, cache) in pairs.items():
            # With its cache, a load builds nothing (every piece's objects are in it).
            run = precompile.load(code, cache if use_cache else None, require_prebuilt=use_cache)
            torch.manual_seed(2)
            eager, model = Net(), Net()
            model.load_state_dict(eager.state_dict())
            extra = [(), ()]
            if form == "optimizer":
                extra = [(torch.optim.AdamW(m.parameters(), lr=0.01),) for m in (eager, model)]
            for i in range(2):
                x = torch.randn(4, 8)
                if form == "infer":
                    with torch.no_grad():
                        same(f"{{form}} {{i}}", run(model, x), infer(eager, x))
                    continue
                if form == "differentiable":
                    out, expected = run(model, x), infer(eager, x)
                    same(f"{{form}} {{i}}", out, expected)
                    out.square().sum().backward()
                    expected.square().sum().backward()
                else:
                    fn = step if form == "step" else optimizer_step
                    same(f"{{form}} loss {{i}}", run(model, x, *extra[1]), fn(eager, x, *extra[0]))
                for (name, p), q in zip(model.named_parameters(), eager.parameters()):
                    if q.grad is not None:
                        same(f"{{form}} grad {{name}} {{i}}", p.grad, q.grad)
                    same(f"{{form}} {{name}} {{i}}", p.detach(), q.detach())
    print(json.dumps(differ))
"""


def _build(form: str, backend: str) -> tuple[str, bytes]:
    torch.manual_seed(0)
    model, x = Net(), torch.randn(4, 8)
    if form == "infer":
        with torch.no_grad():
            return precompile(infer, model, x, backend=backend, blocks=True)
    if form == "differentiable":
        return precompile(infer, model, x, backend=backend, blocks=True)
    if form == "step":
        return precompile(step, model, x, backend=backend, blocks=True)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    return precompile(optimizer_step, model, x, opt, backend=backend, blocks=True)


def test_blocks_share_code_and_run_like_eager(backend: str, tmp_path: Path) -> None:
    forms = ["infer", "step", "optimizer", "differentiable"]
    pairs = {}
    for form in forms:
        code, cache = _build(form, backend)
        # A training step shares its blocks' backward too. The differentiable form's graphs
        # are cut as well: the plain one, then the forward and the backward for the
        # parameters and for inputs that may require grad.
        shared = {"infer": 1, "step": 2, "optimizer": 2, "differentiable": 5}[form]
        assert shared_runs(code).count(DEPTH) == shared, form
        (tmp_path / f"{form}.py").write_text(code)
        (tmp_path / f"{form}.cache").write_bytes(cache)
        pairs[form] = (str(tmp_path / f"{form}.py"), str(tmp_path / f"{form}.cache"))
    proc = run_python(FRESH.format(pairs=pairs))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.splitlines()[-1]) == []


def _differing(case: str) -> Net:
    torch.manual_seed(0)
    model = Net(4)
    odd = model.layers[2]
    if case == "attribute":
        odd.scale = 0.5
    elif case == "dtype":
        odd.to(torch.float64)
        model.layers[2] = _Cast(odd)  # type: ignore[assignment]
    elif case == "hook":
        odd.register_forward_hook(lambda m, args, out: out * 2)
    elif case == "class":
        model.layers[2] = _Other()  # type: ignore[assignment]
    return model


class _Cast(torch.nn.Module):
    """A float64 block between float32 ones."""

    def __init__(self, block: Block) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x.double()).float()


class _Other(Block):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x - self.down(torch.relu(self.up(self.norm(x))))


@pytest.mark.parametrize("case", ["attribute", "dtype", "hook", "class"])
def test_a_block_that_differs_gets_its_own_code(case: str) -> None:
    model, x = _differing(case), torch.randn(4, 8)
    with torch.no_grad():
        code, cache = precompile(infer, model, x, backend="eager", blocks=True)
        run = precompile.load(code, cache)
        torch.testing.assert_close(run(model, x), model(x))
    # Layers 0, 1 and 3 share code, layer 2 has its own; a hook's operations run after the
    # block's, apart from them (all four blocks share code).
    assert shared_runs(code) == ([4] if case == "hook" else [3]), case
    if case == "attribute":  # the value is still checked at every call, per block
        model.layers[2].scale = 2.0
        refused = pytest.raises(PrecompileError, match="'scale' of module 'layers.2'")
        with refused, torch.no_grad():
            run(model, x)


def test_blocks_can_be_named_or_turned_off(tmp_path: Path) -> None:
    """By default blocks this small stay unrolled (cutting would not pay), as with False."""
    model, x = Net(), torch.randn(4, 8)
    with torch.no_grad():
        default, _ = precompile(infer, model, x, backend="eager")
        unrolled, _ = precompile(infer, model, x, backend="eager", blocks=False)
        named, _ = precompile(infer, model, x, backend="eager", blocks=[Block])
        none_found, _ = precompile(infer, model, x, backend="eager", blocks=[torch.nn.GRU])
    assert all("# Piece" not in code for code in (default, unrolled, none_found))
    assert shared_runs(named) == [DEPTH]
    precompile.save(named, b"", tmp_path / "named.py")
    said = render(describe(tmp_path / "named.py"))
    assert (
        "blocks    : the forward of blocks layers.0, layers.1, layers.2: one piece of code, 3 calls"
        in said
    )
    deep = Net(40)
    with torch.no_grad():
        by_default, _ = precompile(infer, deep, x, backend="eager")
    assert shared_runs(by_default) == [40]
    with pytest.raises(PrecompileError, match="blocks= takes True, False, or the classes"):
        precompile(infer, model, x, backend="eager", blocks=["layers"])


def test_no_hook_stays_on_the_model_after_a_build() -> None:
    """The marks hook parameters' AccumulateGrad nodes, which outlive the trace: once the
    build returns, nothing holds the marks."""
    import gc

    from torch_precompile.trace.blocks import BlockMarks

    model, x = Net(), torch.randn(4, 8)
    precompile(step, model, x, backend="eager", blocks=True)
    model(x).sum().backward()
    gc.collect()
    assert not [o for o in gc.get_objects() if isinstance(o, BlockMarks)]


class _Normed(torch.nn.Module):
    """A block that writes its buffers in place (BatchNorm's running statistics)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(16, 16)
        self.norm = torch.nn.BatchNorm1d(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.norm(self.fc(x)).relu()


def test_blocks_that_write_their_buffers_share_code(backend: str) -> None:
    """A training step whose blocks write their buffers (BatchNorm statistics) and whose
    optimizer steps inside fn: the pieces match eager, buffers and optimizer state included;
    a call the driver refuses (a state tensor in another layout than the pieces assume)
    writes nothing, though the pieces that would run first write buffers."""
    torch.manual_seed(5)
    model = torch.nn.Sequential(*(_Normed() for _ in range(3)))
    eager = torch.nn.Sequential(*(_Normed() for _ in range(3)))
    eager.load_state_dict(model.state_dict())
    # (SGD: the gradient of a bias before BatchNorm is rounding noise, which AdamW's
    # normalized step would turn into updates of any size, in eager as in any artifact.)
    opts = [torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9) for m in (model, eager)]
    x = torch.randn(8, 16)
    for m, opt in zip((model, eager), opts, strict=True):
        optimizer_step(m, x, opt)  # the optimizer's state exists at capture
    code, cache = precompile(optimizer_step, model, x, opts[0], backend=backend, blocks=True)
    # All three blocks share their forward: block 0, whose input needs no gradient, runs it
    # and lets go of what only the others' backward keeps. Blocks 1 and 2 share their
    # backward; block 0's needs none of the weight its input's gradient would.
    assert shared_runs(code) == [3, 2]
    run = precompile.load(code, cache)
    for _ in range(2):
        x = torch.randn(8, 16)
        torch.testing.assert_close(run(model, x, opts[0]), optimizer_step(eager, x, opts[1]))
    pairs = zip(model.state_dict().items(), eager.state_dict().values(), strict=True)
    for (name, ours), theirs in pairs:
        torch.testing.assert_close(ours, theirs, msg=name)
    if backend != "inductor":
        return  # the eager graph takes any layout of the state
    weight = model[2].fc.weight
    state = opts[0].state[weight]["momentum_buffer"]
    opts[0].state[weight]["momentum_buffer"] = state.t().contiguous().t()  # other strides
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(PrecompileError, match="state 'momentum_buffer' of parameter '2.fc.weight'"):
        run(model, torch.randn(8, 16), opts[0])
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, before[name], msg=name)


def test_the_first_blocks_backward_runs_the_shared_code() -> None:
    """Blocks that take fn's input, which needs no gradient: block 0's backward computes
    all the others' do but that gradient, so it runs their code and lets the gradient go
    (with Inductor: the conv blocks' test below)."""
    torch.manual_seed(6)
    model = torch.nn.Sequential(*(Block() for _ in range(DEPTH)))
    eager = torch.nn.Sequential(*(Block() for _ in range(DEPTH)))
    eager.load_state_dict(model.state_dict())
    x = torch.randn(4, 16)
    code, cache = precompile(step, model, x, backend="eager", blocks=True)
    assert shared_runs(code) == [DEPTH, DEPTH]
    run = precompile.load(code, cache)
    for _ in range(2):
        x = torch.randn(4, 16)
        torch.testing.assert_close(run(model, x), step(eager, x))
        for p, q in zip(model.parameters(), eager.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad)


def test_two_blocks_share_a_forward_that_keeps_a_value_fewer() -> None:
    """Two encoder layers taking fn's input: the first's forward keeps a value fewer for the
    backward (its input needs no gradient), so neither forward repeats; the first runs the
    second's code and lets that value go. (Its backward, which would need the value, stays
    apart.)"""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
    eager = copy.deepcopy(model)
    mask = torch.zeros(2, 8, dtype=torch.bool)
    mask[1, 6:] = True

    def encoder_step(m: torch.nn.Module, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        loss = m(x, src_key_padding_mask=mask).square().mean()
        loss.backward()
        return loss

    code, cache = precompile(
        encoder_step, model, torch.randn(2, 8, 16), mask, backend="eager", blocks=True
    )
    assert shared_runs(code) == [2]
    run = precompile.load(code, cache)
    for _ in range(2):
        x = torch.randn(2, 8, 16)
        torch.testing.assert_close(run(model, x, mask), encoder_step(eager, x, mask))
        for p, q in zip(model.parameters(), eager.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad)


class _ConvBlock(torch.nn.Module):
    def __init__(self, channels: int = 16) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.norm = torch.nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.norm(self.conv(x)).relu()


def test_conv_blocks_hand_on_values_in_the_layout_the_next_piece_reads() -> None:
    """Inductor computes convolutions channels-last inside a piece; each value a piece
    returns comes back in the layout the trace recorded, which the next piece's kernels
    were compiled for (they refused the channels-last value before). The blocks take fn's
    input, so block 0's backward runs the others' code (output masks asking for more)."""

    def conv_net() -> torch.nn.Sequential:
        return torch.nn.Sequential(*(_ConvBlock() for _ in range(3)))

    torch.manual_seed(7)
    model, eager = conv_net(), conv_net()
    eager.load_state_dict(model.state_dict())
    code, cache = precompile(step, model, torch.randn(4, 16, 8, 8), backend="inductor", blocks=True)
    assert shared_runs(code) == [3, 3]
    run = precompile.load(code, cache)
    for _ in range(2):
        x = torch.randn(4, 16, 8, 8)
        torch.testing.assert_close(run(model, x), step(eager, x))
        for p, q in zip(model.parameters(), eager.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)


def test_a_batch_norm_that_writes_its_statistics_is_never_pruned() -> None:
    """A piece runs another's code only where what that code computes besides does nothing
    but compute values: training-mode batch norm writes its running statistics though its
    schema does not say so, and counts as a write."""
    from torch_precompile.lower.regions import _pure

    norm = torch.nn.BatchNorm1d(4)
    graph = torch.fx.experimental.proxy_tensor.make_fx(lambda x: norm(x))(torch.randn(3, 4))
    calls = [n for n in graph.graph.nodes if n.op == "call_function"]
    norms = [n for n in calls if "batch_norm" in str(n.target)]
    assert norms and not any(_pure(n) for n in norms)
    assert any(_pure(n) for n in calls if n not in norms)  # its getitems, say
