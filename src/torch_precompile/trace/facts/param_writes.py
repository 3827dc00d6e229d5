"""Parameters fn writes in place while it is traced, put back once the trace is done.

The trace runs fn on the model's own parameters (their ``.grad`` is what a backward fills),
so a write fn makes to one (an EMA update, a hand-written SGD step ``p -= lr * p.grad``,
``p.data.mul_(...)``) would change the caller's model at capture. Parameters are not copied
up front, which would double their memory: each is copied just before the first operator
that writes its storage, and copied back after the trace. A parameter whose data fn replaces
(``p.data = p.data - lr * p.grad``) is pointed back at its own; no operator records that
replacement, so capture refuses it (``swapped``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from torch_precompile.internals import storage_id
from torch_precompile.internals.tracing import (
    TorchDispatchMode,
    operator_schema,
    untraced,
)

_PLAIN = (torch.Tensor, torch.nn.Parameter)


class ParamWrites(TorchDispatchMode):
    """Pushed around fn while it is traced on real tensors; ``put_back`` after the trace."""

    # Control-flow operators pass straight through; capture rejects them afterwards.
    supports_higher_order_operators = True

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
        self.params: dict[int, torch.Tensor] = {}
        self.saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        # Each parameter, by flat index, with an alias of the data it had before the trace.
        self.data: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.swapped: list[int] = []  # flat indices of parameters whose data fn replaced

    def watching(self, params: Sequence[torch.Tensor], copied: bool = False) -> ParamWrites:
        """Watch ``params`` (the trace's parameters) in the next ``with``; ``copied``: capture
        copies their values itself (as with an optimizer argument), so only a replacement of
        their data is watched."""
        # Plain tensors only: a subclass's storage is its inner tensors', which the trace lays
        # out itself; a fake or meta one holds no data to write.
        real = [p for p in params if type(p) in _PLAIN and not p.is_meta]
        if not copied:  # a trace on fakes writes nothing real
            self.params = {storage_id(p): p for p in real}
        with untraced():  # an alias kept aside, not an operator of fn's
            for index, param in enumerate(params):
                if any(param is p for p in real) and index not in self.data:
                    self.data[index] = (param, param.detach())
        return self

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        schema = operator_schema(func) if self.params else None  # None: a control-flow op
        if schema is not None:
            for position, argument in enumerate(schema.arguments):
                if argument.alias_info is None or not argument.alias_info.is_write:
                    continue
                if position < len(args):
                    self._save(args[position])
                elif argument.name in kwargs:  # out=
                    self._save(kwargs[argument.name])
        return func(*args, **kwargs)

    def _save(self, written: Any) -> None:
        for tensor in written if isinstance(written, list | tuple) else (written,):
            if not isinstance(tensor, torch.Tensor) or tensor.is_meta:
                continue
            key = storage_id(tensor)
            param = self.params.get(key)
            if param is not None and key not in self.saved:
                with untraced(), torch.no_grad():
                    self.saved[key] = (param, param.detach().clone())

    def put_back(self) -> None:
        """Point every parameter whose data fn replaced back at its own, then copy back every
        parameter the trace wrote."""
        with torch.no_grad():
            for index, (param, data) in self.data.items():
                if storage_id(param) != storage_id(data):
                    param.data = data
                    self.swapped.append(index)
            for param, value in self.saved.values():
                param.detach().copy_(value)
        self.saved.clear()
        self.data.clear()
