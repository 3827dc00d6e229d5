"""The driver part for results with autograd history, when fn runs no backward itself.

Under grad mode, a call where a tensor requires grad runs the compiled forward of the form
that covers it (see ``no_history``) inside one autograd function: its results get history,
and the values it saves for backward are kept as autograd keeps a function's saved tensors
(freed by the backward unless ``retain_graph``; an in-place write to one before the backward
is refused by autograd). ``backward()``, whenever the caller's code runs it, runs that form's
compiled backward, and autograd puts the gradients on ``.grad`` (adding to what is there) and
on inputs that require grad, as eager does. Under ``no_grad`` or with nothing requiring grad,
the plain graph runs as before.
"""

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from torch_precompile.shipped.driver.core import Driver
from torch_precompile.shipped.driver.no_history import NoHistory
from torch_precompile.shipped.driver.tensor_rules import PrecompileError

Graph = Callable[[list[Any]], list[Any]]
Ready = Callable[[], Graph] | None


def differentiable(
    forward: Ready = None,
    backward: Ready = None,
    input_forward: Ready = None,
    input_backward: Ready = None,
) -> "Callable[[Driver], AutogradCall]":
    """The ``autograd`` part of a driver whose artifact holds the functions that ready the
    graphs of its differentiable forms: ``forward`` and ``backward`` for the inputs that
    required grad at capture, the ``input_`` pair for calls where an input tensor that did
    not requires grad (None where a form has no graphs)."""
    return lambda driver: AutogradCall(
        driver, ((forward, backward), (input_forward, input_backward))
    )


class Form:
    """One differentiable form: the results it gives history, and its graphs, readied at
    the first call that needs them (calls under no_grad never pay for them)."""

    def __init__(self, record: Any, ready: tuple[Ready, Ready], num_outputs: int) -> None:
        self.inputs = sorted(record.inputs)
        self.outputs = list(record.outputs)
        self.tangent_strides = [tuple(s) for s in record.tangent_strides]
        self.ready = ready
        # The graphs once readied (None before): Any, as they are called only after that.
        self.forward: Any = None
        self.backward: Any = None
        self.lock = threading.Lock()
        self.num_outputs = num_outputs  # results, gradients, value guards

    def readied(self) -> "Form":
        if self.forward is None:
            with self.lock:
                if self.forward is None:
                    self.backward = self.ready[1]()  # type: ignore[misc]  # given with outputs
                    self.forward = self.ready[0]()  # type: ignore[misc]
        return self


class AutogradCall(NoHistory):
    """Which form a call needs, and the call that gives its results history."""

    def __init__(self, driver: "Driver", ready: Sequence[tuple[Ready, Ready]]) -> None:
        super().__init__(driver)
        records = [r for r in driver.autograd_records if r is not None]
        self.forms = [
            Form(record, pair, driver.graph_outputs)
            for record, pair in zip(records, ready, strict=False)
        ]

    def wanted(self, flat: Sequence[torch.Tensor]) -> Form | None:
        """The form whose graphs this call (under grad mode) runs, where its results get
        history: none where no result depends on what requires grad."""
        index = self.form_for(flat)
        if index is None or not self.forms[index].outputs:
            return None
        return self.forms[index].readied()

    def __call__(self, flat: list[torch.Tensor], form: Form) -> list[Any]:
        """Run ``form``'s forward with history (grad mode on); the results as the plain
        call's."""
        return list(_Compiled.apply(form, *flat))  # type: ignore[no-untyped-call]


class _Compiled(torch.autograd.Function):
    """The compiled forward and backward as one autograd node."""

    @staticmethod
    def forward(ctx: Any, plan: Form, *flat: torch.Tensor) -> Any:
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
        plan: Form = ctx.plan
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
        given = dict(zip(plan.inputs, computed, strict=True))
        return (None, *(given.get(i) for i in range(len(ctx.needs_input_grad) - 1)))


def _in_layout(grad: torch.Tensor, strides: tuple[int, ...]) -> torch.Tensor:
    """A tangent in the layout the backward graph was compiled for (``sum().backward()``
    hands an expanded one, with zero strides)."""
    if grad.stride() == strides:
        return grad
    return torch.empty_strided(grad.shape, strides, dtype=grad.dtype, device=grad.device).copy_(
        grad
    )
