"""Tiny models and computations shared by the tests (and by fresh test subprocesses).

This module must not import torch_precompile: artifacts are checked in processes where the
package cannot be imported.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    def __init__(self, d_in: int = 4, hidden: int = 8, d_out: int = 3) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.bn = nn.BatchNorm1d(hidden)
        self.fc2 = nn.Linear(hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


class TiedLM(nn.Module):
    """Embedding and output head share one weight (as in GPT-2)."""

    def __init__(self, vocab: int = 11, dim: int = 6) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.embed(ids)))


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.proj(x))


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.out = nn.Linear(5, 2)
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.out(h) * self.scale


class PartlyFrozen(nn.Module):
    """fc1 is frozen, `unused` never takes part: neither may get a gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 6)
        self.fc2 = nn.Linear(6, 2)
        self.unused = nn.Parameter(torch.ones(3))
        self.fc1.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Dropper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(64, 64)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.fc(x))


def mse_step(m: nn.Module, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    loss = F.mse_loss(m(x), t)
    loss.backward()
    return loss.detach()


def infer(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return m(x)


def lm_step(m: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = m(ids)
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    loss.backward()
    return loss.detach()


def two_model_step(encoder: nn.Module, x: torch.Tensor, head: nn.Module) -> torch.Tensor:
    y = head(encoder(x))
    y.square().mean().backward()
    return y.detach()


def pytree_fn(m: nn.Module, batch: dict[str, Any]) -> dict[str, Any]:
    x = batch["x"] * batch["scale"]
    extra, (offset, tag) = batch["extras"]
    y = m(x) + extra.sum() + offset
    return {"y": y, "parts": (y.mean(), [tag, 3]), "none": None}


def literal_fn(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    y = m(x)
    weights = torch.tensor([1.0, -2.0, float("inf")])
    empty = torch.tensor([])
    mask = torch.tensor([[True, False, True]])
    return torch.where(mask, y, y * weights.clamp(max=3.0)) + empty.sum()


def mask_fn(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Bakes -inf, nan and a device into the graph, as attention masks do."""
    scores = m(x)
    scores = torch.where(scores > 10, float("nan"), scores)
    causal = torch.ones(scores.shape[-1], scores.shape[-1], device=x.device).tril().bool()
    square = scores[:, :, None] * scores[:, None, :]
    masked = square.masked_fill(~causal, float("-inf"))
    return torch.nan_to_num(masked.softmax(-1), nan=0.0)


def mutate_fn(m: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x.mul_(2)
    return m(x), x, x[0]


@dataclass
class Workload:
    """A computation plus how to build its example model(s) and inputs."""

    fn: Callable[..., Any]
    make_args: Callable[[], tuple[Any, ...]]

    def args(self, seed: int = 0) -> tuple[Any, ...]:
        """Seed 0 gives the capture's example; any other seed, new weights and inputs."""
        torch.manual_seed(seed)
        return self.make_args()


def _mlp(train: bool) -> nn.Module:
    m = MLP()
    with torch.no_grad():
        m.bn.running_mean.uniform_(-0.5, 0.5)
        m.bn.running_var.uniform_(0.5, 1.5)
    return m.train(train)


WORKLOADS: dict[str, Workload] = {
    "mlp_infer": Workload(infer, lambda: (_mlp(False), torch.randn(5, 4))),
    "mlp_train": Workload(mse_step, lambda: (_mlp(True), torch.randn(5, 4), torch.randn(5, 3))),
    "tied": Workload(lm_step, lambda: (TiedLM(), torch.randint(0, 11, (2, 7)))),
    "two_models": Workload(two_model_step, lambda: (Encoder(), torch.randn(3, 4), Head())),
    "frozen": Workload(mse_step, lambda: (PartlyFrozen(), torch.randn(5, 4), torch.randn(5, 2))),
    "pytree": Workload(
        pytree_fn,
        lambda: (
            _mlp(False),
            {
                "x": torch.randn(5, 4),
                "scale": 2.0,
                "extras": [torch.randn(2, 2), (torch.randn(3), "tag")],
            },
        ),
    ),
    "literals": Workload(literal_fn, lambda: (_mlp(False), torch.randn(5, 4))),
    "mask": Workload(mask_fn, lambda: (nn.Linear(4, 4), torch.randn(3, 4))),
    "mutate": Workload(mutate_fn, lambda: (nn.Linear(4, 2), torch.randn(3, 4))),
    "dropout": Workload(infer, lambda: (Dropper().train(), torch.randn(64, 64))),
}


class Block(nn.Module):
    """A pre-norm transformer block written with plain ops (no fixed sizes inside)."""

    def __init__(self, dim: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        q, k, v = (t.unflatten(-1, (self.heads, -1)).transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) * (q.shape[-1] ** -0.5)
        attn = scores.softmax(-1) @ v
        x = x + self.proj(attn.transpose(1, 2).flatten(2))
        return x + self.mlp(self.norm2(x))


def block_step(m: nn.Module, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    loss = F.mse_loss(m(x), target)
    loss.backward()
    return loss.detach()
