"""Cheap re-checks of what a full check found: a tensor guard in C++ and the count of
module registrations in the process.

A check that passed is remembered (``memo``, ``plain``); while the registration count and the
id of the next hook handle stand still, no module can have gained, lost or replaced a member or
a hook, and the tensor guard tells whether the tensors kept their type, dtype, device, sizes,
strides and requires_grad.
"""

import sys
import types
import weakref
from collections.abc import Sequence
from typing import Any

import torch


def tensor_guard(tensors: Sequence[torch.Tensor]) -> Any:
    """A check, in C++, that tensors keep the type, dtype, device, sizes, strides and
    requires_grad they have now (None where this torch has none). It is stricter than the
    capture's contract (exact strides everywhere): a call it refuses takes the full check,
    which decides."""
    try:
        from torch._C._dynamo.guards import TensorGuards

        guards: Any = TensorGuards  # its stubs lag behind its keywords
        return guards(
            *tensors,
            dynamic_dims_sizes=[list(t.shape) for t in tensors],
            dynamic_dims_strides=[list(t.stride()) for t in tensors],
            tensor_check_names=[f"t{i}" for i in range(len(tensors))],
        )
    except (ImportError, RuntimeError, TypeError):
        return None


# Every hook registration anywhere (module, global or tensor hook) takes a new handle id.
_HANDLES = torch.utils.hooks.RemovableHandle
_DEREF = weakref.ref.__call__  # a remembered model, or None once it is gone


# The registration count is one per process, in a module of its own shared by every artifact
# loaded (whatever version made it): hooks registered per load would pile up, each keeping its
# artifact alive. bump is compiled into that module, so its globals are the module's and it
# references no artifact. Artifacts of every version read counter[0]: a different layout
# needs a different module name.
_SHARED_COUNT = "_torch_precompile_registration_count"
_SHARED_COUNT_SOURCE = """\
counter = [0]


def bump(*_):
    counter[0] += 1
"""


def registration_counter() -> list[int]:
    """The process-wide count of parameter, buffer and submodule registrations, as a
    one-element list, counted from the process's first memo on: while it stands still, no
    remembered model can have a replaced, re-tied or added member."""
    shared = sys.modules.get(_SHARED_COUNT)
    if shared is None:
        fresh = types.ModuleType(_SHARED_COUNT, "torch_precompile's count of module registrations")
        exec(_SHARED_COUNT_SOURCE, vars(fresh))
        # setdefault is atomic: of two first loads at once, only one registers hooks.
        shared = sys.modules.setdefault(_SHARED_COUNT, fresh)
        if shared is fresh:
            hooks = torch.nn.modules.module
            hooks.register_module_parameter_registration_hook(fresh.bump)
            hooks.register_module_buffer_registration_hook(fresh.bump)
            hooks.register_module_module_registration_hook(fresh.bump)
    return shared.counter
