"""The error a broken rule raises, and the rules for a call's tensors and arguments.

Shared by the generic ``Driver`` (``core``) and the checks generated for a plain artifact
(``plain``): the arguments and the structure of the inputs, an input or a model tensor
against its captured shape, dtype, device and layout, tensors the graph writes in place, and
gradients put on ``.grad``. Each broken rule raises ``PrecompileError`` naming what was
captured, what was given and the fix. The state a call is made in is ``call_state``'s; the
rules for models, submodules and hooks are ``module_rules``'.
"""

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree


class PrecompileError(RuntimeError):
    """A precompile contract was broken: at capture, at load, or by a call to an artifact."""

    check_stage: int  # set by a call's generated checks: how far they got


def structure_error(expected: Any, given: Any) -> PrecompileError:
    return PrecompileError(
        "the runtime inputs have a different structure than at capture: expected "
        f"{sketch(expected)}, got {sketch(given)}. Pass the same nesting of lists, tuples "
        "and dicts."
    )


class Shown:
    """A leaf of a structure sketch, shown as ``text``."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def sketch(tree: Any) -> str:
    """A structure with tensors shown as ``Tensor``, for error messages."""
    text = repr(
        pytree.tree_map(lambda v: Shown("Tensor") if isinstance(v, torch.Tensor) else v, tree)
    )
    return text if len(text) <= 300 else text[:297] + "..."


PLAIN = (torch.Tensor, torch.nn.Parameter)


def subclass_error(what: str, tensor: torch.Tensor) -> PrecompileError:
    """A tensor subclass where the artifact was captured with a plain tensor: the kernels
    would read its wrapper as if it held the data."""
    kind = qualified_name(type(tensor))
    if kind == "torch.distributed.tensor.DTensor":
        fix = (
            "A module the artifact runs was sharded after capture (fully_shard, say): its "
            "hooks never run inside the artifact. Shard the precompiled module as a whole "
            "(fully_shard(wrapped)), or precompile the sharded model."
        )
    else:
        fix = (
            "Pass a plain tensor (the checkpoint unquantized, as at capture), or precompile "
            "again with this one."
        )
    return PrecompileError(f"{what} is a {kind}, but was a plain tensor at capture. {fix}")


def dense_error(what: str, tensor: torch.Tensor) -> PrecompileError:
    """A sparse, nested (or other non-strided) tensor where the capture had a dense one."""
    nested = tensor.is_nested
    kind = "nested" if nested else tensor.layout
    fix = ".to_padded_tensor(0.0)" if nested else ".to_dense()"
    return PrecompileError(
        f"{what}: the graph reads a dense tensor, got a {kind} one. Pass it dense ({fix})."
    )


def layout_differs(tensor: torch.Tensor, strides: Sequence[int]) -> bool:
    # Strides of dims of size 0 or 1 never matter, as in Inductor's own assert.
    return bool(tensor.numel()) and any(
        size > 1 and got != want
        for size, got, want in zip(tensor.shape, tensor.stride(), strides, strict=True)
    )


def check_layout(
    tensor: torch.Tensor, strides: Sequence[int], name: str, backend: str = "inductor"
) -> None:
    """The graph assumes a layout; anything else is refused before it runs."""
    if tensor.layout is not torch.strided:
        raise dense_error(name, tensor)
    if backend != "eager" and (tensor.is_neg() or tensor.is_conj()):
        # A negative or conjugate view (x.conj().imag is one) keeps its memory as it was and
        # a bit saying so: ATen's kernels honour the bit, the compiled ones read the memory.
        neg = tensor.is_neg()
        kind, done = ("negative", "negation") if neg else ("conjugate", "conjugation")
        raise PrecompileError(
            f"{name} is a {kind} view: its memory holds the values before {done}, which "
            "ATen's kernels apply as they read; the compiled kernels would read the memory as "
            f"it is. Pass it resolved (.{'resolve_neg' if neg else 'resolve_conj'}())."
        )
    if not layout_differs(tensor, strides):
        return
    if backend == "eager":  # an input the graph writes, or returns a view of
        raise PrecompileError(
            f"{name}: the graph writes this input or returns a view of it, and its views were "
            f"traced on strides {tuple(strides)} (the example's layout); got "
            f"{tuple(tensor.stride())}. Pass it in the example's layout (.contiguous() for a "
            "contiguous example)."
        )
    raise PrecompileError(
        f"{name}: the compiled kernels assume strides {tuple(strides)} (the example's "
        f"layout), got {tuple(tensor.stride())}. Pass it in the example's layout "
        "(.contiguous() for a contiguous example), or precompile with backend='eager', "
        "which takes any layout."
    )


def qualified_name(obj: Any) -> str:
    """``module.qualname`` of a class or function (a hook's name in the spec)."""
    return f"{getattr(obj, '__module__', None)}.{getattr(obj, '__qualname__', '?')}"


def argument_kind(arg: Any) -> str:
    """What an argument of fn is, by its spec record: ``"model"``, ``"optimizer"`` or
    ``"input"``."""
    return "model" if arg.is_model else "optimizer" if arg.is_optimizer else "input"


def runs_backward(spec: Any) -> bool:
    """Whether fn runs a backward itself, by its spec: a model tensor gets a gradient from
    it, or it steps an optimizer argument."""
    return any(t.gets_grad for t in spec.model) or bool(spec.optimizers)


def accumulate_grads(
    state: Sequence[torch.Tensor], indices: Sequence[int], grads: Sequence[torch.Tensor]
) -> None:
    """Put harvested gradients on ``.grad`` the way eager backward does: set or add in place."""
    taken: set[int] = set()
    for index, grad in zip(indices, grads, strict=True):
        param = state[index]
        if param.grad is None:
            # A gradient can be taken as is only if nothing else holds it and it already has
            # the parameter's layout; otherwise a later in-place add would write through.
            if grad._base is None and id(grad) not in taken and grad.stride() == param.stride():
                taken.add(id(grad))
                param.grad = grad
            else:
                param.grad = torch.empty_like(param).copy_(grad)
        else:
            param.grad.add_(grad)


def check_no_old_grads(
    state: Sequence[torch.Tensor], indices: Sequence[int], name: Callable[[int], str]
) -> None:
    """Refuse a call where a parameter whose gradient fn reads comes with one already."""
    for index in indices:
        if state[index].grad is not None:
            raise PrecompileError(
                f"{name(index)} has a .grad from before the call, and fn reads that parameter's "
                "gradient (clip_grad_norm_, a norm of it, a test of whether it is None): the "
                "trace saw none there, where eager would see the old one. Call "
                "model.zero_grad() before the call, or call it at the start of fn."
            )


def written_apart(written: Collection[int], first_buffer: int, end: int) -> list[int]:
    """The flat inputs to keep apart in memory: where the graph writes a buffer or an input
    (``written``), those and every buffer and input (flat indices ``first_buffer``..``end``)."""
    tail = set(range(first_buffer, end))
    return sorted(i for i in {*written, *tail} if i < end) if set(written) & tail else []


def check_written_apart(
    flat: Sequence[torch.Tensor],
    apart: Sequence[int],
    written: Collection[int],
    name: Callable[[int], str],
    parameters: int = 0,
) -> None:
    """Refuse a call where a tensor the graph writes shares memory with another input, or
    (a buffer or input written: after the first ``parameters``) with a parameter, or where
    eager would refuse the write itself."""
    owner: dict[int, int] = {}
    for index in apart:
        tensor = flat[index]
        if not tensor.numel():
            continue
        storage = tensor.untyped_storage()
        if index >= parameters and index in written:
            if not tensor.is_contiguous():
                _check_writable(tensor, name(index))
            # A plain tensor whose storage no other tensor holds (the count is its hold and
            # the storage object's) cannot be a parameter's: the common case costs no walk.
            # (isinstance of Parameter runs Python: a type test keeps the call cheap.)
            if _STORAGE_USES(storage._cdata) > 2 or type(tensor) is not torch.Tensor:
                _check_not_a_parameter(flat, index, storage.data_ptr(), parameters, name)
        other = owner.setdefault(storage.data_ptr(), index)
        if other != index and (index in written or other in written):
            target, alias = (index, other) if index in written else (other, index)
            raise PrecompileError(
                f"{name(target)} shares memory with {name(alias)} at this call, and the "
                "artifact writes the first in place: eager fn would see the write through the "
                "other, the graph (which takes them as separate tensors) would not. Pass "
                "separate tensors (x.clone())."
            )


_STORAGE_USES = torch._C._storage_Use_Count


def _check_writable(tensor: torch.Tensor, what: str) -> None:
    """A tensor the graph writes in place must hold each element at an address of its own, as
    eager's in-place operators insist (they raise before writing an expanded tensor)."""
    if any(
        size > 1 and stride == 0 for size, stride in zip(tensor.shape, tensor.stride(), strict=True)
    ):
        raise PrecompileError(
            f"{what} is written in place by fn, and at this call several of its elements are "
            f"one memory location (strides {tuple(tensor.stride())}, as .expand() makes): "
            "eager fn would fail at that write. Pass a tensor of its own (x.clone())."
        )


def _check_not_a_parameter(
    flat: Sequence[torch.Tensor],
    index: int,
    address: int,
    parameters: int,
    name: Callable[[int], str],
) -> None:
    for other in range(parameters):
        if flat[other].numel() and flat[other].untyped_storage().data_ptr() == address:
            raise PrecompileError(
                f"{name(index)} shares memory with {name(other)} at this call, and the "
                "artifact writes the first in place: eager fn would see the write through the "
                "other, the graph (which takes them as separate tensors) would not. Pass "
                "separate tensors (x.clone())."
            )


def _requires_grad_message(what: str, captured: bool) -> str:
    return (
        f"{what} has requires_grad={not captured}, but was captured with requires_grad="
        f"{captured}: which tensors get gradients from the backward inside fn is fixed at "
        "capture. Set it back, or precompile again."
    )


def dtype_named(name: str) -> torch.dtype:
    return getattr(torch, name.removeprefix("torch."))


def arguments_error(
    kwargs: Mapping[str, Any], count: int, arity: int, shown: str
) -> PrecompileError:
    """Keyword arguments, or another number of positional ones than fn took (``shown``)."""
    if kwargs:
        return PrecompileError(
            f"keyword arguments {sorted(kwargs)} given; a precompiled artifact takes the same "
            f"positional arguments as the captured fn: {shown}."
        )
    return PrecompileError(f"expected {arity} positional arguments ({shown}), got {count}.")


class LeafPlan:
    """What a call must pass for one input leaf: a tensor (its shape with None for a dynamic
    dim, dtype, device, strides or memory format) or a Python value."""

    def __init__(
        self,
        name: str,
        kind: str = "tensor",
        shape: Sequence[int | None] = (),
        dtype: str | None = None,
        device: str | None = None,
        strides: Any = None,
        requires_grad: bool | None = None,
        value: Any = None,
        bounds: Any = None,
        relayout: bool = False,
        read: Sequence[tuple[str, Any, str]] = (),
    ) -> None:
        self.name = name
        self.read = read  # properties fn's Python read: (property, value at capture, where)
        self.is_tensor = kind == "tensor"
        self.value = value
        self.static = None not in shape
        self.shape = torch.Size(shape) if self.static else tuple(shape)  # type: ignore[arg-type]
        self.shown = "(" + ", ".join("*" if s is None else str(s) for s in shape) + ")"
        self.dtype = dtype_named(dtype) if dtype is not None else None
        self.device = torch.device(device) if device is not None else None
        self.strides = strides
        self.bounds = bounds or {}
        self.subclass = False  # whether a driver part unwraps it (DTensor, other subclasses)
        self.relayout = relayout  # whether a call's other layout is copied into ``strides``
        # With a backward inside fn, requires_grad decides which gradients eager would produce
        # (None: not checked).
        self.requires_grad = requires_grad


def positional_inputs(leaves: Sequence[Any], plans: Sequence[LeafPlan]) -> Sequence[Any]:
    """``leaves``, where the captured inputs were positional tensors: no nesting in their
    place."""
    if not all([isinstance(a, torch.Tensor) for a in leaves]) and (
        pytree.tree_flatten(list(leaves))[1] != pytree.tree_flatten(list(plans))[1]
    ):
        expected = tuple(Shown(f"Tensor{p.shown}") for p in plans)
        raise structure_error(expected, tuple(leaves))
    return leaves


def _dims(plan: LeafPlan, leaf: torch.Tensor) -> str:
    """The dims in which ``leaf`` differs from the example (``dim 0``), or ``the dims`` where
    their number differs."""
    if leaf.dim() != len(plan.shape):
        return "the dims"
    differ = [str(i) for i, size in enumerate(leaf.shape) if size != plan.shape[i]]
    return f"dim{'s' if len(differ) > 1 else ''} {', '.join(differ)}"


def check_input(plan: LeafPlan, leaf: Any, backend: str, sizes: Any = None) -> torch.Tensor:
    """The tensor the graph gets for one input leaf, after checking it (``sizes``: the
    driver's part for dynamic dims)."""
    name = plan.name
    if not isinstance(leaf, torch.Tensor):
        raise PrecompileError(
            f"input {name}: expected a tensor of shape {plan.shown}, got {type(leaf).__name__}."
        )
    if leaf.is_nested:  # it has no shape to compare
        raise dense_error(f"input {name}", leaf)
    if not plan.static:
        sizes.check_shape(plan, leaf)
    elif leaf.shape != plan.shape:
        raise PrecompileError(
            f"input {name}: expected shape {plan.shown}, got {tuple(leaf.shape)}. Shapes are "
            "specialized to the example: precompile again for this shape, mark "
            f"{_dims(plan, leaf)} dynamic on the example with torch._dynamo.decorators."
            "mark_unbacked before precompiling, or capture each shape as a variant of one "
            "artifact (capture())."
        )
    if leaf.dtype != plan.dtype:
        raise PrecompileError(f"input {name}: expected dtype {plan.dtype}, got {leaf.dtype}.")
    if type(leaf) not in PLAIN and not plan.subclass:
        raise subclass_error(f"input {name}", leaf)
    if leaf.device != plan.device:
        raise PrecompileError(f"input {name}: expected device {plan.device}, got {leaf.device}.")
    if leaf.layout is not torch.strided:
        raise dense_error(f"input {name}", leaf)
    if plan.requires_grad is not None and leaf.requires_grad != plan.requires_grad:
        raise PrecompileError(_requires_grad_message(f"input {name}", plan.requires_grad))
    if isinstance(plan.strides, str):  # an input with dynamic dims: its memory format
        return sizes.check_memory_format(leaf, plan, f"input {name}", backend)
    elif plan.strides is not None:
        if plan.relayout and layout_differs(leaf, plan.strides):
            return torch.empty_strided(
                leaf.shape, plan.strides, dtype=leaf.dtype, device=leaf.device
            ).copy_(leaf)
        check_layout(leaf, plan.strides, f"input {name}", backend)
    return leaf


# What fn's Python read of an input: how to read it now, how to say it, how to match it.
READ_PROPERTIES: dict[str, tuple[Callable[[torch.Tensor], Any], str, str]] = {
    "stride": (
        lambda t: tuple(t.stride()),
        "strides",
        "laid out as at capture (.contiguous() for a contiguous example)",
    ),
    "storage_offset": (
        lambda t: t.storage_offset(),
        "storage offset",
        "starting where the example did in its storage (a .clone() starts at 0)",
    ),
    "is_inference": (
        lambda t: t.is_inference(),
        "is_inference()",
        "made as at capture (under torch.inference_mode() or not; .clone() outside it makes "
        "a normal tensor)",
    ),
    "is_neg": (lambda t: t.is_neg(), "is_neg()", "as at capture (.resolve_neg() resolves a view)"),
    "is_conj": (
        lambda t: t.is_conj(),
        "is_conj()",
        "as at capture (.resolve_conj() resolves a view)",
    ),
}


def check_reads(plan: LeafPlan, leaf: torch.Tensor) -> None:
    """Each property of an input that fn's Python read (and branched on, maybe) as it was at
    capture."""
    for name, expected, where in plan.read:
        read, shown, fix = READ_PROPERTIES[name]
        now = read(leaf)
        if now != (tuple(expected) if name == "stride" else expected):
            raise PrecompileError(
                f"input {plan.name}: fn read its {shown} at {where}, {expected!r} at capture, "
                f"and this call's is {now!r}; the artifact decides as the capture's did. Pass "
                f"it {fix}, or precompile again with one like it."
            )


def check_model_tensor(
    tensor: torch.Tensor,
    what: str,
    shape: Sequence[int],
    dtype: str,
    device: str,
    strides: Sequence[int] | None = None,
    requires_grad: bool | None = None,
    carried: bool = False,
) -> None:
    """A model's parameter or buffer (``what``) against its capture; ``requires_grad`` None:
    not checked, ``carried``: a subclass a driver part unwraps."""
    if (
        tensor.shape != torch.Size(shape)
        or tensor.dtype != dtype_named(dtype)
        or tensor.device != torch.device(device)
    ):
        raise PrecompileError(
            f"{what}: expected shape {tuple(shape)}, dtype {dtype_named(dtype)}, device {device}; "
            f"got shape {tuple(tensor.shape)}, dtype {tensor.dtype}, device {tensor.device}. "
            "Load a checkpoint of the same architecture."
        )
    if requires_grad is not None and tensor.requires_grad != requires_grad:
        raise PrecompileError(_requires_grad_message(what, requires_grad))
    if type(tensor) not in PLAIN and not carried:
        raise subclass_error(what, tensor)
    if tensor.layout is not torch.strided:
        raise dense_error(what, tensor)
    if strides is not None:
        check_layout(tensor, strides, what)
