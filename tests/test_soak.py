"""Long runs: a thousand training steps, and many threads calling one artifact at once."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from torch_precompile import precompile

from conftest import in_threads


def _step(
    model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, t: torch.Tensor
) -> torch.Tensor:
    opt.zero_grad()
    loss = nn.functional.mse_loss(model(x), t)
    loss.backward()
    opt.step()
    return loss.detach()


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def _schedule(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s / 100))


@pytest.mark.soak
@pytest.mark.timeout(900)
def test_a_thousand_adamw_steps_under_a_schedule_end_where_eager_does(backend: str) -> None:
    """AdamW inside fn, its lr set by a schedule after every step, 1,000 steps on fresh data:
    every 100th loss and the final parameters and optimizer state equal eager's run."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(1)
    x, t = torch.randn(16, 4, generator=generator), torch.randn(16, 1, generator=generator)
    code, cache = precompile(_step, model, opt, x, t, backend=backend)
    run = precompile.load(code, cache)
    runs = []
    for fn in (_step, run):
        m = _model()
        o = torch.optim.AdamW(m.parameters(), lr=1e-2)
        scheduler, data = _schedule(o), torch.Generator().manual_seed(2)
        losses = []
        for i in range(1000):
            loss = fn(m, o, torch.randn(16, 4, generator=data), torch.randn(16, 1, generator=data))
            scheduler.step()
            if i % 100 == 99:
                losses.append(loss)
        state = [v for s in o.state.values() for v in s.values()]
        runs.append((losses, [p.detach() for p in m.parameters()], state))
    eager, artifact = runs
    torch.testing.assert_close(artifact, eager, rtol=1e-4, atol=1e-5)
    assert not torch.equal(eager[1][0], _model()[0].weight)  # the steps moved the weights


@pytest.mark.soak
def test_eight_threads_call_one_artifact_with_their_own_models(backend: str) -> None:
    """Eight threads, each with its own model (other weights) and inputs, 25 calls each at
    once: every result is eager's for that thread's model."""
    base = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).eval()
    code, cache = precompile(lambda m, x: m(x), base, torch.randn(5, 4), backend=backend)
    run = precompile.load(code, cache)
    models = []
    for i in range(8):
        model = copy.deepcopy(base)
        torch.manual_seed(10 + i)
        for p in model.parameters():
            torch.nn.init.normal_(p)
        models.append(model)

    def work(i: int) -> None:
        generator = torch.Generator().manual_seed(i)
        for _ in range(25):
            x = torch.randn(5, 4, generator=generator)
            torch.testing.assert_close(run(models[i], x), models[i](x).detach())

    assert in_threads(work, 8) == []
