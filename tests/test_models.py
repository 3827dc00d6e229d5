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

from torch_precompile import precompile

from conftest import assert_same, model_state

TOL = {"rtol": 1e-4, "atol": 1e-5}


def sgd_steps(step: Callable[..., Any], model: nn.Module, args: tuple[Any, ...],
              steps: int = 3) -> list[tuple[Any, dict[str, Any]]]:
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

    def load(self, name: str, backend: str, fn: Callable[..., Any], model: nn.Module,
             *args: Any) -> Callable[..., Any]:
        key = (name, backend)
        if key not in self._pairs:
            self._pairs[key] = precompile(fn, copy.deepcopy(model), *args, backend=backend)
        return precompile.load(*self._pairs[key])


@pytest.fixture(scope="session")
def pairs() -> PairCache:
    return PairCache()


def check_training(pairs: PairCache, name: str, backend: str, step: Callable[..., Any],
                   model: nn.Module, *args: Any, **tol: float) -> None:
    """The artifact's losses, grads and parameters over three SGD steps are eager's."""
    run = pairs.load(name, backend, step, model, *args)
    compiled = sgd_steps(run, copy.deepcopy(model), args)
    eager = sgd_steps(step, copy.deepcopy(model), args)
    for (loss, state), (eager_loss, eager_state) in zip(compiled, eager, strict=True):
        assert_same(loss, eager_loss, **(tol or TOL))
        assert_same(state, eager_state, **(tol or TOL))


def check_inference(pairs: PairCache, name: str, backend: str, fn: Callable[..., Any],
                    model: nn.Module, *args: Any, **tol: float) -> None:
    run = pairs.load(name, backend, fn, model, *args)
    eager_model = copy.deepcopy(model)
    assert_same(run(model, *args), fn(eager_model, *args), **(tol or TOL))
    assert_same(model_state(model), model_state(eager_model), **(tol or TOL))


def infer(m: nn.Module, *args: Any) -> Any:
    return m(*args)


def mean_square_step(m: nn.Module, *args: Any) -> torch.Tensor:
    out = m(*args)
    loss = sum(o.square().mean() for o in (out if isinstance(out, tuple) else (out,)))
    loss.backward()
    return loss.detach()


# Max pooling: Inductor's max_pool decomposition refers to torch._inductor.lowering.


def conv_pool() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv1d(2, 4, 3), nn.BatchNorm1d(4), nn.ReLU(), nn.MaxPool1d(2))


def test_max_pooling_inference_inductor(pairs: PairCache) -> None:
    model = conv_pool().eval()
    check_inference(pairs, "pool_infer", "inductor", infer, model, torch.randn(2, 2, 10))


def test_max_pooling_training_step_inductor(pairs: PairCache) -> None:
    model = conv_pool().train()
    check_training(pairs, "pool_train", "inductor", mean_square_step, model,
                   torch.randn(2, 2, 10))
