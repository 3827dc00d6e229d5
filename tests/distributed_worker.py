"""One rank of a distributed test run: ``python distributed_worker.py RANK WORLD PORT OUT CASES``.

Every rank joins a gloo process group on 127.0.0.1, runs the named cases in order and writes
``OUT/rank{RANK}.json``: per case, either the compared numbers or the error it raised. Each
training case compares against single-process eager on the unsharded model (built locally
with the same seed) over three SGD steps: losses, full gradients, full parameters. Some steps
accumulate the gradients of several batches before the update, as eager ``.backward()`` does.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import re
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.nn.parallel import DistributedDataParallel

from torch_precompile import PrecompileError, precompile

STEPS = 3
LR = 0.1


class MLP(torch.nn.Module):
    def __init__(self, dim: int = 8, hidden: int = 16) -> None:
        super().__init__()
        self.up = torch.nn.Linear(dim, hidden)
        self.down = torch.nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


class Block(torch.nn.Module):
    """A pre-norm transformer block: attention (q, k, v, o) and an MLP."""

    def __init__(self, dim: int = 8, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = torch.nn.LayerNorm(dim)
        self.q = torch.nn.Linear(dim, dim)
        self.k = torch.nn.Linear(dim, dim)
        self.v = torch.nn.Linear(dim, dim)
        self.o = torch.nn.Linear(dim, dim)
        self.norm2 = torch.nn.LayerNorm(dim)
        self.mlp = MLP(dim, 2 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        q, k, v = self.q(h), self.k(h), self.v(h)
        b, s, width = q.shape  # under sequence parallelism, the gathered sequence

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, s, self.heads_here(t), -1).transpose(1, 2)

        attn = torch.nn.functional.scaled_dot_product_attention(
            heads(q), heads(k), heads(v), is_causal=True
        )
        x = x + self.o(attn.transpose(1, 2).reshape(b, s, width))
        return x + self.mlp(self.norm2(x))

    def heads_here(self, t: torch.Tensor) -> int:
        # Under tensor parallelism each rank holds heads / tp of the heads.
        return self.heads * t.shape[-1] // self.q.in_features


def tp_plan_mlp() -> dict[str, Any]:
    return {"up": ColwiseParallel(), "down": RowwiseParallel()}


def tp_plan_block(sequence_parallel: bool) -> dict[str, Any]:
    if not sequence_parallel:
        return {
            "q": ColwiseParallel(),
            "k": ColwiseParallel(),
            "v": ColwiseParallel(),
            "o": RowwiseParallel(),
            "mlp.up": ColwiseParallel(),
            "mlp.down": RowwiseParallel(),
        }
    return {
        "norm1": SequenceParallel(),
        "norm2": SequenceParallel(),
        "q": ColwiseParallel(input_layouts=Shard(1)),
        "k": ColwiseParallel(input_layouts=Shard(1)),
        "v": ColwiseParallel(input_layouts=Shard(1)),
        "o": RowwiseParallel(output_layouts=Shard(1)),
        "mlp.up": ColwiseParallel(input_layouts=Shard(1)),
        "mlp.down": RowwiseParallel(output_layouts=Shard(1)),
    }


def train_step(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    loss = model(x).square().mean()
    loss.backward()
    return loss


def full(t: Any) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def sgd(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p -= LR * p.grad
            p.grad = None


def max_diff(a: Any, b: Any) -> float:
    return float((full(a).detach() - full(b).detach()).abs().max())


def eager_reference(
    make: Callable[[], torch.nn.Module],
    batches: list[torch.Tensor],
    accumulate: int = 1,
) -> tuple[list[float], list[dict[str, torch.Tensor]], dict[str, Any]]:
    """Eager on ``make()``: the loss and the .grad after each batch; an SGD step after every
    ``accumulate`` batches, whose gradients add up in .grad until then."""
    model = make()
    losses, grads = [], []
    for i, x in enumerate(batches):
        losses.append(float(train_step(model, x)))
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        if (i + 1) % accumulate == 0:
            sgd(model)
    return losses, grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def compare_training(
    step: Callable[..., Any],
    model: torch.nn.Module,
    make: Callable[[], torch.nn.Module],
    batches: list[torch.Tensor],
    wrap: Callable[[torch.Tensor], Any],
    loss_of: Callable[[Any], float] = lambda loss: float(full(loss)),
    accumulate: int = 1,
) -> dict[str, float]:
    """SGD steps of ``step`` on the sharded ``model`` against eager on ``make()``, one per
    ``accumulate`` batches. ``accumulating_calls`` counts the calls that found every .grad
    already set (and so had to add to it)."""
    ref_losses, ref_grads, ref_params = eager_reference(make, batches, accumulate)
    worst = {"loss": 0.0, "grad": 0.0, "param": 0.0, "accumulating_calls": 0.0}
    for i, (x, ref_loss, ref_grad) in enumerate(zip(batches, ref_losses, ref_grads, strict=True)):
        if all(p.grad is not None for p in model.parameters()):
            worst["accumulating_calls"] += 1
        loss = step(model, wrap(x))
        worst["loss"] = max(worst["loss"], abs(loss_of(loss) - ref_loss))
        for name, p in model.named_parameters():
            worst["grad"] = max(worst["grad"], max_diff(p.grad, ref_grad[name]))
        if (i + 1) % accumulate == 0:
            sgd(model)
    for name, p in model.named_parameters():
        worst["param"] = max(worst["param"], max_diff(p, ref_params[name]))
    return worst


def make_mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return MLP()


def make_normed_mlp() -> torch.nn.Module:
    """A norm before the MLP: under tensor parallelism its parameters stay on dp alone."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.LayerNorm(8), MLP())


def make_block() -> torch.nn.Module:
    torch.manual_seed(0)
    return Block()


def batches(*shape: int, count: int = STEPS) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(*shape, generator=generator) for _ in range(count)]


def mesh_1d() -> Any:
    return init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))


def digest(pair: tuple[str, bytes]) -> str:
    return hashlib.sha256(pair[0].encode() + pair[1]).hexdigest()


# Cases: each returns a JSON-able dict (numbers compared by the test).


def linear_dtensor(backend: str) -> dict[str, Any]:
    """distribute_tensor parameters (Shard and Replicate), a replicated DTensor input; each
    SGD step accumulates the gradients of two batches."""
    mesh = mesh_1d()

    def make() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Linear(8, 4)

    model = make()
    model.weight = torch.nn.Parameter(distribute_tensor(model.weight.detach(), mesh, [Shard(0)]))
    model.bias = torch.nn.Parameter(distribute_tensor(model.bias.detach(), mesh, [Replicate()]))

    def wrap(x: torch.Tensor) -> Any:
        return distribute_tensor(x, mesh, [Replicate()])

    data = batches(2, 8, count=2 * STEPS)
    pair = precompile(train_step, model, wrap(data[0]), backend=backend)
    step = precompile.load(*pair)
    result = compare_training(step, model, make, data, wrap, accumulate=2)
    result["grad_placements"] = [str(p.placements) for p in model.parameters()]
    step(model, wrap(data[0]))
    step(model, wrap(data[1]))  # the placements of an accumulated gradient
    result["grad_placements_after"] = [
        [repr(q) for q in p.grad.placements] for p in model.parameters()
    ]
    result["param_placements"] = [[repr(q) for q in p.placements] for p in model.parameters()]
    return result


class Scaled(torch.nn.Module):
    """A sharded Linear and a DTensor buffer it reads and updates in place at every call."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 4)
        self.register_buffer("scale", torch.full((4,), 0.5))
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        return self.linear(x) * self.scale * self.calls


def dtensor_buffers(backend: str) -> dict[str, Any]:
    """DTensor buffers (read, and updated in place) next to sharded parameters."""
    mesh = mesh_1d()

    def make() -> torch.nn.Module:
        torch.manual_seed(0)
        return Scaled()

    model, reference = make(), make()
    for name in ("weight", "bias"):
        setattr(
            model.linear,
            name,
            torch.nn.Parameter(
                distribute_tensor(getattr(model.linear, name).detach(), mesh, [Shard(0)])
            ),
        )
    for name in ("scale", "calls"):
        setattr(model, name, distribute_tensor(getattr(model, name), mesh, [Replicate()]))
    data = batches(2, 8)

    def wrap(x: torch.Tensor) -> Any:
        return distribute_tensor(x, mesh, [Replicate()])

    with torch.no_grad():
        run = precompile.load(*precompile(lambda m, x: m(x), model, wrap(data[0]), backend=backend))
        out = max(max_diff(run(model, wrap(x)), reference(x)) for x in data)
    return {
        "out": out,
        "calls": float(full(model.calls)),
        "ref_calls": float(reference.calls),
        "buffer_type": type(model.calls).__name__,
    }


def tp_mlp(backend: str, one_rank: bool = False) -> dict[str, Any]:
    mesh = mesh_1d()
    model = parallelize_module(make_mlp(), mesh, tp_plan_mlp())
    data = batches(4, 8)
    pair = precompile(train_step, model, data[0], backend=backend, compile_on_one_rank=one_rank)
    result = compare_training(precompile.load(*pair), model, make_mlp, data, lambda x: x)
    result["digest"] = digest(pair)
    result["build_modules"] = sorted(
        m for m in sys.modules if m.startswith(("torch_precompile.trace", "torch_precompile.lower"))
    )
    spec = precompile.inspect(pair[0])
    result["meshes"] = [(m.shape, m.dim_names, m.coordinate) for m in spec.meshes]
    result["placements"] = [d.placements for d in spec.distributed]
    return result


def tp_mlp_infer(backend: str) -> dict[str, Any]:
    mesh = mesh_1d()
    model = parallelize_module(make_mlp(), mesh, tp_plan_mlp())
    reference = make_mlp()
    data = batches(4, 8)
    with torch.no_grad():
        infer = precompile.load(*precompile(lambda m, x: m(x), model, data[0], backend=backend))
        return {"out": max(max_diff(infer(model, x), reference(x)) for x in data)}


def tp_block(backend: str, sequence_parallel: bool, one_rank: bool = True) -> dict[str, Any]:
    """Attention and MLP under tensor parallelism; with sequence parallelism each rank passes
    and gets its slice of the sequence, and the loss is a sum over ranks."""
    mesh, world, rank = mesh_1d(), dist.get_world_size(), dist.get_rank()
    data = batches(2, 4, 8)
    if sequence_parallel:

        def wrap(x: torch.Tensor) -> torch.Tensor:
            return x.chunk(world, dim=1)[rank]

        def step_fn(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
            loss = model(x).square().sum() / (x.numel() * world)
            loss.backward()
            return loss

        def loss_of(loss: torch.Tensor) -> float:
            total = loss.detach().clone()
            dist.all_reduce(total)
            return float(total)
    else:
        wrap, step_fn, loss_of = (lambda x: x), train_step, (lambda loss: float(full(loss)))
    model = parallelize_module(make_block(), mesh, tp_plan_block(sequence_parallel))
    pair = precompile(step_fn, model, wrap(data[0]), backend=backend, compile_on_one_rank=one_rank)
    result = compare_training(precompile.load(*pair), model, make_block, data, wrap, loss_of)
    fresh = parallelize_module(make_block(), mesh, tp_plan_block(sequence_parallel)).eval()
    reference = make_block().eval()
    with torch.no_grad():
        infer = precompile.load(
            *precompile(
                lambda m, x: m(x),
                fresh,
                wrap(data[0]),
                backend=backend,
                compile_on_one_rank=one_rank,
            )
        )
        result["infer"] = max(max_diff(infer(fresh, wrap(x)), wrap(reference(x))) for x in data)
    return result


class Head(torch.nn.Module):
    """An MLP with a vocabulary head: logits sharded over the vocabulary under loss_parallel."""

    def __init__(self, dim: int = 8, vocab: int = 12) -> None:
        super().__init__()
        self.body = MLP(dim, 2 * dim)
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def parallel_loss_step(
    model: torch.nn.Module, x: torch.Tensor, target: torch.Tensor
) -> torch.Tensor:
    from torch.distributed.tensor.parallel import loss_parallel

    with loss_parallel():
        loss = torch.nn.functional.cross_entropy(model(x), target)
        loss.backward()
    return loss


def loss_parallel_case(backend: str) -> dict[str, Any]:
    """Cross-entropy on vocabulary-sharded logits (loss_parallel), three SGD steps."""
    mesh = mesh_1d()

    def make() -> torch.nn.Module:
        torch.manual_seed(0)
        return Head()

    plan = {
        "body.up": ColwiseParallel(),
        "body.down": RowwiseParallel(),
        "head": ColwiseParallel(use_local_output=False),
    }
    model = parallelize_module(make(), mesh, plan)
    data = batches(4, 8)
    targets = [torch.arange(4) * 3 % 12 + i for i in range(STEPS)]
    step = precompile.load(
        *precompile(parallel_loss_step, model, data[0], targets[0], backend=backend)
    )
    reference = make()
    worst = {"loss": 0.0, "grad": 0.0, "param": 0.0}
    for x, target in zip(data, targets, strict=True):
        ref_loss = torch.nn.functional.cross_entropy(reference(x), target)
        ref_loss.backward()
        loss = step(model, x, target)
        worst["loss"] = max(worst["loss"], abs(float(full(loss)) - float(ref_loss)))
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            worst["grad"] = max(worst["grad"], max_diff(p.grad, q.grad))
        sgd(model)
        sgd(reference)
    worst["param"] = max(
        max_diff(p, q) for p, q in zip(model.parameters(), reference.parameters(), strict=True)
    )
    return worst


def data_parallel(backend: str) -> dict[str, Any]:
    """Plain data parallelism: each rank steps on its slice, then all_reduce of each .grad."""
    world, rank = dist.get_world_size(), dist.get_rank()
    model = make_mlp()
    data = batches(4 * world, 8)
    step = precompile.load(
        *precompile(train_step, model, data[0].chunk(world)[rank], backend=backend)
    )
    ref_losses, ref_grads, ref_params = eager_reference(make_mlp, data)
    worst = {"loss": 0.0, "grad": 0.0, "param": 0.0}
    for x, ref_loss, ref_grad in zip(data, ref_losses, ref_grads, strict=True):
        loss = step(model, x.chunk(world)[rank]).detach().clone()
        dist.all_reduce(loss)
        worst["loss"] = max(worst["loss"], abs(float(loss) / world - ref_loss))
        for name, p in model.named_parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
            worst["grad"] = max(worst["grad"], max_diff(p.grad, ref_grad[name]))
        sgd(model)
    worst["param"] = max(max_diff(p, ref_params[n]) for n, p in model.named_parameters())
    return worst


def ddp_case(backend: str, one_rank: bool = False) -> dict[str, Any]:
    """A DDP model as users pass it: the artifact averages gradients over the ranks as DDP
    does, so each rank's .grad equals single-process eager's on the full batch."""
    world, rank = dist.get_world_size(), dist.get_rank()
    model = DistributedDataParallel(make_mlp())
    data = batches(4 * world, 8)
    code, cache = precompile(
        train_step, model, data[0].chunk(world)[rank], backend=backend, compile_on_one_rank=one_rank
    )
    step = precompile.load(code, cache)
    ref_losses, ref_grads, ref_params = eager_reference(make_mlp, data)
    worst = {
        "loss": 0.0,
        "grad": 0.0,
        "param": 0.0,
        "all_reduces": len(re.findall(r"\ball_reduce_?\.default\(", code)),
    }
    for x, ref_loss, ref_grad in zip(data, ref_losses, ref_grads, strict=True):
        loss = step(model, x.chunk(world)[rank]).detach().clone()
        dist.all_reduce(loss)
        worst["loss"] = max(worst["loss"], abs(float(loss) / world - ref_loss))
        for name, p in model.module.named_parameters():
            worst["grad"] = max(worst["grad"], max_diff(p.grad, ref_grad[name]))
        sgd(model)
    worst["param"] = max(max_diff(p, ref_params[n]) for n, p in model.module.named_parameters())
    return worst


def ddp_no_sync(backend: str) -> dict[str, Any]:
    """Gradient accumulation: one artifact captured inside no_sync() for the first batch of
    each step, one outside for the second; .grad after the second equals eager's on both
    full batches. The synced artifact is refused inside no_sync()."""
    world, rank = dist.get_world_size(), dist.get_rank()
    model = DistributedDataParallel(make_mlp())
    data = batches(4 * world, 8, count=2 * STEPS)
    first = data[0].chunk(world)[rank]
    sync = precompile.load(
        *precompile(train_step, model, first, backend=backend, compile_on_one_rank=True)
    )
    with model.no_sync():
        local = precompile.load(
            *precompile(train_step, model, first, backend=backend, compile_on_one_rank=True)
        )
    _, ref_grads, ref_params = eager_reference(make_mlp, data, accumulate=2)
    worst: dict[str, Any] = {"grad": 0.0, "param": 0.0}
    for i, x in enumerate(data):
        mine = x.chunk(world)[rank]
        if i % 2 == 0:
            with model.no_sync():
                local(model, mine)
                if i == 0:
                    worst["refused"] = _message(lambda m=mine: sync(model, m))
            continue
        sync(model, mine)
        for name, p in model.module.named_parameters():
            worst["grad"] = max(worst["grad"], max_diff(p.grad, ref_grads[i][name]))
        sgd(model)
    worst["param"] = max(max_diff(p, ref_params[n]) for n, p in model.module.named_parameters())
    return worst


def ddp_adamw(backend: str, one_rank: bool = False) -> dict[str, Any]:
    """A whole DDP training step inside fn: zero_grad, forward, backward, AdamW step; the LR
    follows a schedule outside. Parameters equal single-process eager's on the full batch."""
    world, rank = dist.get_world_size(), dist.get_rank()
    result = adamw_training(
        DistributedDataParallel(make_mlp()),
        backend,
        one_rank,
        lambda x: x.chunk(world)[rank],
        world,
    )
    del result["opt"]
    return result


def fsdp_adamw(backend: str, one_rank: bool, two_d: bool) -> dict[str, Any]:
    """The same whole step on fully_shard (on a (dp, tp) mesh with tensor parallelism when
    ``two_d``): AdamW's state is sharded like the parameters, DTensors between calls."""
    from torch.distributed.fsdp import fully_shard

    world = dist.get_world_size()
    if two_d:
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
        model, dp = parallelize_module(make_mlp(), mesh["tp"], tp_plan_mlp()), mesh["dp"]
    else:
        model, dp = make_mlp(), init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    for child in model.children():
        fully_shard(child, mesh=dp)
    fully_shard(model, mesh=dp)
    replicas, replica = dp.size(), dp.get_local_rank()
    result = adamw_training(
        model, backend, one_rank, lambda x: x.chunk(replicas)[replica], replicas, dp.get_group()
    )
    result["state"] = sorted(
        {
            type(t).__name__
            for s in result.pop("opt").state.values()
            for k, t in s.items()
            if k != "step"
        }
    )
    return result


def adamw_training(
    model: torch.nn.Module,
    backend: str,
    one_rank: bool,
    mine: Callable[[torch.Tensor], torch.Tensor],
    replicas: int,
    group: Any = None,
) -> dict[str, Any]:
    """Three AdamW steps inside fn under a StepLR schedule, against single-process eager."""
    reference = make_mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.01)
    schedules = [torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.5) for o in (opt, ref_opt)]
    data = batches(4 * replicas, 8)
    step = precompile.load(
        *precompile(
            adamw_step, model, opt, mine(data[0]), backend=backend, compile_on_one_rank=one_rank
        )
    )
    worst: dict[str, Any] = {"loss": 0.0, "param": 0.0}
    for x in data:
        loss = step(model, opt, mine(x)).detach().clone()
        ref_loss = adamw_step(reference, ref_opt, x)
        dist.all_reduce(loss, group=group)
        worst["loss"] = max(worst["loss"], abs(float(loss) / replicas - float(ref_loss)))
        for schedule in schedules:
            schedule.step()
    own = model.module if isinstance(model, DistributedDataParallel) else model
    worst["param"] = max(
        max_diff(p, q) for p, q in zip(own.parameters(), reference.parameters(), strict=True)
    )
    worst["opt"] = opt
    return worst


def adamw_step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> torch.Tensor:
    opt.zero_grad()
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    return loss


class NormMLP(torch.nn.Module):
    """An MLP with BatchNorm: buffers DDP broadcasts from rank 0 before every forward."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = MLP()
        self.norm = torch.nn.BatchNorm1d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.mlp(x))


def ddp_buffers(backend: str) -> dict[str, Any]:
    """BatchNorm under DDP against eager DDP itself (per-rank batch statistics are what DDP
    computes): losses, gradients, parameters and the broadcast running statistics."""
    rank, world = dist.get_rank(), dist.get_world_size()

    def make() -> torch.nn.Module:
        torch.manual_seed(0)
        return DistributedDataParallel(NormMLP())

    model, reference = make(), make()
    data = batches(4 * world, 8)
    pair = precompile(train_step, model, data[0].chunk(world)[rank], backend=backend)
    step = precompile.load(*pair)
    worst: dict[str, Any] = {
        "loss": 0.0,
        "grad": 0.0,
        "param": 0.0,
        "buffer": 0.0,
        "inspect": _inspected(pair),
    }
    for x in data:
        mine = x.chunk(world)[rank]
        worst["loss"] = max(
            worst["loss"], abs(float(step(model, mine)) - float(train_step(reference, mine)))
        )
        worst["grad"] = max(
            worst["grad"],
            *(
                max_diff(p.grad, q.grad)
                for p, q in zip(model.parameters(), reference.parameters(), strict=True)
            ),
        )
        sgd(model)
        sgd(reference)
    worst["param"] = max(
        max_diff(p, q) for p, q in zip(model.parameters(), reference.parameters(), strict=True)
    )
    worst["buffer"] = max(
        max_diff(b.float(), c.float())
        for b, c in zip(model.buffers(), reference.buffers(), strict=True)
    )
    return worst


def ddp_refusals(backend: str) -> dict[str, Any]:
    """DDP options a precompiled step cannot reproduce, and calls it cannot serve."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    x = batches(4, 8)[0]
    messages: dict[str, Any] = {}
    for option, kwargs in (
        ("find_unused_parameters", {"find_unused_parameters": True}),
        ("static_graph", {"static_graph": True}),
    ):
        wrapped = DistributedDataParallel(make_mlp(), **kwargs)
        messages[option] = _message(lambda m=wrapped: precompile(train_step, m, x, backend=backend))
    hooked = DistributedDataParallel(make_mlp())
    hooked.register_comm_hook(None, default_hooks.allreduce_hook)
    messages["comm_hook"] = _message(lambda: precompile(train_step, hooked, x, backend=backend))
    model = DistributedDataParallel(make_mlp())

    def no_sync_inside(m: Any, x: torch.Tensor) -> torch.Tensor:
        with m.no_sync():
            return train_step(m, x)

    messages["no_sync_inside_fn"] = _message(
        lambda: precompile(no_sync_inside, model, x, backend=backend)
    )

    def down_only(m: Any, x: torch.Tensor) -> torch.Tensor:
        loss = m.module.down(x.repeat(1, 2)).square().mean()  # up gets no gradient
        loss.backward()
        return loss

    messages["partial_backward"] = _message(
        lambda: precompile(down_only, model, x, backend=backend)
    )
    step = precompile.load(*precompile(train_step, model, x, backend=backend))
    messages["plain_module"] = _message(lambda: step(model.module, x))
    messages["after_refusals"] = _message(lambda: step(model, x))
    return messages


def fully_sharded(
    make: Callable[[], torch.nn.Module], mesh: Any, **options: Any
) -> torch.nn.Module:
    """``make()`` with fully_shard on each Linear child, then on the root."""
    from torch.distributed.fsdp import fully_shard

    model = make()
    for child in model.children():
        fully_shard(child, mesh=mesh, **options)
    return fully_shard(model, mesh=mesh, **options)


def mean_over_ranks(loss: torch.Tensor) -> float:
    loss = loss.detach().clone()
    dist.all_reduce(loss)
    return float(loss) / dist.get_world_size()


def fsdp_case(backend: str, one_rank: bool = False, reshard: bool = True) -> dict[str, Any]:
    """fully_shard on each layer and the root; each rank passes its slice of the batch. Two
    batches per SGD step (the second call adds to the sharded .grad), against single-process
    eager on the full batches; .grad stays a Shard(0) DTensor."""
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    model = fully_sharded(make_mlp, mesh, reshard_after_forward=reshard)
    data = batches(2 * world, 8, count=2 * STEPS)

    def mine(x: torch.Tensor) -> torch.Tensor:
        return x.chunk(world)[rank]

    step = precompile.load(
        *precompile(train_step, model, mine(data[0]), backend=backend, compile_on_one_rank=one_rank)
    )
    result: dict[str, Any] = compare_training(
        step, model, make_mlp, data, mine, loss_of=mean_over_ranks, accumulate=2
    )
    step(model, mine(data[0]))
    result["grad_placements"] = sorted({str(p.grad.placements) for p in model.parameters()})
    result["local_shapes"] = [list(p.to_local().shape) for p in model.parameters()]
    if backend == "eager" and not one_rank:
        result["inspect"] = _inspected(
            precompile(train_step, model, mine(data[0]), backend=backend)
        )
    return result


def _inspected(pair: tuple[str, bytes]) -> list[str]:
    """The data-parallel lines of ``inspect`` for a saved pair."""
    import tempfile

    from torch_precompile.inspection import describe

    with tempfile.TemporaryDirectory() as folder:
        path = precompile.save(*pair, Path(folder) / "step.py")
        return describe(path)["data_parallel"]


def fsdp_mixed_precision(backend: str) -> dict[str, Any]:
    """MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) against eager FSDP2 with the
    same policy (single-process eager has no bf16 gathers to compare with)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model, reference = (fully_sharded(make_mlp, mesh, mp_policy=policy) for _ in range(2))
    data = [x.chunk(world)[rank] for x in batches(2 * world, 8)]
    step = precompile.load(*precompile(train_step, model, data[0], backend=backend))
    worst = {"loss": 0.0, "grad": 0.0, "param": 0.0}
    for x in data:
        worst["loss"] = max(
            worst["loss"], abs(float(step(model, x)) - float(train_step(reference, x)))
        )
        worst["grad"] = max(
            worst["grad"],
            *(
                max_diff(p.grad, q.grad)
                for p, q in zip(model.parameters(), reference.parameters(), strict=True)
            ),
        )
        worst["grad_dtype"] = str(next(model.parameters()).grad.dtype)
        sgd(model)
        sgd(reference)
    worst["param"] = max(
        max_diff(p, q) for p, q in zip(model.parameters(), reference.parameters(), strict=True)
    )
    for name, other_policy in (
        ("no_policy", None),
        (
            "fp16_gathers",
            MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32),
        ),
    ):
        other = fully_sharded(
            make_mlp, mesh, **({"mp_policy": other_policy} if other_policy else {})
        )
        before = [p.detach().clone() for p in other.parameters()]
        try:
            step(other, data[0])
            worst[name] = "ran"
        except PrecompileError as e:
            worst[name] = f"PrecompileError: {e}"
        worst[f"{name}_untouched"] = all(
            torch.equal(p, q) and p.grad is None
            for p, q in zip(other.parameters(), before, strict=True)
        )
    return worst


def fsdp_divide_factor(backend: str) -> dict[str, Any]:
    """set_gradient_divide_factor(3.0) on one layer: its gradients are the ranks' sum over
    3 (eager's full-batch gradient times world / 3), the others' the average; changing the
    factor after capture is refused."""
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    model = fully_sharded(make_mlp, mesh)
    model.up.set_gradient_divide_factor(3.0)
    data = batches(2 * world, 8)
    mine = data[0].chunk(world)[rank]
    step = precompile.load(*precompile(train_step, model, mine, backend=backend))
    step(model, mine)
    _, ref_grads, _ = eager_reference(make_mlp, data[:1])
    result: dict[str, Any] = {
        "grad": max(
            max_diff(p.grad, ref_grads[0][n] * (world / 3 if n.startswith("up.") else 1))
            for n, p in model.named_parameters()
        )
    }
    model.up.set_gradient_divide_factor(2.0)
    result["other_factor"] = _message(lambda: step(model, mine))
    return result


def fsdp_refusals(backend: str) -> dict[str, Any]:
    """FSDP2 settings a precompiled step cannot reproduce, and calls it cannot serve."""
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    x = batches(2, 8)[0]
    messages: dict[str, Any] = {}
    unsynced = fully_sharded(make_mlp, mesh)
    unsynced.set_requires_gradient_sync(False)
    messages["no_gradient_sync"] = _message(
        lambda: precompile(train_step, unsynced, x, backend=backend)
    )
    hooked = fully_sharded(make_mlp, mesh)
    hooked.up.set_all_reduce_hook(lambda grad: None)
    messages["all_reduce_hook"] = _message(
        lambda: precompile(train_step, hooked, x, backend=backend)
    )
    if world == 4:
        hybrid = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        hsdp = fully_sharded(make_mlp, hybrid)
        messages["hsdp"] = _message(lambda: precompile(train_step, hsdp, x, backend=backend))
    model = fully_sharded(make_mlp, mesh)
    step = precompile.load(*precompile(train_step, model, x, backend=backend))
    model.set_requires_gradient_sync(False)
    messages["call_without_sync"] = _message(lambda: step(model, x))
    model.set_requires_gradient_sync(True)
    messages["plain_model"] = _message(lambda: step(make_mlp(), x))
    messages["after_refusals"] = _message(lambda: step(model, x))
    return messages


def fsdp_tp_2d(backend: str, one_rank: bool = False) -> dict[str, Any]:
    """torchtitan's layout: tensor parallelism on ``tp``, fully_shard on ``dp`` of a 2-D
    mesh; each data-parallel replica passes its slice of the batch. Two batches per SGD step
    against single-process eager on the full batches."""
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, dist.get_world_size() // 2), mesh_dim_names=("dp", "tp"))
    replica = mesh.get_local_rank("dp")
    model = parallelize_module(
        make_normed_mlp(), mesh["tp"], {"1.up": ColwiseParallel(), "1.down": RowwiseParallel()}
    )
    fully_shard(model[1].up, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])  # the norm (on dp) and the row-wise down (on dp, tp)
    data = batches(4, 8, count=2 * STEPS)

    def mine(x: torch.Tensor) -> torch.Tensor:
        return x.chunk(2)[replica]

    def mean_over_replicas(loss: torch.Tensor) -> float:
        loss = loss.detach().clone()
        dist.all_reduce(loss, group=mesh.get_group("dp"))
        return float(loss) / 2

    code, cache = precompile(
        train_step, model, mine(data[0]), backend=backend, compile_on_one_rank=one_rank
    )
    step = precompile.load(code, cache)
    result: dict[str, Any] = compare_training(
        step, model, make_normed_mlp, data, mine, loss_of=mean_over_replicas, accumulate=2
    )
    result["gathers"] = code.count("all_gather_into_tensor.default(")
    step(model, mine(data[0]))
    result["placements"] = sorted({str(p.grad.placements) for p in model.parameters()})
    infer = precompile.load(
        *precompile(
            lambda m, x: m(x), model, mine(data[0]), backend=backend, compile_on_one_rank=one_rank
        )
    )
    reference = make_normed_mlp()
    with torch.no_grad():
        for p, q in zip(reference.parameters(), model.parameters(), strict=True):
            p.copy_(q.full_tensor())
        result["infer"] = max_diff(infer(model, mine(data[1])), reference(mine(data[1])))
    return result


def _message(thunk: Callable[[], Any]) -> str:
    try:
        thunk()
    except precompile.PrecompileError as e:
        return f"PrecompileError: {e}"
    except Exception as e:
        return f"RAW {type(e).__name__}: {e}"
    return "no error"


def tp_dp_2d(backend: str) -> dict[str, Any]:
    """A (dp, tp) mesh: tensor parallelism inside each replica, then an all_reduce of each
    gradient's local shard across replicas; one rank compiles for all four."""
    mesh = init_device_mesh("cpu", (2, dist.get_world_size() // 2), mesh_dim_names=("dp", "tp"))
    replicas, replica = mesh["dp"].size(), mesh.get_local_rank("dp")
    model = parallelize_module(make_mlp(), mesh["tp"], tp_plan_mlp())
    data = batches(8, 8)
    step = precompile.load(
        *precompile(
            train_step,
            model,
            data[0].chunk(replicas)[replica],
            backend=backend,
            compile_on_one_rank=True,
        )
    )
    ref_losses, ref_grads, ref_params = eager_reference(make_mlp, data)
    worst = {"loss": 0.0, "grad": 0.0, "param": 0.0}
    for x, ref_loss, ref_grad in zip(data, ref_losses, ref_grads, strict=True):
        loss = full(step(model, x.chunk(replicas)[replica])).detach().clone()
        with torch.no_grad():
            dist.all_reduce(loss, group=mesh.get_group("dp"))
            for p in model.parameters():
                local = p.grad.to_local()
                dist.all_reduce(local, group=mesh.get_group("dp"))
                local /= replicas
        worst["loss"] = max(worst["loss"], abs(float(loss) / replicas - ref_loss))
        for name, p in model.named_parameters():
            worst["grad"] = max(worst["grad"], max_diff(p.grad, ref_grad[name]))
        sgd(model)
    worst["param"] = max(max_diff(p, ref_params[n]) for n, p in model.named_parameters())
    return worst


def refusals(backend: str) -> dict[str, Any]:
    """Each wrong call or unsupported input, and the message it gets."""
    mesh = mesh_1d()
    messages: dict[str, Any] = {}

    def message(thunk: Callable[[], Any]) -> str:
        try:
            thunk()
        except precompile.PrecompileError as e:
            return f"PrecompileError: {e}"
        except Exception as e:
            return f"RAW {type(e).__name__}: {e}"
        return "no error"

    model = parallelize_module(make_mlp(), mesh, tp_plan_mlp())
    x = batches(4, 8)[0]
    step = precompile.load(*precompile(train_step, model, x, backend=backend))
    plain = make_mlp()
    messages["plain_model"] = message(lambda: step(plain, x))
    rowwise = parallelize_module(
        make_mlp(), mesh, {"up": RowwiseParallel(), "down": ColwiseParallel()}
    )
    messages["other_placements"] = message(lambda: step(rowwise, x))
    if dist.get_world_size() % 2 == 0 and dist.get_world_size() > 2:
        other_mesh = init_device_mesh(
            "cpu", (2, dist.get_world_size() // 2), mesh_dim_names=("dp", "tp")
        )
        sub = parallelize_module(make_mlp(), other_mesh["tp"], tp_plan_mlp())
        messages["other_mesh"] = message(lambda: step(sub, x))
    from torch.distributed.device_mesh import DeviceMesh

    only_rank_zero = DeviceMesh("cpu", [0])  # every rank creates it; rank 0 alone is in it
    outside = torch.nn.Linear(8, 4)
    outside.weight = torch.nn.Parameter(
        distribute_tensor(outside.weight.detach(), only_rank_zero, [Replicate()])
    )
    messages["outside_mesh"] = message(
        lambda: precompile(lambda m, x: m.weight.sum(), outside, x, backend=backend)
    )
    closed = torch.ones(8)
    messages["closed_over"] = message(
        lambda: precompile(lambda m, x: train_step(m, x + closed), model, x, backend=backend)
    )
    messages["in_place_collective"] = message(
        lambda: precompile(lambda m, x: dist.all_reduce(m(x)), model, x, backend=backend)
    )
    messages["dynamic"] = message(lambda: _dynamic(model, x, backend))
    from torch.testing._internal.two_tensor import TwoTensor

    pair = TwoTensor(torch.ones(4, 8), torch.ones(4, 8))
    messages["beside_dtensors"] = message(
        lambda: precompile(lambda m, x, y: train_step(m, x + y), model, x, pair, backend=backend)
    )
    nested = DTensor.from_local(
        TwoTensor(torch.ones(4, 8), torch.ones(4, 8)), mesh, [Replicate()], run_check=False
    )
    messages["nested"] = message(lambda: precompile(lambda x: x * 2, nested, backend=backend))
    return messages


def _dynamic(model: torch.nn.Module, x: torch.Tensor, backend: str) -> Any:
    torch._dynamo.decorators.mark_unbacked(x, 0)
    return precompile(train_step, model, x, backend="inductor")


def uneven_one_rank(backend: str) -> dict[str, Any]:
    """Rank 0's artifact on ranks whose shards have other shapes: refused at the first call."""
    mesh = mesh_1d()
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2 * dist.get_world_size() + 1)  # rows do not divide evenly
    model.weight = torch.nn.Parameter(distribute_tensor(model.weight.detach(), mesh, [Shard(0)]))
    model.bias = torch.nn.Parameter(distribute_tensor(model.bias.detach(), mesh, [Shard(0)]))
    x = distribute_tensor(batches(4, 8)[0], mesh, [Replicate()])
    step = precompile.load(
        *precompile(train_step, model, x, backend=backend, compile_on_one_rank=True)
    )
    try:
        step(model, x)  # no collective on the result: other ranks may have been refused
        return {"outcome": "ran"}
    except precompile.PrecompileError as e:
        return {"outcome": f"PrecompileError: {e}"}


def rank_zero_artifact(backend: str) -> dict[str, Any]:
    """Every rank compiles its own artifact; rank 0's, loaded everywhere, serves rank 0 only
    when its graph depends on the rank (an every-rank build records the coordinate)."""
    mesh = mesh_1d()
    model = parallelize_module(make_mlp(), mesh, tp_plan_mlp())
    x = batches(4, 8)[0]
    pairs: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(pairs, precompile(train_step, model, x, backend=backend))
    try:
        precompile.load(*pairs[0])(model, x)
        return {"outcome": "ran"}
    except precompile.PrecompileError as e:
        return {"outcome": f"PrecompileError: {e}"}


def save_and_inspect(backend: str, folder: str) -> dict[str, Any]:
    mesh = mesh_1d()
    model = parallelize_module(make_mlp(), mesh, tp_plan_mlp())
    x = batches(4, 8)[0]
    path = Path(folder) / f"rank{dist.get_rank()}" / "step.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    precompile.save(*precompile(train_step, model, x, backend=backend), path)
    step = precompile.load_file(path)
    reference = make_mlp()
    loss, ref = step(model, x), train_step(reference, x)
    spec = precompile.inspect(path.read_text())
    cli = subprocess.run(
        [sys.executable, "-m", "torch_precompile", "inspect", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    return {
        "loss": abs(float(full(loss)) - float(ref)),
        "path": str(path),
        "meshes": [m.dim_names for m in spec.meshes],
        "cli": cli.stdout + cli.stderr,
    }


CASES: dict[str, Callable[[], dict[str, Any]]] = {
    "linear_eager": lambda: linear_dtensor("eager"),
    "linear_inductor": lambda: linear_dtensor("inductor"),
    "buffers_eager": lambda: dtensor_buffers("eager"),
    "buffers_inductor": lambda: dtensor_buffers("inductor"),
    "tp_mlp_eager": lambda: tp_mlp("eager"),
    "tp_mlp_inductor_one_rank": lambda: tp_mlp("inductor", one_rank=True),
    "tp_mlp_eager_one_rank": lambda: tp_mlp("eager", one_rank=True),
    "tp_mlp_infer_eager": lambda: tp_mlp_infer("eager"),
    "tp_mlp_infer_inductor": lambda: tp_mlp_infer("inductor"),
    "tp_block_eager": lambda: tp_block("eager", sequence_parallel=False, one_rank=False),
    "tp_block_sp_eager": lambda: tp_block("eager", sequence_parallel=True),
    "tp_block_sp_inductor": lambda: tp_block("inductor", sequence_parallel=True),
    "data_parallel_eager": lambda: data_parallel("eager"),
    "ddp_eager": lambda: ddp_case("eager"),
    "ddp_eager_one_rank": lambda: ddp_case("eager", one_rank=True),
    "ddp_inductor_one_rank": lambda: ddp_case("inductor", one_rank=True),
    "ddp_no_sync_eager": lambda: ddp_no_sync("eager"),
    "ddp_adamw_eager": lambda: ddp_adamw("eager"),
    "ddp_adamw_inductor_one_rank": lambda: ddp_adamw("inductor", one_rank=True),
    "fsdp_adamw_eager": lambda: fsdp_adamw("eager", one_rank=False, two_d=False),
    "fsdp_adamw_inductor_one_rank": lambda: fsdp_adamw("inductor", one_rank=True, two_d=False),
    "fsdp_tp_2d_adamw_eager": lambda: fsdp_adamw("eager", one_rank=False, two_d=True),
    "fsdp_tp_2d_adamw_inductor_one_rank": lambda: fsdp_adamw("inductor", one_rank=True, two_d=True),
    "ddp_buffers_eager": lambda: ddp_buffers("eager"),
    "ddp_buffers_inductor": lambda: ddp_buffers("inductor"),
    "ddp_refusals": lambda: ddp_refusals("eager"),
    "fsdp_eager": lambda: fsdp_case("eager"),
    "fsdp_inductor": lambda: fsdp_case("inductor"),
    "fsdp_eager_one_rank": lambda: fsdp_case("eager", one_rank=True),
    "fsdp_inductor_one_rank": lambda: fsdp_case("inductor", one_rank=True),
    "fsdp_keep_after_forward": lambda: fsdp_case("inductor", reshard=False),
    "fsdp_mixed_precision": lambda: fsdp_mixed_precision("eager"),
    "fsdp_refusals": lambda: fsdp_refusals("eager"),
    "fsdp_divide_factor": lambda: fsdp_divide_factor("eager"),
    "fsdp_tp_2d_eager": lambda: fsdp_tp_2d("eager"),
    "fsdp_tp_2d_inductor_one_rank": lambda: fsdp_tp_2d("inductor", one_rank=True),
    "data_parallel_inductor": lambda: data_parallel("inductor"),
    "loss_parallel_eager": lambda: loss_parallel_case("eager"),
    "loss_parallel_inductor": lambda: loss_parallel_case("inductor"),
    "refusals": lambda: refusals("eager"),
    "tp_dp_2d_eager": lambda: tp_dp_2d("eager"),
    "tp_dp_2d_inductor": lambda: tp_dp_2d("inductor"),
    "uneven_one_rank": lambda: uneven_one_rank("eager"),
    "rank_zero_artifact": lambda: rank_zero_artifact("eager"),
}


def main() -> None:
    rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=180),
    )
    report: dict[str, Any] = {}
    seconds: dict[str, float] = {}  # what each case took on this rank, to keep the worlds cheap
    for name in sys.argv[5].split(","):
        start = time.perf_counter()
        try:
            if name == "save_and_inspect":
                report[name] = save_and_inspect("eager", out)
            else:
                report[name] = CASES[name]()
        except Exception as e:
            report[name] = {
                "error": f"{type(e).__name__}: {e}",
                "traceback": traceback.format_exc(),
            }
        dist.barrier()
        seconds[name] = round(time.perf_counter() - start, 2)
    report["_seconds"] = seconds
    Path(out, f"rank{rank}.json").write_text(json.dumps(report, indent=1, default=str))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
