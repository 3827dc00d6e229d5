"""Torch internals that capture uses: make_fx (with the user's source line on each node),
reparametrization, fake tensors and ShapeEnv, dispatch modes, operator effects, the marks
``mark_unbacked`` leaves on a tensor."""

from __future__ import annotations

import contextlib
import os
import re
import traceback
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, cast

import torch
import torch.fx.proxy
import torch.utils.checkpoint
from torch._subclasses.fake_tensor import (
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
)
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode, ShapeEnv
from torch.fx.graph import _custom_builtins
from torch.nn.utils.stateless import _reparametrize_module as reparametrize_module
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

from torch_precompile.errors import PrecompileError
from torch_precompile.internals import fx_stand_ins
from torch_precompile.internals.fx_stand_ins import NOT_USER_CODE

__all__ = [
    "BAKED_READS",
    "GRAD_ATTRIBUTE",
    "BatchNormBase",
    "DynamicOutputShapeException",
    "FakeTensor",
    "FakeTensorMode",
    "GuardOnDataDependentSymNode",
    "ShapeEnv",
    "TensorMarks",
    "TorchDispatchMode",
    "TracerRefusal",
    "check",
    "compiling",
    "deferred_asserts",
    "differentiable_rnns",
    "dispatch_modes",
    "effect_of",
    "forget_pending_unbacked",
    "forward_pre_hooks",
    "function_modes",
    "fx_builtin_imports",
    "graph_function_source",
    "is_operator",
    "is_traceable_wrapper_subclass",
    "is_view",
    "make_fx",
    "operator_schema",
    "plain_checkpoints",
    "rename_node",
    "reparametrize_module",
    "reshape_unwritten_views",
    "set_size_hint",
    "size_function_types",
    "symbol_pinning",
    "tensor_marks",
    "trace_with_user_lines",
    "tracer_refusal",
    "untraced",
    "version_of",
    "written_inputs",
]

check: Callable[..., None] = torch._check


# ``Tensor.grad`` as the C tensor type defines it, which a property on ``torch.Tensor`` can
# wrap while a trace watches what fn does with gradients.
GRAD_ATTRIBUTE: Any = vars(torch._C.TensorBase)["grad"]


def dispatch_modes() -> list[Any]:
    """The dispatch modes active in this thread, innermost last."""
    return list(torch.utils._python_dispatch._get_current_dispatch_mode_stack())


def function_modes() -> list[Any]:
    """The torch function modes active in this thread, innermost last."""
    return list(torch.overrides._get_current_function_mode_stack())


def untraced() -> contextlib.AbstractContextManager[Any]:
    """Inside, no dispatch mode sees an operator: work of capture's own on the real tensors
    (a copy kept aside) stays out of the graph being traced."""
    return torch.utils._python_dispatch._disable_current_modes()


# Reads whose value the trace baked (capture guards them); nothing downstream uses the result.
BAKED_READS = (
    torch.ops.aten._local_scalar_dense.default,
    torch.ops.aten.item.default,
    torch.ops.aten.equal.default,
    torch.ops.aten.allclose.default,
    torch.ops.aten.is_nonzero.default,
)


def compiling() -> contextlib.AbstractContextManager[None]:
    """``torch.compiler.is_compiling()`` is True inside: torch.optim then keeps its step
    counts and learning rates as tensors (no ``.item()``), as it does under torch.compile."""
    return torch.compiler._compile_session_context()


@dataclass(frozen=True)
class TensorMarks:
    """What ``torch._dynamo.decorators.mark_*`` recorded on one tensor."""

    backed_dims: set[int]
    specialize_on: dict[int, Any]
    unbacked_dims: set[int]
    shape_ids: dict[int, Any]
    bounds: dict[int, tuple[int | None, int | None]]
    hints: dict[int, int]


def tensor_marks(tensor: torch.Tensor) -> TensorMarks:
    """The marks are private attributes the decorators set on the tensor object."""

    def read(name: str) -> Any:
        return getattr(tensor, name, None) or {}

    return TensorMarks(
        backed_dims=set(read("_dynamo_dynamic_indices")),
        specialize_on=dict(read("_specialize_on")),
        unbacked_dims=set(read("_dynamo_unbacked_indices"))
        | set(read("_dynamo_strict_unbacked_indices")),
        shape_ids=dict(read("_dynamo_shape_ids")),
        bounds=dict(read("_dynamo_unbacked_bounds")),
        hints=dict(read("_dynamo_hint_overrides")),
    )


def set_size_hint(shape_env: ShapeEnv, symbol: torch.SymInt, hint: int) -> None:
    shape_env.var_to_hint_override[symbol.node.expr] = hint


def forget_pending_unbacked(shape_env: ShapeEnv) -> None:
    """Symbols bound by the inputs themselves, not by an operation of the trace."""
    shape_env.pending_fresh_unbacked_symbols.clear()


def symbol_pinning(shape_env: ShapeEnv, symbol: Any) -> Any:
    """The single value the trace pinned ``symbol`` to, or None while it is free."""
    replaced = shape_env.replacements.get(symbol)
    if replaced is not None and getattr(replaced, "is_number", False):
        return replaced
    value_range = shape_env.var_to_range.get(symbol)
    if value_range is not None and value_range.lower == value_range.upper:
        return value_range.lower
    return None


def deferred_asserts(shape_env: ShapeEnv) -> list[Any]:
    """The sympy conditions the trace deferred to run time."""
    return [a.expr for asserts in shape_env.deferred_runtime_asserts.values() for a in asserts]


def size_function_types() -> tuple[type, tuple[type, ...]]:
    """torch's sympy functions for sizes: FloorDiv, and the modulo kinds."""
    from torch.utils._sympy.functions import FloorDiv, Mod, PythonMod

    return FloorDiv, (Mod, PythonMod)


def is_operator(target: Any) -> bool:
    return isinstance(target, torch._ops.OpOverload)


def operator_schema(target: Any) -> Any:
    """The ``torch.FunctionSchema`` of an operator call's target, or None for other targets."""
    return getattr(target, "_schema", None)


def effect_of(target: Any) -> Any:
    """The ordering side effect an operator declares (printing, recording), or None."""
    from torch._higher_order_ops.effects import _get_effect

    return _get_effect(target) if is_operator(target) else None


def trace_with_user_lines(
    fn: Callable[..., Any],
    decomposition_table: Mapping[Any, Callable[..., Any]] | None = None,
    *,
    tracing_mode: Literal["real", "fake", "symbolic"] = "real",
    tolerate_data_dependent_ops: bool = False,
) -> Callable[..., torch.fx.GraphModule]:
    """``make_fx(fn)`` whose nodes each carry the user's source line that produced them.

    A node's ``stack_trace`` is the innermost frame outside torch, this package and the
    standard library (``nn.Linear``'s ops name the line that called the layer); fx prints it
    as a ``# File: ...`` comment above the node's code. ``tolerate_data_dependent_ops``
    records data-dependent operators (``.item()``, ``nonzero``) on real tensors instead of
    refusing them; capture guards the values read.
    """
    options = {"_error_on_data_dependent_ops": False} if tolerate_data_dependent_ops else {}
    traced = make_fx(
        fn,
        # A table, even an empty one: without, torch 2.14+ records ``detach`` as ``alias``,
        # and the graph re-differentiated for results with history would let gradients
        # through where fn stopped them.
        decomposition_table=dict(decomposition_table or {}),
        tracing_mode=tracing_mode,
        record_stack_traces=True,
        **options,
    )

    def run(*args: Any) -> torch.fx.GraphModule:
        with fx_stand_ins.installed(), _one_fake_mode_for_values(tracing_mode):
            return traced(*args)

    return run


@contextlib.contextmanager
def _one_fake_mode_for_values(tracing_mode: str) -> Iterator[None]:
    """On real tensors, make_fx describes each value it records with a fake tensor of a new
    fake mode, unless a tracing context names one: each new mode records its creator's stack,
    a quarter of a deep model's trace. One mode, named here, serves them all."""
    from torch._guards import TracingContext, tracing

    if tracing_mode != "real" or TracingContext.try_get() is not None:
        yield
        return
    with tracing(TracingContext(FakeTensorMode(allow_fallback_kernels=True))):
        yield


# torch.fx, the tracer, and torch.storage, whose reads need real memory (fake tensors have
# none): their refusals of what fn does while traced are not fn's errors.
_TRACER_CODE = (str(Path(torch.fx.__file__).parent) + os.sep, str(Path(torch.storage.__file__)))


@dataclass(frozen=True)
class TracerRefusal:
    where: str  # the line of fn's code, as file:line (function)
    storage: bool  # fn reached a tensor's memory through its storage


def tracer_refusal(error: BaseException) -> TracerRefusal | None:
    """Where fn's code met the tracer's refusal of what it did (``NotImplementedError:
    argument of type: <class 'torch.storage.UntypedStorage'>``); None for any other error,
    fn's own ones included."""
    if not isinstance(error, (NotImplementedError, TypeError)):
        return None
    frames = traceback.extract_tb(error.__traceback__)
    if not frames or not frames[-1].filename.startswith(_TRACER_CODE):
        return None
    storage = "Storage" in str(error) or any(f.filename == _TRACER_CODE[1] for f in frames)
    for frame in reversed(frames):
        if not frame.filename.startswith(NOT_USER_CODE):
            where = f"{Path(frame.filename).name}:{frame.lineno} ({frame.name})"
            return TracerRefusal(where, storage)
    return TracerRefusal("a line of fn", storage)


def member_dicts(module: torch.nn.Module) -> tuple[tuple[dict[str, Any], str], ...]:
    """The dicts a module registers its members in, each with the kind of member it holds."""
    return (
        (module._parameters, "parameter"),
        (module._buffers, "buffer"),
        (module._modules, "submodule"),
    )


def rename_node(node: torch.fx.Node, name: str) -> None:
    """Rename ``node`` in its graph; fx picks a free name near ``name`` when it is taken."""
    node._rename(name)


def graph_function_source(gm: torch.fx.GraphModule, name: str) -> str:
    """The graph's code as a plain function ``name(*inputs)``, each value annotated."""
    code = gm.graph.python_code(root_module="self", verbose=True).src
    code = code.replace("    # No stacktrace found for following nodes\n", "")
    header = re.search(r"^def forward\(self(, )?", code, re.MULTILINE)
    if header is None or code.count("\ndef forward(self") != 1:
        raise PrecompileError(
            f"internal: the fx graph's code has no single 'def forward(self' (torch "
            f"{torch.__version__}); this torch release is not supported yet."
        )
    return code[: header.start()] + f"def {name}(" + code[header.end() :]


def fx_builtin_imports() -> list[str]:
    """The imports that code printed from an fx graph relies on."""
    return [builtin.import_str for builtin in _custom_builtins.values()]


@contextlib.contextmanager
def differentiable_rnns() -> Iterator[None]:
    """Trace LSTMs through their decomposition into cells rather than oneDNN's RNN layer.

    With oneDNN enabled, ``nn.LSTM`` on CPU records ``mkldnn_rnn_layer`` when its input needs
    no gradient, and a backward then records ``mkldnn_rnn_layer_backward``, which reads the
    forward's workspace. The forward produces that workspace only with grad mode on, and an
    artifact runs its graph with grad mode off: the eager backend then fails on a missing
    workspace, and Inductor cannot lower the pair. The decomposition is plain differentiable
    ATen ops. Other operators are recorded the same way either way: oneDNN is otherwise
    chosen inside the kernels.
    """
    # Only this flag: torch.backends.mkldnn.flags() would reset TF32 and determinism too.
    enabled = torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(False)
    try:
        yield
    finally:
        torch._C._set_mkldnn_enabled(enabled)


class _PlainCheckpointFunction:
    """Stands in for checkpoint's reentrant autograd function: runs the region as is."""

    @staticmethod
    def apply(function: Any, _preserve_rng_state: bool, *args: Any) -> Any:
        return function(*args)


def _plain_checkpoint_generator(*_args: Any, **_kwargs: Any) -> Iterator[None]:
    yield  # no saved-tensor hooks: the region's activations are kept, not recomputed


@contextlib.contextmanager
def plain_checkpoints() -> Iterator[None]:
    """Trace ``torch.utils.checkpoint`` regions as plain calls (both of its forms).

    A checkpointed region is recomputed in the backward with the random state of its forward,
    which a trace cannot replay: the recomputation's dropout would draw a new mask. Traced
    once, the graph uses the forward's own activations, which is what the recomputation
    reproduces in eager.
    """
    module = torch.utils.checkpoint
    stand_ins = {
        "CheckpointFunction": _PlainCheckpointFunction,
        "_checkpoint_without_reentrant_generator": _plain_checkpoint_generator,
        # torch 2.14 moved the body here and calls it directly
        "_checkpoint_without_reentrant_generator_impl": _plain_checkpoint_generator,
    }
    saved = {name: vars(module)[name] for name in stand_ins if name in vars(module)}
    for name in saved:
        setattr(module, name, stand_ins[name])
    try:
        yield
    finally:
        for name, original in saved.items():
            setattr(module, name, original)


def version_of(tensor: torch.Tensor) -> int:
    """The tensor's version counter: it moves with every in-place write."""
    return tensor._version


def is_view(tensor: torch.Tensor) -> bool:
    return tensor._base is not None


def fake_with_layout(
    mode: FakeTensorMode, like: torch.Tensor, device: torch.device | None = None
) -> torch.Tensor:
    """A fake tensor of ``mode`` with the layout of ``like`` (shape, strides, storage offset,
    dtype; its device unless ``device``): a view of a base that reaches every element."""
    reach = sum((n - 1) * s for n, s in zip(like.shape, like.stride(), strict=True))
    size = like.storage_offset() + reach + 1 if like.numel() else 0
    with mode:
        base = torch.empty(size, dtype=like.dtype, device=device or like.device)
        offset = like.storage_offset() if like.numel() else 0
        return base.as_strided(like.shape, like.stride(), offset)


def view_base(tensor: torch.Tensor) -> torch.Tensor | None:
    """The tensor ``tensor`` is a view of, or None."""
    return tensor._base


def forward_pre_hooks(module: torch.nn.Module) -> list[Any]:
    return list(module._forward_pre_hooks.values())


BatchNormBase = torch.nn.modules.batchnorm._BatchNorm


@contextlib.contextmanager
def padded_lengths_in_python() -> Iterator[None]:
    """``pad_packed_sequence`` with its lengths computed where the trace sees them.

    The operator writes the lengths it returns in C++, so a trace records an empty tensor in
    their place. Computed here from the batch sizes (read with ``.tolist()``, which capture
    guards where they can vary), they become a literal of the graph.
    """
    original = torch._C._VariableFunctions._pad_packed_sequence
    saved = vars(torch._VF).get("_pad_packed_sequence")  # a capture inside a capture

    def pad(data: torch.Tensor, batch_sizes: torch.Tensor, *args: Any) -> Any:
        padded, _ = original(data, batch_sizes, *args)
        sizes = batch_sizes.tolist()
        lengths = [sum(1 for size in sizes if size > b) for b in range(sizes[0] if sizes else 0)]
        return padded, torch.tensor(lengths, dtype=torch.int64)

    torch._VF._pad_packed_sequence = cast(Any, pad)  # takes the operator's arguments positionally
    try:
        yield
    finally:
        if saved is None:
            del torch._VF._pad_packed_sequence
        else:
            torch._VF._pad_packed_sequence = saved


def reshape_unwritten_views(graph: torch.fx.Graph) -> None:
    """Turn ``view`` into ``reshape`` where no in-place op writes the viewed memory.

    The trace recorded each ``view`` on the strides eager produced. The retrace runs Inductor's
    decompositions, which need not reproduce every intermediate's strides, and ``view`` fails
    on strides it cannot reinterpret. ``reshape`` is the same view wherever the strides allow
    one, and a copy elsewhere; a copy is equal in value as long as nothing writes through the
    view or its base, which is checked: views of memory written in place stay views.
    """
    roots, written = _written_roots(graph)
    for node in graph.nodes:
        if node.target is torch.ops.aten.view.default and roots[node] not in written:
            node.target = torch.ops.aten.reshape.default


def written_inputs(graph: torch.fx.Graph) -> list[int]:
    """The positions of the placeholders whose memory an operator of the graph writes in
    place, directly or through a view of it.

    Told by the operators' schemas (an argument ``Tensor(a!)``), not by version counters:
    an operator that writes an argument beside its results (``native_batch_norm``'s running
    statistics in training mode) leaves the argument's version as it was.
    """
    roots, written = _written_roots(graph)
    placeholders = graph.find_nodes(op="placeholder")
    return [i for i, node in enumerate(placeholders) if roots[node] in written]


# Operators that write their running_mean and running_var in training mode though their
# schemas do not say so (``Tensor? running_mean``, not ``Tensor(a!)``).
_BATCH_NORMS = frozenset(
    getattr(torch.ops.aten, name)
    for name in ("native_batch_norm", "cudnn_batch_norm", "miopen_batch_norm")
    if hasattr(torch.ops.aten, name)
)


def writes_an_argument(node: torch.fx.Node) -> bool:
    """Whether the operator ``node`` calls writes into one of its arguments, where its schema
    does not say so too (``native_batch_norm``'s running statistics in training mode)."""
    schema = operator_schema(node.target)
    if schema is None:
        return False
    if any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
        return True
    bound = dict(zip((a.name for a in schema.arguments), node.args, strict=False))
    bound.update(node.kwargs)
    return _writes_running_stats(node.target, bound)


def _writes_running_stats(target: Any, bound: Mapping[str, Any]) -> bool:
    packet = getattr(target, "overloadpacket", None)
    return packet in _BATCH_NORMS and bound.get("training", True) is not False


def _written_roots(
    graph: torch.fx.Graph,
) -> tuple[dict[torch.fx.Node, torch.fx.Node], set[torch.fx.Node]]:
    """Each node's root (the node whose memory it views, or itself), and the roots some
    operator of the graph writes in place."""
    import operator

    roots: dict[torch.fx.Node, torch.fx.Node] = {}
    written: set[torch.fx.Node] = set()
    for node in graph.nodes:
        roots[node] = node
        if node.op != "call_function":
            continue
        source = node.args[0] if node.args else None
        if node.target is operator.getitem and isinstance(source, torch.fx.Node):
            roots[node] = roots[source]
            continue
        schema = operator_schema(node.target)
        if schema is None:
            continue
        bound = dict(zip((a.name for a in schema.arguments), node.args, strict=False))
        bound.update(node.kwargs)
        if _writes_running_stats(node.target, bound):
            for name in ("running_mean", "running_var"):
                if isinstance(bound.get(name), torch.fx.Node):
                    written.add(roots[bound[name]])
        for argument in schema.arguments:
            value = bound.get(argument.name)
            if argument.alias_info is None:
                continue
            if isinstance(value, (list, tuple)):  # Tensor(a!)[]: the _foreach_ operators
                if argument.alias_info.is_write:
                    written.update(roots[v] for v in value if isinstance(v, torch.fx.Node))
                continue
            if not isinstance(value, torch.fx.Node):
                continue
            if argument.alias_info.is_write:
                written.add(roots[value])
            if schema.returns and schema.returns[0].alias_info is not None:
                roots[node] = roots[value]  # a view (or list of views) of this argument
    return roots, written
