"""The inductor backend: the captured graph compiled by Inductor into C++ (or Triton) kernels.

The captured graph is functionalized (input mutations become stores inside the kernels),
retraced with Inductor's decompositions on fake tensors and compiled with ``compile_fx_inner``.
Section 2 of the artifact is the generated wrapper module (C++ wherever Inductor's C++ wrapper
can run the graph, else Python, or as ``wrapper=`` asks), its ``torch._inductor`` imports
replaced by the stand-ins of ``kernel_loader`` and ``wrapper_imports``, plus a ``call`` that
adds the tensor literals, puts back the constant outputs and re-creates outputs that alias
inputs.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, cast

import torch
import torch.fx

from torch_precompile.errors import PrecompileError
from torch_precompile.internals.inductor import (
    asserted_inputs,
    compile_to_wrapper,
    data_dependent_condition,
    is_cpp_wrapper,
    retrace_for_inductor,
    without_input_asserts,
    wrapper_with_stand_ins,
)
from torch_precompile.internals.tracing import (
    BAKED_READS,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    fake_with_layout,
    reshape_unwritten_views,
)
from torch_precompile.internals.vector_units import vector_bits
from torch_precompile.lower import WRAPPER_LINE, LoweredGraph
from torch_precompile.lower.kernels import BuiltKernels, collect_built_kernels
from torch_precompile.shipped import kernel_loader, wrapper_imports
from torch_precompile.spec import ArtifactSpec, Layout
from torch_precompile.trace import Capture
from torch_precompile.trace.checks import MAX_LITERAL_ELEMENTS, constant_source, literal_source

if TYPE_CHECKING:
    from torch_precompile.spec import DistributedTensor, WrappedTensor

aten = torch.ops.aten
log = logging.getLogger("torch_precompile")
# Convolution operators and the positions of their activation arguments.
_CONVOLUTIONS = {aten.convolution.default: (0,), aten.convolution_backward.default: (0, 1)}

# The lines around Inductor's generated module in section 2 of the artifact.
GENERATED_START = "# Inductor's generated wrapper module follows"
GENERATED_END = "# End of Inductor's generated wrapper module."


def lower_inductor(capture: Capture, wrapper_kind: str = "auto") -> LoweredGraph:
    """Compile the capture; ``wrapper_kind`` "cpp" or "auto" asks for Inductor's C++ wrapper,
    and the Python wrapper is used where that one cannot be (the source says why)."""
    inputs = [t.detach() for t in (*capture.example_inputs, *capture.literals)]
    outputs = _GraphOutputs.of(capture)
    if not _has_compute(capture.graph):
        raise PrecompileError(
            "the inductor backend has nothing to compile: fn returns its inputs or constants "
            "without computing on them. Use backend='eager' for such a computation."
        )
    _refuse_packing(capture.graph)
    graph = _functional_graph(capture.graph, outputs.tensors, inputs, capture.fake_mode)
    wrapper, wrapper_note = _compile_wrapper(graph, capture, wrapper_kind)
    if not is_cpp_wrapper(wrapper):
        return _lowered(capture, graph, wrapper, wrapper_note, outputs)
    try:
        return _lowered(capture, graph, wrapper, wrapper_note, outputs)
    except PrecompileError as e:  # a C++ wrapper module in a form this package cannot read
        if wrapper_kind == "cpp":
            raise
        reason = _reason(e)
    except Exception as e:  # its build failed
        reason = _reason(e)
        if wrapper_kind == "cpp":
            raise PrecompileError(
                f"Inductor's C++ wrapper could not be built for this graph ({reason}). Use "
                "wrapper='python', or leave wrapper out: the default then takes the Python "
                "wrapper."
            ) from e
    wrapper, wrapper_note = _python_wrapper(graph, capture, wrapper_kind, reason)
    return _lowered(capture, graph, wrapper, wrapper_note, outputs)


class _GraphOutputs(NamedTuple):
    """The captured graph's outputs: which are tensors, and the constants among them."""

    tensors: list[int]
    constants: dict[int, Any]
    count: int  # type: ignore[assignment]  # the field shadows tuple.count

    @classmethod
    def of(cls, capture: Capture) -> _GraphOutputs:
        outputs = list(cast("Sequence[Any]", capture.graph.graph.output_node().args[0]))
        return cls(
            [i for i, o in enumerate(outputs) if isinstance(o, torch.fx.Node)],
            {i: o for i, o in enumerate(outputs) if not isinstance(o, torch.fx.Node)},
            len(outputs),
        )


def _lowered(
    capture: Capture,
    graph: torch.fx.GraphModule,
    wrapper: str,
    wrapper_note: list[str],
    outputs: _GraphOutputs,
) -> LoweredGraph:
    """Section 2 of the artifact around a generated wrapper, and its built kernels."""
    input_names = [n.name for n in graph.graph.find_nodes(op="placeholder")]
    strides = _asserted_strides(wrapper, input_names, capture)
    # The driver checks these layouts before every call (the model walk or its memo, the
    # input checks); Inductor's own assert of each would repeat that check per call.
    wrapper = without_input_asserts(
        wrapper, {input_names[i] for i in _driver_checked(capture.spec, strides)}
    )
    stand_ins = (kernel_loader,) if is_cpp_wrapper(wrapper) else (kernel_loader, wrapper_imports)
    source = "\n".join(
        [
            f"{GENERATED_START}, its torch._inductor imports replaced by the stand-ins above.",
            *wrapper_note,
            wrapper_with_stand_ins(wrapper, vector_bits()).strip("\n"),
            GENERATED_END,
            *literal_lines(capture),
            _call_source(capture, outputs.tensors, outputs.constants, outputs.count),
        ]
    )
    kernels = collect_built_kernels(wrapper)
    return LoweredGraph(
        source,
        kernels.payload,
        input_strides=strides,
        kernels=kernels.objects,
        stand_ins=stand_ins,
        wrapper="cpp" if is_cpp_wrapper(wrapper) else "python",
    )


def _has_compute(gm: torch.fx.GraphModule) -> bool:
    return any(
        n.op == "call_function"
        and n.target not in BAKED_READS
        and n.target is not aten.detach.default
        for n in gm.graph.nodes
    )


def _refuse_packing(gm: torch.fx.GraphModule) -> None:
    """Refuse ``aten._pack_padded_sequence`` left in the graph.

    A capture on real tensors replaces it by fixed-index operations for the lengths it saw
    (and guards them). Where that could not happen (dims marked dynamic), Inductor can only
    keep the operator with a fake implementation of the wrong output size, and the artifact
    would fail at every call.
    """
    for node in gm.graph.find_nodes(op="call_function", target=aten._pack_padded_sequence.default):
        lines = re.findall(r'File "(?:[^"]*/)?([^"/]*)", line (\d+)', node.stack_trace or "")
        where = f" at {lines[-1][0]}:{lines[-1][1]}" if lines else ""
        raise PrecompileError(
            f"fn calls torch.nn.utils.rnn.pack_padded_sequence (aten._pack_padded_sequence)"
            f"{where}, whose output sizes follow the values of its lengths, which this capture "
            "could not fix (dims marked dynamic); the inductor backend cannot compile the "
            "operator. Leave the dims static (the lengths are then fixed and checked at every "
            "call), or pad and mask instead of packing (run the RNN over the padded batch and "
            "mask the steps past each length)."
        )


def _functional_graph(
    captured: torch.fx.GraphModule,
    tensor_outputs: list[int],
    inputs: list[torch.Tensor],
    fake_mode: Any,
) -> torch.fx.GraphModule:
    """Retrace the capture functionally, with Inductor's decompositions, on fake tensors.

    A dynamic capture is retraced inside its own fake mode, so the unbacked symbols of its
    inputs (and what the ShapeEnv learned about them) carry over to the lowering.
    """
    gm = torch.fx.GraphModule(captured, captured.graph)  # a copy: the capture stays as it was
    gm.graph = _prepared_graph(captured.graph, dynamic=fake_mode is not None)
    gm.recompile()

    running = _NodeRecorder(gm)

    def tensors_only(*args: torch.Tensor) -> list[torch.Tensor]:
        results = running.run(*args)
        return [results[i] for i in tensor_outputs]

    functional = torch.func.functionalize(tensors_only, remove="mutations")
    try:
        # Each retraced node keeps the meta of the captured node it came from (its user line
        # and ATen op), so the kernels' comments say where they come from.
        with torch.fx.traceback.preserve_node_meta():
            return retrace_for_inductor(functional, inputs, fake_mode)
    except DynamicOutputShapeException as e:
        raise PrecompileError(
            f"the inductor backend cannot compile {e.func}, whose output size depends on tensor "
            "values (boolean-mask indexing, nonzero, masked_select). Use fixed-size operations "
            "(torch.where, masked arithmetic), or backend='eager'."
        ) from e
    except PrecompileError:
        raise
    except Exception as e:
        raise _inductor_failure(
            "retracing the captured graph with its decompositions", e, running.node
        ) from e


def _prepared_graph(graph: torch.fx.Graph, dynamic: bool) -> torch.fx.Graph:
    """A copy without the baked reads; with dynamic dims, convolutions get contiguous inputs.

    Fake convolution cannot tell the output layout of a channels_last input whose sizes are
    unbacked (it answers contiguous; eager gives channels_last), and Inductor would then
    assert the wrong strides. A contiguous input makes both agree.
    """
    import copy

    copied = copy.deepcopy(graph)
    reshape_unwritten_views(copied)
    for node in reversed(list(copied.nodes)):
        if node.op == "call_function" and node.target in BAKED_READS and not node.users:
            copied.erase_node(node)
        elif dynamic and node.target in _CONVOLUTIONS:
            for position in _CONVOLUTIONS[node.target]:
                source = node.args[position]
                with copied.inserting_before(node):
                    contiguous = copied.call_function(
                        aten.clone.default, (source,), {"memory_format": torch.contiguous_format}
                    )
                node.update_arg(position, contiguous)
    return copied


def _compile_wrapper(
    graph: torch.fx.GraphModule, capture: Capture, kind: str
) -> tuple[str, list[str]]:
    """The generated wrapper module, and the lines that say which wrapper it is: the C++ one
    for "cpp" and "auto" where it can run the graph, else the Python one."""
    if kind == "python":
        return _compile(graph, capture.fake_mode, capture.symbol_names), []
    reason = _cpp_wrapper_obstacle(capture)
    if reason is None:
        try:
            wrapper = _compile(graph, capture.fake_mode, capture.symbol_names, cpp=True)
            return wrapper, [
                f"{WRAPPER_LINE}C++. One compiled function runs the whole call; its shared "
                "object is in the",
                "# cache, and without the cache it is built from cpp_wrapper_src and "
                "kernel_src below.",
            ]
        except PrecompileError as e:
            reason = _reason(e)
    return _python_wrapper(graph, capture, kind, reason)


def _python_wrapper(
    graph: torch.fx.GraphModule, capture: Capture, kind: str, reason: str
) -> tuple[str, list[str]]:
    """The Python wrapper where the C++ one was asked for (``kind``) and cannot be used (a
    warning where "cpp" was asked for explicitly)."""
    if kind == "cpp":
        log.warning(
            "wrapper='cpp' cannot be used for this graph (%s); the Python wrapper runs it.", reason
        )
    said = (
        "wrapper='cpp' was asked for and cannot be used"
        if kind == "cpp"
        else "the C++ wrapper is not used"
    )
    note = [f"{WRAPPER_LINE}Python. {said}: {reason}."]
    return _compile(graph, capture.fake_mode, capture.symbol_names), note


def _reason(error: BaseException) -> str:
    """The first sentence of why the C++ wrapper could not be used, on one line (it becomes a
    comment of the artifact), at most 200 characters."""
    lines = str(error).strip().splitlines()
    text = (lines[0] if lines else "").split(". ")[0].strip()[:200]
    return text if isinstance(error, PrecompileError) else f"{type(error).__name__}: {text}"


def _cpp_wrapper_obstacle(capture: Capture) -> str | None:
    """Why Inductor's C++ wrapper does not run this capture, if it does not."""
    spec = capture.spec
    if spec.distributed:
        return "the graph communicates (DTensor collectives), which the C++ wrapper does not run"
    if spec.fully_sharded or spec.data_parallel:
        return (
            "the graph communicates (FSDP2 or DDP collectives), which this package runs "
            "with the Python wrapper only"
        )
    return None


def _compile(
    graph: torch.fx.GraphModule, fake_mode: Any, symbol_names: dict[str, str], cpp: bool = False
) -> str:
    options: dict[str, Any] = {}
    if fake_mode is not None and fake_mode.shape_env is not None:
        options["scalar_asserts"] = True  # keep Inductor's own checks of size assumptions
        # Channels-last conversions for convolutions rely on layout predictions that do not
        # hold for unbacked sizes (see _prepared_graph).
        options["layout_optimization"] = False
    if cpp:
        # The glue (allocations and calls, most of a deep graph's lines) is built apart from
        # the kernels and at a lower optimization level; one unit at -O3 grows superlinearly.
        options["cpp_wrapper_build_separate"] = True
    try:
        source, constants = compile_to_wrapper(graph, fake_mode, options, cpp_wrapper=cpp)
    except Exception as e:
        guard = data_dependent_condition(e)
        if guard is None:
            raise _inductor_failure("compiling the graph", e) from e
        condition = re.sub(r"\bu\d+\b", lambda m: symbol_names.get(m[0], m[0]), guard)
        condition = re.sub(r"^Eq\((.+), (.+)\)$", r"\1 == \2", condition)
        raise PrecompileError(
            f"Inductor needs to know whether {condition} to compile this graph, and a dynamic "
            "dim cannot be decided on at build time. Declare bounds that settle it (for "
            "example mark_unbacked(x, dim, min=2) when a size of 1 is what Inductor asks "
            "about), or leave that dim static."
        ) from e
    if cpp and constants:
        raise PrecompileError(
            "Inductor made tensor constants for this graph, which its C++ wrapper takes from "
            "the module it loads and an artifact cannot hand it"
        )
    return _with_constants(source, constants)


def _with_constants(source: str, constants: dict[str, Any]) -> str:
    """The wrapper with each tensor constant Inductor made (a scalar argument it turned into
    a tensor, say) written as source, where the generated module leaves a placeholder."""
    for name, value in constants.items():
        placeholder = re.search(rf"^{re.escape(name)} = None  # .*$", source, re.MULTILINE)
        if not isinstance(value, torch.Tensor) or placeholder is None:
            continue
        if value.numel() > MAX_LITERAL_ELEMENTS or isinstance(value, FakeTensor):
            raise PrecompileError(
                f"Inductor made a tensor constant of shape {tuple(value.shape)} for this graph, "
                "which the artifact cannot write as source; use backend='eager'."
            )
        source = (
            source[: placeholder.start()]
            + f"{name} = {literal_source(value)}  # a constant Inductor made"
            + source[placeholder.end() :]
        )
    return source


class _NodeRecorder(torch.fx.Interpreter):
    """Runs a graph node by node, keeping the node that runs (to name it when it fails)."""

    node: torch.fx.Node | None = None

    def run_node(self, n: torch.fx.Node) -> Any:
        self.node = n
        return super().run_node(n)


def _inductor_failure(
    step: str, error: BaseException, node: torch.fx.Node | None = None
) -> PrecompileError:
    """A PrecompileError for an error Inductor raised while ``step``: it names the operator
    (the node that ran, or the one Inductor's lowering reports) and suggests the eager backend.
    """
    cause = getattr(error, "inner_exception", None) or error  # InductorError wraps the cause
    operator = str(node.target) if node is not None and node.op == "call_function" else None
    seen: BaseException | None = cause
    while operator is None and seen is not None:
        reported = re.search(r"^\s*target: (\S+)", str(seen), re.MULTILINE)
        operator = reported[1] if reported else None
        seen = getattr(seen, "inner_exception", None) or seen.__cause__ or seen.__context__
    lines = str(cause).strip().splitlines()
    summary = f"{type(cause).__name__}: {lines[0] if lines else ''}".rstrip(": ")
    where = f" at operator {operator}" if operator else ""
    return PrecompileError(
        f"Inductor failed while {step}{where}: {summary}. The inductor backend cannot compile "
        "this computation; backend='eager' runs the captured graph without Inductor."
    )


def _asserted_strides(wrapper: str, input_names: list[str], capture: Capture) -> list[Layout]:
    """The layout Inductor asserts for each flat input: its strides, or for an input with
    dynamic dims its memory-format name; None where the kernels never read it."""
    index = {name: i for i, name in enumerate(input_names)}
    num_inputs = len(capture.example_inputs)
    strides: list[Layout] = [None] * num_inputs
    for name in asserted_inputs(wrapper):
        i = index.get(name)
        if i is not None and i < num_inputs:
            strides[i] = capture.memory_formats.get(i) or tuple(
                int(s) for s in capture.example_inputs[i].stride()
            )
    return strides


def driver_checkable(spec: ArtifactSpec, count: int) -> set[int]:
    """The flat inputs (of ``count``) whose layout the driver checks where it is static."""
    return set(_driver_checked(spec, [()] * count))


def _driver_checked(spec: ArtifactSpec, strides: list[Layout]) -> list[int]:
    """The flat inputs whose static layout the driver checks exactly on every call: plain
    model tensors and plain tensor inputs. Optimizer state, DTensor shards and subclasses'
    inner tensors keep Inductor's asserts."""
    carried = {
        d.index
        for d in cast(
            "tuple[DistributedTensor | WrappedTensor, ...]", (*spec.distributed, *spec.wrapped)
        )
        if d.role == "input"
    }
    checked = len([t for t in spec.model if t.tied_to is None]) + len(
        [leaf for leaf in spec.inputs if leaf.kind == "tensor"]
    )
    return [
        i
        for i in range(min(checked, len(strides)))
        if i not in carried and isinstance(strides[i], tuple)
    ]


def literal_lines(capture: Capture) -> list[str]:
    if not capture.literals:
        return [""]
    items = "".join(f"    {literal_source(t)},\n" for t in capture.literals)
    # The C++ wrapper's module, unlike the Python one, does not import these names.
    names = sorted(set(re.findall(r"\b(inf|nan)\b", items)))
    imports = [f"from math import {', '.join(names)}"] if names else []
    return [
        "",
        "# Tensor literals built inside fn, passed after the flat inputs.",
        *imports,
        f"TENSOR_LITERALS = [\n{items}]",
        "",
    ]


def _flat_inputs_comment(capture: Capture) -> list[str]:
    """What each positional argument of the generated code holds: the captured graph's
    placeholders (named after model tensors, inputs and optimizer state), in order."""
    lines = [
        "# call's flat inputs, in order; Inductor's code above takes them as arg0_1, arg1_1, ...",
        "# (then any tensor literals):",
    ]
    placeholders = list(capture.graph.graph.find_nodes(op="placeholder"))
    width = max((len(node.name) for node in placeholders), default=0)
    for index, node in enumerate(placeholders):
        value = node.meta.get("val")
        kind = ""
        if isinstance(value, torch.Tensor):
            dims = ", ".join(str(d) for d in value.shape)
            kind = f"  {str(value.dtype).removeprefix('torch.')}[{dims}]"
        lines.append(f"#   {f'arg{index}_1':<8}{node.name:<{width}}{kind}".rstrip())
    return lines


def _call_source(
    capture: Capture, tensor_outputs: list[int], constants: dict[int, Any], count: int
) -> str:
    aliases = capture.spec.output_aliases
    lines = [
        "",
        *_flat_inputs_comment(capture),
        "def call(flat_inputs):",
        '    """Run the kernels on the flat inputs (the list is consumed); return all outputs."""',
    ]
    if aliases:
        lines.append("    inputs = list(flat_inputs)")
    lines += [
        "    args = [*flat_inputs, *TENSOR_LITERALS]"
        if capture.literals
        else "    args = list(flat_inputs)",
        "    flat_inputs.clear()",
        "    computed = inductor_call(args)",
    ]
    if not constants:
        lines.append("    outputs = list(computed)")
    else:
        slots = ", ".join(
            constant_source(constants[i])
            if i in constants
            else f"computed[{tensor_outputs.index(i)}]"
            for i in range(count)
        )
        lines.append(f"    outputs = [{slots}]")
    for alias in aliases:
        out, source = alias.output, alias.source
        if alias.size is None:
            lines.append(f"    outputs[{out}] = inputs[{source}]  # fn returned it")
            continue
        lines.append(f"    # output {out} is a view of input {source}, as in eager")
        lines.append(
            f"    outputs[{out}] = _view_of(inputs[{source}], {alias.size!r}, {alias.stride!r}, "
            f"{alias.offset!r})"
        )
    lines.append("    return outputs")
    if any(alias.size is not None for alias in aliases):
        lines += [
            "",
            "",
            "def _view_of(base, size, stride, offset):",
            "    if tuple(base.shape) == size and base.stride() == stride and offset == 0:",
            "        return base",
            "    return base.as_strided(size, stride, base.storage_offset() + offset)",
        ]
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class CompiledPiece:
    """A piece of a graph compiled on its own (``lower.regions``): the generated wrapper with
    the stand-ins in place (its entry named ``inductor_call``), the comment lines that say
    which wrapper it is, its built kernels, and the input positions whose layout the kernels
    assume."""

    source: str
    wrapper_note: list[str]
    kernels: BuiltKernels
    asserted: list[int]
    cpp: bool
    written: list[int]  # the input positions it writes in place


def compile_piece(
    piece: torch.fx.GraphModule,
    examples: list[torch.Tensor],
    wrapper_kind: str,
    unasserted: Callable[[list[int]], set[int]],
) -> CompiledPiece:
    """Compile ``piece`` (a function of ``examples`` returning a tuple of tensors) as the
    whole graph is compiled: the C++ wrapper where asked for and it builds, else the Python
    one; ``unasserted`` picks, of the positions the kernels assert, those whose layout the
    driver already checks."""
    count = len(cast("Sequence[Any]", piece.graph.output_node().args[0]))
    graph = _functional_graph(piece, list(range(count)), _fakes_like(examples), None)
    if wrapper_kind == "python":
        return _finished_piece(graph, _compile(graph, None, {}), [], unasserted)
    try:
        return _finished_piece(graph, _compile(graph, None, {}, cpp=True), [], unasserted)
    except Exception as e:
        if wrapper_kind == "cpp":
            raise
        note = [f"{WRAPPER_LINE}Python. the C++ wrapper is not used: {_reason(e)}."]
    return _finished_piece(graph, _compile(graph, None, {}), note, unasserted)


def _finished_piece(
    graph: torch.fx.GraphModule,
    wrapper: str,
    note: list[str],
    unasserted: Callable[[list[int]], set[int]],
) -> CompiledPiece:
    placeholders = list(graph.graph.find_nodes(op="placeholder"))
    names = [n.name for n in placeholders]
    index = {name: i for i, name in enumerate(names)}
    asserted = sorted(index[name] for name in asserted_inputs(wrapper) if name in index)
    wrapper = without_input_asserts(wrapper, {names[i] for i in unasserted(asserted)})
    written = [i for i, p in enumerate(placeholders) if _written(p)]
    return CompiledPiece(
        wrapper_with_stand_ins(wrapper, vector_bits()),
        note,
        collect_built_kernels(wrapper),
        asserted,
        is_cpp_wrapper(wrapper),
        written,
    )


def _written(placeholder: torch.fx.Node) -> bool:
    """Whether the functional graph writes its new value back into ``placeholder``."""
    return any(
        user.target is aten.copy_.default and user.args[0] is placeholder
        for user in placeholder.users
    )


def _fakes_like(values: list[torch.Tensor]) -> list[torch.Tensor]:
    """Fake tensors of one mode with the layouts of ``values`` (fakes of several modes)."""
    mode = FakeTensorMode()
    return [fake_with_layout(mode, v) for v in values]
