"""What marking a repeated block's operations in a trace touches of torch: the graph the
running make_fx trace is building, autograd nodes' creation order, the end of a backward pass,
and module calls seen process-wide."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx


def traced_graph() -> torch.fx.Graph | None:
    """The graph the innermost running make_fx trace records into, if one runs."""
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    mode = get_proxy_mode()
    return None if mode is None else mode.tracer.graph


def creation_number() -> int:
    """The number the next autograd node created on this thread will get."""
    return int(torch.autograd._get_sequence_nr())  # type: ignore[attr-defined]


def node_number(node: Any) -> int:
    """When autograd ``node`` was created, as ``creation_number`` counts."""
    return int(node._sequence_nr())


def accumulates(node: Any) -> bool:
    """Whether autograd ``node`` puts a leaf's gradient on its ``.grad``."""
    return hasattr(node, "variable")


def at_backward_end(callback: Callable[[], None]) -> None:
    """Run ``callback`` once the running backward pass has finished."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


@contextlib.contextmanager
def module_calls(
    before: Callable[[torch.nn.Module], None], after: Callable[[torch.nn.Module, Any], None]
) -> Iterator[None]:
    """Hear of every module call in the process (before it, and after it with its output)."""
    from torch.nn.modules import module as module_module

    pre = module_module.register_module_forward_pre_hook(lambda m, _args: before(m))
    post = module_module.register_module_forward_hook(
        lambda m, _args, out: after(m, out), always_call=True
    )
    try:
        yield
    finally:
        pre.remove()
        post.remove()
