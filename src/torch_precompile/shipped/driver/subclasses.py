"""The driver part for artifacts with tensor subclasses (torchao's quantized weights): the
subclass at the call, its inner tensors in the graph.

Before the graph runs, each subclass parameter, buffer and input is checked against its
record (class, flatten context, size, and each inner tensor's shape, dtype, device and layout)
and replaced by its inner tensors: the first in its place, the others after the flat inputs.
Result leaves that were subclasses at capture are rebuilt with ``__tensor_unflatten__``. A
subclass's module (and those its flatten context names) is imported at the first call, by
then the caller has imported it to make the tensors it passes.

A tensor that passed is remembered: while its attributes are the same objects (its inner
tensors and everything its flatten context is made of live there) and its inner tensors keep
their shapes and strides, a later call takes its inner tensors without flattening it again.
"""

import importlib
import operator
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from torch_precompile.shipped.driver.core import Driver
from torch_precompile.shipped.driver.planned import TensorPlan, check_planned
from torch_precompile.shipped.driver.rechecks import tensor_guard
from torch_precompile.shipped.driver.tensor_rules import PrecompileError, qualified_name


class WrappedCall:
    """``call`` over the inner tensors of a call's tensor subclasses; results rebuilt."""

    def __init__(self, driver: Driver, call: Callable[[list[Any]], list[Any]]) -> None:
        spec = driver.spec
        self.call = call
        inner: list[list[Any]] = [[] for _ in spec.wrapped]
        for record in spec.wrapped_inner:
            inner[record.wrapper].append(record)
        self.inputs = [
            Wrapped(r, inner[w]) for w, r in enumerate(spec.wrapped) if r.role == "input"
        ]
        self.results = [
            Wrapped(r, inner[w]) for w, r in enumerate(spec.wrapped) if r.role == "result"
        ]
        self.result_extras = sum(len(w.inner) - 1 for w in self.results)

    def __call__(self, flat: list[Any]) -> list[Any]:
        extras: list[torch.Tensor] = []
        for wrapped in self.inputs:
            first, *rest = wrapped.unwrap(flat[wrapped.record.index])
            flat[wrapped.record.index] = first
            extras.extend(rest)
        flat.extend(extras)
        outputs = self.call(flat)
        if not self.results:
            return outputs
        end = len(outputs) - self.result_extras
        tail = iter(outputs[end:])
        outputs = outputs[:end]
        for wrapped in self.results:
            index = wrapped.record.index
            inner = [outputs[index], *(next(tail) for _ in wrapped.inner[1:])]
            outputs[index] = wrapped.rebuild(inner)
        return outputs


class Wrapped:
    """One subclass record with its inner tensors; the class and context are resolved at the
    first use (importing the subclass's module)."""

    def __init__(self, record: Any, inner: Sequence[Any]) -> None:
        self.record = record
        self.inner = [TensorPlan(t.shape, t.dtype, t.device, t.strides) for t in inner]
        self.attrs = [t.attr for t in inner]
        self.shape = torch.Size(record.shape)
        self.cls: Any = None
        self.context: Any = None
        # id -> (the tensor, weakly; its attribute values; its inner tensors; their check)
        self.passed: dict[int, tuple[Any, list[Any], list[torch.Tensor], Any]] = {}

    def resolve(self) -> None:
        if self.cls is None:
            cls = named(self.record.cls)
            try:
                self.context = decode_context(self.record.context)
            except PrecompileError:
                raise
            except Exception as e:  # its classes changed since capture (another release)
                raise PrecompileError(
                    f"{self.record.name}: the {self.record.cls} flatten context the artifact "
                    f"was captured with cannot be rebuilt here ({type(e).__name__}: {e}); "
                    "install the release of its package the artifact was made with, or "
                    "precompile again."
                ) from e
            self.cls = cls

    def unwrap(self, tensor: Any) -> list[torch.Tensor]:
        """``tensor``'s inner tensors, after checking it against the record."""
        passed = self.passed.get(id(tensor))
        if passed is not None and passed[0]() is tensor and self.unchanged(tensor, passed):
            return passed[2]
        inner = self.checked(tensor)
        guard = tensor_guard(inner)
        if hasattr(tensor, "__dict__") and guard is not None:
            if len(self.passed) >= 8:
                self.passed.clear()
            self.passed[id(tensor)] = (
                weakref.ref(tensor),
                list(vars(tensor).values()),
                inner,
                guard,
            )
        return inner

    @staticmethod
    def unchanged(tensor: Any, passed: tuple[Any, list[Any], list[torch.Tensor], Any]) -> bool:
        """Whether a tensor that passed still holds the same attributes, and its inner tensors
        their layouts."""
        now = vars(tensor)
        return (
            len(now) == len(passed[1])
            and all(map(operator.is_, now.values(), passed[1]))
            and passed[3].check(*passed[2])
        )

    def checked(self, tensor: Any) -> list[torch.Tensor]:
        """The full check of a tensor against the record; its inner tensors."""
        record = self.record
        if type(tensor).__module__ + "." + type(tensor).__qualname__ != record.cls:
            raise PrecompileError(
                f"{record.name}: expected a {record.cls} (a tensor subclass the artifact "
                f"carries by its inner tensors), got {_kind_of(tensor)}. Prepare it as at "
                "capture (the same quantization config), or precompile again."
            )
        self.resolve()
        attrs, context = tensor.__tensor_flatten__()
        if list(attrs) != self.attrs or context != self.context:
            raise PrecompileError(
                f"{record.name}: a {record.cls} with "
                f"{_difference(self.attrs, self.context, list(attrs), context)}. The graph is "
                "specialized to the captured one (its quantization granularity, block size "
                "and options); prepare it as at capture, or precompile again."
            )
        if tensor.shape != self.shape:
            raise PrecompileError(
                f"{record.name}: expected a {record.cls} of shape {tuple(self.shape)}, got "
                f"shape {tuple(tensor.shape)}."
            )
        inner = [getattr(tensor, attr) for attr in attrs]
        for attr, plan, part in zip(self.attrs, self.inner, inner, strict=True):
            check_inner(f"{record.name} (its inner tensor {attr!r})", plan, part)
        return inner

    def rebuild(self, inner: Sequence[torch.Tensor]) -> Any:
        self.resolve()
        return self.cls.__tensor_unflatten__(
            dict(zip(self.attrs, inner, strict=True)), self.context, self.shape, self.record.strides
        )


def check_inner(what: str, plan: TensorPlan, tensor: Any) -> None:
    if type(tensor) not in (torch.Tensor, torch.nn.Parameter):
        raise PrecompileError(
            f"{what} is a {qualified_name(type(tensor))}; the artifact was captured with a plain "
            "tensor there (nested tensor subclasses are not carried)."
        )
    check_planned(tensor, plan, what, "Prepare it as at capture, or precompile again.")


def decode_context(encoded: Any) -> Any:
    """A flatten context from its encoding (see the spec); classes are imported by name."""
    kind, value = encoded
    if kind in ("const", "none"):
        return value
    if kind == "float":
        return float(value)
    if kind == "dtype":
        return getattr(torch, value)
    if kind == "device":
        return torch.device(value)
    if kind == "size":
        return torch.Size(value)
    if kind == "list":
        return [decode_context(item) for item in value]
    if kind == "tuple":
        return tuple(decode_context(item) for item in value)
    if kind == "dict":
        return {decode_context(k): decode_context(v) for k, v in value}
    if kind == "enum":
        return named(value[0])[value[1]]
    if kind in ("dataclass", "frozen"):
        return named(value[0])(**{field: decode_context(item) for field, item in value[1]})
    raise PrecompileError(f"internal: a flatten context of unknown kind {kind!r}")


def named(path: str) -> Any:
    """The object a qualified name (``package.module.Class.Inner``) names, importing its
    module."""
    parts = path.split(".")
    for split in range(len(parts) - 1, 0, -1):
        try:
            found: Any = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        try:
            for part in parts[split:]:
                found = getattr(found, part)
        except AttributeError:
            continue
        return found
    raise PrecompileError(
        f"the artifact names {path}, which cannot be imported here; install the package that "
        "defines it (the one the captured tensor subclass came from)."
    )


def _difference(attrs: list[str], context: Any, given_attrs: list[str], given: Any) -> str:
    """The first difference between the captured flatten and the given one, in words."""
    if given_attrs != attrs:
        return f"inner tensors {given_attrs}, where the captured one had {attrs}"
    if isinstance(context, dict) and isinstance(given, dict):
        for key in [*context, *(k for k in given if k not in context)]:
            if context.get(key) != given.get(key):
                return (
                    f"{key!r} = {given.get(key)!r} in its flatten context, where the "
                    f"captured one had {context.get(key)!r}"
                )
    return f"flatten context {given!r}, where the captured one had {context!r}"


def _kind_of(value: Any) -> str:
    if type(value) in (torch.Tensor, torch.nn.Parameter):
        return "a plain tensor"
    return (
        f"a {qualified_name(type(value))}"
        if isinstance(value, torch.Tensor)
        else (f"a {type(value).__name__}")
    )
