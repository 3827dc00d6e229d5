"""The rules every driver checks a call by, and what each refusal says.

Shared by the generic ``Driver`` (``core``) and the checks generated for a plain artifact
(``plain``): a tensor against its captured shape, dtype, device and layout, a module against
its captured class, forward, mode and hooks, the state a call is made in. Each broken rule
raises ``PrecompileError`` naming what was captured, what was given and the fix.
"""

import functools
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


def walk_owner(name: str, arguments: Sequence[str]) -> tuple[str, str]:
    """(argument, name within that model) of a walk name: with several model arguments
    (``arguments``, their names) the walk calls a member or submodule ``m<index>.<name>``."""
    if len(arguments) <= 1:
        return (arguments[0] if arguments else ""), name
    head, _, local = name.partition(".")
    return arguments[int(head[1:])], local


def shown_module(name: str, arguments: Sequence[str] = ()) -> str:
    """A submodule as messages name it, by its walk name."""
    if len(arguments) <= 1:
        return f"module {name!r}" if name else "the model"
    argument, local = walk_owner(name, arguments)
    return (
        f"module {local!r} of model argument {argument}" if local else f"model argument {argument}"
    )


def shown_member(kind: str, name: str, arguments: Sequence[str] = ()) -> str:
    """A parameter or buffer as messages name it, by its walk name."""
    if len(arguments) > 1:
        argument, local = walk_owner(name, arguments)
        return f"{kind} {local!r} of model argument {argument}"
    return f"model {kind} {name!r}"


def qualified_name(obj: Any) -> str:
    """``module.qualname`` of a class or function (a hook's name in the spec)."""
    return f"{getattr(obj, '__module__', None)}.{getattr(obj, '__qualname__', '?')}"


def forward_name(module: Any) -> str | None:
    """None where ``module`` runs its class's own forward (as the class, or the base that
    defines it, wrote it); otherwise the name of what it runs instead: a forward set on the
    instance, or one patched into the class."""
    if "forward" in vars(module):
        return hook_name(vars(module)["forward"])
    for klass in type(module).__mro__:
        function = vars(klass).get("forward")
        if function is not None:
            own = klass is torch.nn.Module or (
                getattr(function, "__qualname__", None) == f"{klass.__qualname__}.forward"
                and getattr(function, "__module__", None) == klass.__module__
            )
            return None if own else hook_name(function)
    return None


def forward_error(what: str, captured: str | None, now: str | None) -> PrecompileError:
    def shown(name: str | None) -> str:
        return "its class's own forward" if name is None else f"the forward {name}"

    return PrecompileError(
        f"{what} runs {shown(now)}, but ran {shown(captured)} at capture: the artifact runs "
        "the code the captured forward ran. Set the forward back, or precompile again with "
        "this one."
    )


# Where nn.Module keeps hooks, by the kind the spec names them.
MODULE_HOOKS = (
    ("forward_pre", "_forward_pre_hooks"),
    ("forward", "_forward_hooks"),
    ("backward_pre", "_backward_pre_hooks"),
    ("backward", "_backward_hooks"),
)
GLOBAL_HOOKS = (
    ("forward_pre", "_global_forward_pre_hooks"),
    ("forward", "_global_forward_hooks"),
    ("backward_pre", "_global_backward_pre_hooks"),
    ("backward", "_global_backward_hooks"),
)
TENSOR_HOOKS = (
    ("grad", "_backward_hooks"),
    ("post_accumulate_grad", "_post_accumulate_grad_hooks"),
)


def hook_name(hook: Any) -> str:
    """A hook by the name of the code it runs (a bound method by its function, a partial by
    the function it wraps), the same in every process."""
    while isinstance(hook, functools.partial):
        hook = hook.func
    hook = getattr(hook, "__func__", hook)
    return qualified_name(hook if hasattr(hook, "__qualname__") else type(hook))


def no_values(hook: Any) -> list[tuple[str, str, Callable[[], Any]]]:
    """The values of hooks where the capture had none: any hook now is one too many."""
    return []


def hook_sets(
    owner: Any, places: Sequence[tuple[str, str]], values: Callable[[Any], Any] = no_values
) -> tuple[Any, ...]:
    """The hooks found on ``owner`` (a module, a tensor, or torch's module of global hooks)
    as (kind, hook labels) pairs, kinds without hooks left out: a hook by its name and the
    plain ``values`` it holds. torch.distributed's own hooks (FSDP2, distribute_module) are
    left to the parts that check sharding."""
    found = []
    for kind, attribute in places:
        hooks = getattr(owner, attribute, None)
        labels = tuple(
            hook_name(h) + "".join(f" {n}={v}" for n, v, _ in values(h))
            for h in (hooks or {}).values()
            if not hook_name(h).startswith(DISTRIBUTED_HOOKS)
        )
        if labels:
            found.append((kind, labels))
    return tuple(found)


DISTRIBUTED_HOOKS = "torch.distributed."
GLOBAL_HOOKS_OWNER = "the process (global module hooks, as register_module_forward_hook adds)"


def hooks_error(what: str, captured: Any, now: Any) -> PrecompileError:
    def shown(sets: Any) -> str:
        return "; ".join(f"{kind}: {', '.join(names)}" for kind, names in sets) or "none"

    return PrecompileError(
        f"{what} has hooks {shown(now)}, but had {shown(captured)} at capture (each hook "
        "with the plain values it holds). The artifact holds what the hooks present at "
        "capture computed with those values, so a hook added since would never run, one "
        "removed would still act and a changed value would not be seen. Register the same "
        "hooks, holding the same values, as at capture, or precompile again with the hooks "
        "you want."
    )


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# The torch settings fn's Python may read and branch on, by the call that reads them: how to
# read each now, and how the spec holds the value it gives.
SETTINGS: dict[str, tuple[Callable[[], Any], Callable[[Any], Any]]] = {
    "torch.is_grad_enabled": (torch.is_grad_enabled, bool),
    "torch.is_inference_mode_enabled": (torch.is_inference_mode_enabled, bool),
    "torch.get_default_dtype": (torch.get_default_dtype, _dtype_name),
    "torch.get_num_threads": (torch.get_num_threads, int),
    "torch.get_float32_matmul_precision": (torch.get_float32_matmul_precision, str),
}


class AmbientPlan:
    """Thread and process state the graph was specialized to: autocast, the default dtype
    (where fn built tensors from it), deterministic algorithms, active modes, and the torch
    settings fn's Python read (``settings``: the reading call, its value, where it was read)."""

    def __init__(
        self,
        recorded: bool = True,
        autocast: Sequence[Any] = (),
        default_dtype: str | None = None,
        deterministic: bool = False,
        modes: Sequence[str] = (),
        settings: Sequence[tuple[str, Any, str]] = (),
    ) -> None:
        self.recorded = recorded  # artifacts before ambient state was recorded check none
        self.autocast = tuple(autocast)
        self.default_dtype = _dtype(default_dtype) if default_dtype else None
        self.deterministic = deterministic
        self.modes = tuple(modes)
        self.settings = tuple(
            (*SETTINGS[name], value, name, where) for name, value, where in settings
        )

    def check(self) -> None:
        """A few C calls when nothing differs; the full comparison names what does."""
        if not self.recorded:
            return
        if (
            (_ANY_AUTOCAST() or self.autocast)
            or _DETERMINISTIC() is not self.deterministic
            or _FUNCTION_MODES() + _DISPATCH_MODES() != len(self.modes)
            or (
                self.default_dtype is not None
                and torch.get_default_dtype() is not self.default_dtype
            )
        ):
            self._compare()
        for read, held, value, name, where in self.settings:
            if held(read()) != value:
                raise PrecompileError(
                    f"{name}() gives {held(read())!r} at this call, but gave {value!r} when fn "
                    f"read it at capture ({where}): the trace took fn's Python branch for that "
                    "value. Call it in the same setting, or precompile again in this one."
                )

    def _compare(self) -> None:
        now = ambient_now()
        for what, captured, current in (
            ("autocast", self.autocast, now[0]),
            ("the default dtype", self.default_dtype or now[1], now[1]),
            ("deterministic algorithms", self.deterministic, now[2]),
            ("active torch function and dispatch modes", self.modes, now[3]),
        ):
            if captured != current:
                raise PrecompileError(
                    f"{what} at this call: {_shown_state(current)}; at capture: "
                    f"{_shown_state(captured)}. The graph was traced under the capture's "
                    "state (autocast's casts, the dtype of tensors fn builds, the modes' "
                    "behaviour are in it), so this call would not compute what fn computes "
                    "now. Call it as at capture, or precompile again in this state."
                )


def ambient_now() -> tuple[Any, ...]:
    """(autocast per device type, default dtype, deterministic algorithms, modes) now."""
    autocast = tuple(
        (device, str(torch.get_autocast_dtype(device)).removeprefix("torch."))
        for device in ("cpu", "cuda")
        if torch.is_autocast_enabled(device)
    )
    modes = tuple(
        qualified_name(type(m))
        for m in (
            *torch.overrides._get_current_function_mode_stack(),
            *torch.utils._python_dispatch._get_current_dispatch_mode_stack(),
        )
    )
    return autocast, torch.get_default_dtype(), _DETERMINISTIC(), modes


def _shown_state(value: Any) -> str:
    if isinstance(value, tuple):
        return (
            ", ".join(" ".join(map(str, v)) if isinstance(v, tuple) else str(v) for v in value)
            or "none"
        )
    return str(value)


_ANY_AUTOCAST = torch._C._is_any_autocast_enabled
_DETERMINISTIC = torch._C._get_deterministic_algorithms
_FUNCTION_MODES = torch._C._len_torch_function_stack
_DISPATCH_MODES = torch._C._len_torch_dispatch_stack


def grad_mode_error() -> PrecompileError:
    return PrecompileError(
        "fn runs a backward, but this call is under torch.no_grad() (or inference_mode), "
        "where eager fn would fail: no gradient can flow. Call the artifact with gradients "
        "enabled."
    )


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


def _dtype(name: str) -> torch.dtype:
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
        self.dtype = _dtype(dtype) if dtype is not None else None
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
        or tensor.dtype != _dtype(dtype)
        or tensor.device != torch.device(device)
    ):
        raise PrecompileError(
            f"{what}: expected shape {tuple(shape)}, dtype {_dtype(dtype)}, device {device}; "
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


def members_differ(expected: tuple[str, str, str], found: tuple[str, str, str]) -> PrecompileError:
    """A model whose walk finds ``found`` (argument, kind, name) where the capture's found
    ``expected``, or found nothing more (``expected`` empty)."""
    owner, kind, local = found
    where = (
        f"where the captured model {expected[0]} has {expected[1]} {expected[2]!r}, the "
        f"runtime model has {kind} {local!r}"
        + (f" (of argument {owner})" if owner != expected[0] else "")
        if expected[0]
        else f"it has {kind} {local!r} beyond the captured model's parameters and buffers"
    )
    return PrecompileError(
        f"model argument {owner} does not match the captured model: {where}. Pass a model "
        "with the same parameters and buffers, in the same order."
    )


def check_is_model(value: Any, argument: str) -> None:
    if not isinstance(value, torch.nn.Module):
        raise PrecompileError(
            f"argument {argument} was a torch.nn.Module at capture; got "
            f"{type(value).__name__}. Pass the model in the same position."
        )


def tied_since(kind: str, name: str, owner: str) -> PrecompileError:
    """A member that is the very tensor of member ``owner`` at a call, but was not at capture."""
    return PrecompileError(
        f"model {kind} {name!r} is tied to {owner!r} at runtime but was a separate "
        "tensor at capture. Use a model with the same weight tying."
    )


def tied_apart(kind: str, name: str, tied_to: str) -> PrecompileError:
    """A member tied to another at capture that is a tensor of its own now."""
    return PrecompileError(
        f"model {kind} {name!r} was tied to {tied_to!r} at capture; at runtime it is a "
        "separate tensor. Tie the weights as in the example model."
    )


def members_missing(missing: Sequence[str]) -> PrecompileError:
    """The parameters and buffers (``kind 'name'``) a runtime model lacks."""
    return PrecompileError(
        f"the runtime model lacks {', '.join(missing[:5])}"
        f"{' and more' if len(missing) > 5 else ''}, which the captured model had. Pass a "
        "model with the same parameters and buffers."
    )


def submodules_differ(names: Sequence[str], captured: Sequence[str]) -> PrecompileError:
    """The submodule names a walk found, where the capture's were ``captured``."""
    added = sorted(set(names) - set(captured))
    return PrecompileError(
        "the runtime model's submodules differ from the captured model's"
        + (f" (new: {', '.join(repr(n or '<root>') for n in added[:5])})" if added else "")
        + ". Pass a model with the same modules as the example."
    )


def check_module(
    module: Any,
    name: str,
    cls: str | None,
    forward: str | None = None,
    training: bool = True,
    arguments: Sequence[str] = (),
) -> None:
    """One submodule (``name`` in the walk of the model ``arguments``) against its captured
    class, forward and mode."""
    shown = shown_module(name, arguments)
    if cls is not None and qualified_name(type(module)) != cls:
        raise PrecompileError(
            f"{shown} is a {qualified_name(type(module))}, but was a {cls} at "
            "capture: the artifact runs the code the captured class ran. Pass a model "
            "built like the example, or precompile again with this one."
        )
    if cls is not None and forward_name(module) != forward:
        raise forward_error(shown, forward, forward_name(module))
    if module.training != training:
        mode, fix = ("training", ".train()") if training else ("eval", ".eval()")
        raise PrecompileError(
            f"{shown} is in {'training' if module.training else 'eval'} mode, "
            f"but was captured in {mode} mode (dropout and BatchNorm behave differently). Call "
            f"{fix} on the model before calling the artifact, or precompile again in this "
            "mode."
        )
