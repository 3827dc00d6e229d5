"""The driver part for results with autograd history, when fn runs no backward itself.

Under grad mode, a call where a flat input that required grad at capture requires grad now
runs the compiled forward inside one autograd function: its results get history, and the
values it saves for backward are kept as autograd keeps a function's saved tensors (freed by
the backward unless ``retain_graph``; an in-place write to one before the backward is refused
by autograd). ``backward()``, whenever the caller's code runs it, runs the compiled backward,
and autograd puts the gradients on ``.grad`` (adding to what is there) and on inputs that
require grad, as eager does. Under ``no_grad`` or with nothing requiring grad, the plain
graph runs as before.
"""

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from torch_precompile.shipped.driver.core import Driver
from torch_precompile.shipped.driver.no_history import NoHistory
from torch_precompile.shipped.driver.refusals import PrecompileError

Graph = Callable[[list[Any]], list[Any]]


def differentiable(
    forward: Callable[[], Graph] | None = None, backward: Callable[[], Graph] | None = None
) -> "Callable[[Driver], AutogradCall]":
    """The ``autograd`` part of a driver whose artifact holds the functions that ready its
    ``forward`` and ``backward`` graphs (none where results carry no history)."""
    return lambda driver: AutogradCall(driver, forward, backward)


class AutogradCall(NoHistory):
    """Whether a call needs history, and the call that gives it."""

    def __init__(
        self,
        driver: "Driver",
        forward: Callable[[], Graph] | None,
        backward: Callable[[], Graph] | None,
    ) -> None:
        super().__init__(driver)
        record = driver.autograd_record
        self.outputs = list(record.outputs)
        self.tangent_strides = [tuple(s) for s in record.tangent_strides]
        self.ready = (forward, backward)
        # The graphs once readied (None before): Any, as they are called only after that.
        self.forward: Any = None
        self.backward: Any = None
        self.lock = threading.Lock()
        self.num_outputs = driver.graph_outputs  # results, gradients, value guards

    def wanted(self, flat: Sequence[torch.Tensor]) -> bool:
        """Whether this call (under grad mode) must give its results history."""
        if not self.may_have_history(flat):
            return False
        if self.forward is None and self.ready[0] is not None:
            self._ready_graphs()
        return self.forward is not None

    def _ready_graphs(self) -> None:
        """The forward and backward graphs, readied at the first call that needs them: calls
        under no_grad never pay for them."""
        with self.lock:
            if self.forward is None:
                self.backward = self.ready[1]()  # type: ignore[misc]  # both given when readied
                self.forward = self.ready[0]()  # type: ignore[misc]

    def __call__(self, flat: list[torch.Tensor]) -> list[Any]:
        """Run the forward with history (grad mode on); the results as the plain call's."""
        return list(_Compiled.apply(self, *flat))  # type: ignore[no-untyped-call]


class _Compiled(torch.autograd.Function):
    """The compiled forward and backward as one autograd node."""

    @staticmethod
    def forward(ctx: Any, plan: AutogradCall, *flat: torch.Tensor) -> Any:
        outputs = plan.forward(list(flat))
        results, saved = outputs[: plan.num_outputs], outputs[plan.num_outputs :]
        ctx.plan = plan
        ctx.save_for_backward(*saved)
        with_history = set(plan.outputs)
        ctx.mark_non_differentiable(
            *(
                r
                for i, r in enumerate(results)
                if isinstance(r, torch.Tensor) and i not in with_history
            )
        )
        return tuple(results)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        plan: AutogradCall = ctx.plan
        if torch.is_grad_enabled():
            raise PrecompileError(
                "a double backward (create_graph=True, or torch.autograd.grad of a gradient) "
                "through a precompiled artifact is not supported: its backward graph is "
                "compiled without history. Run that computation eagerly."
            )
        tangents = [
            _in_layout(grads[i], strides)
            for i, strides in zip(plan.outputs, plan.tangent_strides, strict=True)
        ]
        computed = plan.backward([*ctx.saved_tensors, *tangents])
        given = dict(zip(sorted(plan.inputs), computed, strict=True))
        return (None, *(given.get(i) for i in range(len(ctx.needs_input_grad) - 1)))


def _in_layout(grad: torch.Tensor, strides: tuple[int, ...]) -> torch.Tensor:
    """A tangent in the layout the backward graph was compiled for (``sum().backward()``
    hands an expanded one, with zero strides)."""
    if grad.stride() == strides:
        return grad
    return torch.empty_strided(grad.shape, strides, dtype=grad.dtype, device=grad.device).copy_(
        grad
    )
