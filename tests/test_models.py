"""Model families beyond the small workloads: each matches eager, or fails with a clean error.

Every artifact is built once per session (building Inductor kernels is the slow part) and
exercised through ``precompile.load`` of the emitted pair.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from torch_precompile import PrecompileError, precompile

from conftest import assert_same, model_state

TOL = {"rtol": 1e-4, "atol": 1e-5}


def sgd_steps(
    step: Callable[..., Any], model: nn.Module, args: tuple[Any, ...], steps: int = 3
) -> list[tuple[Any, dict[str, Any]]]:
    """Run ``steps`` SGD steps; after each, the step's result and the model's state."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    history = []
    for _ in range(steps):
        opt.zero_grad()
        result = step(model, *args)
        history.append((result, model_state(model)))
        opt.step()
    return history


class PairCache:
    """Artifact pairs built once per session, keyed by a name and the backend."""

    def __init__(self) -> None:
        self._pairs: dict[tuple[str, str], tuple[str, bytes]] = {}

    def load(
        self, name: str, backend: str, fn: Callable[..., Any], model: nn.Module, *args: Any
    ) -> Callable[..., Any]:
        key = (name, backend)
        if key not in self._pairs:
            self._pairs[key] = precompile(fn, copy.deepcopy(model), *args, backend=backend)
        return precompile.load(*self._pairs[key])


@pytest.fixture(scope="session")
def pairs() -> PairCache:
    return PairCache()


def check_training(
    pairs: PairCache,
    name: str,
    backend: str,
    step: Callable[..., Any],
    model: nn.Module,
    *args: Any,
    **tol: float,
) -> None:
    """The artifact's losses, grads and parameters over three SGD steps are eager's."""
    run = pairs.load(name, backend, step, model, *args)
    compiled = sgd_steps(run, copy.deepcopy(model), args)
    eager = sgd_steps(step, copy.deepcopy(model), args)
    for (loss, state), (eager_loss, eager_state) in zip(compiled, eager, strict=True):
        assert_same(loss, eager_loss, **(tol or TOL))
        assert_same(state, eager_state, **(tol or TOL))


def check_inference(
    pairs: PairCache,
    name: str,
    backend: str,
    fn: Callable[..., Any],
    model: nn.Module,
    *args: Any,
    **tol: float,
) -> None:
    """The artifact's results are eager's on the example and on other weights and inputs."""
    run = pairs.load(name, backend, fn, model, *args)
    for weights, inputs in ((model, args), other_weights_and_inputs(model, args)):
        eager_model = copy.deepcopy(weights)
        assert_same(run(weights, *inputs), fn(eager_model, *inputs), **(tol or TOL))
        assert_same(model_state(weights), model_state(eager_model), **(tol or TOL))


def other_weights_and_inputs(
    model: nn.Module, args: tuple[Any, ...]
) -> tuple[nn.Module, tuple[Any, ...]]:
    """A copy of ``model`` with moved weights, and new inputs of the same kinds and ranges."""
    torch.manual_seed(2)
    other = copy.deepcopy(model)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn_like(p) * 0.1)

    def new(a: Any) -> Any:
        if not isinstance(a, torch.Tensor):
            return a
        if a.is_floating_point():
            return torch.randn_like(a)
        return torch.randint_like(a, int(a.max()) + 1)

    return other, tuple(new(a) for a in args)


def infer(m: nn.Module, *args: Any) -> Any:
    return m(*args)


def mean_square_step(m: nn.Module, *args: Any) -> torch.Tensor:
    out = m(*args)
    loss = sum(o.square().mean() for o in (out if isinstance(out, tuple) else (out,)))
    loss.backward()
    return loss.detach()


# Max pooling: Inductor's max_pool decomposition refers to torch._inductor.lowering.


class PoolNet(nn.Module):
    """Conv1d + BatchNorm1d + MaxPool1d, and a ResNet stem (padded, strided MaxPool2d)."""

    def __init__(self) -> None:
        super().__init__()
        self.seq = nn.Sequential(nn.Conv1d(2, 4, 3), nn.BatchNorm1d(4), nn.MaxPool1d(2))
        self.stem = nn.Sequential(
            nn.Conv2d(2, 4, 3, stride=2, padding=1, bias=False),
            nn.BatchNorm2d(4),
            nn.ReLU(),
            nn.MaxPool2d(3, 2, padding=1),
        )

    def forward(self, x1: torch.Tensor, x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.seq(x1), self.stem(x2)


def pool_inputs() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return PoolNet(), torch.randn(2, 2, 10), torch.randn(2, 2, 8, 8)


def test_max_pooling_inference(pairs: PairCache, backend: str) -> None:
    model, x1, x2 = pool_inputs()
    check_inference(pairs, "pool_infer", backend, infer, model.eval(), x1, x2)


def test_max_pooling_training_step(pairs: PairCache, backend: str) -> None:
    model, x1, x2 = pool_inputs()
    check_training(pairs, "pool_train", backend, mean_square_step, model.train(), x1, x2)


# Strides the lowering's retrace cannot reproduce: Inductor's cat decomposition drops an empty
# input (Hugging Face caches start as torch.tensor([])) and keeps the other input's strides,
# where eager cat returns a contiguous tensor; later views were recorded on eager's layout.


class CachedAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.transpose(1, 2) for t in self.qkv(x).view(2, 4, 3, 2, 4).unbind(2))
        k = torch.cat([torch.tensor([]), k], dim=-2)  # an empty cache, then the new keys
        v = torch.cat([torch.tensor([]), v], dim=-2)
        return (q @ k.transpose(-2, -1)).softmax(-1) @ v


@pytest.mark.parametrize("disabled", ["_decomposition_table", "reshape_unwritten_views"])
def test_cat_of_empty_cache_then_view_inductor(disabled: str, monkeypatch) -> None:
    """Either half of the fix (eager's layout for cat, reshape for views nobody writes
    through) suffices on its own."""
    from torch._inductor.decomposition import select_decomp_table

    import torch_precompile.internals.inductor as layer
    import torch_precompile.lower.inductor as lowering

    module = layer if disabled == "_decomposition_table" else lowering
    stand_in = {
        "_decomposition_table": lambda: dict(select_decomp_table()),
        "reshape_unwritten_views": lambda graph: None,
    }[disabled]
    monkeypatch.setattr(module, disabled, stand_in)
    torch.manual_seed(0)
    model, x = CachedAttention(), torch.randn(2, 4, 8)
    run = precompile.load(*precompile(infer, model, x))
    assert_same(run(model, x), model(x))


def test_views_written_through_stay_views() -> None:
    from torch.fx.experimental.proxy_tensor import make_fx

    from torch_precompile.internals.tracing import reshape_unwritten_views

    def fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x.view(6).add_(1)  # written through: must stay a view
        x.view(3, 2)  # another view of written memory
        return y.view(3, 2) * 2  # never written: may become a reshape

    graph = make_fx(fn)(torch.zeros(2, 3), torch.zeros(2, 3)).graph
    reshape_unwritten_views(graph)
    targets = [n.target for n in graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.aten.view.default) == 2
    assert targets.count(torch.ops.aten.reshape.default) == 1


def t5() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.T5Config(
        d_model=16,
        d_ff=32,
        num_layers=1,
        num_heads=2,
        d_kv=8,
        vocab_size=64,
        dropout_rate=0.0,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    return transformers.T5ForConditionalGeneration(config)


def t5_logits(m: nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return m(input_ids=ids, labels=labels).logits


def t5_step(m: nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    out = m(input_ids=ids, labels=labels)
    out.loss.backward()
    return out.loss.detach()


def t5_batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return (
        torch.randint(0, 64, (2, 8), generator=generator),
        torch.randint(0, 64, (2, 4), generator=generator),
    )


def test_t5_inference(pairs: PairCache, backend: str) -> None:
    check_inference(
        pairs, "t5_infer", backend, t5_logits, t5().eval(), *t5_batch(), rtol=1e-4, atol=1e-4
    )


def test_t5_training_step(pairs: PairCache, backend: str) -> None:
    check_training(
        pairs, "t5_train", backend, t5_step, t5().train(), *t5_batch(), rtol=1e-4, atol=1e-4
    )


# Recurrent layers: with oneDNN on, the trace recorded oneDNN's LSTM layer and its backward,
# which cannot be replayed from a graph.


class Recurrent(nn.Module):
    """LSTM and GRU, two layers, each one-way and bidirectional, batch-first and
    sequence-first; the GRU starts from a given hidden state."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(3, 4, num_layers=2, batch_first=True)
        self.lstm_bi = nn.LSTM(3, 4, num_layers=2, bidirectional=True)
        self.gru = nn.GRU(3, 4, num_layers=2)
        self.gru_bi = nn.GRU(3, 4, num_layers=2, batch_first=True, bidirectional=True)

    def forward(self, x: torch.Tensor, h0: torch.Tensor) -> tuple[torch.Tensor, ...]:
        seq_first = x.transpose(0, 1)
        a, (ha, ca) = self.lstm(x)
        b, (hb, cb) = self.lstm_bi(seq_first)
        c, hc = self.gru(seq_first, h0)
        d, hd = self.gru_bi(x)
        return a, ha, ca, b, hb, cb, c, hc, d, hd


def recurrent_inputs() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return Recurrent(), torch.randn(2, 2, 3), torch.randn(2, 2, 4)


def test_recurrent_training_steps(pairs: PairCache, backend: str) -> None:
    model, x, h0 = recurrent_inputs()
    check_training(pairs, "rnn_train", backend, mean_square_step, model.train(), x, h0)


def test_recurrent_inference(pairs: PairCache) -> None:
    """On eager only: Inductor lowers the same recurrent cells in the training step."""
    model, x, h0 = recurrent_inputs()
    check_inference(pairs, "rnn_infer", "eager", infer, model.eval(), x, h0)


def test_recurrent_capture_keeps_onednn_setting() -> None:
    from torch_precompile.trace import capture

    model, x, h0 = recurrent_inputs()
    assert torch.backends.mkldnn.enabled
    captured = capture(mean_square_step, (model, x, h0), "eager")
    assert torch.backends.mkldnn.enabled
    assert not any("mkldnn" in str(n.target) for n in captured.graph.graph.nodes)


# Errors from Inductor reach the user as PrecompileError, naming the operator.


def sine(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return torch.sin(m(x))


def _raise_unsupported(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("unsupported here")


def test_inductor_lowering_failure_is_precompile_error(monkeypatch) -> None:
    from torch._inductor import lowering

    monkeypatch.setitem(lowering.lowerings, torch.ops.aten.sin.default, _raise_unsupported)
    with pytest.raises(
        PrecompileError,
        match=r"compiling the graph at operator aten\.sin\.default"
        r": .*unsupported here.*backend='eager'",
    ) as caught:
        precompile(sine, nn.Linear(3, 2), torch.randn(4, 3))
    assert caught.value.__cause__ is not None
    assert "unsupported here" in str(caught.value.__cause__)


def test_inductor_decomposition_failure_is_precompile_error(monkeypatch) -> None:
    import torch_precompile.internals.inductor as layer

    table = layer._decomposition_table()
    table[torch.ops.aten.sin.default] = _raise_unsupported
    monkeypatch.setattr(layer, "_decomposition_table", lambda: table)
    with pytest.raises(
        PrecompileError,
        match=r"retracing .* at operator aten\.sin\.default: "
        r"RuntimeError: unsupported here.*backend='eager'",
    ) as caught:
        precompile(sine, nn.Linear(3, 2), torch.randn(4, 3))
    assert isinstance(caught.value.__cause__, RuntimeError)
